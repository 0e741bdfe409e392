"""Which request comes back, through the gate (lifecycle/attempts.py over the attempt ledger,
core/retries.py): a copy of a request still waiting or running gains nothing, an SDK's first
attempt is one whatever was sent before, and a client's key belongs to its caller and to the
request it was first given to."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.events import AppointmentTold, RetryJudged
from extproc.core.outcomes import Outcome, Rejection, reply_for
from extproc.lifecycle.waiting_room import Appointment
from extproc.stores.queue import Waiter

from ..conftest import CLERK_KEY, OFFICER_KEY
from ..helpers import chat
from .test_gate import Rig

PROMPT = chat("Why was my card declined?", max_tokens=8)
SDK_FIRST = {"x-stainless-retry-count": "0"}
SDK_RETRY = {"x-stainless-retry-count": "1"}


async def turned_away(rig: Rig, body: bytes, ticket_type: str = "complaint", **headers: str) -> Rejection:
    """An attempt that is turned away, its exchange closed as the servicer closes it (Rig.refused)."""
    return await rig.refused(ticket_type, body, **headers)


async def served(rig: Rig, exchange) -> None:
    rig.gate.response_started(exchange, 200)
    await rig.gate.close(exchange)
    await asyncio.sleep(0)


async def past_the_red_tier(rig: Rig) -> None:
    """One slot held, seven loans waiting: an unprotected new request is shed, a returning one let in."""
    for _ in range(7):
        await rig.arrive("loan_approval")


async def test_a_copy_sent_while_the_first_waits_gains_no_age_and_no_place():
    rig = Rig()  # one slot
    await rig.arrive()
    _, waiting = await rig.arrive(body=PROMPT, **SDK_FIRST)
    assert isinstance(waiting, Waiter)
    rig.clock.advance(5)
    for headers in (SDK_FIRST, SDK_RETRY):
        copy, in_line = await rig.arrive(body=PROMPT, **headers)
        assert isinstance(in_line, Waiter)
        assert copy.attempt.age_s == 0 and in_line.ticket.waited_s == 0  # not ordered by the first's arrival


@pytest.mark.parametrize("headers", [SDK_FIRST, SDK_RETRY], ids=["count_0", "count_1"])
async def test_a_copy_of_a_running_request_is_shed_at_the_red_tier_like_any_new_one(headers):
    rig = Rig()
    _, admitted = await rig.arrive(body=PROMPT, **SDK_FIRST)
    assert admitted is None  # it runs
    await past_the_red_tier(rig)
    rig.clock.advance(5)
    copy = await turned_away(rig, PROMPT, **headers)
    assert copy.outcome is Outcome.SHED_OVERLOADED


async def test_the_same_prompt_sent_again_is_a_first_attempt_and_spends_no_retry_budget():
    rig = Rig(retries={"budget_min": 1, "budget_ratio": 0.0})  # one retry per branch per 10 s
    for _ in range(4):
        exchange, waiter = await rig.arrive(body=PROMPT, **SDK_FIRST)
        assert waiter is None and exchange.attempt.age_s == 0
        await served(rig, exchange)
        rig.clock.advance(1)
    assert len(rig.told(RetryJudged, verdict="allowed")) == 0


async def test_an_sdk_retry_comes_back_aged_from_its_own_first_attempt():
    rig = Rig()
    await rig.arrive()
    await past_the_red_tier(rig)
    assert (await turned_away(rig, PROMPT, **SDK_FIRST)).outcome is Outcome.SHED_OVERLOADED
    rig.clock.advance(10)
    # the same prompt sent anew (a count of 0): a new request, shed like one
    anew = await turned_away(rig, PROMPT, **SDK_FIRST)
    assert anew.outcome is Outcome.SHED_OVERLOADED
    rig.clock.advance(anew.retry_after_s)
    back, waiter = await rig.arrive(body=PROMPT, **SDK_RETRY)  # its retry: let in, aged from it
    assert isinstance(waiter, Waiter) and back.attempt.age_s == pytest.approx(anew.retry_after_s)


async def test_an_idempotency_key_belongs_to_its_caller():
    rig = Rig()
    officer = {"authorization": f"Bearer {OFFICER_KEY}", "idempotency-key": "ticket-1"}
    clerk = {"authorization": f"Bearer {CLERK_KEY}", "idempotency-key": "ticket-1"}
    await rig.arrive(**officer)
    theirs, waiter = await rig.arrive(**clerk)  # another caller's ticket-1: a request of its own
    assert isinstance(waiter, Waiter) and theirs.attempt.age_s == 0
    with pytest.raises(Rejection) as repeated:  # the same caller's is still refused while it runs
        await rig.arrive(**officer)
    assert repeated.value.outcome is Outcome.REJECTED_IN_PROGRESS


async def test_a_key_given_to_another_request_is_refused_and_lends_it_no_place():
    rig = Rig()
    await rig.arrive()
    await past_the_red_tier(rig)
    cheap, costly = chat("ok?", max_tokens=1), chat("Summarize every complaint of the year.", max_tokens=8)
    first = await turned_away(rig, cheap, **{"idempotency-key": "k-1"})
    assert first.outcome is Outcome.SHED_OVERLOADED
    rig.clock.advance(first.retry_after_s)
    with pytest.raises(Rejection) as reused:
        await rig.arrive(body=costly, **{"idempotency-key": "k-1"})
    reply = reply_for(reused.value)
    assert reply.status == 422 and b'"idempotency_key_reused"' in reply.body
    assert len(rig.told(RetryJudged, verdict="key_reused")) == 1
    back, waiter = await rig.arrive(body=cheap, **{"idempotency-key": "k-1"})  # its own retry is let in
    assert isinstance(waiter, Waiter) and back.attempt.age_s == pytest.approx(first.retry_after_s)


async def test_a_trace_id_passed_on_to_several_requests_names_each_with_its_body():
    """x-request-id alone is often a trace id a caller passes on to every request it makes for one
    of its own: a different body under it is another request (neither refused nor a retry); the
    same body again, once the first has ended, is its retry."""
    rig = Rig()
    await rig.arrive()
    await past_the_red_tier(rig)
    summary, answer = chat("Summarize the complaint.", max_tokens=8), chat("Draft the answer.", max_tokens=8)
    first = await turned_away(rig, summary, **{"x-request-id": "trace-7"})
    assert first.outcome is Outcome.SHED_OVERLOADED
    rig.clock.advance(first.retry_after_s)
    other = await turned_away(rig, answer, **{"x-request-id": "trace-7"})  # a new request: shed as one
    assert other.outcome is Outcome.SHED_OVERLOADED
    back, waiter = await rig.arrive(body=summary, **{"x-request-id": "trace-7"})  # the first's retry
    assert isinstance(waiter, Waiter) and back.attempt.age_s == pytest.approx(first.retry_after_s)
    assert len(rig.told(RetryJudged, verdict="key_reused")) == 0


async def test_a_caller_naming_anothers_branch_spends_its_own_retry_budget():
    """A caller without a key names its branch itself: naming a tenant's branch, its retries must
    not spend that tenant's budget."""
    rig = Rig(retries={"budget_min": 2, "budget_ratio": 0.0})  # two retries per caller and branch per 10 s
    for i in range(3):  # the third is over the anonymous caller's budget
        outcome = None
        try:
            await rig.arrive(body=chat(f"spoof {i}", max_tokens=1), **{"x-branch-id": "0001"}, **SDK_RETRY)
        except Rejection as rejection:
            outcome = rejection.outcome
    assert outcome is Outcome.REJECTED_RETRY_BUDGET
    officer = {"authorization": f"Bearer {OFFICER_KEY}"}  # the tenant whose branch is 0001
    exchange, _ = await rig.arrive(body=PROMPT, **officer, **SDK_RETRY)
    assert exchange.classification.branch_id == "0001" and exchange.outcome is not Outcome.REJECTED_RETRY_BUDGET
    assert len(rig.told(RetryJudged, verdict="allowed")) == 3


async def test_a_request_back_before_its_appointment_is_held_until_then_instead_of_refused():
    """A client that ignores retry-after comes back at once: it is held (no slot, no place in
    line) until its appointment, then decided again as if it came back then, instead of being
    refused again until its retries run out. Its first attempt is still refused with the time:
    a client that honours retry-after is never held."""
    rig = Rig()
    holder, _ = await rig.arrive()  # the one slot
    loans = [(await rig.arrive("loan_approval"))[0] for _ in range(10)]  # the line full (hard_max)
    key = {"idempotency-key": "storm-1"}
    first = await turned_away(rig, PROMPT, **key)
    assert first.outcome is Outcome.SHED_QUEUE_FULL and first.retry_after_s > 1
    rig.clock.advance(0.1)  # back 100 ms later: past the red tier (it keeps its place), not the full line
    early, held = await rig.arrive(body=PROMPT, **key)
    assert isinstance(held, Appointment) and held.at == pytest.approx(rig.clock() + first.retry_after_s - 0.1)
    assert early.outcome is None and early.lease is None and rig.store.depth("primary") == 10
    assert len(rig.told(AppointmentTold, result="held")) == 1
    assert rig.gate.hold_seconds(early) > first.retry_after_s  # Envoy is told to keep it that long
    for exchange in (holder, *loans):  # by its time the pool has room
        await rig.gate.close(exchange)
    await rig.gate.wait(early, held)
    assert early.outcome is Outcome.ADMITTED and early.lease is not None and rig.clock() >= held.at


async def test_a_request_whose_appointment_is_past_what_envoy_holds_is_refused_again():
    rig = Rig(limits={"max_body_bytes": 65536, "max_message_timeout_s": 3})  # held at most 1 s
    await rig.arrive()
    for _ in range(10):
        await rig.arrive("loan_approval")
    key = {"idempotency-key": "storm-2"}
    first = await turned_away(rig, PROMPT, **key)
    rig.clock.advance(0.1)
    again = await turned_away(rig, PROMPT, **key)
    assert again.outcome is Outcome.SHED_QUEUE_FULL
    assert again.retry_after_s == pytest.approx(first.retry_after_s - 0.1)  # the same appointment
    assert len(rig.told(AppointmentTold, result="held")) == 0
