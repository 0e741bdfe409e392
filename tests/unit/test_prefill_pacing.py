"""The prefill pace at the gate (lifecycle/prefill_pacing.py), with a stepped clock: a request of a
class without a latency target waits its turn, admitted and holding its slot; a latency-bound one
never waits; a pace is learnt from the latency-bound classes' answers; every wait ends exactly
once, however it ends."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.events import FirstByte, PaceWaited
from extproc.core.prefill_pace import PrefillPace
from extproc.core.request_life import Phase
from extproc.lifecycle.prefill_pacing import PaceWait

from .test_engine_drain import URL_A, URL_B, watched
from .test_gate import Rig

CLASSES = {
    "loan_approval": {"base": 0, "max_wait_s": 60, "protected": True, "latency_target_s": 2},
    "complaint": {"base": 1, "max_wait_s": 10},
    "archive_query": {"base": 2, "max_wait_s": 60},
    "quick_check": {"base": 3, "max_wait_s": 1},
}
POOLS = {"primary": {"cluster": "vllm_primary", "max_inflight": 8}}


def paced_rig(rate: float | None = 0.5, **capacity) -> Rig:
    """A gate whose pool's pace lets `rate` prompt tokens a second start (None: no pace); the
    sidecar picks the pool's engines (Envoy not known to ignore it), so the rate applies."""
    rig = Rig(classes=CLASSES, pools={"primary": {**POOLS["primary"], "capacity": {
        "backends": [URL_A, URL_B], "pick_backend": True, **capacity}}})
    _, picker = watched(rig)
    rig.build_gate(picker=picker)
    rig.metrics.refresh_before_render(rig.gate.pacing.publish_gauges)  # as server.py hooks it
    if rate is not None:
        pace = rig.gate.pacing.paces["primary"] = PrefillPace()
        pace.rate = rate
        pace._observed_at = pace._delayed_at = pace._changed_at = pace._last = rig.clock()
    return rig


async def test_over_the_pace_a_request_waits_its_turn_holding_its_slot_then_starts():
    rig = paced_rig()
    first, start = await rig.arrive("complaint")
    assert start is None and first.phase is Phase.ADMITTED  # the schedule had room: it starts now
    second, start = await rig.arrive("complaint")
    assert isinstance(start, PaceWait) and start.due > rig.clock()
    assert second.phase is Phase.AWAITING_PACE and await rig.inflight() == 2  # its slot is held meanwhile
    began = rig.clock()
    await rig.gate.wait(second, start)
    assert second.phase is Phase.ADMITTED and rig.clock() == start.due > began
    assert rig.told(PaceWaited, pool="primary", result="started") == [PaceWaited("primary", "started")]
    for exchange in (first, second):
        await rig.gate.close(exchange)
    assert await rig.inflight() == 0


async def test_a_latency_bound_request_is_never_paced():
    rig = paced_rig(rate=1.0)
    await rig.arrive("complaint")
    loan, start = await rig.arrive("loan_approval")
    assert start is None and loan.phase is Phase.ADMITTED


async def test_a_pool_that_is_not_paced_lets_every_prompt_start():
    rig = paced_rig(rate=None, prefill_pace=False)
    for _ in range(5):
        _, start = await rig.arrive("complaint")
        assert start is None
    assert "primary" not in rig.gate.pacing.paces


async def test_a_paced_wait_ends_with_what_is_left_of_the_class_wait():
    rig = paced_rig(rate=0.1)  # the second prompt's turn is seconds away
    await rig.arrive("quick_check")
    exchange, start = await rig.arrive("quick_check")
    assert start.due - rig.clock() > 1
    began = rig.clock()
    await rig.gate.wait(exchange, start)
    assert exchange.phase is Phase.ADMITTED and rig.clock() - began <= 1  # quick_check: max_wait_s 1
    assert rig.told(PaceWaited, pool="primary", result="cut_short") == [PaceWaited("primary", "cut_short")]


async def test_a_client_that_leaves_while_paced_is_a_cancellation_and_its_slot_goes_back():
    rig = paced_rig()
    first, _ = await rig.arrive("complaint")
    second, start = await rig.arrive("complaint")
    waiting = asyncio.ensure_future(rig.gate.wait(second, start))
    await asyncio.sleep(0)
    waiting.cancel()  # Envoy reset the stream: the servicer's task is cancelled
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await rig.gate.close(second)
    await rig.gate.close(first)
    assert await rig.inflight() == 0
    assert rig.told(PaceWaited, pool="primary", result="cancelled") == [PaceWaited("primary", "cancelled")]
    assert second.outcome is not None and second.outcome.value == "cancelled_client_gone"


async def test_the_pace_is_learnt_from_the_latency_bound_answers():
    rig = paced_rig(rate=None)
    pacing = rig.gate.pacing
    for _ in range(40):  # complaints' prompts start freely while loans take 3 s against their 2 s target
        rig.clock.advance(0.25)
        exchange, start = await rig.arrive("complaint")
        if start is not None:
            await rig.gate.wait(exchange, start)
        await rig.gate.close(exchange)
        pacing.first_byte(FirstByte("primary", "loan_approval", 3.0, 2.9, True))
        pacing.first_byte(FirstByte("primary", "complaint", 9.0, 8.9, True))  # no target: not a measure
    pace = pacing.paces["primary"]
    assert pace.rate is not None
    assert rig.counted("extproc_prefill_pace_rate", pool="primary") == pace.limit(rig.clock()) <= pace.rate


async def test_the_pace_shown_is_the_one_in_force_when_the_metrics_are_read():
    rig = paced_rig()
    await rig.arrive("complaint")
    assert rig.counted("extproc_prefill_pace_rate", pool="primary") == 0.5
    rig.clock.advance(3600)  # no latency-bound request answered since: nobody to protect
    assert rig.counted("extproc_prefill_pace_rate", pool="primary") == -1


async def test_a_drain_waits_for_the_paced_requests_too():
    rig = paced_rig()
    first, _ = await rig.arrive("complaint")
    second, start = await rig.arrive("complaint")
    assert isinstance(start, PaceWait)
    await rig.gate.close(first)
    await rig.gate.drain()
    assert rig.gate.holding == {second.id}  # it holds a slot: the server's drain waits for it
    await rig.gate.wait(second, start)  # the drain cuts its wait short: it starts at once
    assert second.phase is Phase.ADMITTED
    assert rig.told(PaceWaited, pool="primary", result="cut_short") == [PaceWaited("primary", "cut_short")]
    await rig.gate.close(second)
    assert rig.gate.holding == set() and await rig.inflight() == 0


async def test_a_long_prompt_whose_turn_comes_looks_for_its_lane_then():
    from extproc.lifecycle.slots import LaneWait

    from ..helpers import chat
    pools = {"primary": {"cluster": "vllm_primary", "max_inflight": 16,
                         "capacity": {"backends": [URL_A, URL_B], "pick_backend": True, "long_request_tokens": 200}}}
    rig = Rig(classes=CLASSES, pools=pools)
    _, picker = watched(rig)
    rig.build_gate(picker=picker)
    pace = rig.gate.pacing.paces["primary"] = PrefillPace()
    pace.rate = 20.0
    pace._observed_at = pace._delayed_at = pace._changed_at = pace._last = rig.clock()
    long_body = chat("word " * 400, max_tokens=8)
    await rig.arrive("complaint")
    paced, start = await rig.arrive("complaint", body=long_body)
    assert isinstance(start, PaceWait) and paced.lease.ticket.long  # a lane was free when it was granted
    loans = [await rig.arrive("loan_approval") for _ in range(4)]  # meanwhile loans run on both engines
    assert all(s is None for _, s in loans)
    _, fresh = await rig.arrive("complaint", body=long_body)
    assert isinstance(fresh, LaneWait)  # a long prompt now has to wait for a lane (its pace turn booked, not waited)
    waiting = asyncio.ensure_future(rig.gate.wait(paced, start))
    for _ in range(20):
        await asyncio.sleep(0)
    assert paced.phase is Phase.AWAITING_PACE and paced.endpoints is None  # its turn came: it waits for a lane
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_where_envoy_ignores_the_picks_only_a_surge_is_spread_not_the_rate():
    # (there a loan is slowed by the long prompt Envoy put beside it, which no pace prevents:
    # the rate the loans' latency set would only take the others' throughput)
    rig = paced_rig(rate=0.5)
    for _ in range(50):  # Envoy ran every placed request elsewhere than the engine named first
        rig.gate.slots.picks.observe("primary", False)
    assert rig.gate.slots.picks_followed("primary") is False
    pace = rig.gate.pacing.paces["primary"]
    for _ in range(3):  # a prompt a second: no surge
        rig.clock.advance(1.0)
        exchange, start = await rig.arrive("complaint")
        assert start is None  # at 0.5 tokens a second these would wait seconds each
        await rig.gate.close(exchange)
    assert pace.rate is not None and pace.rate < 10  # kept: it applies again once Envoy follows the picks
