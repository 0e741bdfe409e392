"""The waiting room: what a request that cannot wait in line now is told, and the forecast made
when it arrives (the rules: core/appointments.py).

A request the sidecar must turn away (the red tier, the queue's hard maximum, a wait longer than
it holds a connection for, or one that ran out) gets an appointment in its pool's book, as
`retry-after` / `retry-after-ms` (never more than `retry_after_s.max`), and keeps its place for
when it comes back; or, when no appointment fits its class's deadline, a final answer at once
(`x-should-retry: false`). One turned away again before its appointment keeps it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.appointments import AppointmentRequest, DrainMeter, forecast_rate, horizon, latest_appointment, wait_budget
from ..core.config import Config
from ..core.events import AppointmentTold, Observers
from ..core.outcomes import Outcome, Rejection, appointment, past_deadline, turned_away
from ..stores.queue import QueueStore
from .exchange import Exchange
from .pool_watch import DRAIN_READING_S

@dataclass(frozen=True, slots=True)
class Appointment:
    """A request held until its appointment rather than refused again (`WaitingRoom.hold`)."""

    pool: str
    at: float  # when it is decided again, as if it came back then (the gate's clock)
    avoid: str | None = None  # the pool its earlier attempt failed in


class WaitingRoom:
    def __init__(self, store: QueueStore,
                 ahead: Callable[[str, str], int], drain_rate: Callable[[str], float | None],
                 service_s: Callable[[str, str], float], observers: Observers, clock: Callable[[], float],
                 retry_after: Callable[[int, str | None], int]):
        self.store = store
        self._ahead = ahead
        self._drain_rate = drain_rate
        self._service_s = service_s
        self._emit = observers.emit  # who hears each appointment told
        self.clock = clock
        self._retry_after = retry_after  # without appointments: the drain time, spread (refusals.py)
        self._arrivals: dict[tuple[str, str], list] = {}  # (pool, class) -> [count, its rate (DrainMeter)]

    def arrived(self, pool: str, class_name: str) -> None:
        """A request of `class_name` joined `pool`'s line or was admitted (the classes' inflow
        feeds the forecasts of the classes served after them)."""
        key = (pool, class_name)
        arrivals = self._arrivals.get(key)
        if arrivals is None:
            arrivals = self._arrivals[key] = [0, DrainMeter(min_interval_s=DRAIN_READING_S)]
        arrivals[0] += 1
        arrivals[1].observe(self.clock(), arrivals[0])

    def _rates(self, config: Config, pool: str, class_name: str) -> tuple[float, float]:
        """(the pool's drain rate, what of it is left to this class while the classes served
        before it keep arriving as they do now; at least a fifth of it)."""
        rate = forecast_rate(self._drain_rate(pool))
        mine = config.classes[class_name].base
        before = sum(meter.rate or 0.0 for (p, name), (_, meter) in self._arrivals.items()
                     if p == pool and config.classes[name].base < mine)
        return rate, max(rate - before, 0.2 * rate)

    def forecast(self, exchange: Exchange, pool: str) -> float | None:
        """Seconds until a request of this class finds room in `pool` if it joined the line now:
        the line ahead of it (its class and the classes served first) at the rate left to it
        (None: the pool is not draining now, nothing to forecast from)."""
        ahead = self._ahead(pool, exchange.class_name)
        if ahead == 0:
            return 0.0
        if not self._drain_rate(pool):
            return None
        _, left = self._rates(exchange.config, pool, exchange.class_name)
        return ahead / left

    def may_wait_s(self, exchange: Exchange, pool: str, returning: bool) -> float:
        """How long it may wait in line: its class's `max_wait_s` within its deadline; one that
        comes back, as long as its deadline allows (it was promised room)."""
        policy = exchange.config.classes[exchange.class_name]
        if returning and policy.deadline_s is None:
            return policy.max_wait_s
        longest = policy.deadline_s if returning else policy.max_wait_s
        return wait_budget(self.clock(), self.first_arrival(exchange), longest, policy.deadline_s,
                           self._service_s(pool, exchange.class_name))

    def first_arrival(self, exchange: Exchange) -> float:
        return exchange.arrived_at - exchange.attempt.age_s

    def decide_wait(self, exchange: Exchange, pool: str, returning: bool, longest_s: float) -> float | None:
        """Decide at arrival how long the request may wait (at most `longest_s`, what Envoy
        keeps it), and whether it should: a request of an unprotected class whose forecast wait
        is longer is turned away at once (an appointment, or a final answer past its deadline),
        rather than held until it expires. A protected class waits its `max_wait_s`; one that
        comes back, until its deadline. Returns the forecast to turn it away with (None: it may
        wait)."""
        config = exchange.config
        policy = config.classes[exchange.class_name]
        exchange.forecast_wait_s = forecast = self.forecast(exchange, pool)
        if policy.protected:
            exchange.may_wait_s = min(policy.max_wait_s, longest_s)
        else:
            exchange.may_wait_s = min(self.may_wait_s(exchange, pool, returning), longest_s)
            too_long = forecast is not None and forecast > exchange.may_wait_s and config.queue.decide_at_arrival
            if too_long or exchange.may_wait_s <= 0:  # (its deadline has passed: a final answer)
                return forecast or 0.0
        self.arrived(pool, exchange.class_name)
        return None

    def hold(self, exchange: Exchange, pool: str, rejection: Rejection, longest_s: float,
             avoid: str | None = None) -> Appointment | None:
        """A request that comes back and is turned away again (a client that ignores
        `retry-after` comes back before its appointment, and is told the same time again) is held
        until its appointment instead, if Envoy keeps it that long (`longest_s`), then decided
        again as if it came back then: a retry storm becomes a wait. The hold costs an open
        stream and no slot. None: refused as it is (a final answer, or too far off)."""
        delay = rejection.retry_after_s
        if rejection.final or delay is None or exchange.attempt.age_s <= 0 or delay > longest_s:
            return None
        policy = exchange.config.classes[exchange.class_name]
        # How long it may wait in line once its time comes: as a request that comes back then.
        after = policy.max_wait_s if policy.protected else self.may_wait_s(exchange, pool, True) - delay
        now = self.clock()
        exchange.may_wait_s = (now - exchange.arrived_at) + min(longest_s, delay + max(0.0, after))
        self._emit(AppointmentTold(pool, exchange.class_name, "held"))
        return Appointment(pool, now + delay, avoid)

    async def turn_away(self, exchange: Exchange, pool: str, outcome: Outcome, forecast_s: float = 0.0) -> Rejection:
        """An appointment (`outcome`, with the time to come back) or, past the deadline, a final answer."""
        config = exchange.config
        class_name = exchange.class_name
        policy = config.classes[class_name]
        if not config.queue.appointments:
            floor = config.retry_after_s.wait_expired if outcome is Outcome.EXPIRED_IN_QUEUE \
                else config.retry_after_s.overloaded
            return turned_away(outcome, pool, policy.max_wait_s, forecast_s, self._retry_after(floor, pool))
        now = self.clock()
        # A protected class is never given up: its appointment may be past its deadline.
        latest = None if policy.protected else latest_appointment(
            now, self.first_arrival(exchange), policy.deadline_s, self._service_s(pool, class_name))
        delay = None
        rate, left = self._rates(config, pool, class_name)
        ahead = self._ahead(pool, class_name) if self._drain_rate(pool) else 0  # no drain known: no forecast
        # Past the deadline even if the classes before it stopped coming now: a final answer.
        if latest is None or ahead / rate <= latest:
            # Otherwise when it is likely to find room, as they keep coming; within the deadline.
            earliest = max(forecast_s, ahead / left, float(config.retry_after_s.overloaded))
            if latest is not None:
                earliest = min(earliest, latest)
            mine = policy.base
            longest = config.retry_after_s.max
            attempt = exchange.attempt
            request = AppointmentRequest(
                class_name,
                tuple(name for name, other in config.classes.items() if other.base < mine),
                tuple((name, horizon(other.deadline_s, longest))
                      for name, other in config.classes.items() if other.base > mine),
                earliest, 1 / rate, latest, horizon(policy.deadline_s, longest),
                attempt.ledger_key, attempt.returning)
            delay = await self.store.book_appointment(pool, request)
            if delay is not None:
                delay = min(delay, float(longest))  # (one kept from before a reload lowered the maximum)
        if delay is None:
            self._emit(AppointmentTold(pool, class_name, "past_deadline"))
            return past_deadline(pool, policy.deadline_s, class_name)
        self._emit(AppointmentTold(pool, class_name, "given", delay))
        return appointment(outcome, pool, policy.max_wait_s, forecast_s, delay)
