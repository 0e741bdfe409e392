"""Where this replica takes and gives back slots of the queue store: each lease it is granted is
counted, placed on a backend when its pool picks them, and released exactly once."""

from __future__ import annotations

from ..core.capacity import Placing
from ..ops.metrics import Metrics
from ..stores.queue import Lease, QueueStore
from .exchange import Exchange
from .placement import BackendPicker


class Slots:
    def __init__(self, store: QueueStore, metrics: Metrics, picker: BackendPicker | None = None):
        self.store = store
        self.metrics = metrics
        self.picker = picker
        self.holding: set[str] = set()  # exchanges admitted by this replica and not yet released

    def granted(self, lease: Lease) -> Lease:
        self.metrics.slots_admitted.labels(lease.pool).inc()
        return lease

    def hold(self, exchange: Exchange, place: bool = True) -> None:
        """The exchange is admitted: it holds its lease until `release`, and, for a pool whose
        backends the sidecar picks, its place on one (the backends to try, best first; not
        for the sidecar's own requests, which Envoy's relay balances)."""
        self.holding.add(exchange.id)
        lease = exchange.lease
        if place and self.picker is not None and lease is not None and self.picker.picks(lease.pool):
            ticket = lease.ticket
            exchange.endpoints = self.picker.pick(lease.pool, ticket.id, Placing(ticket.cost, ticket.long, ticket.bounded))
            if exchange.endpoints:  # every replica's picker counts it there
                self.store.place(lease, exchange.endpoints.split(",", 1)[0])

    def ran_on(self, exchange: Exchange, endpoint: str) -> None:
        """Envoy sent the exchange to `endpoint` (its pick was unhealthy, or it retried
        elsewhere): what it holds is counted there from now on."""
        if self.picker is not None and exchange.lease is not None:
            if self.picker.moved(exchange.lease.ticket.id, endpoint):
                self.store.place(exchange.lease, endpoint)

    async def release(self, exchange: Exchange, end: str) -> None:
        """The exchange's slot goes back (once, however often this is called)."""
        self.holding.discard(exchange.id)
        lease = exchange.lease
        if lease is None or lease.released:
            return
        await self.release_lease(lease, end)

    async def release_lease(self, lease: Lease, end: str) -> None:
        self.metrics.released.labels(lease.pool, end).inc()
        if self.picker is not None:
            self.picker.release(lease.ticket.id)
        # Envoy resets the gRPC stream as soon as the exchange is over, which may cancel the
        # task running this; every store hands the release over before it first suspends.
        await self.store.release(lease)
