"""The admission gate driven directly, on the in-process stores, with a stepped clock: no
sockets, no Envoy, no gRPC. Each test walks one request's life the way the servicer does."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import typing

import pytest

from extproc.control.capacity_watch import CapacityWatch
from extproc.control.plane import ControlPlane
from extproc.core.config import parse_config
from extproc.core.events import (AppointmentTold, ClientLeft, DecisionTimed, Event, FirstByte, JoinedLine, Observers,
                                 RequestDecided, RequestFinished, SlotLeased, SlotReleased, UpstreamAnswered,
                                 UpstreamCounted)
from extproc.core.outcomes import Outcome, Rejection
from extproc.lifecycle.gate import AdmissionGate
from extproc.lifecycle.relay import Relay
from extproc.ops.decision_log import DecisionLog
from extproc.ops.metrics import Metrics
from extproc.stores.control import LocalControlStore
from extproc.stores.local_queue import LocalQueueStore
from extproc.stores.queue import Waiter
from extproc_testbed.stack import metric_sum, parse_samples

from ..conftest import e2e_config
from ..helpers import chat


class Recorder:
    """Every event the gate emits (core/events.py), in order."""

    def __init__(self, observers) -> None:
        self.events: list = []
        for kind in typing.get_args(Event):
            observers.subscribe(kind, self.events.append)

    def of(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]


class SteppedClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        """What the gate's waits take: the time passes at once."""
        self.advance(seconds)
        await asyncio.sleep(0)


class Rig:
    """A gate over the local stores, and what it counted; with `relay`, where its failovers and
    shadow copies go (a stand-in here, tests/relays.py; the real HttpRelay in tests/e2e)."""

    def __init__(self, relay: Relay | None = None, /, **overrides) -> None:
        self.config = parse_config(e2e_config(**overrides))
        self.clock = SteppedClock()
        self.metrics = Metrics()
        self.metrics.declare(self.config.classes, self.config.pools)
        self.store = LocalQueueStore({name: pool.max_inflight for name, pool in self.config.pools.items()},
                                     on_change=lambda pool, snapshot: self.gate.pool_changed(pool, snapshot),
                                     clock=self.clock)
        self.observers = Observers()  # what the gate and its control plane tell (core/events.py)
        self.control = ControlPlane(self.config, LocalControlStore(self.config.retries, clock=self.clock), self.metrics,
                                    observers=self.observers)
        self.relay = relay
        self.build_gate()

    def build_gate(self, **parts) -> None:
        """The gate, built again with `parts` (a picker...), and a recorder of what it tells."""
        self.gate = AdmissionGate(self.config, self.store, self.metrics, self.control, relay=self.relay,
                                  clock=self.clock, observers=self.observers, rng=random.Random(7),
                                  sleep=self.clock.sleep, **parts)
        self.heard = Recorder(self.gate.observers)  # what the request path told (core/events.py)

    def decision_log(self) -> DecisionLog:
        """The decision log, hearing this gate as the server wires it."""
        log = DecisionLog(True)
        for kind, handler in log.subscriptions():
            self.gate.observers.subscribe(kind, handler)
        return log

    def told(self, kind: type, **fields: object) -> list:
        """The events of `kind` told so far whose fields are `fields`."""
        return [e for e in self.heard.of(kind) if all(getattr(e, k) == v for k, v in fields.items())]

    def counted(self, name: str, **labels: str) -> float:
        return metric_sum(parse_samples(self.metrics.render().decode()), name, **labels)

    async def arrive(self, ticket_type: str = "complaint", body: bytes | None = None, **headers: str):
        exchange = self.gate.open({"x-ticket-type": ticket_type, ":path": "/v1/chat/completions", **headers})
        return exchange, await self.gate.enqueue(exchange, body or chat(max_tokens=8))

    async def refused(self, ticket_type: str = "complaint", body: bytes | None = None, **headers: str) -> Rejection:
        """An attempt that is turned away, its exchange closed as the servicer closes it."""
        exchange = self.gate.open({"x-ticket-type": ticket_type, ":path": "/v1/chat/completions", **headers})
        try:
            await self.gate.enqueue(exchange, body or chat(max_tokens=8))
        except Rejection as rejection:
            self.gate.refused(exchange, rejection)
            return rejection
        finally:
            await self.gate.close(exchange)
            await asyncio.sleep(0)  # the attempt ledger hears of the end in a task of its own
        raise AssertionError("it was not turned away")

    async def inflight(self, pool: str = "primary") -> int:
        return (await self.store.snapshot(pool)).inflight


async def test_a_request_admitted_at_once_goes_to_its_pool_and_is_released_when_answered():
    rig = Rig()
    exchange, waiter = await rig.arrive()
    assert waiter is None and exchange.outcome is Outcome.ADMITTED and exchange.lease is not None
    admission = rig.gate.admission(exchange)
    assert dict(admission.set_headers) == {"x-llm-pool": "vllm_primary", "x-llm-priority": "1", "x-llm-class": "complaint"}
    assert admission.body is None  # nothing to rewrite
    rig.clock.advance(0.75)
    plan = rig.gate.response_started(exchange, 200, "via_upstream")
    assert plan.finished and not plan.fail_over
    assert dict(plan.set_headers) == {"x-queue-wait-ms": "0", "x-queue-wait-predicted-ms": "0"}
    await rig.gate.close(exchange)
    assert await rig.inflight() == 0
    assert len(rig.told(SlotReleased, pool="primary", end="completed")) == 1
    assert [e.since_arrival_s for e in rig.told(RequestFinished, pool="primary")] == [pytest.approx(0.75)]
    assert len(rig.told(UpstreamCounted, pool="primary", result="success")) == 1


async def test_a_waiter_is_admitted_when_the_slot_comes_free_and_its_wait_is_measured_on_the_clock():
    rig = Rig()  # the primary pool has one slot
    first, _ = await rig.arrive()
    second, waiter = await rig.arrive("loan_approval")
    assert isinstance(waiter, Waiter) and rig.store.depth("primary") == 1
    # who joined the line is told, not who was admitted at once
    assert rig.heard.of(JoinedLine) == [JoinedLine("primary", "loan_approval")]
    waiting = asyncio.create_task(rig.gate.wait(second, waiter))
    rig.clock.advance(2.5)
    rig.gate.response_started(first, 200)
    await rig.gate.close(first)
    await asyncio.wait_for(waiting, 1)
    assert second.outcome is Outcome.ADMITTED and second.queue_wait_s == pytest.approx(2.5)
    assert dict(rig.gate.admission(second).set_headers)["x-llm-class"] == "loan_approval"
    await rig.gate.close(second)
    assert await rig.inflight() == 0


async def test_a_wait_that_ran_out_on_the_clock_is_refused_with_retry_after():
    rig = Rig()
    await rig.arrive()
    late, waiter = await rig.arrive()
    rig.clock.advance(61)  # complaints wait 60 s in this configuration
    with pytest.raises(Rejection) as refused:
        await rig.gate.wait(late, waiter)
    assert refused.value.outcome is Outcome.EXPIRED_IN_QUEUE and refused.value.retry_after_s >= 1
    assert rig.store.depth("primary") == 0 and late.queue_wait_s == pytest.approx(61)
    await rig.gate.close(late)
    assert len(rig.told(RequestDecided, outcome=Outcome.EXPIRED_IN_QUEUE)) == 1


async def test_a_client_that_leaves_is_a_cancellation_wherever_it_was_never_an_upstream_failure():
    rig = Rig()
    admitted, _ = await rig.arrive()
    queued, waiter = await rig.arrive()
    await rig.gate.close(queued)  # its stream closed before it waited: it leaves the line
    assert rig.store.depth("primary") == 0 and queued.outcome is Outcome.CANCELLED_CLIENT_GONE
    await rig.gate.close(admitted)  # admitted, and gone before any response
    assert await rig.inflight() == 0
    assert rig.heard.of(ClientLeft) == [ClientLeft("primary", "complaint", "queued"),
                                        ClientLeft("primary", "complaint", "before_response")]
    assert len(rig.told(UpstreamCounted)) == 0
    assert rig.control.breakers["primary"].reading("instant", rig.clock()).requests == 0


async def test_envoys_own_503_counts_as_the_failure_its_details_name():
    rig = Rig()
    exchange, _ = await rig.arrive()
    details = "upstream_reset_before_response_started{remote_connection_failure}"
    plan = rig.gate.response_started(exchange, 503, details)
    assert not plan.fail_over  # no relay: nothing to fail over to, the client gets the 503
    await rig.gate.close(exchange)
    assert len(rig.told(UpstreamCounted, pool="primary", result="connect_failure")) == 1
    assert len(rig.told(SlotReleased, end="upstream_error")) == 1
    assert exchange.failover.failed_in == "primary"


async def test_past_the_red_tier_an_unprotected_class_is_shed_and_a_protected_one_still_queues():
    rig = Rig()  # one slot; tiers yellow 2, orange 4, red 6, hard max 10
    await rig.arrive()
    for _ in range(7):
        await rig.arrive("loan_approval")
    with pytest.raises(Rejection) as shed:
        await rig.arrive("complaint")
    assert shed.value.outcome is Outcome.SHED_OVERLOADED and shed.value.retry_after_s >= 1
    _, still = await rig.arrive("loan_approval")
    assert isinstance(still, Waiter)


async def test_a_named_request_running_elsewhere_is_refused_and_its_name_is_freed_at_the_end():
    rig = Rig()
    first, _ = await rig.arrive(**{"idempotency-key": "ticket-42"})
    with pytest.raises(Rejection) as repeated:
        await rig.arrive(**{"idempotency-key": "ticket-42"})
    assert repeated.value.outcome is Outcome.REJECTED_IN_PROGRESS
    rig.gate.response_started(first, 200)
    await rig.gate.close(first)
    await asyncio.sleep(0)  # the ledger hears of the end in a task of its own
    again, waiter = await rig.arrive(**{"idempotency-key": "ticket-42"})
    assert again.outcome is Outcome.ADMITTED and waiter is None


async def test_draining_answers_the_line_and_refuses_what_comes_next():
    rig = Rig()
    await rig.arrive()
    queued, waiter = await rig.arrive()
    waiting = asyncio.create_task(rig.gate.wait(queued, waiter))
    await asyncio.sleep(0)
    await rig.gate.drain()
    with pytest.raises(Rejection) as answered:
        await waiting
    assert answered.value.outcome is Outcome.REJECTED_DRAINING
    with pytest.raises(Rejection) as refused:
        rig.gate.open({"x-ticket-type": "complaint"})
    assert refused.value.outcome is Outcome.REJECTED_DRAINING
    assert rig.counted("extproc_serving") == 0


async def test_past_the_red_tier_a_request_is_given_an_appointment_and_let_in_when_it_comes_back():
    rig = Rig()  # one slot; red above 6 waiting
    await rig.arrive()
    for _ in range(7):
        await rig.arrive("loan_approval")
    refused = await rig.refused("complaint", **{"idempotency-key": "ticket-7"})
    assert refused.outcome is Outcome.SHED_OVERLOADED and not refused.final
    assert refused.retry_after_s >= 1 and "keeps its place" in refused.message
    assert len(rig.told(AppointmentTold, pool="primary", result="given")) == 1
    rig.clock.advance(refused.retry_after_s)
    back, waiter = await rig.arrive("complaint", **{"idempotency-key": "ticket-7"})
    assert isinstance(waiter, Waiter)  # the red tier lets it in: it was given an appointment
    assert back.attempt.age_s == pytest.approx(refused.retry_after_s)  # and it keeps its first arrival
    assert waiter.ticket.waited_s == pytest.approx(refused.retry_after_s)
    again = await rig.refused("complaint", **{"idempotency-key": "ticket-8"})  # a new one is still refused
    assert again.outcome is Outcome.SHED_OVERLOADED


async def test_a_request_that_cannot_be_answered_before_its_deadline_gets_a_final_answer():
    rig = Rig(classes={**e2e_config()["classes"], "complaint": {"base": 1, "max_wait_s": 60, "deadline_s": 5}})
    await rig.arrive()
    for _ in range(7):
        await rig.arrive("loan_approval")
    first = await rig.refused("complaint", **{"idempotency-key": "late"})
    assert first.outcome is Outcome.SHED_OVERLOADED and first.retry_after_s <= 5
    rig.clock.advance(8)  # it comes back after its deadline
    final = await rig.refused("complaint", **{"idempotency-key": "late"})
    assert final.outcome is Outcome.REJECTED_PAST_DEADLINE and final.final and final.retry_after_s is None
    assert len(rig.told(AppointmentTold, pool="primary", result="past_deadline")) == 1


async def test_a_request_whose_forecast_wait_is_longer_than_it_may_wait_is_told_at_arrival():
    rig = Rig()  # quick_check may wait 1 s
    served, _ = await rig.arrive()
    rig.clock.advance(2.0)  # a request takes 2 s: with one slot, the pool drains one every 2 s
    rig.gate.response_started(served, 200)
    await rig.gate.close(served)
    await rig.arrive()
    for _ in range(3):
        await rig.arrive("complaint")
    started = rig.clock()
    deferred = await rig.refused("quick_check")
    assert rig.clock() == started  # answered at once, not after its 1 s wait
    assert deferred.outcome is Outcome.DEFERRED
    assert deferred.retry_after_s >= 6  # three in line before it, one every 2 s
    # a class that may wait longer than its forecast joins the line, the forecast noted
    exchange, waiter = await rig.arrive("complaint")
    assert isinstance(waiter, Waiter) and exchange.forecast_wait_s == pytest.approx(6.0)


async def half_open(rig: Rig) -> None:
    """The primary pool's breaker opens (ten failures in its 1 s window), then half-opens."""
    for _ in range(10):
        rig.control.record("primary", True, None, "http_5xx")
    await asyncio.sleep(0)  # its change is written in the background
    rig.clock.advance(31)  # open_s: 30
    assert rig.control.permit("primary")[0].value == "probe"


async def test_a_half_open_probe_that_leaves_the_line_unserved_gives_its_permit_back():
    rig = Rig()  # three probes per half-open period; one slot
    await half_open(rig)
    first, _ = await rig.arrive()
    assert first.pool == "primary" and first.route.probe is not None  # a probe, admitted
    probes = [await rig.arrive() for _ in range(2)]  # two more probes, waiting for the slot
    assert all(exchange.pool == "primary" and isinstance(waiter, Waiter) for exchange, waiter in probes)
    # a fourth request finds no permit left: it goes to the fallback pool
    assert (await rig.arrive())[0].pool == "fallback"
    # the waiting probes run out of time (expired), or their clients leave: no outcome for the breaker
    (expired, waiter), (left, _) = probes
    rig.clock.advance(61)
    with pytest.raises(Rejection):
        await rig.gate.wait(expired, waiter)
    await rig.gate.close(expired)
    await rig.gate.close(left)
    await asyncio.sleep(0)  # permits go back in a task of their own
    # so two more probes may go: the breaker can still close
    again = [(await rig.arrive())[0] for _ in range(2)]
    assert [exchange.pool for exchange in again] == ["primary", "primary"]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


async def test_the_writer_formats_the_lines_off_the_request_path_exactly_as_their_records():
    """With no handler of the application's on `extproc.decisions`, the request path hands the
    writer's thread a record and the function that formats it: the lines it writes are the
    records' JSON, the release the decision's fields with its own at the end."""
    import io

    from extproc.ops.decision_log import DecisionLogWriter, encode_line

    stream = io.StringIO()
    log = logging.getLogger("extproc.decisions")
    level = log.level
    log.setLevel(logging.INFO)
    try:
        rig = Rig()
        decisions = rig.decision_log()
        decisions.writer = DecisionLogWriter(lambda: stream)
        exchange, _ = await rig.arrive(**{"x-branch-id": 'b","outcome":"admitted","x":"', "x-request-id": "r-1"})
        rig.clock.advance(0.25)
        rig.gate.response_started(exchange, 200, "via_upstream")
        await rig.gate.close(exchange)
        decisions.close()
    finally:
        log.setLevel(level)
    decision_line, release_line = stream.getvalue().splitlines()
    decision, release = json.loads(decision_line), json.loads(release_line)
    assert decision_line == encode_line(exchange.decision) and decision["client_request_id"] == "r-1"
    assert release_line == encode_line({**decision, "ts": release["ts"], "outcome": "released", "end": "completed",
                                        "status": 200, "duration_ms": 250})


async def test_the_release_line_repeats_the_decision_lines_fields_and_adds_how_it_ended():
    log = logging.getLogger("extproc.decisions")
    lines, level = Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        rig = Rig()
        rig.decision_log()
        # A branch id that reads like the fields around it: the release is still the decision's fields.
        exchange, _ = await rig.arrive(**{"x-branch-id": 'b","outcome":"admitted","x":"'})
        rig.clock.advance(0.25)
        rig.gate.response_started(exchange, 200, "via_upstream")
        await rig.gate.close(exchange)
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    decision, release = lines.lines
    assert decision["outcome"] == "admitted" and decision["branch"] == 'b","outcome":"admitted","x":"'
    assert release == {**decision, "ts": release["ts"], "outcome": "released", "end": "completed", "status": 200,
                       "duration_ms": 250}
    assert list(release)[:len(decision)] == list(decision)  # in the same order, the release's own last


async def test_each_step_of_a_life_moves_the_exchange_through_the_state_machines_phases():
    """The gate reports each event to the state machine (core/request_life.py): the exchange's
    phase follows, and an event its life does not allow is refused, never a silent change."""
    from extproc.core.request_life import IllegalStep, Phase

    rig = Rig()  # the primary pool has one slot
    first, _ = await rig.arrive()
    second, waiter = await rig.arrive("loan_approval")
    assert (first.phase, second.phase) == (Phase.ADMITTED, Phase.QUEUED)
    waiting = asyncio.ensure_future(rig.gate.wait(second, waiter))
    await asyncio.sleep(0)
    assert second.phase is Phase.WAITING
    rig.gate.response_started(first, 200)
    assert first.phase is Phase.ANSWERED
    await rig.gate.close(first)
    await waiting
    assert first.phase is Phase.CLOSED and second.phase is Phase.ADMITTED
    with pytest.raises(IllegalStep):  # a life ends once
        await rig.gate.close(first)
    assert len(rig.told(SlotReleased, pool="primary", end="completed")) == 1
    await rig.gate.close(second)  # its client left before any response
    assert second.phase is Phase.CLOSED and await rig.inflight() == 0
    assert len(rig.told(SlotReleased, pool="primary", end="client_gone")) == 1


async def test_a_life_is_told_to_observers_as_events_once_each():
    rig = Rig()  # the primary pool has one slot
    heard = rig.heard
    first, _ = await rig.arrive()
    second, waiter = await rig.arrive("loan_approval")
    assert heard.of(RequestDecided) == [RequestDecided("complaint", Outcome.ADMITTED, "primary", "primary", True, 0.0,
                                                       first.decision, first.classification)]
    assert first.decision is not None and first.decision["outcome"] == "admitted"
    assert heard.of(JoinedLine) == [JoinedLine("primary", "loan_approval")]
    assert [type(e) for e in heard.events] == [SlotLeased, RequestDecided, DecisionTimed, JoinedLine, DecisionTimed]
    rig.clock.advance(0.5)
    rig.gate.response_started(first, 200)
    rig.clock.advance(0.25)
    waiting = asyncio.ensure_future(rig.gate.wait(second, waiter))
    await rig.gate.close(first)
    await waiting
    assert heard.of(FirstByte) == [FirstByte("primary", "complaint", 0.5, 0.5, True)]
    assert heard.of(RequestFinished) == [RequestFinished("primary", "complaint", "completed", 0.75, 0.75, first.cost,
                                                         200, first.decision, first.classification)]
    assert heard.of(RequestDecided)[1] == RequestDecided("loan_approval", Outcome.ADMITTED, "primary", "primary",
                                                         True, 0.75, second.decision, second.classification)
    assert heard.of(UpstreamAnswered) == [UpstreamAnswered("primary", 200)]
    rig.gate.response_started(second, 503)  # a failure: not the latency limiter's to learn from
    await rig.gate.close(second)
    assert heard.of(FirstByte)[1].succeeded is False
    assert [e.end for e in heard.of(RequestFinished)] == ["completed", "upstream_error"]
    assert len(heard.of(RequestDecided)) == 2  # each decided once
    assert heard.of(UpstreamAnswered)[1] == UpstreamAnswered("primary", 503)
    assert heard.of(SlotLeased) == [SlotLeased("primary")] * 2  # each slot taken once, and given back once
    assert heard.of(SlotReleased) == [SlotReleased("primary", "completed"), SlotReleased("primary", "upstream_error")]


async def test_an_observer_that_fails_stops_neither_the_request_nor_its_release(caplog):
    def broken(event) -> None:
        raise RuntimeError("observer bug")

    rig = Rig()
    heard = []
    for kind in (RequestDecided, RequestFinished):
        rig.gate.observers.subscribe(kind, broken)
        rig.gate.observers.subscribe(kind, heard.append)  # the next one still hears
    exchange, waiter = await rig.arrive()
    assert waiter is None and exchange.outcome is Outcome.ADMITTED
    rig.gate.response_started(exchange, 200)
    await rig.gate.close(exchange)
    assert await rig.inflight() == 0 and exchange.id not in rig.gate.holding
    assert [type(e) for e in heard] == [RequestDecided, RequestFinished]
    assert "observer bug" in caplog.text


async def test_a_sidecar_failure_after_the_response_came_is_not_counted_as_its_client_leaving():
    rig = Rig()
    exchange, _ = await rig.arrive()

    def record(*args, **kwargs):
        raise RuntimeError("the breaker failed")

    rig.gate.control.record = record
    with pytest.raises(RuntimeError):
        rig.gate.response_started(exchange, 200)
    rig.gate.refused(exchange, Rejection(Outcome.INTERNAL_ERROR, "Internal gateway error."))
    await rig.gate.close(exchange)
    assert rig.heard.of(ClientLeft) == []
    assert await rig.inflight() == 0


async def test_a_request_is_decided_under_the_configuration_it_arrived_under():
    """A reload while a request waits in line changes nothing of its decisions (its wait, its
    admission's body); the next request is decided under the new configuration."""
    rig = Rig()  # the primary pool has one slot
    first, _ = await rig.arrive()
    waiting, waiter = await rig.arrive("loan_approval", body=chat())  # no max_tokens: the default is written in
    assert isinstance(waiter, Waiter)
    reloaded = parse_config(e2e_config(requests={"default_max_tokens": 64},
                                       limits={"max_body_bytes": 65536, "max_message_timeout_s": 30}))
    rig.gate.reconfigure(reloaded)
    assert rig.gate.hold_seconds(waiting) > 30  # its hold, as the configuration it came under allows
    wait = asyncio.ensure_future(rig.gate.wait(waiting, waiter))
    await rig.gate.close(first)
    await wait
    assert json.loads(rig.gate.admission(waiting).body)["max_tokens"] == 512  # the embedded default
    await rig.gate.close(waiting)
    later, admitted_at_once = await rig.arrive("loan_approval", body=chat())
    assert admitted_at_once is None
    assert json.loads(rig.gate.admission(later).body)["max_tokens"] == 64
    assert rig.gate.hold_seconds(later) <= 30
    await rig.gate.close(later)


@pytest.mark.parametrize("replicas, desired", [(1, 5), (2, 10)])
async def test_demand_for_one_model_moves_only_its_own_pools_capacity_estimate(replicas, desired):
    """Capacity per model pool: requests for the small model count as demand on the pool that
    serves it (their home), so its `extproc_desired_backends` rises and the large model's pool,
    asked for nothing, keeps its minimum; the watch hears the gate as server.py wires it. A
    replica that hears half the pool's arrivals (a line shared with another) counts them twice."""
    rig = Rig(pools={
        "loans": {"cluster": "vllm_primary", "max_inflight": 4, "served_models": ["deepseek-sim"]},
        "archive": {"cluster": "vllm_fallback", "max_inflight": 4, "served_models": ["deepseek-sim-small"],
                    "capacity": {"max_num_seqs": 1}},
    }, default_pool="loans")
    watch = CapacityWatch(lambda: rig.config, rig.store, rig.metrics, backends_up=lambda pool: 1,
                          kv_tokens=lambda pool: None, clock=rig.clock, replicas_hearing=lambda pool: replicas)
    for kind, handler in ((RequestDecided, watch.decided), (FirstByte, watch.first_byte),
                          (RequestFinished, watch.finished)):
        rig.gate.observers.subscribe(kind, handler)
    rig.clock.advance(0.6)
    for _ in range(12):  # 4 at once every 2.4 s, each served in 2.4 s, within the model's 30 s window
        admitted = [(await rig.arrive("archive_query", chat(model="deepseek-sim-small", max_tokens=8)))[0]
                    for _ in range(4)]
        assert {exchange.pool for exchange in admitted} == {"archive"}
        rig.clock.advance(2.4)
        for exchange in admitted:
            rig.gate.response_started(exchange, 200)
            await rig.gate.close(exchange)
    rig.clock.advance(0.6)  # a whole window since the watch started
    await watch.tick()
    archive, loans = watch.estimates["archive"], watch.estimates["loans"]
    # 48 arrivals in 30 s; one engine carries 1 x 0.8 / 2.4 s = 1/3 a second: 1.6 x 3 = 4.8, 5 engines
    assert archive.demand_rps["archive_query"] == pytest.approx(1.6 * replicas)
    assert archive.desired == desired
    assert set(loans.demand_rps.values()) == {0.0} and loans.desired == 1  # min_backends
    assert rig.counted("extproc_desired_backends", pool="archive") == desired
    assert rig.counted("extproc_desired_backends", pool="loans") == 1


async def test_the_watch_tells_the_model_what_concurrency_its_completions_ran_at():
    """Each tick tells the model the pool's requests in flight per engine (`ran_at`); a completion
    is kept with the mean of that over its life, and the fit is exported: 4 requests at once on
    one engine, 2.4 s each, is all the model saw (one level): 2.4 s at 4, 0.6 s a request."""
    rig = Rig(pools={"archive": {"cluster": "vllm_fallback", "max_inflight": 4}}, default_pool="archive")
    watch = CapacityWatch(lambda: rig.config, rig.store, rig.metrics, backends_up=lambda pool: 1,
                          kv_tokens=lambda pool: None, clock=rig.clock)
    rig.gate.observers.subscribe(RequestFinished, watch.finished)
    for _ in range(3):
        admitted = [(await rig.arrive("archive_query"))[0] for _ in range(4)]
        for _ in range(3):  # ticks while the 4 are in flight
            rig.clock.advance(0.8)
            await watch.tick()
        for exchange in admitted:
            rig.gate.response_started(exchange, 200)
            await rig.gate.close(exchange)
    model = watch.models["archive"]
    assert [n for _, _, n in model._samples("archive_query").service] == pytest.approx([4.0] * 12)
    await watch.tick()
    assert rig.counted("extproc_service_fit_seconds", pool="archive", term="per_request",
                       **{"class": "archive_query"}) == pytest.approx(0.6)
    assert rig.counted("extproc_service_fit_seconds", pool="archive", term="base", **{"class": "archive_query"}) == 0
    # a class not served yet borrows the pool's completions
    assert rig.counted("extproc_service_fit_seconds", pool="archive", term="per_request",
                       **{"class": "complaint"}) == pytest.approx(0.6)
