"""Where the sidecar places requests, the other classes' prompts start beside the loans at the
spill pace (core/spill.py): a complaint for which the engine free of loans has no room waits,
admitted, for its turn on the loans' engine (lifecycle/slots.py), and an engine whose loans just
finished still counts as theirs (`bound_lately_s`)."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.capacity import BackendReading, Placing
from extproc.core.events import LaneWaited, Observers
from extproc.lifecycle.slots import LANE_POLL_S, LaneWait, Slots

from .test_long_lane import LOAN, LONG, A, B, _Clock, _exchange, _picker, _Store, waits

COMPLAINT = Placing(1024)  # half a second of turn at 2048 tokens a second


def test_a_complaint_with_no_room_off_the_loans_engine_waits_its_turn_there():
    async def go():
        clock, observers, heard = _Clock(), Observers(), []
        observers.subscribe(LaneWaited, heard.append)
        picker = _picker(clock=clock)

        async def sleep(seconds: float) -> None:
            clock.now += seconds

        slots = Slots(_Store(), observers, picker, clock, sleep)
        slots.hold(_exchange("lane", Placing(65000, long=True)))  # A: the long prompts' lane, its cache spoken for
        slots.hold(_exchange("loan", LOAN))  # B: the loans'
        first = _exchange("c1", COMPLAINT)
        assert slots.lane_needed(first) is None  # its turn: it goes beside the loan at once
        slots.hold(first)
        assert first.endpoints.startswith(B)
        second = _exchange("c2", COMPLAINT)
        assert slots.lane_needed(second) == LaneWait("p")  # the next waits for its turn
        await slots.wait_for_lane(second, until=10.0, stop=lambda: False)
        slots.hold(second)
        assert second.endpoints.startswith(B)
        assert clock.now == pytest.approx(COMPLAINT.cost / 2048, abs=LANE_POLL_S)
        assert waits(heard, "placed") == 1
        # the loan ends and no loan started there lately (bound_lately_s 0 here): the engine is no
        # longer the loans', and the others start there at once
        picker.release("loan")
        assert slots.lane_needed(_exchange("c3", COMPLAINT)) is None
        # a loan never waits for the pace
        assert slots.lane_needed(_exchange("loan2", LOAN)) is None

    asyncio.run(go())


def test_a_complaint_waits_for_nothing_where_every_engine_serves_loans():
    clock = _Clock()
    picker = _picker(clock=clock)
    slots = Slots(_Store(), Observers(), picker, clock)
    for name in ("loan1", "loan2", "c1"):
        slots.hold(_exchange(name, COMPLAINT if name == "c1" else LOAN))
    assert {e for e in picker.running("p")} == {A, B}
    # both engines serve loans and c1 took the turn on one: the next goes to the other, and then
    # starts anyway (there is no engine free of loans to wait for)
    assert slots.lane_needed(_exchange("c2", COMPLAINT)) is None
    slots.hold(_exchange("c2", COMPLAINT))
    assert slots.lane_needed(_exchange("c3", COMPLAINT)) is None


def test_an_engine_serves_loans_for_bound_lately_s_after_its_last_one_started():
    clock = _Clock()
    picker = _picker(bound_lately_s=2.0, clock=clock)
    assert picker.pick("p", "loan1", LOAN).startswith(A)
    assert picker.pick("p", "loan2", LOAN).startswith(B)
    picker.release("loan1")
    clock.now = 1.0
    # A runs no loan, but the next one is likely on its way: no long prompt takes it for a lane...
    assert not picker.may_start("p", LONG)
    clock.now = 2.5  # (loan1 started at 0: A has served none for 2 s)
    assert picker.may_start("p", LONG)
    assert picker.pick("p", "long", LONG).startswith(A)


def test_a_long_prompt_waits_for_a_lane_whatever_its_class():
    clock = _Clock()
    slots = Slots(_Store(), Observers(), _picker(clock=clock), clock)
    for i in (1, 2):
        slots.hold(_exchange(f"loan{i}", LOAN))
    # a loan of 12k tokens would stall the loans beside it as any long prompt would
    assert slots.lane_needed(_exchange("long_loan", Placing(12000, long=True, bound=True))) == LaneWait("p")


def test_the_other_classes_take_their_turns_beside_the_loans_in_the_order_they_began_to_wait():
    async def go():
        clock, observers = _Clock(), Observers()
        picker = _picker(clock=clock)
        sleeps: list[float] = []

        async def sleep(seconds: float) -> None:
            sleeps.append(seconds)
            clock.now += seconds
            await asyncio.sleep(0)

        slots = Slots(_Store(), observers, picker, clock, sleep)
        slots.hold(_exchange("lane", Placing(65000, long=True)))
        slots.hold(_exchange("loan", LOAN))
        slots.hold(_exchange("c1", COMPLAINT))  # B's turn taken until 0.5 s
        c2, c3 = _exchange("c2", COMPLAINT), _exchange("c3", COMPLAINT)
        assert slots.lane_needed(c2) == LaneWait("p")
        first = asyncio.ensure_future(slots.wait_for_lane(c2, until=10.0, stop=lambda: False))
        await asyncio.sleep(0)
        clock.now = 0.6  # c2's turn has come, but it has not looked yet: a newcomer queues behind it
        assert slots.lane_needed(c3) == LaneWait("p")
        await first
        slots.hold(c2)  # placed at its turn, the first to wait...
        assert c2.endpoints.startswith(B) and clock.now == pytest.approx(0.6, abs=LANE_POLL_S)
        # ...and the newcomer's turn is the next one (c2's tokens on from then)
        assert slots.lane_needed(c3) == LaneWait("p")
        clock.now += COMPLAINT.cost / 2048
        assert slots.lane_needed(c3) is None

    asyncio.run(go())


# -- through the gate: a prompt over the pool's prefill pace and before its turn beside the loans ---------

async def test_a_prompt_waits_for_its_turn_on_the_prefill_pace_first_then_for_one_beside_the_loans():
    from extproc.core.events import PaceWaited
    from extproc.core.prefill_pace import PrefillPace
    from extproc.core.request_life import Phase
    from extproc.lifecycle.placement import BackendPicker
    from extproc.lifecycle.prefill_pacing import PaceWait

    from ..helpers import chat
    from ..unit.test_engine_drain import URL_A, URL_B
    from ..unit.test_gate import Rig
    from ..unit.test_prefill_pacing import CLASSES

    rig = Rig(classes=CLASSES, pools={"primary": {"cluster": "vllm_primary", "max_inflight": 8, "capacity": {
        "backends": [URL_A, URL_B], "pick_backend": True, "kv_tokens_per_backend": 100_000}}})
    picker = BackendPicker(lambda: rig.config, clock=rig.clock)
    picker.observe("primary", {url: BackendReading(0.0, 100_000, False) for url in (URL_A, URL_B)})
    rig.build_gate(picker=picker)
    pace = rig.gate.pacing.paces["primary"] = PrefillPace()
    pace.rate = 0.5
    pace._observed_at = pace._delayed_at = pace._changed_at = pace._last = rig.clock()
    picker.pick("primary", "lane", Placing(84_000, long=True))  # A: the long prompts' lane, no room left
    loan, _ = await rig.arrive("loan_approval")
    assert loan.endpoints.startswith("10.0.0.2")  # B: the loans'
    body = chat("word " * 1500, max_tokens=64)  # about 2000 tokens: a second of B's turns
    first, start = await rig.arrive("complaint", body)
    assert start is None and first.endpoints.startswith("10.0.0.2")
    second, start = await rig.arrive("complaint", body)
    # over the pace (its turn booked there) and before its turn beside the loans: the pace first
    assert isinstance(start, PaceWait) and second.phase is Phase.AWAITING_PACE
    assert rig.gate.slots.lane_needed(second) is not None
    await rig.gate.wait(second, start)
    assert second.phase is Phase.ADMITTED and second.endpoints.startswith("10.0.0.2")
    assert len(rig.told(PaceWaited, pool="primary")) == 1


def test_a_newcomer_that_would_not_go_beside_the_loans_does_not_queue_behind_those_that_wait_to():
    async def go():
        clock = _Clock()
        picker = _picker(clock=clock)

        async def sleep(seconds: float) -> None:
            await asyncio.sleep(0)

        slots = Slots(_Store(), Observers(), picker, clock, sleep)
        slots.hold(_exchange("lane", Placing(65000, long=True)))
        slots.hold(_exchange("loan", LOAN))
        slots.hold(_exchange("c1", COMPLAINT))
        c2 = _exchange("c2", COMPLAINT)
        assert slots.lane_needed(c2) == LaneWait("p")
        waiting = asyncio.ensure_future(slots.wait_for_lane(c2, until=10.0, stop=lambda: False))
        await asyncio.sleep(0)
        picker.release("lane")  # A has room again and serves no loan: a newcomer goes there at once
        c3 = _exchange("c3", COMPLAINT)
        assert slots.lane_needed(c3) is None
        slots.hold(c3)
        assert c3.endpoints.startswith(A)
        await waiting  # (and the one that waited starts too, on A)
        slots.hold(c2)
        assert c2.endpoints.startswith(A)

    asyncio.run(go())
