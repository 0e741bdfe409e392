"""Appointments instead of refusals and the forecasts behind them (core/appointments.py), pure,
with the time passed in; and the line keeping a returning request's place (core/admission.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.admission import PoolLine, Ticket
from extproc.core.appointments import (
    MIN_RATE,
    AppointmentRequest,
    ServiceTime,
    ahead_of,
    book,
    drain_rate,
    forecast_rate,
    horizon,
    latest_appointment,
    wait_budget,
)

CLASSES = ("loan", "complaint", "archive")  # served in this order
HORIZONS = {"loan": 2.0, "complaint": 30.0, "archive": 60.0}


def served_first(name: str) -> tuple[str, ...]:
    return CLASSES[: CLASSES.index(name)]


def served_later(name: str) -> tuple[str, ...]:
    return CLASSES[CLASSES.index(name) + 1:]


def appointment(class_name: str, earliest_s: float, spacing_s: float, latest_s: float | None,
                **named) -> AppointmentRequest:
    return AppointmentRequest(class_name, served_first(class_name),
                              tuple((c, HORIZONS[c]) for c in served_later(class_name)),
                              earliest_s, spacing_s, latest_s, HORIZONS[class_name], **named)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 2), st.sampled_from(CLASSES), st.floats(0, 90),
                          st.one_of(st.none(), st.floats(0, 60))), max_size=60),
       st.floats(0.05, 2))
def test_appointments_never_overbook_the_drain_pass_a_deadline_or_reach_past_a_horizon(requests, spacing):
    """However the requests come (when, of which class, how far their forecast wait, their
    deadline), no class's book reaches past its horizon, and the appointments that take a slot
    in it are never closer than the spacing (1 / the drain rate); those its full book has no
    slot for are told its horizon. None is earlier than its forecast or than the next free time
    of a class served before it (either, within its horizon), nor later than its deadline."""
    now, pages, slots = 0.0, {}, {name: [] for name in CLASSES}
    for step, name, earliest, latest in requests:
        now += step
        booking = book(now, pages, appointment(name, earliest, spacing, latest))
        if booking is None:
            assert latest is not None  # refused only for a deadline
            continue
        farthest = now + HORIZONS[name]
        assert min(now + earliest, farthest) - 1e-9 <= booking.at <= farthest + 1e-9
        assert latest is None or booking.at <= now + latest + 1e-9
        for first in served_first(name):  # never ahead of a class served first that is booked
            assert booking.at >= min(pages.get(first, 0.0), farthest) - 1e-9
        if booking.next_free:
            slots[name].append(booking.at)
        else:  # no slot: its book is full to its horizon
            assert booking.at + spacing > farthest - 1e-9
        pages.update(booking.next_free)
        assert all(t <= now + HORIZONS[c] + 1e-9 for c, t in pages.items())
    for times in slots.values():
        assert all(b - a >= spacing - 1e-9 for a, b in zip(times, times[1:], strict=False))


def test_a_class_served_first_is_booked_before_the_later_ones_and_pushes_them_back():
    pages: dict[str, float] = {}
    archive = book(0.0, pages, appointment("archive", 10.0, 1.0, None))
    pages.update(archive.next_free)
    assert archive.at == 10.0 and pages == {"archive": 11.0}
    complaint = book(0.0, pages, appointment("complaint", 2.0, 1.0, 30.0))
    pages.update(complaint.next_free)
    assert complaint.at == 2.0  # not behind the archive query booked first: it is served first
    assert pages == {"archive": 12.0, "complaint": 3.0}  # the next archive query comes one slot later
    assert book(0.0, pages, appointment("complaint", 0.0, 1.0, 30.0)).at == 3.0
    # no room before its deadline: no appointment (the client gets a final answer)
    assert book(0.0, pages, AppointmentRequest("archive", (), (), 0.0, 1.0, 11.5, 60.0)) is None


def test_a_burst_of_protected_refusals_stays_within_its_horizon_and_leaves_room_for_the_classes_after():
    """Loans are never given up (no latest time), but 600 of them turned away in a second push
    neither their own book nor the complaints behind them past the loans' horizon: the next
    complaint still has an appointment within its deadline."""
    pages: dict[str, float] = {}
    for i in range(600):
        booking = book(i / 600, pages, appointment("loan", 0.5, 0.1, None))
        pages.update(booking.next_free)
        assert booking.at <= i / 600 + HORIZONS["loan"]
    assert pages["loan"] <= 1.0 + HORIZONS["loan"]
    complaint = book(1.0, pages, appointment("complaint", 2.0, 0.1, 30.0))
    assert complaint is not None and complaint.at <= 1.0 + HORIZONS["loan"] + 2.0
    # a class without a deadline is held to its horizon too, and so are the classes it pushes back
    pages.update(book(1.0, pages, appointment("archive", 50.0, 1.0, None)).next_free)
    for _ in range(100):
        booking = book(1.0, pages, appointment("complaint", 0.0, 1.0, None))
        pages.update(booking.next_free)
        assert booking.at <= 1.0 + HORIZONS["complaint"]
    assert pages["complaint"] <= 1.0 + HORIZONS["complaint"] and pages["archive"] == 1.0 + HORIZONS["archive"]


def test_the_horizon_is_the_deadline_and_never_past_the_longest_retry_after():
    assert horizon(2.0, 60) == 2.0
    assert horizon(None, 60) == 60
    assert horizon(120.0, 60) == 60


def test_a_request_turned_away_again_before_its_appointment_keeps_it():
    pages: dict[str, float] = {}
    first = book(0.0, pages, appointment("complaint", 5.0, 1.0, 30.0, name="k"))
    pages.update(first.next_free)
    assert first.at == 5.0
    back = book(2.0, pages, appointment("complaint", 1.0, 1.0, 28.0, name="k", again=True), kept=first.at)
    assert back.at == 5.0 and back.next_free == {}  # the same time, and nobody else moves
    # a first attempt under a name that holds an appointment takes a slot of its own
    assert book(2.0, pages, appointment("complaint", 1.0, 1.0, 28.0, name="k"), kept=5.0).at == 6.0
    # back after its appointment and turned away again: booked anew
    late = book(7.0, pages, appointment("complaint", 1.0, 1.0, 23.0, name="k", again=True), kept=5.0)
    assert late.at == 8.0 and late.next_free == {"complaint": 9.0}


def test_the_line_ahead_of_a_class_counts_it_and_the_classes_served_first():
    bases = {"loan": 0, "complaint": 1, "archive": 2}
    waiting = {"loan": 3, "complaint": 5, "archive": 40}
    assert [ahead_of(bases[c], waiting, bases) for c in CLASSES] == [3, 8, 48]


def test_how_long_a_request_may_wait_and_be_booked_counts_from_its_first_attempt():
    # a complaint first sent at t=100, back at t=112: 30 s deadline, 1 s of service
    assert wait_budget(112.0, 100.0, max_wait_s=15.0, deadline_s=30.0, service_s=1.0) == pytest.approx(15.0)
    assert wait_budget(125.0, 100.0, max_wait_s=15.0, deadline_s=30.0, service_s=1.0) == pytest.approx(4.0)
    assert wait_budget(125.0, 100.0, max_wait_s=15.0, deadline_s=None, service_s=1.0) == 15.0
    assert latest_appointment(112.0, 100.0, 30.0, 1.0) == pytest.approx(17.0)
    assert latest_appointment(112.0, 100.0, None, 1.0) is None


def test_a_forecast_needs_a_served_request_and_a_full_pool_drains_at_its_whole_rate():
    assert drain_rate(None, 8, 0.0) is None  # nothing served yet: nothing to forecast from
    assert drain_rate(0.0, 8, 0.0) is None
    assert drain_rate(2.0, 8, 0.5) == 16.0  # 8 in flight, 0.5 s each, though the measured rate lags
    assert drain_rate(20.0, 8, 0.5) == 20.0
    assert forecast_rate(None) == MIN_RATE and forecast_rate(12.0) == 12.0
    service = ServiceTime(weight=0.5)
    service.observe("p", "loan", 1.0)
    service.observe("p", "loan", 3.0)
    service.observe("p", "archive", 6.0)
    assert service.mean("p", "loan") == 2.0 and service.mean("p", "archive") == 6.0
    assert service.mean("p") == pytest.approx(4.0) and service.mean("q", "loan") == 0.0


def test_a_request_that_comes_back_keeps_its_place_in_its_class():
    line = PoolLine(1)
    assert line.offer(Ticket(score=2, seq=0, id="running", class_name="archive"), now=0.0)
    line.offer(Ticket(score=2, seq=1, id="newer", class_name="archive", branch_id="b1"), now=50.0)
    line.offer(Ticket(score=2, seq=2, id="newest", class_name="archive", branch_id="b2"), now=51.0)
    # first sent at t=10, refused with an appointment, back at t=52: ahead of those sent after it
    line.offer(Ticket(score=2, seq=3, id="returning", class_name="archive", branch_id="b3", waited_s=42.0), now=52.0)
    # ...but not of a class served first
    line.offer(Ticket(score=1, seq=4, id="complaint", class_name="complaint"), now=53.0)
    order = []
    current = "running"
    for _ in range(4):
        (admitted,) = line.release(current, now=60.0)
        order.append(current := admitted.id)
    assert order == ["complaint", "returning", "newer", "newest"]
