"""Failover decided by the gate, its relay a stand-in (tests/relays.py) that answers as HttpRelay
does when the fallback answers, refuses the connection, resets it or stays silent: which failed
attempts are tried once more and where, what is sent, what the client gets, what is counted and
released. Each test walks the request the way the servicer does (response headers, then
`fail_over`; a None reply passes the primary's response on with the plan's headers). No sockets:
tests/e2e/test_relay.py holds the stand-in's failures to HttpRelay's over real ones."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from extproc.core.admission import Ticket
from extproc.core.events import FailedOver, Rerouted, SlotReleased, UpstreamCounted
from extproc.core.request_life import IllegalStep
from extproc.stores.queue import Lease

from ..conftest import OFFICER_KEY, e2e_config
from ..helpers import chat
from ..relays import REFUSED, RESET, SILENT, StandInRelay
from .test_gate import Rig

CONNECT_FAILURE = "upstream_reset_before_response_started{remote_connection_failure}"


def with_fallback_slots(slots: int) -> dict:
    pools = e2e_config()["pools"]
    return {**pools, "fallback": {**pools["fallback"], "max_inflight": slots}}


async def admitted(rig: Rig, ticket_type: str = "complaint", body: bytes | None = None, **headers: str):
    """A request admitted in the primary pool, told to Envoy as the servicer tells it."""
    exchange, waiter = await rig.arrive(ticket_type, body, **headers)
    assert waiter is None and exchange.pool == "primary"
    return exchange, dict(rig.gate.admission(exchange).set_headers)


async def occupy(rig: Rig, pool: str) -> Lease:
    """The pool's one slot, taken by a request of another replica's (straight from the store)."""
    lease = await rig.store.enqueue(pool, Ticket(score=1, seq=0, id="elsewhere", class_name="complaint"))
    assert isinstance(lease, Lease)
    return lease


async def test_a_request_failed_in_the_primary_is_answered_by_the_fallback_with_the_paired_model():
    rig = Rig(StandInRelay(200))
    exchange, told_envoy = await admitted(rig, "loan_approval", authorization=f"Bearer {OFFICER_KEY}")
    rig.clock.advance(0.4)
    plan = rig.gate.response_started(exchange, 503, "via_upstream")
    assert plan.fail_over and plan.finished

    reply = await rig.gate.fail_over(exchange)
    assert reply is not None and reply.status == 200
    assert json.loads(reply.body)["model"] == "deepseek-sim-small"
    assert dict(reply.headers) == {"Content-Type": "application/json; charset=utf-8",
                                   "x-llm-fallback": "true", "x-queue-wait-ms": "0"}
    (sent,) = rig.relay.sent
    assert (sent.path, sent.cluster) == ("/v1/chat/completions", "vllm_fallback")
    assert sent.body["model"] == "deepseek-sim-small"
    assert sent.body["messages"] == json.loads(chat())["messages"]
    assert sent.headers == {"x-llm-priority": told_envoy["x-llm-priority"], "x-llm-class": "loan_approval"}
    assert sent.authorization == f"Bearer {OFFICER_KEY}"  # the client's, passed on as it came
    assert exchange.pool == "fallback" and exchange.upstream_status == 200

    await rig.gate.close(exchange)
    assert await rig.inflight("primary") == 0 and await rig.inflight("fallback") == 0
    assert rig.heard.of(FailedOver) == [FailedOver("primary", "fallback", "answered")]
    assert rig.heard.of(Rerouted) == [Rerouted("loan_approval", "primary", "fallback", "failover")]
    assert rig.heard.of(SlotReleased) == [SlotReleased("primary", "failed_over"),
                                          SlotReleased("fallback", "failover_completed")]
    assert rig.heard.of(UpstreamCounted) == [UpstreamCounted("primary", "http_5xx"), UpstreamCounted("fallback", "success")]


async def test_the_fallback_holds_a_slot_while_it_answers_and_the_failed_backend_none():
    seen = []

    class Watching(StandInRelay):
        async def send(self, *args, **kwargs):
            seen.append((await rig.inflight("primary"), await rig.inflight("fallback")))
            return await super().send(*args, **kwargs)

    rig = Rig(Watching(200))
    exchange, _ = await admitted(rig)
    rig.gate.response_started(exchange, 500, "via_upstream")
    await rig.gate.fail_over(exchange)
    assert seen == [(0, 1)]
    await rig.gate.close(exchange)
    assert await rig.inflight("fallback") == 0


@pytest.mark.parametrize("status, details", [(500, "via_upstream"), (503, "via_upstream"), (429, "via_upstream"),
                                             (503, CONNECT_FAILURE), (504, "upstream_response_timeout")])
async def test_what_fails_before_the_response_starts_is_failed_over_whoever_answered_it(status, details):
    rig = Rig(StandInRelay(200))
    exchange, _ = await admitted(rig)
    assert rig.gate.response_started(exchange, status, details).fail_over
    assert (await rig.gate.fail_over(exchange)).status == 200
    assert len(rig.relay.sent) == 1
    await rig.gate.close(exchange)


@pytest.mark.parametrize("status", [200, 400, 404, 413])
async def test_an_answer_that_is_no_upstream_failure_goes_to_the_client(status):
    rig = Rig(StandInRelay(200))
    exchange, _ = await admitted(rig)
    plan = rig.gate.response_started(exchange, status, "via_upstream")
    assert not plan.fail_over and plan.finished
    await rig.gate.close(exchange)
    assert rig.relay.sent == [] and len(rig.told(FailedOver)) == 0


async def test_a_streamed_request_is_failed_over_and_answered_in_one_piece():
    rig = Rig(StandInRelay(200))
    exchange, _ = await admitted(rig, body=chat(stream=True, max_tokens=8))
    plan = rig.gate.response_started(exchange, 503, "via_upstream")
    assert plan.fail_over and not plan.finished  # the servicer holds the stream for the fallback's answer
    reply = await rig.gate.fail_over(exchange)
    assert reply.status == 200 and rig.relay.sent[0].body["stream"] is True
    await rig.gate.close(exchange)


@pytest.mark.parametrize("fails, released, counted", [
    (503, "failover_completed", {"http_5xx": 1}),
    (SILENT, "relay_failed", {"timeout": 1}),  # no answer within relay.timeout_s: the fallback's failure
    (REFUSED, "relay_failed", {}),  # the relay listener itself unreachable: nothing the fallback did
    (RESET, "relay_failed", {}),
], ids=["503", "silent", "refused", "reset"])
async def test_a_fallback_that_fails_too_leaves_the_client_the_primarys_failure(fails, released, counted):
    rig = Rig(StandInRelay(fails))
    exchange, _ = await admitted(rig)
    rig.clock.advance(0.25)
    plan = rig.gate.response_started(exchange, 503, CONNECT_FAILURE)
    assert plan.fail_over

    assert await rig.gate.fail_over(exchange) is None  # the servicer passes the primary's 503 on
    headers = dict(plan.set_headers)  # the headers it gets with it: its wait, and no x-llm-fallback
    assert headers["x-queue-wait-ms"] == "0" and "x-llm-fallback" not in headers
    assert exchange.upstream_status == 503
    assert len(rig.relay.sent) == 1
    await rig.gate.close(exchange)
    assert await rig.inflight("primary") == 0 and await rig.inflight("fallback") == 0
    assert len(rig.told(FailedOver, pool="fallback", result="failed")) == 1
    assert len(rig.told(SlotReleased, pool="fallback", end=released)) == 1
    assert Counter(e.result for e in rig.told(UpstreamCounted, pool="fallback")) == counted
    assert len(rig.told(UpstreamCounted, pool="primary", result="connect_failure")) == 1


async def test_a_request_is_failed_over_at_most_once():
    rig = Rig(StandInRelay(503, 200))  # a second attempt would be answered
    exchange, _ = await admitted(rig)
    assert rig.gate.response_started(exchange, 503, "via_upstream").fail_over
    assert await rig.gate.fail_over(exchange) is None
    assert not rig.gate.failover.possible(exchange)  # tried once: not again
    with pytest.raises(IllegalStep):  # and a request's life has one response (core/request_life.py)
        rig.gate.response_started(exchange, 503, "via_upstream")
    assert len(rig.relay.sent) == 1
    await rig.gate.close(exchange)


async def test_a_fallback_with_no_room_within_the_requests_wait_leaves_it_its_failure_and_is_not_asked_again():
    rig = Rig(StandInRelay(200), pools=with_fallback_slots(1))
    elsewhere = await occupy(rig, "fallback")
    exchange, _ = await admitted(rig)
    rig.clock.advance(61)  # past the 60 s a complaint may wait: nothing left to wait in the fallback's line
    assert rig.gate.response_started(exchange, 503, "via_upstream").fail_over
    assert await rig.gate.fail_over(exchange) is None
    assert rig.relay.sent == [] and rig.store.depth("fallback") == 0  # it left the line it joined
    assert len(rig.told(FailedOver, pool="fallback", result="no_capacity")) == 1
    assert len(rig.told(SlotReleased, pool="primary", end="failed_over")) == 1
    assert not rig.gate.failover.possible(exchange)  # tried once: not again
    await rig.gate.close(exchange)
    await rig.store.release(elsewhere)
    assert await rig.inflight("fallback") == 0 and rig.relay.sent == []


async def test_a_failover_waits_in_the_fallbacks_line_while_its_wait_lasts():
    rig = Rig(StandInRelay(200), pools=with_fallback_slots(1))
    elsewhere = await occupy(rig, "fallback")
    exchange, _ = await admitted(rig)
    rig.gate.response_started(exchange, 503, "via_upstream")
    failing_over = asyncio.create_task(rig.gate.fail_over(exchange))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not failing_over.done() and rig.store.depth("fallback") == 1 and rig.relay.sent == []
    await rig.store.release(elsewhere)
    reply = await asyncio.wait_for(failing_over, 5)
    assert reply.status == 200 and len(rig.relay.sent) == 1
    await rig.gate.close(exchange)
    assert await rig.inflight("fallback") == 0


async def test_a_model_the_fallback_does_not_pair_is_not_failed_over():
    rig = Rig(StandInRelay(200))
    exchange, _ = await admitted(rig, body=chat(model="another-model", max_tokens=8))
    assert not rig.gate.response_started(exchange, 503, "via_upstream").fail_over
    await rig.gate.close(exchange)
    assert rig.relay.sent == []


async def test_a_request_rerouted_to_the_fallback_at_admission_is_not_failed_over_from_there():
    """Even where the fallback has a fallback of its own: a reroute is never failed over again."""
    pools = e2e_config()["pools"]
    pools = {**pools, "fallback": {**pools["fallback"], "fallback": "third"},
             "third": {"cluster": "vllm_third", "max_inflight": 4, "models": {"deepseek-sim": "deepseek-sim-tiny"}}}
    rig = Rig(StandInRelay(200), pools=pools)  # the primary has one slot; orange above 4 waiting
    await admitted(rig)
    for _ in range(5):
        await rig.arrive("complaint")
    degraded, waiter = await rig.arrive("archive_query")  # degradable: served by the fallback instead
    assert waiter is None and degraded.pool == "fallback" and degraded.route.rerouted
    assert not rig.gate.response_started(degraded, 503, "via_upstream").fail_over
    await rig.gate.close(degraded)
    assert rig.relay.sent == []


@pytest.mark.parametrize("why", ["no relay", "failover off", "draining"])
async def test_no_failover_without_a_relay_when_turned_off_or_while_draining(why):
    relay = None if why == "no relay" else StandInRelay(200)
    rig = Rig(relay, retries={"failover": why != "failover off"})
    exchange, _ = await admitted(rig)
    if why == "draining":
        await rig.gate.drain()
    assert not rig.gate.response_started(exchange, 503, "via_upstream").fail_over
    await rig.gate.close(exchange)
    assert relay is None or relay.sent == []
    assert len(rig.told(FailedOver)) == 0


async def test_envoy_holds_the_exchange_for_the_rest_of_its_wait_and_the_relays_timeout_within_its_bound():
    rig = Rig(StandInRelay(200), relay={"timeout_s": 5})
    exchange, _ = await admitted(rig)
    rig.clock.advance(50)  # 10 s left of a complaint's 60
    assert rig.gate.failover_hold_seconds(exchange) == 10 + 5 + 2
    bounded = Rig(StandInRelay(200), relay={"timeout_s": 5}, limits={"max_body_bytes": 65536, "max_message_timeout_s": 12})
    exchange, _ = await admitted(bounded)
    assert bounded.gate.failover_hold_seconds(exchange) == 12
