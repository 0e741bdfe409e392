"""What the gate decided, counted and written down, in one place: each outcome's metrics, the
decision record (kept for the live queue page and logged as one JSON line, docs/logs.md), and
the record of a release."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable

from ..core.events import FirstByte, Observers, RequestDecided, RequestFinished
from ..core.outcomes import Outcome, Rejection
from ..ops.decision_log import DecisionLines, DecisionLogWriter, encode_line as _encode_line
from ..ops.metrics import Metrics
from .exchange import Exchange

# One JSON object per line and per decision (docs/logs.md).
decision_log = logging.getLogger("extproc.decisions")
RECENT_DECISIONS = 200  # kept in memory for the live queue page


class Decisions:
    def __init__(self, metrics: Metrics, enabled: bool, observers: Observers | None = None,
                 wall_clock: Callable[[], float] = time.time):
        self.metrics = metrics
        self.observers = observers or Observers()  # who hears each decision, first byte and end (core/events.py)
        self.enabled = enabled  # config.logging.decisions: the gate sets it again when a reload changes it
        self._wall_clock = wall_clock
        self.recent: deque[dict] = deque(maxlen=RECENT_DECISIONS)  # newest last
        self._lines = DecisionLines()
        self._cancelled: dict[str, Counter[str]] = {}  # pool -> phase -> clients that left, since start
        # The lines go to stderr off the event loop (ops/decision_log.py), unless the application
        # gave the `extproc.decisions` logger a handler of its own: then through logging.
        self.writer = None if decision_log.handlers else DecisionLogWriter(
            on_drop=metrics.decision_log_dropped.inc)

    # -- outcomes ------------------------------------------------------------------------------

    def count(self, exchange: Exchange) -> None:
        """Count the exchange's outcome and make it the latest decision record."""
        assert exchange.outcome is not None
        outcome = exchange.outcome._value_  # (the enum's `value` is a descriptor: two calls a read)
        self.metrics.outcomes.labels(exchange.class_name, outcome).inc()
        exchange.decision = self._record(exchange, outcome)
        route = exchange.route
        self.observers.emit(RequestDecided(exchange.class_name, exchange.outcome, exchange.pool,
                                           route.home if route is not None else None,
                                           not exchange.attempt.age_s, exchange.queue_wait_s))

    def admitted(self, exchange: Exchange) -> None:
        self.count(exchange)
        self.metrics.queue_wait.labels(exchange.pool, exchange.class_name).observe(exchange.queue_wait_s)

    def rejected(self, exchange: Exchange) -> None:
        self.count(exchange)
        if exchange.outcome is Outcome.EXPIRED_IN_QUEUE and exchange.pool is not None:
            self.metrics.queue_wait.labels(exchange.pool, exchange.class_name).observe(exchange.queue_wait_s)

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

    def first_byte(self, exchange: Exchange, now: float, succeeded: bool) -> None:
        """The client is about to get response headers; `succeeded`: its pool's upstream answered
        with no failure (a failure passed on, or answered from the fallback, did not)."""
        since_arrival = now - exchange.arrived_at
        self.metrics.first_byte.labels(exchange.pool, exchange.class_name).observe(since_arrival)
        admitted = exchange.outcome is Outcome.ADMITTED
        self.observers.emit(FirstByte(exchange.pool or "", exchange.class_name, since_arrival,
                                      now - exchange.admitted_at if admitted else None, succeeded))

    def finished(self, exchange: Exchange, end: str, now: float) -> None:
        """An admitted exchange is over: its duration, and a `released` line in the log."""
        seconds = now - exchange.arrived_at
        self.metrics.duration.labels(exchange.pool, exchange.class_name).observe(seconds)
        self.observers.emit(RequestFinished(exchange.pool or "", exchange.class_name, end, seconds,
                                            now - exchange.admitted_at, exchange.cost))
        if self.logging():  # a release is only logged: no record to build when the log is off
            status, duration_ms = exchange.upstream_status, round(seconds * 1000)
            decided = exchange.decision
            if exchange.decision_logged and decided is not None and decided["pool"] == exchange.pool:
                # the decision's fields, another `ts` and outcome, the release's own at the end
                self._write(self._lines.release, decided, exchange.classification, self._wall_clock(), end,
                            status, duration_ms)
            else:  # (not logged when decided, or a failover moved it): from a record of its own
                self._record(exchange, "released", decision=False,
                             extra={"end": end, "status": status, "duration_ms": duration_ms})

    def decided_in(self, seconds: float) -> None:
        self.metrics.decision.observe(seconds)

    # -- the record ----------------------------------------------------------------------------

    def logging(self) -> bool:
        return self.enabled and decision_log.isEnabledFor(logging.INFO)

    def _record(self, exchange: Exchange | None, outcome: str, class_name: str = "unclassified",
                decision: bool = True, extra: dict | None = None) -> dict:
        """The one place a record is built: a decision is kept in `recent`, a release only
        logged; either is written as one JSON line (docs/logs.md)."""
        ts = self._wall_clock()
        if exchange is None:
            record = {"ts": ts, "request_id": None, "tenant": None, "pool": None,
                      "class": class_name, "branch": None, "outcome": outcome, "wait_ms": 0, "cost_tokens": None,
                      "priority": None, "client_request_id": None}
        else:
            c = exchange.classification
            record = {"ts": ts, "request_id": exchange.id, "tenant": c.tenant, "pool": exchange.pool,
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
        logged = self.logging()
        if decision and exchange is not None:
            exchange.decision_logged = logged  # (a release line repeats a decision line only if there is one)
        if logged:
            if exchange is not None and not extra:
                self._write(self._lines.line, record, exchange.classification)
            else:
                self._write(_encode_line, record)
        return record

    def _write(self, format_line: Callable[..., str], *args) -> None:
        """One line, `format_line(*args)`: formatted by the writer's thread as it writes it (a
        record is not changed once built), or here for the application's own handler."""
        if self.writer is not None:
            self.writer.write((format_line, args))
        else:  # handle() rather than info(): the same line, without looking up the caller's frame
            line = format_line(*args)
            decision_log.handle(decision_log.makeRecord(decision_log.name, logging.INFO, __file__, 0, line, (), None))

    def flush(self) -> None:
        """Write every decision line buffered so far (before the process ends, and for tests)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
