"""Engines taken out before they go, pure: the loop that follows them is control/engine_drains.py.

An engine of a pool whose engines the sidecar picks (`capacity.pick_backend`) drains when
- an operator drains it (the admin API's DrainEngine, `extproc admin engine drain`), or
- it leaves the pool's engines: its address left a `dns://` name's answer (a Kubernetes pod
  terminating leaves its headless Service's answer at once, a scale-in first of all), or a
  reload no longer lists it.

A draining engine gets no new request: the sidecar names it to Envoy for none, and it leaves the
pool's budget and count; what this replica still runs there is given back to both until it ends
(`drained_back`: the serving engines keep their whole room). The requests it runs finish there.
Envoy may still send it a request the sidecar did not name there (a retry once the named engines
failed: override_host then balances over every host of its cluster); the response says so
(Envoy's upstream.address), and the drain counts it (`landed`). Its state, from what this replica
placed there and still runs (`running`), what last ran there and its deadline:
- draining: it runs requests before its deadline, or ran or answered one less than `settle_s` ago;
- idle: it runs none, and nothing ran or answered there for `settle_s`: it may be stopped (as far
  as this replica knows: vLLM's own num_requests_running is the engine's word);
- overdue: its deadline passed and it still runs requests. Stopping it resets them: Envoy retries
  each whose response had not started on the next engine the sidecar named (the pool's others),
  and the sidecar fails over to the fallback pool what Envoy could not retry. A stopped engine's
  failure (`STOPPED_FAILURES`: a reset, a connection refused, a timeout) of a request placed on a
  draining engine, or last tried on one, is the drain's, never counted by the pool's breaker;
  a draining engine's own answer (a 5xx, a 429) is the pool's as any.

Each drain is counted once (`Ending`), by how it ended first: `idle` (it ran its last request
before its deadline), `deadline` (its deadline came while it still ran requests) or `cancelled`
(undrained, its address came back, or its pool stopped picking its engines, before either). An
engine gone from the pool's engines stays listed until its deadline (it is idle by then, or
overdue until its requests end); one an operator drained stays until undrained or gone. An
address that comes back after it was gone is a new engine (a new pod may take a deleted one's
address): whoever drained the old one, the drain ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from pydantic import Field

from .admission import PoolLimits
from .pool_config import StrictModel, backend_endpoint

OPERATOR, REMOVED = "operator", "removed"  # who began a drain
DRAINING, IDLE, OVERDUE = "draining", "idle", "overdue"  # a drain's state now
ENDED_IDLE, ENDED_DEADLINE, ENDED_CANCELLED = "idle", "deadline", "cancelled"  # how one ended (counted once)
REASONS, RESULTS = (OPERATOR, REMOVED), (ENDED_IDLE, ENDED_DEADLINE, ENDED_CANCELLED)
STATES = (DRAINING, IDLE, OVERDUE)
# The failures (core/breaker.failure_kind) of an engine stopped under its requests: it reset them,
# refused the connection, or never answered. An engine's own answer (a 5xx, a 429) is its own.
STOPPED_FAILURES = frozenset({"reset", "connect_failure", "timeout"})


class EngineDrainSettings(StrictModel):
    """How long a draining engine may run what it holds (docs/configuration.md#draining-engines)."""

    # as the engines' terminationGracePeriodSeconds: when the kubelet stops a pod that left its Service
    deadline_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    # idle only once nothing ran or answered there for this long (a retry Envoy sent there may be under way)
    settle_s: float = Field(5.0, ge=0, allow_inf_nan=False)


class DrainRefused(Exception):
    """An operator's drain or undrain that cannot be done; the message says why. `missing`: the
    pool or the engine named is not there; `invalid`: the request itself is malformed (an engine
    that is no IP:PORT, a deadline that is no finite number of seconds); else: it is there, but
    cannot be drained or undrained."""

    def __init__(self, message: str, missing: bool = False, invalid: bool = False):
        super().__init__(message)
        self.missing = missing
        self.invalid = invalid


@dataclass
class Drain:
    endpoint: str  # IP:PORT, as Envoy's hosts and the sidecar's picks name it
    reason: str  # OPERATOR or REMOVED
    began_at: float
    deadline: float
    gone: bool = False  # no longer one of the pool's engines
    ended: str | None = None  # how it was counted (None: not yet)
    busy_at: float | None = None  # when a request last ran or answered there (None: the drain's beginning)
    landed: int = 0  # requests Envoy ran there though the sidecar named it for none (since the drain began)

    def state(self, requests: int, now: float, settle_s: float = 0.0) -> str:
        if requests > 0:
            return OVERDUE if now >= self.deadline else DRAINING
        quiet_since = self.began_at if self.busy_at is None else self.busy_at
        return IDLE if now >= quiet_since + settle_s else DRAINING


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
    landed: int = 0  # requests Envoy ran there though the sidecar named it for none


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


def drained_back(limits: PoolLimits, requests: int, tokens: int, max_inflight: int) -> PoolLimits:
    """`limits`, read from the engines that take requests, with what this replica still runs on
    the pool's draining engines (`requests`, `tokens`) added back: those count in the pool's
    in-flight count and cost until they end, and must not take the serving engines' room. The
    count stays within the pool's `max_inflight`."""
    if requests <= 0 and tokens <= 0:
        return limits
    budget = None if limits.budget_tokens is None else limits.budget_tokens + max(0, tokens)
    return replace(limits, max_inflight=min(max_inflight, limits.max_inflight + max(0, requests)), budget_tokens=budget)


def deadline_refused(deadline_s: float) -> DrainRefused | None:
    """Why `deadline_s` cannot be a drain's deadline (None: it can): a finite number of seconds, above 0."""
    if math.isfinite(deadline_s) and deadline_s > 0:
        return None
    return DrainRefused(f"a drain's deadline is a finite number of seconds above 0, not {deadline_s!r}", invalid=True)


class EngineDrains:
    """The draining engines of every pool; `settle_s`: how long nothing must run or answer on a
    draining engine before it reads idle."""

    def __init__(self, settle_s: float = 0.0) -> None:
        self.settle_s = settle_s
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
        last one that takes requests (the pool would have none), or a deadline that is no finite
        number of seconds above 0."""
        if (refused := deadline_refused(deadline_s)) is not None:
            raise refused
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
        drains; one back is a new engine (its drain ends, cancelled); each drain's first idle or
        overdue moment is counted; a gone engine's drain is forgotten once it is idle past its
        deadline."""
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
            if drain.gone and drain.endpoint in engines:  # back in the name's answer: a new engine
                endings += [e for e in [self._end(pool, drain, ENDED_CANCELLED)] if e is not None]
                continue
            requests = running.get(drain.endpoint, (0, 0))[0]
            if requests > 0:
                drain.busy_at = now
            state = drain.state(requests, now, self.settle_s)
            if drain.ended is None and state != DRAINING:
                drain.ended = ENDED_IDLE if state == IDLE else ENDED_DEADLINE
                endings.append(Ending(pool, drain.endpoint, drain.reason, drain.ended))
            if drain.gone and state == IDLE and now >= drain.deadline:
                del drains[drain.endpoint]
        self._changed(pool)
        return endings

    def landed(self, pool: str, endpoint: str, now: float) -> Drain | None:
        """A request the sidecar did not name `endpoint` for answered from there (Envoy's
        upstream.address): if it drains, counted in its drain, whose settling starts again (its
        drain, if any)."""
        drain = self._drains.get(pool, {}).get(endpoint)
        if drain is not None:
            drain.landed += 1
            drain.busy_at = now if drain.busy_at is None else max(drain.busy_at, now)
        return drain

    def forget(self, pool: str) -> list[Ending]:
        """`pool` no longer picks its engines (a reload): its drains end, cancelled (those not
        counted yet), and what it had is forgotten (picking again, it starts afresh)."""
        drains = self._drains.pop(pool, {})
        self._known.pop(pool, None)
        self._draining.pop(pool, None)
        return [Ending(pool, d.endpoint, d.reason, ENDED_CANCELLED) for d in drains.values() if d.ended is None]

    def pools(self) -> frozenset[str]:
        """The pools this has seen (followed, or drained in)."""
        return frozenset(self._known) | frozenset(self._drains)

    def views(self, pool: str, running: Mapping[str, tuple[int, int]], now: float) -> tuple[DrainView, ...]:
        views = []
        for drain in sorted(self._drains.get(pool, {}).values(), key=lambda d: (d.began_at, d.endpoint)):
            requests, tokens = running.get(drain.endpoint, (0, 0))
            views.append(DrainView(drain.endpoint, drain.reason, drain.state(requests, now, self.settle_s), requests,
                                   tokens, now - drain.began_at, drain.deadline - now, drain.gone, drain.landed))
        return tuple(views)

    def _end(self, pool: str, drain: Drain, result: str) -> Ending | None:
        del self._drains[pool][drain.endpoint]
        self._changed(pool)
        return Ending(pool, drain.endpoint, drain.reason, result) if drain.ended is None else None

    def _changed(self, pool: str) -> None:
        self._draining[pool] = frozenset(self._drains.get(pool, {}))
