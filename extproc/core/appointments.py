"""Appointments instead of refusals, and decisions at arrival, pure: no I/O, time passed in.

Theory of operation
-------------------
A pool drains at `rate` requests a second (measured from its releases: DrainMeter).
A request with `ahead` requests in line before it (those of its own class and of the classes
served before it) finds room no sooner than `ahead / rate` from now: that is its forecast wait.

When the sidecar must refuse a request (the red tier, the queue's hard maximum, or a wait it
cannot hold the connection for), it gives it an appointment: the time it is forecast to find
room. Appointments are spaced `1 / rate` apart in one book per pool (shared by the replicas
when the queue is): the clients coming back arrive no faster than the pool drains, and none
is promised a time another was promised already. The book keeps the classes' order: a class's
appointment comes after those of the classes served before it, and pushes the later classes'
back by one slot (a complaint booked now is served before the archive queries booked earlier,
so it is promised an earlier time, and they a later one). A request that comes back is recognised (its
`idempotency-key`, or the OpenAI SDKs' retry count with the same body) and keeps its place: it is
ordered by its first arrival within its class, and its pool's red tier does not refuse it again.

The book reaches no further than each class's horizon (`horizon`: its deadline, and never past
the longest `retry-after` a client is told): it holds what the pool can drain by then, and a
burst of refusals cannot push a class's book, or the classes served after it, ever further
ahead. A request whose class's book is full to its horizon is told the horizon and takes no
slot (a protected class, or one without a deadline, is never given up); past its deadline it
gets a final answer. Every appointment is kept under the request's name: one turned away again
before its time keeps it instead of taking another slot.

An appointment past the request's deadline (its class's `deadline_s`, counted from its first
attempt, less the service it still needs) is never given: the client gets a final answer at
once (`x-should-retry: false`) rather than a promise that cannot be kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MIN_RATE = 0.5  # requests a second assumed while nothing has drained yet (a cold pool, or a stalled one)


@dataclass(frozen=True)
class Booking:
    """One appointment: when, and the book's next free times after it, by class."""

    at: float
    next_free: dict[str, float]


@dataclass(frozen=True)
class AppointmentRequest:
    """What a book needs to place one appointment (seconds from now; see `book`)."""

    class_name: str
    served_first: tuple[str, ...]  # the classes served before it
    served_later: tuple[tuple[str, float], ...]  # the classes served after it, each with its horizon
    earliest_s: float
    spacing_s: float
    latest_s: float | None  # None: no deadline
    horizon_s: float  # the farthest its class's book reaches (`horizon`)
    name: str | None = None  # the request's name (the attempt ledger's): its appointment is kept under it
    again: bool = False  # it comes back: an appointment it holds that is still ahead is kept


def horizon(deadline_s: float | None, longest_s: float) -> float:
    """How far ahead a class's book reaches: its deadline, never past `longest_s` (the longest
    retry-after a client is told: no time past it can be promised). A class's max wait is no
    horizon: it bounds how long one attempt is held in line, not how far ahead it may be served."""
    return longest_s if deadline_s is None else min(deadline_s, longest_s)


def book(now: float, next_free: Mapping[str, float], request: AppointmentRequest,
         kept: float | None = None) -> Booking | None:
    """An appointment for `request`: the one it holds (`kept`) while that is still ahead and it
    comes back; else the first time at or after `now + earliest_s` and the next free times of its
    class and of the classes served first, unless that falls more than `latest_s` from now (None:
    its deadline cannot be met). Its class's next free time moves past it by `spacing_s`; so do
    those of the classes served later that were booked after it, none past its class's horizon.
    A slot that would end past the request's horizon is not taken: the request is told the
    horizon (or its time, if sooner), and nobody moves."""
    if request.again and kept is not None and kept > now:
        return Booking(kept, {})
    mine = request.class_name
    at = max([now + max(0.0, request.earliest_s)]
             + [next_free.get(name, now) for name in (mine, *request.served_first)])
    if request.latest_s is not None and at > now + request.latest_s:
        return None
    farthest = now + max(0.0, request.horizon_s)
    spacing = max(0.0, request.spacing_s)
    if at + spacing > farthest:  # its book is full to its horizon: told the horizon, it takes no slot
        return Booking(min(at, farthest), {})
    moved = {mine: at + spacing}
    for name, horizon_s in request.served_later:
        later = next_free.get(name, now)
        if later > at:
            moved[name] = min(later + spacing, now + max(0.0, horizon_s))
    return Booking(at, moved)


def forecast_rate(rate: float | None) -> float:
    """The drain rate a forecast uses: the measured one, or MIN_RATE before there is one."""
    return rate if rate is not None and rate > MIN_RATE else MIN_RATE


def ahead_of(class_base: float, waiting_by_class: Mapping[str, int], bases: Mapping[str, float]) -> int:
    """The requests in line that are served before a new one of a class of `class_base`: those of
    its own class and of every class with a lower base (served first)."""
    return sum(n for name, n in waiting_by_class.items() if bases.get(name, math.inf) <= class_base)


def wait_budget(now: float, first_arrival: float, max_wait_s: float, deadline_s: float | None,
                service_s: float) -> float:
    """How long a request may still wait in line: its class's `max_wait_s` (the longest the
    sidecar holds its connection), and no longer than its deadline leaves once its service is
    counted (from its first attempt, retries included)."""
    budget = max_wait_s
    if deadline_s is not None:
        budget = min(budget, deadline_s - (now - first_arrival) - service_s)
    return budget


def latest_appointment(now: float, first_arrival: float, deadline_s: float | None, service_s: float) -> float | None:
    """The latest an appointment may be, from now (None: no deadline, any time)."""
    if deadline_s is None:
        return None
    return deadline_s - (now - first_arrival) - service_s


class ServiceTime:
    """An exponentially weighted mean of how long a pool's requests hold their slot, per class
    and over all of them (what a forecast adds to the wait to tell whether a deadline can be
    met, and how fast a full pool drains: `drain_rate`)."""

    def __init__(self, weight: float = 0.1):
        self.weight = weight
        self._mean: dict[tuple[str, str | None], float] = {}

    def observe(self, pool: str, class_name: str, seconds: float) -> None:
        for key in ((pool, class_name), (pool, None)):
            mean = self._mean.get(key)
            self._mean[key] = seconds if mean is None else mean + self.weight * (seconds - mean)

    def mean(self, pool: str, class_name: str | None = None) -> float:
        """Seconds (0 before the first request ended); `class_name` None: over all classes."""
        return self._mean.get((pool, class_name), 0.0)


class DrainMeter:
    """How fast a pool's line drains: an exponentially weighted rate of finished requests,
    from successive readings of a running count (each replica's, or the shared one).

    A reading less than `min_interval_s` after the last one taken is passed over (the next one
    takes its count): a request path that reads at every change need not pay for the average
    at every change, and a rate over a few milliseconds says nothing the average keeps."""

    def __init__(self, half_life_s: float = 5.0, min_interval_s: float = 0.0):
        self.half_life_s = half_life_s
        self.min_interval_s = min_interval_s
        self.rate: float | None = None
        self._last: tuple[float, int] | None = None
        self._next_at = -math.inf  # no reading is taken before this

    def observe(self, now: float, finished_total: int) -> None:
        if now < self._next_at:
            return
        self._next_at = now + self.min_interval_s
        if self._last is not None:
            then, count = self._last
            elapsed = now - then
            if elapsed <= 0:
                return
            instant = max(0, finished_total - count) / elapsed
            weight = 1 - 0.5 ** (elapsed / self.half_life_s)
            self.rate = instant if self.rate is None else self.rate + weight * (instant - self.rate)
        self._last = (now, finished_total)

    def seconds_to_drain(self, depth: int) -> float | None:
        if self.rate is None or self.rate <= 0:
            return None
        return (depth + 1) / self.rate


def drain_rate(measured: float | None, inflight: int, service_s: float) -> float | None:
    """How fast a pool drains, for a forecast: the measured rate of its releases, or, when
    higher, what its requests in flight release at their mean service time (Little's law: a
    burst that fills an idle pool drains at once at its full rate, before a measured rate
    catches up). None until a request has been served (nothing to forecast from: a pool that
    just started, whose measured rate is still climbing from nothing)."""
    if service_s <= 0:
        return None
    rates = [r for r in (measured, inflight / service_s) if r]
    return max(rates) if rates else None
