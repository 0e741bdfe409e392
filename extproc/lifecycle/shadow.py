"""Shadow copies inside admission: a share of the default pool's admitted requests is copied to
the fallback pool, admitted there at the lowest priority and only into free room (a copy never
waits in line, never beside someone waiting, and holds at most `shadow.max_share` of the pool's
slots), sent through Envoy's relay listener, and compared (events, core/events.py: the metrics
count them), never returned.

Envoy's own request mirroring would bypass ext_proc, and so the fallback pool's admission."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable

from ..core.admission import Ticket
from ..core.events import Observers, ShadowAnswered, ShadowCopied, ShadowTimed, ShadowTokens
from ..core.headers import CLASS, PRIORITY
from ..core.openai_request import rewritten
from ..core.routing import Route, RoutingView, shadow_route
from ..stores.queue import Lease, QueueStore, StoreClosed, Waiter, WaitExpired
from .exchange import Exchange, Tickets, body_changes
from .relay import Relay, RelayAnswer, completion_tokens
from .slots import Slots

log = logging.getLogger("extproc")

SHADOW_CLASS = "shadow"


class ShadowCopies:
    def __init__(self, pools: Iterable[str], store: QueueStore, relay: Relay | None, view: RoutingView,
                 share: Callable[[], float], slots: Slots,
                 tickets: Tickets, observers: Observers, clock: Callable[[], float], rng: random.Random,
                 in_background: Callable[[object], None]):
        self.store = store
        self.relay = relay
        self.view = view
        self._share = share  # the control plane's shadow share (an operator may change it)
        self.slots = slots
        self.tickets = tickets
        self._emit = observers.emit  # who hears of each copy and each response compared
        self.clock = clock
        self.rng = rng
        self._in_background = in_background
        self._running = {name: 0 for name in pools}

    def admitted(self, exchange: Exchange) -> None:
        """A request was admitted: copy it, with the configured share, if the default pool serves
        it as its own (not a request of another pool's model rerouted there: its body is paired)."""
        share = self._share()
        route = exchange.route
        if (self.relay is not None and share > 0 and route is not None and route.home == exchange.config.default_pool
                and not route.rerouted and self.rng.random() < share):
            self._start(exchange)

    def response_started(self, exchange: Exchange, status: int) -> None:
        if exchange.shadowed:
            self._emit(ShadowAnswered("primary", f"{status // 100}xx"))

    def response_body(self, exchange: Exchange, body: bytes) -> None:
        """The whole body of a shadowed non-streamed response: count its tokens."""
        tokens = completion_tokens(body)
        if tokens is not None:
            self._emit(ShadowTokens("primary", tokens))

    def closed(self, exchange: Exchange) -> None:
        if exchange.shadowed and exchange.upstream_status is not None:
            self._emit(ShadowTimed("primary", self.clock() - exchange.arrived_at))

    def _start(self, exchange: Exchange) -> None:
        assert exchange.request is not None
        config = exchange.config
        target = shadow_route(exchange.request.model, config, self.view)
        pool = target.pool if target else (config.shadow.pool or "")
        if target is None:
            self._emit(ShadowCopied(pool, "unavailable"))
            return
        limit = max(1, int(config.pools[pool].max_inflight * config.shadow.max_share))
        if self._running[pool] >= limit:
            self._emit(ShadowCopied(pool, "no_room"))
            return
        try:
            body = rewritten(exchange.request, **body_changes(config, exchange, target, stream=False))
            cost = exchange.lease.ticket.cost if exchange.lease else 0
            lowest = max(c.base for c in config.classes.values()) + 1.0
            ticket = self.tickets.ticket(config, exchange, pool, lowest, cost, SHADOW_CLASS)
        except Exception as error:  # no copy, and the request it copies goes on undisturbed
            log.warning("shadow copy not made: %s", type(error).__name__)
            return
        # Counted only once the copy is built, and from here to its end: `_run` gives it back
        # whatever becomes of the copy (a count taken for a copy that never ran would be a
        # slot of the shadow's share lost for good).
        exchange.shadowed = True
        self._running[pool] += 1
        self._in_background(self._run(exchange, target, ticket, body))

    async def _run(self, exchange: Exchange, target: Route, ticket: Ticket, body: bytes) -> None:
        """Only in free room: the copy leaves the line at once rather than wait, so it never
        delays a real request."""
        pool = target.pool
        lease: Lease | None = None
        try:
            result = await self.store.enqueue(pool, ticket)
            if isinstance(result, Waiter):
                try:
                    result = await self.store.wait(result, 0)
                except (WaitExpired, StoreClosed):
                    self._emit(ShadowCopied(pool, "no_room"))
                    exchange.shadowed = False  # no copy: the primary side is not compared either
                    return
            lease = self.slots.granted(result)
            self._emit(ShadowCopied(pool, "sent"))
            headers = {PRIORITY: f"{ticket.score:g}", CLASS: SHADOW_CLASS}
            answer: RelayAnswer = await self.relay.send(  # type: ignore[union-attr]
                exchange.path, exchange.config.pools[pool].cluster, body, headers, exchange.authorization)
            status_class = "none" if answer.status is None else f"{answer.status // 100}xx"
            self._emit(ShadowAnswered("shadow", status_class))
            self._emit(ShadowTimed("shadow", answer.seconds))
            tokens = answer.completion_tokens()
            if tokens is not None and exchange.request is not None and not exchange.request.stream:
                self._emit(ShadowTokens("shadow", tokens))
            # Never counted by the target pool's breaker: a shadow disturbs nothing, and a pool
            # failing its copies must still take the real failovers.
        except Exception as error:  # a shadow never disturbs anything else
            log.warning("shadow copy failed: %s", error or type(error).__name__)
        finally:
            self._running[pool] -= 1
            if lease is not None:
                await self.slots.release_lease(lease, "shadow")
