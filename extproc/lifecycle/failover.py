"""Failover: an attempt that failed before the client saw anything (a 5xx, a 429, Envoy's own
503) is tried once more on its home pool's fallback, admitted there like any request, through
Envoy's relay listener; the fallback's answer replaces the failure. Never after a response has
started streaming, never twice, never from a pool that was itself a reroute."""

from __future__ import annotations

import math
from collections.abc import Callable

from ..core.breaker import failure_kind, is_failure
from ..core.events import FailedOver, Observers
from ..core.headers import CLASS, FALLBACK, PRIORITY, QUEUE_WAIT_MS
from ..core.openai_request import rewritten
from ..core.outcomes import HttpReply, Rejection
from ..core.routing import RoutingView, failover_route
from ..stores.queue import Lease, QueueStore, StoreClosed, WaitExpired
from .exchange import Exchange, Tickets, body_changes, remaining_wait
from .relay import Relay
from .slots import Slots

HOLD_MARGIN_S = 2.0  # extra seconds Envoy keeps waiting beyond the sidecar's own bound


class Failover:
    def __init__(self, store: QueueStore, relay: Relay | None, view: RoutingView,
                 record: Callable[[str, bool, object, str], None], slots: Slots, tickets: Tickets,
                 observers: Observers, clock: Callable[[], float], draining: Callable[[], bool],
                 rerouted: Callable[[Exchange], None] = lambda exchange: None):
        self.store = store
        self.relay = relay
        self.view = view
        self._record = record  # the control plane's count of an upstream outcome
        self.slots = slots
        self.tickets = tickets
        self._emit = observers.emit  # who hears how each failover ended
        self.clock = clock
        self._draining = draining
        self._rerouted = rerouted  # told once it runs on the fallback (decisions.py)

    def possible(self, exchange: Exchange) -> bool:
        config = exchange.config
        chosen = exchange.route
        return (
            config.retries.failover
            and self.relay is not None
            and chosen is not None
            and not chosen.rerouted
            and not exchange.failover.tried
            and not self._draining()
            and failover_route(chosen.pool, exchange.request.model if exchange.request else None,
                               config, self.view) is not None
        )

    def hold_seconds(self, exchange: Exchange) -> int:
        """How long Envoy must keep the exchange while its fallback answers."""
        config = exchange.config
        wait = max(0.0, remaining_wait(exchange, self.clock()))
        return math.ceil(min(wait + config.relay.timeout_s + HOLD_MARGIN_S, config.limits.max_message_timeout_s))

    async def answer(self, exchange: Exchange) -> HttpReply | None:
        """The fallback's answer, or None: nothing better, the client gets the failure."""
        assert exchange.route is not None and exchange.request is not None and self.relay is not None
        config = exchange.config
        home = exchange.route.pool
        exchange.failover.tried = True
        await self.slots.release(exchange, "failed_over")  # the failed backend is done with it
        target = failover_route(home, exchange.request.model, config, self.view)
        if target is None:
            self._emit(FailedOver(home, "", "no_pool"))
            return None
        cost = exchange.lease.ticket.cost if exchange.lease else 0
        ticket = self.tickets.ticket(config, exchange, target.pool, exchange.classification.score, cost, "failover")
        try:
            result = await self.store.enqueue(target.pool, ticket)
            lease = result if isinstance(result, Lease) else await self.store.wait(
                result, remaining_wait(exchange, self.clock()))
        except (WaitExpired, StoreClosed, Rejection):
            self._emit(FailedOver(home, target.pool, "no_capacity"))
            return None
        exchange.route_to(target)
        exchange.lease = self.slots.granted(lease)
        self.slots.hold(exchange, place=False)
        self._rerouted(exchange)
        body = rewritten(exchange.request, **body_changes(config, exchange, target))
        headers = {PRIORITY: f"{exchange.classification.score:g}", CLASS: exchange.class_name}
        answer = await self.relay.send(exchange.path, config.pools[target.pool].cluster, body, headers,
                                       exchange.authorization)
        await self.slots.release(exchange, "failover_completed" if answer.status is not None else "relay_failed")
        failed = answer.status is None or is_failure(answer.status)
        if answer.status is not None:
            self._record(target.pool, failed, None, failure_kind(answer.status, answer.error))
        elif answer.timed_out:  # the fallback did not answer within relay.timeout_s
            self._record(target.pool, True, None, "timeout")
        # Otherwise the relay listener itself was unreachable: nothing the pool did.
        self._emit(FailedOver(home, target.pool, "answered" if not failed else "failed"))
        if failed:  # the client gets the first failure, which Envoy words as an OpenAI error
            return None
        exchange.upstream_status = answer.status
        headers_out = (*answer.headers, (FALLBACK, "true"), (QUEUE_WAIT_MS, str(round(exchange.queue_wait_s * 1000))))
        return HttpReply(answer.status, headers_out, answer.body)
