"""Engines taken out before they go, pure: the loop that follows them is control/engine_drains.py.

An engine of a pool whose engines the sidecar picks (`capacity.pick_backend`) drains when
- an operator drains it (the admin API's DrainEngine, `extproc admin engine drain`), or
- it leaves the pool's engines: its address left a `dns://` name's answer (a Kubernetes pod
  terminating leaves its headless Service's answer at once, a scale-in first of all), or a
  reload no longer lists it.

A draining engine gets no new request: the sidecar names it to Envoy for none, and it leaves the
pool's budget and count. The requests it runs finish there. Its state, from what this replica
placed there and still runs (`running`) and its deadline:
- draining: it runs requests, before its deadline;
- idle: it runs none: it may be stopped;
- overdue: its deadline passed and it still runs requests. Stopping it resets them: Envoy retries
  each whose response had not started on the next engine the sidecar named (the pool's others),
  and the sidecar fails over to the fallback pool what Envoy could not retry; a failure there is
  the drain's, never counted by the pool's breaker.

Each drain is counted once (`Ending`), by how it ended first: `idle` (it ran its last request
before its deadline), `deadline` (its deadline came while it still ran requests) or `cancelled`
(undrained, or its address came back, before either). An engine gone from the pool's engines
stays listed until its deadline (it is idle by then, or overdue until its requests end); one an
operator drained stays until undrained or gone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import Field

from .pool_config import StrictModel, backend_endpoint

OPERATOR, REMOVED = "operator", "removed"  # who began a drain
DRAINING, IDLE, OVERDUE = "draining", "idle", "overdue"  # a drain's state now
ENDED_IDLE, ENDED_DEADLINE, ENDED_CANCELLED = "idle", "deadline", "cancelled"  # how one ended (counted once)
REASONS, RESULTS = (OPERATOR, REMOVED), (ENDED_IDLE, ENDED_DEADLINE, ENDED_CANCELLED)
STATES = (DRAINING, IDLE, OVERDUE)


class EngineDrainSettings(StrictModel):
    """How long a draining engine may run what it holds (docs/configuration.md#draining-engines)."""

    # as the engines' terminationGracePeriodSeconds: when the kubelet stops a pod that left its Service
    deadline_s: float = Field(120.0, gt=0)


class DrainRefused(Exception):
    """An operator's drain or undrain that cannot be done; the message says why. `missing`: the
    pool or the engine named is not there (else: it is, but cannot be drained or undrained)."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


@dataclass
class Drain:
    endpoint: str  # IP:PORT, as Envoy's hosts and the sidecar's picks name it
    reason: str  # OPERATOR or REMOVED
    began_at: float
    deadline: float
    gone: bool = False  # no longer one of the pool's engines
    ended: str | None = None  # how it was counted (None: not yet)

    def state(self, requests: int, now: float) -> str:
        if requests <= 0:
            return IDLE
        return OVERDUE if now >= self.deadline else DRAINING


@dataclass(frozen=True)
class DrainView:
    """One draining engine, as `extproc admin state` and the queue page show it."""

    engine: str
    reason: str
    state: str
    requests: int  # placed there by this replica, still running
    tokens: int
    for_s: float  # since the drain began
    deadline_in_s: float  # negative: overdue by as much
    gone: bool  # left the pool's engines (its name no longer answers with it)


@dataclass(frozen=True)
class Ending:
    pool: str
    engine: str
    reason: str
    result: str  # ENDED_IDLE, ENDED_DEADLINE or ENDED_CANCELLED


def endpoints(urls: Iterable[str]) -> frozenset[str]:
    """The IP:PORT of each engine's base URL (those that name one)."""
    return frozenset(e for url in urls if (e := backend_endpoint(url)) is not None)


def serving(urls: Iterable[str], draining: frozenset[str]) -> tuple[str, ...]:
    """The engines (base URLs) that take new requests: those not draining."""
    return tuple(url for url in urls if backend_endpoint(url) not in draining)


class EngineDrains:
    """The draining engines of every pool."""

    def __init__(self) -> None:
        self._drains: dict[str, dict[str, Drain]] = {}  # pool -> endpoint -> its drain
        self._known: dict[str, frozenset[str]] = {}  # pool -> its engines at the last `follow`
        self._draining: dict[str, frozenset[str]] = {}  # pool -> the endpoints draining (read on every pick)

    def draining(self, pool: str) -> frozenset[str]:
        """The endpoints of `pool` that get no new request."""
        return self._draining.get(pool, frozenset())

    def drains(self, pool: str) -> tuple[Drain, ...]:
        return tuple(self._drains.get(pool, {}).values())

    def drain(self, pool: str, engines: frozenset[str], endpoint: str, now: float, deadline_s: float) -> Drain:
        """An operator drains `endpoint`, one of the pool's `engines`; again: its deadline is
        `deadline_s` from now. Raises DrainRefused for an engine the pool does not have, or the
        last one that takes requests (the pool would have none)."""
        drains = self._drains.setdefault(pool, {})
        if endpoint not in engines and endpoint not in drains:
            raise DrainRefused(f"pool {pool} has no engine {endpoint} (its engines: "
                               f"{', '.join(sorted(engines)) or 'none'})", missing=True)
        existing = drains.get(endpoint)
        if existing is None and not engines - self.draining(pool) - {endpoint}:
            raise DrainRefused(f"{endpoint} is the last engine of pool {pool} that takes requests: "
                               "drained, the pool would have none")
        if existing is not None:  # already draining: a new deadline
            existing.deadline = now + deadline_s
            return existing
        drain = drains[endpoint] = Drain(endpoint, OPERATOR, now, now + deadline_s, gone=endpoint not in engines)
        self._changed(pool)
        return drain

    def undrain(self, pool: str, endpoint: str) -> Ending | None:
        """An operator takes `endpoint` back: it gets requests again (the Ending to count, if its
        drain was not counted yet). Raises DrainRefused when it is not drained, or is gone."""
        drain = self._drains.get(pool, {}).get(endpoint)
        if drain is None:
            raise DrainRefused(f"{endpoint} of pool {pool} is not draining", missing=True)
        if drain.gone:
            raise DrainRefused(f"{endpoint} left pool {pool}'s engines: it cannot take requests again")
        return self._end(pool, drain, ENDED_CANCELLED)

    def follow(self, pool: str, engines: frozenset[str], running: Mapping[str, tuple[int, int]], now: float,
               deadline_s: float) -> list[Ending]:
        """The pool's engines now (`engines`, IP:PORT), and what this replica placed on each and
        still runs there (`running`: requests, tokens): an engine gone since the last call
        drains; one back is an engine again; each drain's first idle or overdue moment is
        counted; a gone engine's drain is forgotten once it is idle past its deadline."""
        known = self._known.get(pool)
        self._known[pool] = engines
        drains = self._drains.setdefault(pool, {})
        endings: list[Ending] = []
        for endpoint in sorted((known or frozenset()) - engines):
            drain = drains.get(endpoint)
            if drain is None:
                drains[endpoint] = Drain(endpoint, REMOVED, now, now + deadline_s, gone=True)
            else:
                drain.gone = True
        for drain in list(drains.values()):
            if drain.gone and drain.endpoint in engines:  # back in the name's answer
                if drain.reason == REMOVED:
                    endings += [e for e in [self._end(pool, drain, ENDED_CANCELLED)] if e is not None]
                    continue
                drain.gone = False
            state = drain.state(running.get(drain.endpoint, (0, 0))[0], now)
            if drain.ended is None and state != DRAINING:
                drain.ended = ENDED_IDLE if state == IDLE else ENDED_DEADLINE
                endings.append(Ending(pool, drain.endpoint, drain.reason, drain.ended))
            if drain.gone and state == IDLE and now >= drain.deadline:
                del drains[drain.endpoint]
        self._changed(pool)
        return endings

    def views(self, pool: str, running: Mapping[str, tuple[int, int]], now: float) -> tuple[DrainView, ...]:
        views = []
        for drain in sorted(self._drains.get(pool, {}).values(), key=lambda d: (d.began_at, d.endpoint)):
            requests, tokens = running.get(drain.endpoint, (0, 0))
            views.append(DrainView(drain.endpoint, drain.reason, drain.state(requests, now), requests, tokens,
                                   now - drain.began_at, drain.deadline - now, drain.gone))
        return tuple(views)

    def _end(self, pool: str, drain: Drain, result: str) -> Ending | None:
        del self._drains[pool][drain.endpoint]
        self._changed(pool)
        return Ending(pool, drain.endpoint, drain.reason, result) if drain.ended is None else None

    def _changed(self, pool: str) -> None:
        self._draining[pool] = frozenset(self._drains.get(pool, {}))
