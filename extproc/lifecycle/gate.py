"""The admission gate: one request's life from headers to release, over the pure core.

The ext_proc servicer calls `open` (headers), `enqueue` and `wait` (body), `response_started`
(response headers), `fail_over` (when that response is a failure the client has not seen yet)
and `close` (the exchange is over, however it ended). The gate keeps the lifecycle state in an
`Exchange`; protocol state stays in the servicer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import random
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..control.plane import ControlPlane
from ..core.admission import Ticket, Tier, tier_for
from ..core.breaker import ProbeKind, is_failure
from ..core.capacity import check_context, request_cost
from ..core.config import Config
from ..core.openai_request import CompletionRequest, check_size, parse_completion_request, rewritten
from ..core.outcomes import HttpReply, Outcome, Rejection
from ..core.priority import CLAIM_HEADERS, Caller, Callers, Classification, Classifier
from ..core.retries import RETRY_HEADERS, DrainMeter, RetryBudget, Verdict, attempt_key, declared_retry, retry_after_s
from ..core.routing import Route, RoutingView, failover_route, route, shadow_route
from ..core.tokens import estimate_prompt_tokens
from ..ops.metrics import Metrics
from ..stores.queue import Lease, PoolSnapshot, QueueStore, StoreClosed, Waiter, WaitExpired
from .placement import BackendPicker
from .relay import POOL_HEADER, Relay, RelayAnswer, completion_tokens

log = logging.getLogger("extproc")
# One JSON object per line and per decision (docs/logs.md).
decision_log = logging.getLogger("extproc.decisions")
RECENT_DECISIONS = 200  # kept in memory for the live queue page

# Headers the sidecar sets; copies sent by clients are removed before they reach a route.
PRIORITY_HEADER = "x-llm-priority"
CLASS_HEADER = "x-llm-class"
OWN_HEADERS = frozenset({POOL_HEADER, PRIORITY_HEADER, CLASS_HEADER})  # x-llm-pool picks the Envoy route
# Every request header the sidecar reads (the others are not even decoded).
REQUEST_HEADERS_READ = frozenset({
    "authorization", "content-length", ":path", *OWN_HEADERS, *CLAIM_HEADERS, *RETRY_HEADERS,
})
# Response headers.
QUEUE_WAIT_HEADER = "x-queue-wait-ms"
FALLBACK_HEADER = "x-llm-fallback"  # "true": served by the home pool's fallback

SHADOW_CLASS = "shadow"

# Extra seconds Envoy keeps waiting beyond the class's wait, so the sidecar answers first.
_HOLD_MARGIN_S = 2.0


@dataclass
class Exchange:
    id: str
    caller: Caller
    classification: Classification
    arrived_at: float
    path: str = "/v1/chat/completions"
    key: str | None = None  # the client's name for the request (idempotency-key, x-request-id)
    declared_retry: bool = False  # the client says it is retrying (x-stainless-retry-count)
    attempt_begun: bool = False  # the ledger holds this key as running
    route: Route | None = None
    request: CompletionRequest | None = None
    lease: Lease | None = None
    waiter: Waiter | None = None  # in line: from `enqueue` until `wait` has an answer
    queue_wait_s: float = 0.0
    upstream_status: int | None = None
    outcome: Outcome | None = None
    failed_in: str | None = None  # the pool whose upstream failed this request
    failed_over: bool = False
    shadowed: bool = False
    admitted_at: float = 0.0
    cost: int | None = None  # tokens the request holds while admitted (prompt + max_tokens)
    endpoints: str | None = None  # the backends Envoy is told to try, best first (pools that pick)
    decision: dict | None = None  # the latest decision record (as logged)
    started_monotonic: float = field(default_factory=time.monotonic)

    @property
    def pool(self) -> str | None:
        return self.route.pool if self.route is not None else None


@dataclass(frozen=True)
class Admission:
    """What to tell Envoy when a request is admitted."""

    set_headers: tuple[tuple[str, str], ...]
    body: bytes | None  # a rewritten body, or None to pass the original
    endpoints: str | None = None  # the backends to try, best first (pools that pick them)


@dataclass(frozen=True)
class ResponsePlan:
    """What to do with the response headers of an admitted request."""

    set_headers: tuple[tuple[str, str], ...]
    fail_over: bool = False  # a failure the client has not seen: answer from the fallback pool
    read_body: bool = False  # a shadowed non-streamed request: its tokens are compared
    # The backend is done: a non-streamed answer comes whole once generation ended, so its
    # slot is released now and the ext_proc stream let go; a stream holds both to its end.
    finished: bool = True


# Envoy's response details, by the failure kind they mean (the first marker found wins).
_FAILURE_MARKERS = (("no_healthy_upstream", "no_healthy_upstream"), ("connect", "connect_failure"),
                    ("overflow", "overflow"), ("timeout", "timeout"), ("reset", "reset"))
UPSTREAM_RESULTS = ("success", "http_429", "http_5xx", *(kind for _, kind in _FAILURE_MARKERS))


def failure_kind(status: int, details: str) -> str:
    """The breaker's label for an upstream outcome, from the status and Envoy's details."""
    if not is_failure(status):
        return "success"
    if status == 429:
        return "http_429"
    if details.startswith("via_upstream") or not details:
        return "http_5xx"
    for marker, kind in _FAILURE_MARKERS:
        if marker in details:
            return kind
    return "http_5xx"


class AdmissionGate:
    def __init__(
        self,
        config: Config,
        store: QueueStore,
        metrics: Metrics,
        control: ControlPlane,
        relay: Relay | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_tier_change: Callable[[str, Tier, Tier, int], None] = lambda pool, old, new, depth: None,
        rng: random.Random | None = None,
    ):
        self.config = config
        self._on_tier_change = on_tier_change
        self.store = store
        self.metrics = metrics
        self.control = control
        self.relay = relay
        self.clock = clock
        self.rng = rng or random.Random()
        self.draining = False
        self._ids = itertools.count(1)
        # Ticket ids must be unique across every replica sharing a queue: pids repeat across hosts.
        self._id_prefix = f"{uuid.uuid4().hex[:12]}-"
        self._tiers: dict[str, Tier] = {}
        self._callers = Callers(config)
        self._classifier = Classifier(config)
        self._drain = {name: DrainMeter() for name in config.pools}
        self._budget = RetryBudget(config.retries)
        self._shadows_running = {name: 0 for name in config.pools}
        self._background: set[asyncio.Task] = set()
        self.view = RoutingView(store.depth, control.permit, lambda: control.canary_digits)
        self.holding: set[str] = set()  # exchanges admitted by this replica and not yet released
        self.recent_decisions: deque[dict] = deque(maxlen=RECENT_DECISIONS)  # newest last
        _route_decision_lines()
        # (pool, class, seconds from arrival to first byte, queue wait included): feeds the latency limiter
        self.on_first_byte: Callable[[str, str, float], None] = lambda pool, class_name, seconds: None
        self.picker: BackendPicker | None = None  # names the backend, for pools with capacity.pick_backend
        self._snapshots: dict[str, PoolSnapshot] = {}
        metrics.before_render = self.publish_pool_gauges
        for name, pool in config.pools.items():
            metrics.max_inflight.labels(name).set(pool.max_inflight)
            metrics.inflight.labels(name).set(0)
            metrics.tier.labels(name).set(0)
            for class_name in config.classes:
                metrics.queue_depth.labels(name, class_name).set(0)
        metrics.serving.set(1)

    # -- store callbacks -------------------------------------------------------------------

    def pool_changed(self, pool: str, snapshot: PoolSnapshot) -> None:
        """Note a pool's state, its drain rate, and act on tier transitions (called by the
        store on every change: kept cheap; the gauges are written when metrics are read)."""
        self._snapshots[pool] = snapshot
        self._drain[pool].observe(time.monotonic(), snapshot.released_total)
        self._retier(pool, snapshot.depth)

    def _retier(self, pool: str, depth: int) -> None:
        tier = tier_for(depth, self.config.pools[pool].tiers)
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
                pool, previous.name.lower(), tier.name.lower(), depth, action,
            )
            self._on_tier_change(pool, previous, tier, depth)

    def publish_pool_gauges(self) -> None:
        for pool, snapshot in self._snapshots.items():
            self.metrics.inflight.labels(pool).set(snapshot.inflight)
            self.metrics.inflight_tokens.labels(pool).set(snapshot.inflight_tokens)
            self.metrics.max_inflight.labels(pool).set(snapshot.max_inflight)
            by_class = snapshot.depth_by_class
            for class_name in self.config.classes:
                self.metrics.queue_depth.labels(pool, class_name).set(by_class.get(class_name, 0))

    def reconfigure(self, config: Config) -> None:
        """Put a reloaded configuration in force for the next decision (extproc/reload.py):
        the callers and the classification cache are rebuilt, the retry budget keeps its
        counts under the new settings, the tiers are read again at the current depths.
        Exchanges already in line or in flight keep their classification, route and wait; the
        pool set and the class set are the same (a change of either needs a restart)."""
        assert config.pools.keys() == self.config.pools.keys() and config.classes.keys() == self.config.classes.keys()
        self.config = config
        self._callers = Callers(config)
        self._classifier = Classifier(config)
        self._budget.settings = config.retries
        for pool, snapshot in self._snapshots.items():
            self._retier(pool, snapshot.depth)

    # -- a request's life ------------------------------------------------------------------

    def open(self, headers: Mapping[str, str]) -> Exchange:
        """Headers arrived: identify, classify, check what can be checked. Raises Rejection."""
        if self.draining:
            raise self._draining()
        caller = self._callers.identify(headers.get("authorization"))
        classification = self._classifier.classify(headers, caller)
        length = headers.get("content-length", "").strip()
        if length.isdigit():
            check_size(int(length), self.config.limits.max_body_bytes)
        key = attempt_key(headers)
        for what in classification.lowered:
            self.metrics.claims_lowered.labels(what).inc()
        exchange_id = f"{self._id_prefix}{next(self._ids)}"
        path = headers.get(":path", "/v1/chat/completions")
        return Exchange(exchange_id, caller, classification, arrived_at=self.clock(), path=path, key=key,
                        declared_retry=declared_retry(headers))

    def pass_through(self, exchange: Exchange) -> None:
        exchange.outcome = Outcome.PASSED_THROUGH
        self._count(exchange)

    async def enqueue(self, exchange: Exchange, raw_body: bytes) -> Lease | Waiter:
        """The body arrived: parse it, route it, take a slot or a place in line."""
        started = self.clock()
        try:
            if self.draining:
                raise self._draining()
            exchange.request = request = parse_completion_request(raw_body, self.config.limits.max_body_bytes)
            limits = self.config.requests
            prompt_tokens = estimate_prompt_tokens(request.body)
            check_context(prompt_tokens, request.max_tokens, limits.default_max_tokens,
                          limits.max_model_len, limits.context_reserve)
            exchange.cost = cost = request_cost(prompt_tokens, request.max_tokens, limits.default_max_tokens)
            avoid = await self._check_retry(exchange)
            exchange.route = chosen = await self._route(exchange, avoid, cost)
            if chosen.refusal is not None:
                raise self._refusal(chosen)
            if chosen.rerouted:
                labels = (chosen.home, chosen.pool, chosen.reason or "")
                self.metrics.rerouted.labels(*labels).inc()
                if chosen.reason == "degraded":
                    self.metrics.degraded.labels(exchange.classification.class_name, chosen.pool).inc()
            ticket = self._ticket(exchange, chosen.pool, exchange.classification.score, cost)
            try:
                result = await self.store.enqueue(chosen.pool, ticket)
            except StoreClosed:
                raise self._draining() from None
            if isinstance(result, Lease):
                exchange.lease = self._granted(result)
                self._admitted(exchange)
            else:
                exchange.waiter = result
            return result
        except Rejection as rejection:
            self._rejected(exchange, rejection)
            raise
        finally:
            self.metrics.decision.observe(self.clock() - started)

    async def _check_retry(self, exchange: Exchange) -> str | None:
        """Apply the attempt ledger and the branch's retry budget; return the pool to avoid."""
        avoid = None
        is_retry = exchange.declared_retry
        if exchange.key is not None:
            start = await self.control.begin_attempt(exchange.key)
            if start.verdict is Verdict.IN_PROGRESS:
                self.metrics.retries.labels("in_progress").inc()
                raise Rejection(Outcome.REJECTED_IN_PROGRESS,
                                "A request with this idempotency-key / x-request-id is still being served; "
                                "wait for it instead of repeating it.", self._retry_after(1, None))
            if start.verdict is Verdict.TOO_MANY:
                self.metrics.retries.labels("too_many_attempts").inc()
                raise Rejection(Outcome.REJECTED_TOO_MANY_ATTEMPTS,
                                f"This request was attempted {start.attempt} times; it will not be run again "
                                f"within {self.config.retries.window_s:g} s.",
                                self._retry_after(self.config.retry_after_s.max, None))
            exchange.attempt_begun = True
            if start.verdict is Verdict.RETRY:
                is_retry = True
                avoid = start.failed_in
        if is_retry:
            branch = exchange.classification.branch_id
            if not self._budget.allow(branch, True, self.clock()):
                self.metrics.retries.labels("over_budget").inc()
                raise Rejection(Outcome.REJECTED_RETRY_BUDGET,
                                f"Branch {branch} is retrying more than its retry budget allows; retry later.",
                                self._retry_after(self.config.retry_after_s.overloaded, None))
            self.metrics.retries.labels("allowed").inc()
        else:
            self._budget.allow(exchange.classification.branch_id, False, self.clock())
        return avoid

    async def _route(self, exchange: Exchange, avoid: str | None, cost: int = 0) -> Route:
        c = exchange.classification
        model = exchange.request.model if exchange.request else None
        chosen = route(c.class_name, c.branch_id, model, self.config, self.view, avoid=avoid, cost=cost)
        if chosen.probe is not None and chosen.refusal is None:
            if not await self.control.take_probe(chosen.pool, chosen.probe):
                chosen = route(c.class_name, c.branch_id, model, self.config, self.view, avoid=avoid,
                               probe_denied=frozenset({chosen.pool}), cost=cost)
        return chosen

    def _ticket(self, exchange: Exchange, pool: str, score: float, cost: int, class_name: str | None = None) -> Ticket:
        return Ticket(
            score=score,
            seq=next(self._ids),
            id=exchange.id if class_name is None else f"{exchange.id}-{class_name}",
            class_name=class_name or exchange.classification.class_name,
            branch_id=exchange.classification.branch_id,
            cost=cost,
            long=cost > self.config.pools[pool].capacity.long_request_tokens,
            bounded=class_name is None and self.config.classes[exchange.classification.class_name].latency_target_s
            is not None,
        )

    def hold_seconds(self, exchange: Exchange) -> int:
        """How long Envoy must keep the request while it waits in line."""
        wait = self.config.classes[exchange.classification.class_name].max_wait_s
        return math.ceil(min(wait + _HOLD_MARGIN_S, self.config.limits.max_message_timeout_s))

    def _remaining_wait(self, exchange: Exchange) -> float:
        policy = self.config.classes[exchange.classification.class_name]
        return policy.max_wait_s - (self.clock() - exchange.arrived_at)

    async def wait(self, exchange: Exchange, waiter: Waiter) -> None:
        policy = self.config.classes[exchange.classification.class_name]
        exchange.waiter = None  # from here the store's wait answers for the ticket, cancelled or not
        try:
            exchange.lease = self._granted(await self.store.wait(waiter, self._remaining_wait(exchange)))
        except WaitExpired:
            rejection = Rejection(
                Outcome.EXPIRED_IN_QUEUE,
                f"No capacity within the {policy.max_wait_s:g} s wait of class "
                f"{exchange.classification.class_name}; retry later.",
                self._retry_after(self.config.retry_after_s.wait_expired, waiter.pool),
            )
            self._rejected(exchange, rejection)
            raise rejection from None
        except StoreClosed:
            rejection = self._draining()
            self._rejected(exchange, rejection)
            raise rejection from None
        self._admitted(exchange)

    def admission(self, exchange: Exchange) -> Admission:
        assert exchange.route is not None and exchange.request is not None
        pool = self.config.pools[exchange.route.pool]
        headers = (
            (POOL_HEADER, pool.cluster),
            (PRIORITY_HEADER, f"{exchange.classification.score:g}"),
            (CLASS_HEADER, exchange.classification.class_name),
        )
        changes = self._body_changes(exchange, exchange.route)
        if (exchange.route.pool == self.config.default_pool and self.control.shadow_share > 0
                and self.relay is not None and self.rng.random() < self.control.shadow_share):
            self._start_shadow(exchange)
        return Admission(headers, rewritten(exchange.request, **changes) if changes else None, exchange.endpoints)

    def _body_changes(self, exchange: Exchange, chosen: Route, **extra: object) -> dict[str, object]:
        assert exchange.request is not None
        changes: dict[str, object] = dict(extra)
        if chosen.model is not None and exchange.request.model != chosen.model:
            changes["model"] = chosen.model
        if self.config.queue.engine_priority:  # vLLM --scheduling-policy priority: lower first
            changes["priority"] = round(exchange.classification.score * 100)
        return changes

    # -- the response ----------------------------------------------------------------------

    def response_started(self, exchange: Exchange, status: int, details: str = "") -> ResponsePlan:
        """Response headers arrived (from upstream, or Envoy's own reply): count the outcome,
        and decide whether the client gets them or an answer from the fallback pool."""
        exchange.upstream_status = status
        headers: list[tuple[str, str]] = []
        chosen = exchange.route
        if chosen is None or exchange.outcome is not Outcome.ADMITTED:
            return ResponsePlan(())
        streamed = exchange.request is not None and exchange.request.stream
        self.metrics.upstream_status.labels(chosen.pool, f"{status // 100}xx").inc()
        failed = is_failure(status)
        now = self.clock()
        if not failed:
            self.on_first_byte(chosen.pool, exchange.classification.class_name, now - exchange.arrived_at)
        self.control.record(chosen.pool, failed, chosen.probe, failure_kind(status, details))
        headers.append((QUEUE_WAIT_HEADER, str(round(exchange.queue_wait_s * 1000))))
        if failed:
            exchange.failed_in = chosen.pool
            if self._may_fail_over(exchange):  # if the fallback cannot answer, these headers stand
                return ResponsePlan(tuple(headers), fail_over=True, finished=not streamed)
        self._first_byte(exchange, now)
        if chosen.rerouted:
            headers.append((FALLBACK_HEADER, "true"))
        if exchange.shadowed:
            self.metrics.shadow_responses.labels("primary", f"{status // 100}xx").inc()
        read_body = exchange.shadowed and not failed and not streamed
        return ResponsePlan(tuple(headers), read_body=read_body, finished=not streamed and not read_body)

    def _may_fail_over(self, exchange: Exchange) -> bool:
        chosen = exchange.route
        return (
            self.config.retries.failover
            and self.relay is not None
            and chosen is not None
            and not chosen.rerouted
            and not exchange.failed_over
            and not self.draining
            and failover_route(chosen.pool, exchange.request.model if exchange.request else None,
                               self.config, self.view) is not None
        )

    def failover_hold_seconds(self, exchange: Exchange) -> int:
        wait = max(0.0, self._remaining_wait(exchange))
        return math.ceil(min(wait + self.config.relay.timeout_s + _HOLD_MARGIN_S,
                             self.config.limits.max_message_timeout_s))

    async def fail_over(self, exchange: Exchange) -> HttpReply | None:
        """Try a failed attempt once more on the fallback pool, within the fallback pool's own
        admission; the answer replaces the failure. None: nothing better, pass the failure on."""
        reply = await self._answer_from_fallback(exchange)
        self._first_byte(exchange, self.clock())  # the client gets the fallback's answer, or the failure
        return reply

    async def _answer_from_fallback(self, exchange: Exchange) -> HttpReply | None:
        assert exchange.route is not None and exchange.request is not None and self.relay is not None
        home = exchange.route.pool
        exchange.failed_over = True
        await self._release(exchange, "failed_over")  # the failed backend is done with it
        target = failover_route(home, exchange.request.model, self.config, self.view)
        if target is None:
            self.metrics.failovers.labels(home, "", "no_pool").inc()
            return None
        ticket = self._ticket(exchange, target.pool, exchange.classification.score,
                              exchange.lease.ticket.cost if exchange.lease else 0, "failover")
        try:
            result = await self.store.enqueue(target.pool, ticket)
            lease = result if isinstance(result, Lease) else await self.store.wait(result, self._remaining_wait(exchange))
        except (WaitExpired, StoreClosed, Rejection):
            self.metrics.failovers.labels(home, target.pool, "no_capacity").inc()
            return None
        exchange.route = target
        exchange.lease = self._granted(lease)
        self.holding.add(exchange.id)
        self.metrics.rerouted.labels(home, target.pool, "failover").inc()
        body = rewritten(exchange.request, **self._body_changes(exchange, target))
        answer = await self.relay.send(exchange.path, self.config.pools[target.pool].cluster, body,
                                       self._relay_headers(exchange))
        await self._release(exchange, "failover_completed" if answer.status is not None else "relay_failed")
        failed = answer.status is None or is_failure(answer.status)
        if answer.status is not None:
            self.control.record(target.pool, failed, None, failure_kind(answer.status, answer.error))
        elif answer.timed_out:  # the fallback did not answer within relay.timeout_s
            self.control.record(target.pool, True, None, "timeout")
        # Otherwise the relay listener itself was unreachable: nothing the pool did.
        self.metrics.failovers.labels(home, target.pool, "answered" if not failed else "failed").inc()
        if failed:  # the client gets the first failure, which Envoy words as an OpenAI error
            return None
        exchange.upstream_status = answer.status
        headers = (*answer.headers, (FALLBACK_HEADER, "true"),
                   (QUEUE_WAIT_HEADER, str(round(exchange.queue_wait_s * 1000))))
        return HttpReply(answer.status, headers, answer.body)

    def _relay_headers(self, exchange: Exchange) -> dict[str, str]:
        return {PRIORITY_HEADER: f"{exchange.classification.score:g}", CLASS_HEADER: exchange.classification.class_name}

    def response_body(self, exchange: Exchange, body: bytes) -> None:
        """The whole body of a shadowed non-streamed response: count its tokens."""
        tokens = completion_tokens(body)
        if tokens is not None:
            self.metrics.shadow_tokens.labels("primary").inc(tokens)

    async def close(self, exchange: Exchange) -> None:
        """The exchange is over, however it ended: release its slot exactly once.

        Who ended it is told by what Envoy sent, never by how the stream closed (a reset or a
        half-close says nothing: tests/test_envoy_stream.py). Envoy turns every upstream failure
        before the response (connect failure, reset, timeout, no healthy host, overflow) into
        response headers of its own, which `response_started` counts; an exchange that ends
        without response headers was ended by its client (or by Envoy going away), so it is a
        cancellation, never an upstream failure: it cannot move a breaker.

        Envoy resets the stream when an exchange ends, which may cancel the task running this
        at any await: the release is handed over before the first one, and what follows it
        (the attempt ledger, a probe permit) runs in a task of its own."""
        route_ = exchange.route
        if exchange.waiter is not None:  # in line, and the stream closed before it waited
            self.store.withdraw(exchange.waiter)
            exchange.waiter = None
        if exchange.outcome is None:  # the client left before a decision: in line, or before it
            exchange.outcome = Outcome.CANCELLED_CLIENT_GONE
            exchange.queue_wait_s = self.clock() - exchange.arrived_at
            self._count(exchange)
            self._cancelled(exchange, "queued" if route_ is not None else "arriving")
        give_back_probe = False
        if exchange.outcome is Outcome.ADMITTED and route_ is not None and exchange.upstream_status is None:
            self._cancelled(exchange, "before_response")
            give_back_probe = route_.probe is ProbeKind.HALF_OPEN
        if exchange.shadowed and exchange.upstream_status is not None:
            self.metrics.shadow_latency.labels("primary").observe(time.monotonic() - exchange.started_monotonic)
        if exchange.upstream_status is None:
            end = "client_gone"
        elif exchange.upstream_status >= 500:
            end = "upstream_error"
        else:
            end = "completed"
        if exchange.outcome is Outcome.ADMITTED:
            self._finished(exchange, end)
        finish_key = exchange.key if exchange.attempt_begun else None
        exchange.attempt_begun = False
        if finish_key is not None or give_back_probe:
            self._in_background(self._after_close(route_, finish_key, exchange.failed_in, give_back_probe))
        await self._release(exchange, end)  # the first await: nothing above may suspend

    def _cancelled(self, exchange: Exchange, phase: str) -> None:
        """A client left before its response: where it was (arriving, queued, before_response)."""
        self.metrics.client_cancelled.labels(exchange.pool or "", exchange.classification.class_name, phase).inc()

    async def _after_close(self, route_: Route | None, key: str | None, failed_in: str | None, probe: bool) -> None:
        if key is not None:
            await self.control.finish_attempt(key, failed_in)
        if probe and route_ is not None:
            await self.control.return_probe(route_.pool)

    def _in_background(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _granted(self, lease: Lease) -> Lease:
        self.metrics.slots_admitted.labels(lease.pool).inc()
        return lease

    async def _release(self, exchange: Exchange, end: str) -> None:
        lease = exchange.lease
        self.holding.discard(exchange.id)
        if lease is None or lease.released:
            return
        await self._release_lease(lease, end)

    async def _release_lease(self, lease: Lease, end: str) -> None:
        self.metrics.released.labels(lease.pool, end).inc()
        if self.picker is not None:
            self.picker.release(lease.ticket.id)
        # Envoy resets the gRPC stream as soon as the exchange is over, which may cancel the
        # task running this; every store hands the release over before it first suspends.
        await self.store.release(lease)

    async def drain(self) -> None:
        """Stop admitting: new requests and everyone in line get 503 with retry-after."""
        self.draining = True
        self.metrics.serving.set(0)
        await self.store.close()

    # -- shadow copies ---------------------------------------------------------------------

    def _start_shadow(self, exchange: Exchange) -> None:
        assert exchange.request is not None
        target = shadow_route(exchange.request.model, self.config, self.view)
        pool = target.pool if target else (self.config.shadow.pool or "")
        if target is None:
            self.metrics.shadow_copies.labels(pool, "unavailable").inc()
            return
        limit = max(1, int(self.config.pools[pool].max_inflight * self.config.shadow.max_share))
        if self._shadows_running[pool] >= limit:
            self.metrics.shadow_copies.labels(pool, "no_room").inc()
            return
        exchange.shadowed = True
        self._shadows_running[pool] += 1
        body = rewritten(exchange.request, **self._body_changes(exchange, target, stream=False))
        cost = exchange.lease.ticket.cost if exchange.lease else 0
        ticket = self._ticket(exchange, pool, self._lowest_score(), cost, SHADOW_CLASS)
        self._in_background(self._shadow(exchange, target, ticket, body))

    def _lowest_score(self) -> float:
        return max(c.base for c in self.config.classes.values()) + 1.0

    async def _shadow(self, exchange: Exchange, target: Route, ticket: Ticket, body: bytes) -> None:
        """Run a shadow copy only in free room: it never waits in line, so it never delays a
        real request; it is answered by the target pool and compared, never returned."""
        pool = target.pool
        lease: Lease | None = None
        try:
            result = await self.store.enqueue(pool, ticket)
            if isinstance(result, Waiter):
                try:
                    result = await self.store.wait(result, 0)  # leaves the line at once
                except (WaitExpired, StoreClosed):
                    self.metrics.shadow_copies.labels(pool, "no_room").inc()
                    return
            lease = self._granted(result)
            self.metrics.shadow_copies.labels(pool, "sent").inc()
            headers = {PRIORITY_HEADER: f"{ticket.score:g}", CLASS_HEADER: SHADOW_CLASS}
            answer: RelayAnswer = await self.relay.send(  # type: ignore[union-attr]
                exchange.path, self.config.pools[pool].cluster, body, headers)
            status_class = "none" if answer.status is None else f"{answer.status // 100}xx"
            self.metrics.shadow_responses.labels("shadow", status_class).inc()
            self.metrics.shadow_latency.labels("shadow").observe(answer.seconds)
            tokens = answer.completion_tokens()
            if tokens is not None and exchange.request is not None and not exchange.request.stream:
                self.metrics.shadow_tokens.labels("shadow").inc(tokens)
            if answer.status is not None:
                self.control.record(pool, is_failure(answer.status), None, failure_kind(answer.status, answer.error))
        except Exception as error:  # a shadow never disturbs anything else
            log.warning("shadow copy failed: %s", error or type(error).__name__)
        finally:
            self._shadows_running[pool] -= 1
            if lease is not None:
                await self._release_lease(lease, "shadow")

    # -- bookkeeping -----------------------------------------------------------------------

    def _retry_after(self, floor_s: int, pool: str | None) -> int:
        drain = None
        if pool is not None:
            drain = self._drain[pool].seconds_to_drain(self.store.depth(pool))
        return retry_after_s(floor_s, drain, self.config.retry_after_s, self.rng)

    def _refusal(self, chosen: Route) -> Rejection:
        outcome = chosen.refusal
        assert outcome is not None
        if outcome in (Outcome.SHED_OVERLOADED, Outcome.SHED_QUEUE_FULL):
            return Rejection(outcome, f"The {chosen.pool} pool is overloaded; retry later.",
                             self._retry_after(self.config.retry_after_s.overloaded, chosen.pool))
        if outcome is Outcome.REJECTED_NO_PAIRED_MODEL:
            return Rejection(outcome, f"The {chosen.home} pool is failing and the {chosen.pool} pool has no "
                             "model paired with the requested one; retry later.",
                             self._retry_after(self.config.retry_after_s.unavailable, None))
        breaker = self.control.breakers[chosen.home]
        opens_in = max(0.0, breaker.state.open_until - self.control.clock())
        return Rejection(outcome, f"The {chosen.home} pool is failing and no fallback pool can take the "
                         "request; retry later.",
                         retry_after_s(self.config.retry_after_s.unavailable, opens_in or None,
                                       self.config.retry_after_s, self.rng))

    def _draining(self) -> Rejection:
        return Rejection(
            Outcome.REJECTED_DRAINING,
            "This gateway instance is shutting down; retry.",
            self._retry_after(self.config.retry_after_s.draining, None),
        )

    def _admitted(self, exchange: Exchange) -> None:
        self.holding.add(exchange.id)
        exchange.outcome = Outcome.ADMITTED
        exchange.admitted_at = self.clock()
        exchange.queue_wait_s = exchange.admitted_at - exchange.arrived_at
        if self.picker is not None and exchange.lease is not None:
            lease = exchange.lease
            exchange.endpoints = self.picker.pick(lease.pool, lease.ticket.id, lease.ticket.cost)
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
        exchange.decision = self._record(exchange, exchange.outcome.value)

    def refused(self, exchange: Exchange | None, rejection: Rejection) -> dict | None:
        """The decision record of a request answered with `rejection`, counted and recorded
        exactly once (a refusal the gate already counted, or one the sidecar itself failed on),
        so it is never missing from the metrics and the decision log."""
        if exchange is None:
            return self.count_rejection("unclassified", rejection)
        if exchange.outcome is None:
            exchange.outcome = rejection.outcome
            self._count(exchange)
        return exchange.decision

    def count_rejection(self, class_name: str, rejection: Rejection) -> dict:
        """Count and record a rejection that happened before an Exchange existed (bad headers, 401)."""
        self.metrics.outcomes.labels(class_name, rejection.outcome.value).inc()
        return self._record(None, rejection.outcome.value, class_name)

    def _first_byte(self, exchange: Exchange, now: float) -> None:
        """The client is about to get response headers."""
        self.metrics.first_byte.labels(exchange.pool, exchange.classification.class_name).observe(
            now - exchange.arrived_at)

    def _finished(self, exchange: Exchange, end: str) -> None:
        """An admitted exchange is over: its duration, and a `released` line in the log."""
        seconds = self.clock() - exchange.arrived_at
        self.metrics.duration.labels(exchange.pool, exchange.classification.class_name).observe(seconds)
        if self._logging_decisions():  # a release is only logged: no record to build when the log is off
            self._record(exchange, "released", decision=False,
                         extra={"end": end, "status": exchange.upstream_status, "duration_ms": round(seconds * 1000)})

    def _logging_decisions(self) -> bool:
        return self.config.logging.decisions and decision_log.isEnabledFor(logging.INFO)

    def _record(self, exchange: Exchange | None, outcome: str, class_name: str = "unclassified",
                decision: bool = True, extra: dict | None = None) -> dict:
        """The one place a record is built: a decision is kept in `recent_decisions`, a release
        only logged; either is written as one JSON line (docs/logs.md)."""
        if exchange is None:
            record = {"ts": time.time(), "request_id": None, "tenant": None, "pool": None, "class": class_name,
                      "branch": None, "outcome": outcome, "wait_ms": 0, "cost_tokens": None, "priority": None,
                      "client_request_id": None}
        else:
            c = exchange.classification
            record = {"ts": time.time(), "request_id": exchange.id, "tenant": c.tenant, "pool": exchange.pool,
                      "class": c.class_name, "branch": c.branch_id, "outcome": outcome,
                      "wait_ms": round(exchange.queue_wait_s * 1000), "cost_tokens": exchange.cost,
                      "priority": c.score, "client_request_id": exchange.key}
            if c.lowered:
                record["claims_lowered"] = list(c.lowered)
            if exchange.endpoints is not None:
                record["backend"] = exchange.endpoints.split(",", 1)[0]
        if extra:
            record.update(extra)
        if decision:
            self.recent_decisions.append(record)
        if self._logging_decisions():
            # handle() rather than info(): the same line, without looking up the caller's frame
            decision_log.handle(decision_log.makeRecord(
                decision_log.name, logging.INFO, __file__, 0, json.dumps(record, separators=(",", ":")), (), None))
        return record


class _StderrLines(logging.StreamHandler):
    """Each record's message as it is, one per line, on the process's stderr of the moment."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _route_decision_lines() -> None:
    """Decision lines are JSON as they are: unless the application gave the `extproc.decisions`
    logger a handler of its own, they go to stderr without the other lines' prefix."""
    if not decision_log.handlers:
        decision_log.addHandler(_StderrLines())
        decision_log.propagate = False
