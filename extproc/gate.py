"""The admission gate: one request's life from headers to release, over the pure core.

The ext_proc servicer calls `open` (headers), `enqueue` and `wait` (body), `response_started`
(response headers) and `close` (the exchange is over, however it ended). The gate keeps the
lifecycle state in an `Exchange`; protocol state stays in the servicer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .admission import Ticket, Tier, place, tier_for
from .capacity import check_context, request_cost
from .config import Config
from .metrics import Metrics
from .openai_request import CompletionRequest, check_size, parse_completion_request, rewritten
from .outcomes import Outcome, Rejection
from .priority import Caller, Classification, classify, identify, parse_claim
from .queue_store import Lease, PoolSnapshot, QueueStore, StoreClosed, Waiter, WaitExpired
from .tokens import estimate_prompt_tokens

log = logging.getLogger("extproc")

# Headers the sidecar sets; copies sent by clients are removed before they reach a route.
POOL_HEADER = "x-llm-pool"
PRIORITY_HEADER = "x-llm-priority"
CLASS_HEADER = "x-llm-class"
QUEUE_WAIT_HEADER = "x-queue-wait-ms"
OWN_HEADERS = (POOL_HEADER, PRIORITY_HEADER, CLASS_HEADER)

# Extra seconds Envoy keeps waiting beyond the class's wait, so the sidecar answers first.
_HOLD_MARGIN_S = 2.0


@dataclass
class Exchange:
    id: str
    caller: Caller
    classification: Classification
    arrived_at: float
    pool: str | None = None
    request: CompletionRequest | None = None
    lease: Lease | None = None
    queue_wait_s: float = 0.0
    upstream_status: int | None = None
    outcome: Outcome | None = None


@dataclass(frozen=True)
class Admission:
    """What to tell Envoy when a request is admitted."""

    set_headers: tuple[tuple[str, str], ...]
    body: bytes | None  # a rewritten body, or None to pass the original


class AdmissionGate:
    def __init__(
        self,
        config: Config,
        store: QueueStore,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
        on_tier_change: Callable[[str, Tier, Tier, int], None] = lambda pool, old, new, depth: None,
    ):
        self.config = config
        self._on_tier_change = on_tier_change
        self.store = store
        self.metrics = metrics
        self.clock = clock
        self.draining = False
        self._ids = itertools.count(1)
        # Ticket ids must be unique across every replica sharing a queue: pids repeat across hosts.
        self._id_prefix = f"{uuid.uuid4().hex[:12]}-"
        self._tiers: dict[str, Tier] = {}
        self.holding: set[str] = set()  # exchanges admitted by this replica and not yet released
        for name, pool in config.pools.items():
            metrics.max_inflight.labels(name).set(pool.max_inflight)
            metrics.inflight.labels(name).set(0)
            metrics.tier.labels(name).set(0)
            for class_name in config.classes:
                metrics.queue_depth.labels(name, class_name).set(0)
        metrics.serving.set(1)

    # -- store callbacks -------------------------------------------------------------------

    def pool_changed(self, pool: str, snapshot: PoolSnapshot) -> None:
        """Refresh a pool's gauges and log tier transitions (called by the store)."""
        self.metrics.inflight.labels(pool).set(snapshot.inflight)
        self.metrics.inflight_tokens.labels(pool).set(snapshot.inflight_tokens)
        self.metrics.max_inflight.labels(pool).set(snapshot.max_inflight)
        for class_name in self.config.classes:
            self.metrics.queue_depth.labels(pool, class_name).set(
                snapshot.depth_by_class.get(class_name, 0)
            )
        tier = tier_for(snapshot.depth, self.config.pools[pool].tiers)
        previous = self._tiers.get(pool, Tier.GREEN)
        if tier != previous:
            self._tiers[pool] = tier
            self.metrics.tier.labels(pool).set(int(tier))
            action = {
                Tier.GREEN: "normal",
                Tier.YELLOW: "scale-out signal",
                Tier.ORANGE: "degrading degradable classes to the fallback pool",
                Tier.RED: "shedding unprotected classes",
            }[tier]
            log.warning(
                "pool %s tier %s -> %s at queue depth %d (%s)",
                pool, previous.name.lower(), tier.name.lower(), snapshot.depth, action,
            )
            self._on_tier_change(pool, previous, tier, snapshot.depth)

    # -- a request's life ------------------------------------------------------------------

    def open(self, headers: Mapping[str, str]) -> Exchange:
        """Headers arrived: identify, classify, check what can be checked. Raises Rejection."""
        if self.draining:
            raise self._draining()
        caller = identify(headers.get("authorization"), self.config)
        claim = parse_claim(headers)
        length = headers.get("content-length", "").strip()
        if length.isdigit():
            check_size(int(length), self.config.limits.max_body_bytes)
        classification = classify(claim, caller, self.config)
        for what in classification.lowered:
            self.metrics.claims_lowered.labels(caller.tenant, what).inc()
        exchange_id = f"{self._id_prefix}{next(self._ids)}"
        return Exchange(exchange_id, caller, classification, arrived_at=self.clock())

    def pass_through(self, exchange: Exchange) -> None:
        exchange.outcome = Outcome.PASSED_THROUGH
        self._count(exchange)

    async def enqueue(self, exchange: Exchange, raw_body: bytes) -> Lease | Waiter:
        """The body arrived: parse it, place it, take a slot or a place in line."""
        started = self.clock()
        try:
            if self.draining:
                raise self._draining()
            exchange.request = request = parse_completion_request(raw_body, self.config.limits.max_body_bytes)
            limits = self.config.requests
            prompt_tokens = estimate_prompt_tokens(request.body)
            check_context(prompt_tokens, request.max_tokens, limits.default_max_tokens,
                          limits.max_model_len, limits.context_reserve)
            cost = request_cost(prompt_tokens, request.max_tokens, limits.default_max_tokens)
            class_name = exchange.classification.class_name
            placement = place(class_name, self.config, self.store.depth)
            exchange.pool = placement.pool
            if placement.degraded:
                self.metrics.degraded.labels(class_name, placement.pool).inc()
            if placement.shed is not None:
                raise Rejection(
                    placement.shed,
                    f"The {placement.pool} pool is overloaded; retry later.",
                    self.config.retry_after_s.overloaded,
                )
            ticket = Ticket(
                score=exchange.classification.score,
                seq=next(self._ids),
                id=exchange.id,
                class_name=class_name,
                branch_id=exchange.classification.branch_id,
                cost=cost,
                long=cost > self.config.pools[placement.pool].capacity.long_request_tokens,
            )
            try:
                result = await self.store.enqueue(placement.pool, ticket)
            except StoreClosed:
                raise self._draining() from None
            if isinstance(result, Lease):
                exchange.lease = result
                self._admitted(exchange)
            return result
        except Rejection as rejection:
            self._rejected(exchange, rejection)
            raise
        finally:
            self.metrics.decision.observe(self.clock() - started)

    def hold_seconds(self, exchange: Exchange) -> int:
        """How long Envoy must keep the request while it waits in line."""
        wait = self.config.classes[exchange.classification.class_name].max_wait_s
        return math.ceil(min(wait + _HOLD_MARGIN_S, self.config.limits.max_message_timeout_s))

    async def wait(self, exchange: Exchange, waiter: Waiter) -> None:
        policy = self.config.classes[exchange.classification.class_name]
        remaining = policy.max_wait_s - (self.clock() - exchange.arrived_at)
        try:
            exchange.lease = await self.store.wait(waiter, remaining)
        except WaitExpired:
            rejection = Rejection(
                Outcome.EXPIRED_IN_QUEUE,
                f"No capacity within the {policy.max_wait_s:g} s wait of class "
                f"{exchange.classification.class_name}; retry later.",
                self.config.retry_after_s.wait_expired,
            )
            self._rejected(exchange, rejection)
            raise rejection from None
        except StoreClosed:
            rejection = self._draining()
            self._rejected(exchange, rejection)
            raise rejection from None
        self._admitted(exchange)

    def admission(self, exchange: Exchange) -> Admission:
        assert exchange.pool is not None and exchange.request is not None
        pool = self.config.pools[exchange.pool]
        headers = (
            (POOL_HEADER, pool.cluster),
            (PRIORITY_HEADER, f"{exchange.classification.score:g}"),
            (CLASS_HEADER, exchange.classification.class_name),
        )
        changes: dict[str, object] = {}
        if pool.model is not None and exchange.request.model != pool.model:
            changes["model"] = pool.model
        if self.config.queue.engine_priority:  # vLLM --scheduling-policy priority: lower first
            changes["priority"] = round(exchange.classification.score * 100)
        return Admission(headers, rewritten(exchange.request, **changes) if changes else None)

    def response_started(self, exchange: Exchange, status: int) -> None:
        exchange.upstream_status = status
        if exchange.pool is not None:
            self.metrics.upstream_status.labels(exchange.pool, f"{status // 100}xx").inc()

    async def close(self, exchange: Exchange, client_gone: bool) -> None:
        """The exchange is over, however it ended: release its slot exactly once."""
        if exchange.outcome is None:
            exchange.outcome = Outcome.CANCELLED_CLIENT_GONE
            self._count(exchange)
        self.holding.discard(exchange.id)
        lease = exchange.lease
        if lease is None or lease.released:
            return
        if client_gone and exchange.upstream_status is None:
            end = "client_gone"
        elif exchange.upstream_status is None:
            end = "no_response"  # e.g. Envoy's own 503/504: no response headers were seen
        elif client_gone:
            end = "client_gone_streaming"
        elif exchange.upstream_status >= 500:
            end = "upstream_error"
        else:
            end = "completed"
        self.metrics.released.labels(lease.pool, end).inc()
        # Envoy resets the gRPC stream as soon as the exchange is over, which cancels the task
        # running this; a release to a shared store awaits Redis and must not be cut short.
        await asyncio.shield(self.store.release(lease))

    async def drain(self) -> None:
        """Stop admitting: new requests and everyone in line get 503 with retry-after."""
        self.draining = True
        self.metrics.serving.set(0)
        await self.store.close()

    # -- bookkeeping -----------------------------------------------------------------------

    def _draining(self) -> Rejection:
        return Rejection(
            Outcome.REJECTED_DRAINING,
            "This gateway instance is shutting down; retry.",
            self.config.retry_after_s.draining,
        )

    def _admitted(self, exchange: Exchange) -> None:
        self.holding.add(exchange.id)
        exchange.outcome = Outcome.ADMITTED
        exchange.queue_wait_s = self.clock() - exchange.arrived_at
        self._count(exchange)
        self.metrics.queue_wait.labels(exchange.pool, exchange.classification.class_name).observe(
            exchange.queue_wait_s
        )

    def _rejected(self, exchange: Exchange, rejection: Rejection) -> None:
        exchange.outcome = rejection.outcome
        exchange.queue_wait_s = self.clock() - exchange.arrived_at
        self._count(exchange)
        if rejection.outcome is Outcome.EXPIRED_IN_QUEUE and exchange.pool is not None:
            self.metrics.queue_wait.labels(
                exchange.pool, exchange.classification.class_name
            ).observe(exchange.queue_wait_s)

    def _count(self, exchange: Exchange) -> None:
        assert exchange.outcome is not None
        self.metrics.outcomes.labels(exchange.classification.class_name, exchange.outcome.value).inc()

    def count_rejection(self, class_name: str, rejection: Rejection) -> None:
        """Count a rejection that happened before an Exchange existed (bad headers, 401)."""
        self.metrics.outcomes.labels(class_name, rejection.outcome.value).inc()
