"""What the gate decided, told once: each decision's record (sent to Envoy as dynamic metadata,
docs/logs.md) built here, and every decision, rerouting, client gone, first byte and ending
emitted as an event (core/events.py) for whoever subscribed: the metrics, the decision log,
the queue page, the capacity model, the latency limiter (server.py wires them)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..core.events import (ClaimsLowered, ClientLeft, DecisionTimed, FirstByte, JoinedLine, Observers,
                           RequestDecided, RequestFinished, Rerouted, UpstreamAnswered)
from ..core.outcomes import Outcome, Rejection
from .exchange import Exchange


class Decisions:
    def __init__(self, observers: Observers | None = None, wall_clock: Callable[[], float] = time.time):
        self.observers = observers or Observers()  # who hears each decision, first byte and end (core/events.py)
        self._emit = self.observers.emit
        self._wall_clock = wall_clock

    # -- outcomes ------------------------------------------------------------------------------

    def count(self, exchange: Exchange) -> None:
        """Record the exchange's outcome (its decision record) and tell it, once."""
        outcome = exchange.outcome
        assert outcome is not None
        exchange.decision = record = self._record(exchange, outcome._value_)  # (`value` is a descriptor)
        route = exchange.route
        self._emit(RequestDecided(exchange.class_name, outcome, exchange.pool, route.home if route is not None else None,
                                  not exchange.attempt.age_s, exchange.queue_wait_s, record, exchange.classification))

    def count_rejection(self, class_name: str, rejection: Rejection) -> dict:
        """Record and tell a rejection that happened before an Exchange existed (bad headers, 401)."""
        record = self._record(None, rejection.outcome.value, class_name)
        self._emit(RequestDecided(class_name, rejection.outcome, None, None, True, 0.0, record))
        return record

    def queued(self, exchange: Exchange) -> None:
        """No slot fitted it: it joined its pool's line."""
        assert exchange.pool is not None
        self._emit(JoinedLine(exchange.pool, exchange.class_name))

    def cancelled(self, exchange: Exchange, phase: str) -> None:
        """A client left before its response: where it was (arriving, queued, before_response)."""
        self._emit(ClientLeft(exchange.pool or "", exchange.class_name, phase))

    def rerouted(self, exchange: Exchange) -> None:
        """Routed away from its home pool (breaker, degrade, canary, long prompt...)."""
        chosen = exchange.route
        assert chosen is not None
        self._emit(Rerouted(exchange.class_name, chosen.home, chosen.pool, chosen.reason or ""))

    def answered(self, pool: str, status: int) -> None:
        """Response headers arrived from `pool` (its backend's, or Envoy's own)."""
        self._emit(UpstreamAnswered(pool, status))

    def claims_lowered(self, exchange: Exchange) -> None:
        self._emit(ClaimsLowered(exchange.classification.lowered))

    # -- timings -------------------------------------------------------------------------------

    def first_byte(self, exchange: Exchange, now: float, succeeded: bool) -> None:
        """The client is about to get response headers; `succeeded`: its pool's upstream answered
        with no failure (a failure passed on, or answered from the fallback, did not)."""
        admitted = exchange.outcome is Outcome.ADMITTED
        self._emit(FirstByte(exchange.pool or "", exchange.class_name, now - exchange.arrived_at,
                             now - exchange.admitted_at if admitted else None, succeeded))

    def finished(self, exchange: Exchange, end: str, now: float) -> None:
        """An admitted exchange is over: how it ended, where, and the record of its admission."""
        self._emit(RequestFinished(exchange.pool or "", exchange.class_name, end, now - exchange.arrived_at,
                                   now - exchange.admitted_at, exchange.cost, exchange.upstream_status,
                                   exchange.decision, exchange.classification))

    def decided_in(self, seconds: float) -> None:
        self._emit(DecisionTimed(seconds))

    # -- the record ----------------------------------------------------------------------------

    def _record(self, exchange: Exchange | None, outcome: str, class_name: str = "unclassified") -> dict:
        """The one place a decision record is built (docs/logs.md): never changed once built."""
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
        return record
