"""The draining engines, followed (core/engine_drain.py says what a drain is and does).

Every TICK_S the drains follow each picking pool's engines (the discovery's: its listed backends
and what its dns:// names resolve to) and what this replica placed on each and still runs there
(the engine picker's ledger): an engine gone from the pool drains, each drain's ending is counted
once, and the states are exported. An operator drains and undrains through `drain` and
`undrain` (the admin API); the capacity loop then runs at once (`on_change`), so the pool's
budget and count lose or regain the engine before the call returns.

It stands between the discovery and its readers: the engine picker reads every engine and those
draining (lifecycle/placement.PoolEngines: it names none of those for a new request), the
capacity loop the engines that take requests (`serving`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from ..core.config import Config
from ..core.engine_drain import (REASONS, RESULTS, STATES, DrainRefused, DrainView, EngineDrains, Ending,
                                 endpoints, serving)
from ..core.pool_config import backend_endpoint
from ..ops.metrics import Metrics

log = logging.getLogger("extproc.drains")
TICK_S = 0.25


class Engines(Protocol):
    def engines(self, pool: str) -> tuple[str, ...]: ...

    def changing(self, pool: str) -> bool: ...


class EngineDrainWatch:
    def __init__(self, config: Callable[[], Config], discovery: Engines, metrics: Metrics,
                 running: Callable[[str], Mapping[str, tuple[int, int]]] = lambda pool: {},
                 on_change: Callable[[], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._discovery = discovery
        self.metrics = metrics
        self.running = running  # (pool) -> endpoint -> (requests, tokens) this replica placed there, still running
        self.on_change = on_change  # after an operator's drain or undrain: the capacity loop's tick
        self.clock = clock
        self.drains = EngineDrains()
        self._task: asyncio.Task | None = None
        for pool in self._picking():
            for reason in REASONS:
                for result in RESULTS:
                    metrics.engine_drains.labels(pool, reason, result)
            self._export(pool, {})

    # -- the engines, as the picker and the capacity loop read them ------------------------------

    def engines(self, pool: str) -> tuple[str, ...]:
        """Every engine of the pool (base URLs), draining or not."""
        return self._discovery.engines(pool)

    def draining(self, pool: str) -> frozenset[str]:
        """The pool's draining engines (IP:PORT): no new request goes there."""
        return self.drains.draining(pool)

    def changing(self, pool: str) -> bool:
        """The pool's engines changed lately, or some drain: a request placed on an engine may
        run on another (a retry off a stopped one), which says nothing of whether Envoy follows."""
        return self._discovery.changing(pool) or bool(self.drains.draining(pool))

    def serving(self, pool: str) -> tuple[str, ...]:
        """The engines that take requests: probed, counted in the pool's budget and count."""
        engines = self._discovery.engines(pool)
        draining = self.drains.draining(pool)
        return serving(engines, draining) if draining else engines

    # -- an operator's ----------------------------------------------------------------------------

    async def drain(self, pool: str, engine: str, deadline_s: float | None = None) -> None:
        """Take `engine` ("IP:PORT", or its base URL) of `pool` out: it gets no new request,
        what it runs finishes, until `deadline_s` (the configured engine_drain.deadline_s when
        None). Raises DrainRefused."""
        endpoint = self._endpoint(pool, engine)
        config = self._config()
        deadline = deadline_s if deadline_s is not None else config.engine_drain.deadline_s
        self.drains.drain(pool, endpoints(self.engines(pool)), endpoint, self.clock(), deadline)
        log.warning("pool %s: engine %s drains (an operator's): no new request; %g s for what it runs", pool,
                    endpoint, deadline)
        await self._operated()

    async def undrain(self, pool: str, engine: str) -> None:
        """Take a drained `engine` back: it gets requests again. Raises DrainRefused."""
        endpoint = self._endpoint(pool, engine)
        ending = self.drains.undrain(pool, endpoint)
        log.warning("pool %s: engine %s undrained (an operator's): it takes requests again", pool, endpoint)
        self._count([ending] if ending else [])
        await self._operated()

    def _endpoint(self, pool: str, engine: str) -> str:
        config = self._config()
        if pool not in config.pools:
            raise DrainRefused(f"no pool named {pool!r}", missing=True)
        if not config.pools[pool].capacity.picks_backend:
            raise DrainRefused(f"pool {pool} does not pick its engines (capacity.pick_backend): Envoy's cluster "
                               "balances them; take the engine out of the cluster instead")
        endpoint = backend_endpoint(engine if "://" in engine else f"http://{engine}")
        if endpoint is None:
            raise DrainRefused(f"an engine is named IP:PORT, as `extproc admin state` shows it: {engine!r}")
        return endpoint

    async def _operated(self) -> None:
        self.follow()
        if self.on_change is not None:
            await self.on_change()

    # -- the loop ----------------------------------------------------------------------------

    def views(self, pool: str) -> tuple[DrainView, ...]:
        """The pool's draining engines now, with what each still runs."""
        if not self.drains.drains(pool):
            return ()
        return self.drains.views(pool, self.running(pool), self.clock())

    async def start(self) -> None:
        self.follow()  # the engines known at start: one gone later drains
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.follow()
            except Exception:  # (a cancellation is no Exception: it ends the loop)
                log.exception("following the draining engines failed")

    def follow(self) -> None:
        config = self._config()
        now = self.clock()
        for pool in self._picking():
            running = self.running(pool)
            self._count(self.drains.follow(pool, endpoints(self.engines(pool)), running, now,
                                           config.engine_drain.deadline_s))
            self._export(pool, running)

    def _picking(self) -> list[str]:
        return [name for name, pool in self._config().pools.items() if pool.capacity.picks_backend]

    def _count(self, endings: list[Ending]) -> None:
        for ending in endings:
            self.metrics.engine_drains.labels(ending.pool, ending.reason, ending.result).inc()
            how = {"idle": "idle: it may be stopped", "deadline": "past its deadline, still running requests",
                   "cancelled": "cancelled"}[ending.result]
            log.warning("pool %s: engine %s drain (%s) %s", ending.pool, ending.engine, ending.reason, how)

    def _export(self, pool: str, running: Mapping[str, tuple[int, int]]) -> None:
        views = self.drains.views(pool, running, self.clock()) if self.drains.drains(pool) else ()
        for state in STATES:
            self.metrics.draining_engines.labels(pool, state).set(sum(v.state == state for v in views))
        self.metrics.draining_requests.labels(pool).set(sum(v.requests for v in views))
