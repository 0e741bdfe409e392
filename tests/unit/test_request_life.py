"""The request's state machine (core/request_life.py), walked exhaustively without asyncio: every
phase against every event, and every life from arrival to its end."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from extproc.core.outcomes import Outcome
from extproc.core.request_life import (EVENTS, TABLE, Action, Ended, FallbackDone, Held, IllegalStep, Listed, NoBody,
                                       Phase, Placed, Queued, Refused, ResponseStarted, Routed, SlotGranted, Step,
                                       WaitBegun, Yielded, step)

# Each event as it can be reported: with each value of what it carries.
INSTANCES = (NoBody(), Listed(), Routed(), Held(), Queued(), WaitBegun(), SlotGranted(False), SlotGranted(True), SlotGranted(paced=True),
             Placed(), Refused(Outcome.SHED_QUEUE_FULL), Refused(Outcome.INTERNAL_ERROR), ResponseStarted(False),
             ResponseStarted(True), Yielded(), FallbackDone(), Ended())
COUNTS = {Action.COUNT_PASSED, Action.COUNT_LISTED, Action.COUNT_REJECTED, Action.ADMIT, Action.CANCELLED_ARRIVING,
          Action.CANCELLED_QUEUED}  # each counts the request's outcome once


def test_every_event_kind_has_instances_here():
    assert {type(e) for e in INSTANCES} == set(EVENTS)


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("event", INSTANCES, ids=repr)
def test_every_phase_against_every_event_is_a_step_or_illegal(phase, event):
    try:
        taken = step(phase, event)
    except IllegalStep as error:
        assert phase.value in str(error) and type(event).__name__ in str(error)
        return
    assert isinstance(taken, Step) and isinstance(taken.phase, Phase)
    assert all(isinstance(a, Action) for a in taken.actions)
    assert len(set(taken.actions)) == len(taken.actions)


def test_a_closed_exchange_takes_no_event():
    for event in INSTANCES:
        with pytest.raises(IllegalStep):
            step(Phase.CLOSED, event)


@pytest.mark.parametrize("phase", [p for p in Phase if p is not Phase.CLOSED])
def test_every_phase_ends_and_its_end_releases_last(phase):
    taken = step(phase, Ended())
    assert taken.phase is Phase.CLOSED
    assert taken.actions[-2:] == (Action.SETTLE, Action.RELEASE)


@pytest.mark.parametrize(("phase", "event"), [
    (Phase.ARRIVED, SlotGranted()), (Phase.ARRIVED, Queued()), (Phase.ARRIVED, Placed()),
    (Phase.ROUTED, NoBody()), (Phase.ROUTED, WaitBegun()), (Phase.ROUTED, ResponseStarted()),
    (Phase.QUEUED, SlotGranted()),  # the store's wait grants the slot, after WaitBegun
    (Phase.WAITING, Queued()), (Phase.ADMITTED, SlotGranted()), (Phase.ADMITTED, Placed()),
    (Phase.ANSWERED, ResponseStarted()), (Phase.FAILING_OVER, ResponseStarted()), (Phase.ADMITTED, FallbackDone()),
    (Phase.REFUSED, SlotGranted()), (Phase.REFUSED, Routed()), (Phase.PASSED_THROUGH, Routed()),
    (Phase.ROUTED, Listed()), (Phase.LISTED, Routed()), (Phase.LISTED, Listed()), (Phase.PASSED_THROUGH, Listed()),
    (Phase.HELD, Held()), (Phase.HELD, SlotGranted()),
    # only an admitted request, before its response, yields (core/yielding.py)
    (Phase.ANSWERED, Yielded()), (Phase.FAILING_OVER, Yielded()), (Phase.AWAITING_LANE, Yielded()),
    (Phase.QUEUED, Yielded()), (Phase.YIELDED, Yielded()), (Phase.YIELDED, FallbackDone()),
])
def test_what_must_not_happen_is_refused(phase, event):
    with pytest.raises(IllegalStep):
        step(phase, event)


def lives(limit: int = 10) -> list[list[tuple[Phase, object, Step]]]:
    """Every life from arrival to its end, up to `limit` steps (a held request routed again and
    held again is cut at the limit); of the events that take a phase to the same step, one."""
    done, frontier = [], [[]]
    while frontier:
        path = frontier.pop()
        phase = path[-1][2].phase if path else Phase.ARRIVED
        if phase is Phase.CLOSED:
            done.append(path)
            continue
        if len(path) >= limit:
            continue
        seen = set()
        for event in INSTANCES:
            try:
                taken = step(phase, event)
            except IllegalStep:
                continue
            if taken.phase is phase and not taken.actions or taken in seen:  # changes nothing, or as another
                continue
            seen.add(taken)
            frontier.append(path + [(phase, event, taken)])
    return done


LIVES = lives()


def test_every_phase_and_every_table_entry_is_reached():
    reached = {taken.phase for life in LIVES for _, _, taken in life} | {Phase.ARRIVED}
    assert reached == set(Phase)
    used = {(phase, type(event)) for life in LIVES for phase, event, _ in life}
    moving = {key for key, taken in TABLE.items() if taken.phase is not key[0] or taken.actions}
    assert moving <= used
    assert len(LIVES) > 50


def test_every_life_decides_one_outcome_and_counts_it_once():
    for life in LIVES:
        decided = [taken.outcome for _, _, taken in life if taken.outcome is not None]
        counted = [a for _, _, taken in life for a in taken.actions if a in COUNTS]
        assert len(decided) == 1 and len(counted) == 1, life


def test_every_life_releases_once_at_its_end():
    for life in LIVES:
        releases = [i for i, (_, _, taken) in enumerate(life) if Action.RELEASE in taken.actions]
        assert releases == [len(life) - 1]


def test_an_admitted_request_is_finished_once_and_never_cancelled_as_queued():
    for life in LIVES:
        admitted = any(taken.outcome is Outcome.ADMITTED for _, _, taken in life)
        actions = [a for _, _, taken in life for a in taken.actions]
        assert actions.count(Action.FINISH_ADMITTED) == (1 if admitted else 0)
        if admitted:
            assert Action.CANCELLED_QUEUED not in actions and Action.CANCELLED_ARRIVING not in actions


def test_a_place_in_line_is_withdrawn_only_while_the_gate_holds_it():
    """From `Queued` until the store's wait takes it over (`WaitBegun`), the place is the gate's:
    a refusal or an end withdraws it; after, the store's wait answers for it."""
    for life in LIVES:
        holding = False
        for phase, event, taken in life:
            if Action.WITHDRAW in taken.actions:
                assert holding, life
                holding = False
            if isinstance(event, Queued):
                holding = True
            elif isinstance(event, WaitBegun):
                holding = False
        assert not holding, life


def test_every_admission_may_be_copied_as_shadow_once_it_holds_its_slot():
    for life in LIVES:
        actions = [a for _, _, taken in life for a in taken.actions]
        admitted = Action.ADMIT in actions
        assert actions.count(Action.COPY_AS_SHADOW) == (1 if admitted else 0)
        if admitted:
            assert actions.index(Action.COPY_AS_SHADOW) == actions.index(Action.ADMIT) + 1


def test_a_refusal_counted_once_then_its_reply_changes_nothing():
    first = step(Phase.WAITING, Refused(Outcome.EXPIRED_IN_QUEUE))
    assert first == Step(Phase.REFUSED, Outcome.EXPIRED_IN_QUEUE, (Action.COUNT_REJECTED,))
    assert step(first.phase, Refused(Outcome.EXPIRED_IN_QUEUE)) == Step(Phase.REFUSED)
    # An internal error after admission is answered, and the request stays counted as admitted.
    assert step(Phase.ADMITTED, Refused(Outcome.INTERNAL_ERROR)) == Step(Phase.ADMITTED)


def test_a_failure_the_fallback_answers_goes_through_failing_over():
    assert step(Phase.ADMITTED, ResponseStarted(fail_over=True)).phase is Phase.FAILING_OVER
    assert step(Phase.FAILING_OVER, FallbackDone()).phase is Phase.ANSWERED
    assert step(Phase.ADMITTED, ResponseStarted()).phase is Phase.ANSWERED


def test_a_long_prompt_holds_its_slot_before_it_is_admitted():
    lane = step(Phase.ROUTED, SlotGranted(lane_needed=True))
    assert lane == Step(Phase.AWAITING_LANE)
    assert step(lane.phase, Placed()) == Step(Phase.ADMITTED, Outcome.ADMITTED, (Action.ADMIT, Action.COPY_AS_SHADOW))
    gone = step(lane.phase, Ended())
    assert gone.outcome is Outcome.CANCELLED_CLIENT_GONE and Action.RELEASE in gone.actions


def test_a_paced_prompt_holds_its_slot_before_it_is_admitted():
    paced = step(Phase.WAITING, SlotGranted(paced=True))
    assert paced == Step(Phase.AWAITING_PACE)
    assert step(paced.phase, Placed()) == Step(Phase.ADMITTED, Outcome.ADMITTED, (Action.ADMIT, Action.COPY_AS_SHADOW))
    gone = step(paced.phase, Ended())
    assert gone.outcome is Outcome.CANCELLED_CLIENT_GONE and Action.RELEASE in gone.actions
    assert step(paced.phase, Refused(Outcome.INTERNAL_ERROR)).phase is Phase.REFUSED


PACKAGE = Path(__file__).resolve().parents[2] / "extproc"


def test_only_the_driver_changes_an_exchanges_phase_or_outcome():
    """The table is the one place that changes an exchange's state: no module assigns `.phase`
    or `.outcome` on anything but the driver (lifecycle/request_driver.py)."""
    writers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("phase", "outcome") \
                        and not (isinstance(target.value, ast.Name) and target.value.id == "self"):
                    writers.add(path.relative_to(PACKAGE).as_posix())
    assert writers == {"lifecycle/request_driver.py"}


# -- docs/request-life.md holds the table as a reader sees it ------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "request-life.md"
DOC_EVENTS = (("NoBody", NoBody()), ("Listed", Listed()), ("Routed", Routed()), ("Held", Held()), ("Queued", Queued()),
              ("WaitBegun", WaitBegun()), ("SlotGranted", SlotGranted()), ("SlotGranted(lane_needed)", SlotGranted(True)),
              ("SlotGranted(paced)", SlotGranted(paced=True)),
              ("Placed", Placed()), ("Refused(outcome)", Refused(Outcome.INTERNAL_ERROR)),
              ("ResponseStarted", ResponseStarted()), ("ResponseStarted(fail_over)", ResponseStarted(True)),
              ("Yielded", Yielded()), ("FallbackDone", FallbackDone()), ("Ended", Ended()))


def rendered_table() -> str:
    """The machine's table in markdown, every allowed (phase, event) in order."""
    lines = ["| phase | event | next phase | outcome decided | actions |", "|---|---|---|---|---|"]
    for phase in Phase:
        for name, event in DOC_EVENTS:
            if isinstance(event, ResponseStarted) and event.fail_over and phase is not Phase.ADMITTED:
                continue  # (only an admitted request's failure is failed over)
            try:
                taken = step(phase, event)
            except IllegalStep:
                continue
            outcome = "" if taken.outcome is None else \
                "the refusal's" if isinstance(event, Refused) else taken.outcome.value
            lines.append(f"| {phase.value} | {name} | {taken.phase.value} | {outcome} | "
                         f"{', '.join(a.value for a in taken.actions)} |")
    return "\n".join(lines)


def test_the_docs_table_is_the_machines():
    """docs/request-life.md shows the table between its markers; regenerate it with
    `python -c 'from tests.unit.test_request_life import rendered_table; print(rendered_table())'`."""
    text = DOC.read_text("utf-8")
    start, end = "<!-- table: begin -->\n", "\n<!-- table: end -->"
    assert text[text.index(start) + len(start): text.index(end)] == rendered_table()


def test_a_model_list_the_sidecar_answers_is_counted_once_and_its_reply_changes_nothing():
    listed = step(Phase.ARRIVED, Listed())
    assert listed == Step(Phase.LISTED, Outcome.MODELS_LISTED, (Action.COUNT_LISTED,))
    assert step(listed.phase, Refused(Outcome.INTERNAL_ERROR)) == Step(Phase.LISTED)
    assert step(listed.phase, Ended()) == Step(Phase.CLOSED, None, (Action.SETTLE, Action.RELEASE))


def test_a_yield_is_counted_once_as_admitted_and_finished_once():
    """A long prompt that yields (core/yielding.py) was admitted and counted so; its yield decides
    nothing more, a response racing it changes nothing, and its end finishes it once."""
    yielded = [life for life in LIVES if any(isinstance(event, Yielded) for _, event, _ in life)]
    assert yielded
    for life in yielded:
        assert [taken.outcome for _, _, taken in life if taken.outcome is not None] == [Outcome.ADMITTED]
        assert life[-1][0] is Phase.YIELDED and life[-1][2].actions == (Action.FINISH_ADMITTED, Action.SETTLE,
                                                                        Action.RELEASE)
    assert step(Phase.YIELDED, ResponseStarted()) == Step(Phase.YIELDED)
    assert step(Phase.YIELDED, Refused(Outcome.YIELDED)) == Step(Phase.YIELDED)
