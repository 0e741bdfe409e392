"""What the gate decided, counted and written down, in one place: each outcome's metrics, the
decision record (kept for the live queue page and logged as one JSON line, docs/logs.md), and
the record of a release."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from collections.abc import Callable

from ..core.outcomes import Outcome, Rejection
from ..ops.decision_log import DecisionLogWriter
from ..ops.metrics import Metrics
from .exchange import Exchange

# One JSON object per line and per decision (docs/logs.md).
decision_log = logging.getLogger("extproc.decisions")
RECENT_DECISIONS = 200  # kept in memory for the live queue page
_encode_line = json.JSONEncoder(separators=(",", ":")).encode  # built once: json.dumps builds one per call
# The outcomes of a routed request that count as demand on its home pool (what the capacity
# model sizes the pool for): served, or turned away for want of room; not a malformed request.
DEMAND = frozenset({Outcome.ADMITTED, Outcome.SHED_OVERLOADED, Outcome.SHED_QUEUE_FULL, Outcome.EXPIRED_IN_QUEUE,
                    Outcome.DEFERRED, Outcome.REJECTED_PAST_DEADLINE, Outcome.REJECTED_UNAVAILABLE,
                    Outcome.CANCELLED_CLIENT_GONE})


class Decisions:
    def __init__(self, metrics: Metrics, enabled: Callable[[], bool], wall_clock: Callable[[], float] = time.time):
        self.metrics = metrics
        self._enabled = enabled  # config.logging.decisions, read at each decision (a reload may change it)
        self._wall_clock = wall_clock
        self.recent: deque[dict] = deque(maxlen=RECENT_DECISIONS)  # newest last
        self._cancelled: dict[str, Counter[str]] = {}  # pool -> phase -> clients that left, since start
        # The lines go to stderr off the event loop (ops/decision_log.py), unless the application
        # gave the `extproc.decisions` logger a handler of its own: then through logging.
        self.writer = None if decision_log.handlers else DecisionLogWriter(
            on_drop=metrics.decision_log_dropped.inc)
        # What the capacity model hears (control/capacity_watch.py; the server wires it): a first
        # attempt reached its home pool; a first byte came (pool, class, seconds since admission);
        # an admitted exchange completed (pool, class, seconds since admission, its cost).
        self.on_demand: Callable[[str, str], None] = lambda pool, class_name: None
        self.on_response: Callable[[str, str, float], None] = lambda pool, class_name, seconds: None
        self.on_served: Callable[[str, str, float, int | None], None] = lambda pool, class_name, seconds, cost: None

    # -- outcomes ------------------------------------------------------------------------------

    def count(self, exchange: Exchange) -> None:
        """Count the exchange's outcome and make it the latest decision record."""
        assert exchange.outcome is not None
        self.metrics.outcomes.labels(exchange.class_name, exchange.outcome.value).inc()
        exchange.decision = self._record(exchange, exchange.outcome.value)
        if exchange.route is not None and not exchange.attempt.age_s and exchange.outcome in DEMAND:
            self.on_demand(exchange.route.home, exchange.class_name)

    def admitted(self, exchange: Exchange) -> None:
        self.count(exchange)
        self.metrics.queue_wait.labels(exchange.pool, exchange.class_name).observe(exchange.queue_wait_s)

    def rejected(self, exchange: Exchange) -> None:
        self.count(exchange)
        if exchange.outcome is Outcome.EXPIRED_IN_QUEUE and exchange.pool is not None:
            self.metrics.queue_wait.labels(exchange.pool, exchange.class_name).observe(exchange.queue_wait_s)

    def refused(self, exchange: Exchange | None, rejection: Rejection) -> dict | None:
        """The decision record of a request answered with `rejection`, counted and recorded
        exactly once (a refusal the gate already counted, or one the sidecar itself failed on),
        so it is never missing from the metrics and the decision log."""
        if exchange is None:
            return self.count_rejection("unclassified", rejection)
        if exchange.outcome is None:
            exchange.outcome = rejection.outcome
            self.count(exchange)
        return exchange.decision

    def count_rejection(self, class_name: str, rejection: Rejection) -> dict:
        """Count and record a rejection that happened before an Exchange existed (bad headers, 401)."""
        self.metrics.outcomes.labels(class_name, rejection.outcome.value).inc()
        return self._record(None, rejection.outcome.value, class_name)

    def cancelled(self, exchange: Exchange, phase: str) -> None:
        """A client left before its response: where it was (arriving, queued, before_response)."""
        pool = exchange.pool or ""
        self.metrics.client_cancelled.labels(pool, exchange.class_name, phase).inc()
        self._cancelled.setdefault(pool, Counter())[phase] += 1

    def cancelled_in(self, pool: str) -> dict[str, int]:
        """Clients that left before their response since start, by phase (the queue page's)."""
        return dict(self._cancelled.get(pool, {}))

    def rerouted(self, exchange: Exchange) -> None:
        """Routed away from its home pool (breaker, degrade, canary, long prompt...)."""
        chosen = exchange.route
        assert chosen is not None
        self.metrics.rerouted.labels(chosen.home, chosen.pool, chosen.reason or "").inc()
        if chosen.reason == "degraded":
            self.metrics.degraded.labels(exchange.class_name, chosen.pool).inc()

    def answered(self, pool: str, status: int) -> None:
        """Response headers arrived from `pool` (its backend's, or Envoy's own)."""
        self.metrics.upstream_status.labels(pool, f"{status // 100}xx").inc()

    def claims_lowered(self, exchange: Exchange) -> None:
        for what in exchange.classification.lowered:
            self.metrics.claims_lowered.labels(what).inc()

    # -- timings -------------------------------------------------------------------------------

    def first_byte(self, exchange: Exchange, now: float) -> None:
        """The client is about to get response headers."""
        self.metrics.first_byte.labels(exchange.pool, exchange.class_name).observe(now - exchange.arrived_at)
        if exchange.outcome is Outcome.ADMITTED:
            self.on_response(exchange.pool, exchange.class_name, now - exchange.admitted_at)

    def finished(self, exchange: Exchange, end: str, now: float) -> None:
        """An admitted exchange is over: its duration, and a `released` line in the log."""
        seconds = now - exchange.arrived_at
        self.metrics.duration.labels(exchange.pool, exchange.class_name).observe(seconds)
        if end == "completed":
            self.on_served(exchange.pool, exchange.class_name, now - exchange.admitted_at, exchange.cost)
        if self.logging():  # a release is only logged: no record to build when the log is off
            extra = {"end": end, "status": exchange.upstream_status, "duration_ms": round(seconds * 1000)}
            line = self._release_line(exchange, extra)
            if line is None:
                self._record(exchange, "released", decision=False, extra=extra)
            else:
                self._write(line)

    def decided_in(self, seconds: float) -> None:
        self.metrics.decision.observe(seconds)

    # -- the record ----------------------------------------------------------------------------

    def logging(self) -> bool:
        return self._enabled() and decision_log.isEnabledFor(logging.INFO)

    def _record(self, exchange: Exchange | None, outcome: str, class_name: str = "unclassified",
                decision: bool = True, extra: dict | None = None) -> dict:
        """The one place a record is built: a decision is kept in `recent`, a release only
        logged; either is written as one JSON line (docs/logs.md)."""
        if exchange is None:
            record = {"ts": self._wall_clock(), "request_id": None, "tenant": None, "pool": None,
                      "class": class_name, "branch": None, "outcome": outcome, "wait_ms": 0, "cost_tokens": None,
                      "priority": None, "client_request_id": None}
        else:
            c = exchange.classification
            record = {"ts": self._wall_clock(), "request_id": exchange.id, "tenant": c.tenant, "pool": exchange.pool,
                      "class": c.class_name, "branch": c.branch_id, "outcome": outcome,
                      "wait_ms": round(exchange.queue_wait_s * 1000), "cost_tokens": exchange.cost,
                      "priority": c.score, "client_request_id": exchange.attempt.key}
            if c.lowered:
                record["claims_lowered"] = list(c.lowered)
            if exchange.endpoints is not None:
                record["backend"] = exchange.endpoints.split(",", 1)[0]
            if exchange.forecast_wait_s is not None:
                record["forecast_wait_ms"] = round(exchange.forecast_wait_s * 1000)
            if exchange.attempt.age_s:
                record["since_first_attempt_ms"] = round(exchange.attempt.age_s * 1000)
        if extra:
            record.update(extra)
        if decision:
            self.recent.append(record)
        line = _encode_line(record) if self.logging() else None
        if decision and exchange is not None:
            exchange.decision_line = line  # (None when not written: the release is built from a record)
        if line is not None:
            self._write(line)
        return record

    def _release_line(self, exchange: Exchange, extra: dict) -> str | None:
        """The release line, made from the decision line already written: the same fields,
        another `ts` and outcome, the release's own at the end (None: make it from a record)."""
        line, decided = exchange.decision_line, exchange.decision
        if line is None or decided is None or decided["pool"] != exchange.pool:  # (a failover moved it)
            return None
        # The first `"outcome":"` is the key itself: a quote inside a string value is escaped.
        head, _, rest = line[line.index(","):-1].partition('"outcome":"')
        after_outcome = rest[rest.index('"') + 1:]
        return f'{{"ts":{self._wall_clock()!r}{head}"outcome":"released"{after_outcome},{_encode_line(extra)[1:]}'

    def _write(self, line: str) -> None:
        if self.writer is not None:
            self.writer.write(line)
        else:  # handle() rather than info(): the same line, without looking up the caller's frame
            decision_log.handle(decision_log.makeRecord(decision_log.name, logging.INFO, __file__, 0, line, (), None))

    def flush(self) -> None:
        """Write every decision line buffered so far (before the process ends, and for tests)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
