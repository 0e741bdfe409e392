"""The driver of a request's state machine (core/request_life.py): it feeds an exchange's events
to the machine, puts the phase and outcome it returns on the exchange (the one place they
change), and performs what the step says to do: count, hold the slot, withdraw from the line,
settle the attempt. The gate (gate.py) reports the events; `close` awaits the release.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from ..control.plane import ControlPlane
from ..core.appointments import ServiceTime
from ..core.breaker import ProbeKind
from ..core.outcomes import Outcome, refuses
from ..core.request_life import Action, Event, Phase, step
from ..core.routing import Route
from ..stores.queue import QueueStore
from .attempts import Attempts
from .decisions import Decisions
from .exchange import Exchange
from .shadow import ShadowCopies
from .slots import Slots


class RequestDriver:
    def __init__(self, store: QueueStore, slots: Slots, decisions: Decisions, shadow: ShadowCopies,
                 control: ControlPlane, service: ServiceTime, clock: Callable[[], float],
                 in_background: Callable[[Coroutine[Any, Any, None]], None]):
        self.store = store
        self.slots = slots
        self.decisions = decisions
        self.shadow = shadow
        self.control = control
        self.service = service
        self.clock = clock
        self._in_background = in_background

    def perform(self, exchange: Exchange, event: Event) -> tuple[Action, ...]:
        """The driver: the request's state machine takes the event; its phase and outcome change
        here alone, and what the step says to do is done, in order (RELEASE, the one action that
        suspends, is left to `close`)."""
        taken = step(exchange.phase, event)
        exchange.phase = taken.phase
        if taken.phase is Phase.YIELDED:
            exchange.yielded = True  # (how it ends: end_of)
        if taken.outcome is not None:
            exchange.outcome = taken.outcome
            now = self.clock()
            exchange.queue_wait_s = now - exchange.arrived_at
            if taken.outcome is Outcome.ADMITTED:
                exchange.admitted_at = now
        for action in taken.actions:
            self._act(exchange, action)
        return taken.actions

    def _act(self, exchange: Exchange, action: Action) -> None:
        if action is Action.ADMIT:
            self.slots.hold(exchange)
            self.decisions.count(exchange)
        elif action is Action.COPY_AS_SHADOW:
            self.shadow.admitted(exchange)
        elif action is Action.COUNT_REJECTED or action is Action.COUNT_PASSED or action is Action.COUNT_LISTED:
            self.decisions.count(exchange)
        elif action is Action.COUNT_QUEUED:
            self.decisions.queued(exchange)
        elif action is Action.WITHDRAW:
            if exchange.waiter is not None:
                self.store.withdraw(exchange.waiter)
                exchange.waiter = None
        elif action in _CANCELLED:
            if action is not Action.CANCELLED_BEFORE_RESPONSE:  # (that one was counted admitted)
                self.decisions.count(exchange)
            self.decisions.cancelled(exchange, _CANCELLED[action])
        elif action is Action.FINISH_ADMITTED:
            now, end = self.clock(), end_of(exchange)
            self.decisions.finished(exchange, end, now)
            if end == "completed" and exchange.route is not None:
                self.service.observe(exchange.route.pool, exchange.class_name, now - exchange.admitted_at)
        elif action is Action.SETTLE:
            self._settle(exchange)

    def _settle(self, exchange: Exchange) -> None:
        """What an ended exchange lets go of besides its slot: its shadow copy, its name in the
        attempt ledger, and a half-open probe permit that gave the breaker no outcome (its client
        left, its wait ran out, it was turned away after taking it): another may probe."""
        route_ = exchange.route
        give_back_probe = route_ is not None and route_.probe is ProbeKind.HALF_OPEN and exchange.upstream_status is None
        if exchange.shadowed:
            self.shadow.closed(exchange)
        finish_key = Attempts.to_finish(exchange)
        if finish_key is not None or give_back_probe:
            self._in_background(self._after_close(route_, finish_key, exchange.failover.failed_in, give_back_probe))

    async def _after_close(self, route_: Route | None, key: str | None, failed_in: str | None, probe: bool) -> None:
        if key is not None:
            await self.control.finish_attempt(key, failed_in)
        if probe and route_ is not None:
            await self.control.return_probe(route_.pool)


_CANCELLED = {Action.CANCELLED_ARRIVING: "arriving", Action.CANCELLED_QUEUED: "queued",
              Action.CANCELLED_BEFORE_RESPONSE: "before_response"}


def end_of(exchange: Exchange) -> str:
    """How an exchange's upstream ended: no response (the sidecar refused it after it took its
    slot, or its client left), yielded (a long prompt that gave its engine up: the sidecar answered
    it and Envoy reset its upstream request), a server error, or completed."""
    status = exchange.upstream_status
    if exchange.yielded:
        return "yielded"
    if status is None:
        return "refused" if exchange.outcome is not None and refuses(exchange.outcome) else "client_gone"
    return "upstream_error" if status >= 500 else "completed"
