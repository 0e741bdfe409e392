"""What the request path tells the rest of the sidecar, as small frozen events, and the one list
of who hears them.

The gate emits each event once, where it happens: a request decided (admitted, refused, or its
client gone before a decision), its first byte on the way to the client, an admitted request
finished, a pool's queue-depth tier changed. The parts that learn from the request path (the
capacity model, the latency limiter, the scale-out webhook) subscribe in one place, the
composition root (server.py); tests subscribe a recorder and assert on what was emitted.

Handlers run synchronously on the request path, in the order they subscribed, and must be
quick. One that raises is a defect, logged with its traceback; it never reaches the request
path (an exception there could stop a release) nor keeps the other handlers from hearing.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .admission import Tier
from .outcomes import Outcome

log = logging.getLogger("extproc")


@dataclass(frozen=True, slots=True)
class RequestDecided:
    """A request's outcome was decided (counted once): admitted, refused, passed through, or its
    client gone before a decision. `home`: the pool its class goes to (None before routing);
    `first_attempt`: not a client's retry of an earlier attempt."""

    class_name: str
    outcome: Outcome
    pool: str | None
    home: str | None
    first_attempt: bool
    queue_wait_s: float


@dataclass(frozen=True, slots=True)
class FirstByte:
    """Response headers are on their way to the client (the pool's own, or the fallback's)."""

    pool: str
    class_name: str
    since_arrival_s: float  # the queue wait included
    since_admission_s: float | None  # None: not admitted (the gate reports admitted requests only, today)
    succeeded: bool  # not a failure that counts against the pool


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """An admitted request is over. `end`: completed, upstream_error or client_gone."""

    pool: str
    class_name: str
    end: str
    since_arrival_s: float
    since_admission_s: float
    cost: int | None  # the tokens it held


@dataclass(frozen=True, slots=True)
class TierChanged:
    """A pool's queue depth crossed into another tier (scale out, degrade, reject)."""

    pool: str
    old: Tier
    new: Tier
    depth: int


Event = RequestDecided | FirstByte | RequestFinished | TierChanged


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
