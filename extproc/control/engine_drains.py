"""The draining engines, followed (core/engine_drain.py says what a drain is and does).

Every TICK_S the drains follow each picking pool's engines (the discovery's: its listed backends
and what its dns:// names resolve to) and what this replica placed on each and still runs there
(the engine picker's ledger): an engine gone from the pool drains, each drain's ending is counted
once, and the states are exported; a pool that no longer picks its engines (a reload) has its
drains ended and its gauges zeroed. An operator drains and undrains through `drain` and
`undrain` (the admin API); the capacity loop then runs at once (`on_change`), so the pool's
budget and count lose or regain the engine before the call returns.

It stands between the discovery and its readers: the engine picker reads every engine and those
draining (lifecycle/placement.PoolEngines: it names none of those for a new request) and tells
of a request Envoy ran on one all the same (`landed`), the capacity loop the engines that take
requests (`serving`) and what this replica still runs on those that drain or are gone (`held`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from ..core.config import Config
from ..core.engine_drain import (REASONS, RESULTS, STATES, DrainRefused, DrainView, EngineDrains, Ending,
                                 deadline_refused, endpoints, serving)
from ..core.pool_config import engine_address
from ..ops.metrics import Metrics
from .periodic import Periodic

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
        self.drains = EngineDrains(config().engine_drain.settle_s)
        self._loop = Periodic(self.follow, lambda: TICK_S, "following the draining engines failed")
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
        """The pool's engines changed lately (Envoy's cluster may not have followed yet). A drain
        is not such a change: only a request placed on a draining engine, or run on one, says
        nothing of whether Envoy follows the picks (lifecycle/slots.py leaves those out)."""
        return self._discovery.changing(pool)

    def landed(self, pool: str, endpoint: str) -> None:
        """A request the sidecar did not name `endpoint` for ran there (Envoy's upstream.address):
        if it drains, its drain counts it, and reads idle only once it settled again."""
        drain = self.drains.landed(pool, endpoint, self.clock())
        if drain is not None and drain.landed == 1:
            log.warning("pool %s: Envoy ran a request on draining engine %s, which the sidecar named for none (a "
                        "retry once the engines named had failed: override_host then balances over every host of "
                        "the cluster); its drain reads idle only after %g s without any", pool, endpoint,
                        self.drains.settle_s)

    def held(self, pool: str) -> tuple[int, int]:
        """(requests, tokens) this replica placed on the pool's engines on their way out that
        still run: those draining, and those gone from the pool's engines that the drains have not
        followed yet (the discovery runs the capacity loop at once when an engine leaves its
        name, up to TICK_S before its drain begins). Counted in the pool's in-flight until they
        end, the capacity loop gives them back to the count and the budget
        (core/engine_drain.drained_back)."""
        running = self.running(pool)
        if not running:
            return 0, 0
        taking = endpoints(self.serving(pool))
        held = [load for endpoint, load in running.items() if endpoint not in taking]
        return sum(r for r, _ in held), sum(t for _, t in held)

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
        if (refused := deadline_refused(deadline)) is not None:
            raise refused
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
        url = engine if "://" in engine else f"http://{engine}"
        address = engine_address(url)
        if address is None:
            raise DrainRefused(f"an engine is named IP:PORT, as `extproc admin state` shows it: {engine!r}",
                               invalid=True)
        # an IPv4-mapped IPv6 address names the IPv4 engine (as the discovery reads it)
        for endpoint in endpoints(self.engines(pool)) | self.drains.draining(pool):
            if engine_address(f"http://{endpoint}") == address:
                return endpoint
        host, port = address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

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
        self._loop.start()

    async def stop(self) -> None:
        self._loop.stop()

    def follow(self) -> None:
        config = self._config()
        now = self.clock()
        self.drains.settle_s = config.engine_drain.settle_s
        picking = self._picking()
        for pool in sorted(self.drains.pools() - set(picking)):  # it picks no more (a reload): nothing drains
            self._count(self.drains.forget(pool))
            self._export(pool, {})
        for pool in picking:
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
