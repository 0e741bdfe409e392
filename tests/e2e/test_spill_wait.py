"""Where the sidecar places requests, the other classes' prompts start beside the loans at the
spill pace (core/spill.py): a complaint for which the engine free of loans has no room waits,
admitted, for its turn on the loans' engine (lifecycle/slots.py), and an engine whose loans just
finished still counts as theirs (`bound_lately_s`)."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.capacity import Placing
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
