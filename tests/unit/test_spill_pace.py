"""The spill pace (core/spill.py): the prompts of the classes without a latency target start on an
engine serving latency-bound requests one at a time, at `tokens_per_s`, and wait for their turn
there only where another engine serves none."""

from __future__ import annotations

from extproc.core.capacity import BackendLoad, Placing, backend_order
from extproc.core.long_lane import long_may_start
from extproc.core.spill import SpillPace

LOANS, LANE, THIRD = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
COMPLAINT = Placing(512)
LOAN = Placing(512, bound=True)
LONG = Placing(12000, long=True)


def load(endpoint: str, used: int = 0, running: int = 0, bound: int = 0, long: int = 0, lately: bool = False,
         saturated: bool = False) -> BackendLoad:
    return BackendLoad(endpoint, 55000, used, running, saturated, long_running=long, bound_running=bound,
                       bound_lately=lately)


def test_prompts_start_beside_loans_one_at_a_time_at_the_pace():
    pace = SpillPace(tokens_per_s=2048)
    loans = load(LOANS, 1000, 2, bound=2)
    lane_full = load(LANE, 54900, 20, long=4)  # the long prompts' lane: no room for another prompt
    loads = [loans, lane_full]
    # the first goes beside the loans at once...
    assert backend_order(loads, COMPLAINT, 32)[0] == LOANS
    assert pace.may_spill(loads, COMPLAINT, LOANS, now=0.0)
    pace.started(loans, COMPLAINT, now=0.0)
    # ...the next waits its turn: 512 tokens at 2048 a second is a quarter of a second
    assert pace.spent(loads, 0.1) == {LOANS}
    assert not pace.may_spill(loads, COMPLAINT, LOANS, now=0.1)
    assert not pace.may_spill(loads, COMPLAINT, LOANS, now=0.2499)
    assert pace.may_spill(loads, COMPLAINT, LOANS, now=0.25)
    # turns add up: three started at once take three turns
    for _ in range(3):
        pace.started(loans, COMPLAINT, now=1.0)
    assert not pace.may_spill(loads, COMPLAINT, LOANS, now=1.7)
    assert pace.may_spill(loads, COMPLAINT, LOANS, now=1.75)


def test_only_what_runs_beside_latency_bound_requests_takes_a_turn():
    pace = SpillPace(tokens_per_s=2048)
    free, loans = load(LANE, 1000, 2), load(LOANS, 1000, 2, bound=1)
    pace.started(free, COMPLAINT, now=0.0)  # an engine serving no loan: no pace there
    pace.started(loans, LOAN, now=0.0)  # loans themselves take no turn
    pace.started(loans, LONG, now=0.0)  # long prompts have their own rule (core/long_lane.py)
    assert pace.spent([free, loans], 0.0) == frozenset()
    # an engine whose loans just finished still serves them (`bound_lately`): the pace holds there
    just_done = load(LOANS, 0, 0, lately=True)
    pace.started(just_done, COMPLAINT, now=0.0)
    assert pace.spent([free, just_done], 0.1) == {LOANS}
    # ...and once it serves none, what it has taken counts for nothing
    assert pace.spent([free, load(LOANS, 500, 1)], 0.1) == frozenset()


def test_a_prompt_waits_for_its_turn_only_where_another_engine_serves_no_loan():
    pace = SpillPace(tokens_per_s=2048)
    loans = load(LOANS, 1000, 2, bound=2)
    pace.started(loans, COMPLAINT, now=0.0)
    # every engine serves loans: nowhere better to wait for, it starts (the pace only orders them)
    both = [loans, load(LANE, 1000, 2, bound=1)]
    assert pace.may_spill(both, COMPLAINT, LOANS, now=0.1)
    # the only other engine is down: it starts
    assert pace.may_spill([loans, load(LANE, saturated=True)], COMPLAINT, LOANS, now=0.1)
    # a loan or a long prompt never waits for it
    lane_full = [loans, load(LANE, 54900, 20, long=4)]
    assert pace.may_spill(lane_full, LOAN, LOANS, now=0.1)
    assert pace.may_spill(lane_full, LONG, LOANS, now=0.1)


def test_before_its_turn_a_prompt_waits_for_it_rather_than_in_the_line_of_a_full_engine():
    spent = frozenset({LOANS})
    pace = SpillPace(tokens_per_s=2048)
    loans, full = load(LOANS, 1000, 2, bound=2), load(LANE, 20000, 32)
    pace.started(loans, COMPLAINT, now=0.0)
    assert pace.spent([loans, full], 0.1) == spent
    # the free slot comes first: the loans' engine, where it waits for its turn...
    assert backend_order([loans, full], COMPLAINT, 32, spent=spent)[0] == LOANS
    assert not pace.may_spill([loans, full], COMPLAINT, LOANS, now=0.1)
    assert pace.may_spill([loans, full], COMPLAINT, LOANS, now=0.25)
    # ...and among engines with a slot, one whose turn has come before one whose has not
    third = load(THIRD, 3000, 3, bound=1)
    assert backend_order([loans, third, full], COMPLAINT, 32, spent=spent)[0] == THIRD
    # with room everywhere, the one serving no loan, even where it has less room
    assert backend_order([load(LOANS, 0, 0, lately=True), load(LANE, 20000, 5)], COMPLAINT, 32)[0] == LANE


def test_an_engine_that_served_loans_lately_is_no_lane_for_a_long_prompt():
    # the loans' engine between two loans: a long prompt started there would meet the next one
    assert not long_may_start([load(LOANS, 0, 0, lately=True), load(LANE, 1000, 2, bound=1)], LONG)
    assert long_may_start([load(LOANS, 0, 0), load(LANE, 1000, 2, bound=1)], LONG)
    assert backend_order([load(LOANS, 0, 0, lately=True), load(LANE, 9000, 3)], LONG, 32)[0] == LANE
