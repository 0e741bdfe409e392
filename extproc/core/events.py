"""What the request path tells the rest of the sidecar, as small immutable events, and the one
list of who hears them. (Each event is a named tuple: several are built for every request, and a
named tuple is built in about a quarter of a frozen dataclass's time.)

The gate emits each event once, where it happens: a request decided (admitted, refused, or its
client gone before a decision), joining a line, rerouted, its client gone, its response's first
byte, an admitted request finished, a pool's queue-depth tier changed; and what its parts did on
the way: an upstream outcome the breakers counted, a slot taken or given back, a long prompt's
wait for its lane, a pick Envoy followed or not, a failover, a retry judged, an appointment, a
shadow copy and the responses it compares.
Everything that learns from the request path subscribes in one place, the composition root
(server.py): the metrics (ops/request_metrics.py), the decision log (ops/decision_log.py), the
queue page's recent decisions (ops/state.py), the capacity model, the latency limiter, the
scale-out webhook. Tests subscribe a recorder and assert on what was emitted.

Handlers run synchronously on the request path, in the order they subscribed, and must be
quick. One that raises is a defect, logged with its traceback; it never reaches the request
path (an exception there could stop a release) nor keeps the other handlers from hearing.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .admission import Tier
from .outcomes import Outcome
from .priority import Classification

log = logging.getLogger("extproc")


class RequestDecided(NamedTuple):
    """A request's outcome was decided (counted once): admitted, refused, passed through, or its
    client gone before a decision. `home`: the pool its class goes to (None before routing);
    `first_attempt`: not a client's retry of an earlier attempt; `record`: the decision record
    (docs/logs.md), as Envoy gets it in dynamic metadata, never changed once built;
    `classification`: who asked, for what (None: refused before it was known)."""

    class_name: str
    outcome: Outcome
    pool: str | None
    home: str | None
    first_attempt: bool
    queue_wait_s: float
    record: Mapping[str, object]
    classification: Classification | None = None


class JoinedLine(NamedTuple):
    """No slot fitted the request when it arrived: it waits in its pool's line."""

    pool: str
    class_name: str


class Rerouted(NamedTuple):
    """A request goes to another pool than its home (breaker, probe_denied, retry, degraded,
    failover...)."""

    class_name: str
    home: str
    pool: str
    reason: str


class ClientLeft(NamedTuple):
    """A client left before its response: arriving (before its body was decided), queued (in
    line), or before_response (admitted). Never an upstream failure."""

    pool: str  # "" before routing
    class_name: str
    phase: str


class ClaimsLowered(NamedTuple):
    """The priority claims of a request cut down to what its caller may claim."""

    claims: tuple[str, ...]


class DecisionTimed(NamedTuple):
    """How long the gate took to decide on a request's body, its wait in line excluded."""

    seconds: float


class UpstreamAnswered(NamedTuple):
    """Response headers came from a pool (its backend's, or Envoy's own reply for it)."""

    pool: str
    status: int


class FirstByte(NamedTuple):
    """Response headers are on their way to the client (the pool's own, or the fallback's)."""

    pool: str
    class_name: str
    since_arrival_s: float  # the queue wait included
    since_admission_s: float | None  # None: not admitted (the gate reports admitted requests only, today)
    succeeded: bool  # not a failure that counts against the pool


class RequestFinished(NamedTuple):
    """An admitted request is over. `end`: completed, upstream_error, client_gone or yielded; `pool`: where
    it ended (its failover's pool, if it failed over); `decision`: the record of its admission."""

    pool: str
    class_name: str
    end: str
    since_arrival_s: float
    since_admission_s: float
    cost: int | None  # the tokens it held
    status: int | None = None  # the response status its client got (None: none came)
    decision: Mapping[str, object] | None = None
    classification: Classification | None = None


class TierChanged(NamedTuple):
    """A pool's queue depth crossed into another tier (scale out, degrade, reject)."""

    pool: str
    old: Tier
    new: Tier
    depth: int


class UpstreamCounted(NamedTuple):
    """A pool's breaker counted one upstream outcome (control/plane.py): `result` is success, or
    the failure's kind (core/breaker.failure_kind: http_5xx, connect_failure, reset...)."""

    pool: str
    result: str


class SlotLeased(NamedTuple):
    """This replica took a slot of `pool`: an admission, a failover attempt, a shadow copy."""

    pool: str


class SlotReleased(NamedTuple):
    """A slot of `pool` went back; `end`: how its exchange ended (completed, client_gone, refused
    (by the sidecar, after it took its slot), yielded, failed_over, failover_completed, relay_failed, shadow...)."""

    pool: str
    end: str


class LaneWaited(NamedTuple):
    """An admitted request waited for an engine it may start on: placed, timed_out (placed anyway),
    refused (a long prompt that would go beside latency-bound requests) or cancelled;
    `long`: a long prompt, for an engine of its own (core/long_lane.py); else a prompt of a class
    without a latency target, for its turn beside latency-bound requests (core/spill.py)."""

    pool: str
    result: str
    long: bool = True


class PaceWaited(NamedTuple):
    """An admitted prompt waited for its turn on the pool's prefill pace: started, cut_short
    (its wait ran out, or the sidecar drains) or cancelled."""

    pool: str
    result: str


class PickRan(NamedTuple):
    """A placed request answered: on the engine the sidecar named first (`followed`), or elsewhere."""

    pool: str
    followed: bool


class PicksJudged(NamedTuple):
    """Whether Envoy follows the sidecar's engine picks for `pool` was decided, or changed."""

    pool: str
    ignored: bool


class DrainedEngineFailed(NamedTuple):
    """A failure of an engine being drained or removed: the drain's, never the pool's breaker's."""

    pool: str


class FailedOver(NamedTuple):
    """A failed attempt from `home` was tried once more on the fallback, `pool` ("" when there was
    none), and how that ended: no_pool, no_capacity, answered or failed."""

    home: str
    pool: str
    result: str


class RetryJudged(NamedTuple):
    """A client's retry, judged: allowed, over_budget, in_progress, key_reused, too_many_attempts."""

    verdict: str


class AppointmentTold(NamedTuple):
    """A request turned away was told when to come back (given, with `delay_s`), given up
    (past_deadline), or held until the appointment it had (held)."""

    pool: str
    class_name: str
    result: str
    delay_s: float | None = None


class ShadowCopied(NamedTuple):
    """A request picked for a shadow copy to `pool`: sent, no_room (the shadow's share full, or no
    free room), unavailable (no pool to copy it to)."""

    pool: str
    result: str


class ShadowAnswered(NamedTuple):
    """A response compared: `side` primary (the request copied) or shadow (its copy); `status_class`
    2xx, 5xx... or none (the copy got no answer)."""

    side: str
    status_class: str


class ShadowTokens(NamedTuple):
    """The completion tokens of a compared response (`side`: primary or shadow), not streamed."""

    side: str
    tokens: int


class ShadowTimed(NamedTuple):
    """How long a compared response took (`side`: primary, from arrival; shadow, the relay's send)."""

    side: str
    seconds: float


Event = (RequestDecided | JoinedLine | Rerouted | ClientLeft | ClaimsLowered | DecisionTimed | UpstreamAnswered
         | FirstByte | RequestFinished | TierChanged | UpstreamCounted | SlotLeased | SlotReleased | LaneWaited
         | PaceWaited | PickRan | PicksJudged | DrainedEngineFailed | FailedOver | RetryJudged | AppointmentTold | ShadowCopied
         | ShadowAnswered | ShadowTokens | ShadowTimed)


class Observers:
    """Who hears which event: handlers by event type, called in the order they subscribed."""

    def __init__(self) -> None:
        self._handlers: dict[type, list[Callable[[Any], None]]] = defaultdict(list)

    def subscribe(self, kind: type, handler: Callable[[Any], None]) -> None:
        self._handlers[kind].append(handler)

    def emit(self, event: Event) -> None:
        for handler in self._handlers.get(type(event), ()):
            try:
                handler(event)
            except Exception:
                log.exception("an observer of %s failed (%r): the request goes on", type(event).__name__, handler)
