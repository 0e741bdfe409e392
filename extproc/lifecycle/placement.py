"""Where an admitted request runs, for pools with `capacity.pick_backend`: the sidecar names the
backends in order of preference (core/capacity.backend_order: the least loaded by KV tokens first),
Envoy's override_host load-balancing policy on the pool's cluster sends the request to the first
healthy one (the next ones on a retry), and this replica keeps a ledger of what it placed where
until the exchange ends.

Why: the pool's token budget is a sum over its backends, and Envoy's least-request balancing
counts requests, not tokens; two long prompts on one engine can overfill its KV cache while the
pool as a whole has room. Placed by tokens, and admitted under PoolLine's `spread` rule, no
backend overfills. The ledger moves the instant a request is placed or ends. What other
replicas placed comes from the queue store at each poll (the cost placed on each backend by
every replica, minus this one's: `QueueStore.placements`); what bypassed the sidecar, from the
backends' own KV usage beyond this replica's ledger. The larger of the two counts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..core.capacity import BackendLoad, BackendReading, Placing, backend_order
from ..core.long_lane import lane, long_may_start
from ..core.config import Config
from ..core.pool_config import backend_endpoint
from ..core.spill import SpillPace, spills

# Envoy's override_host policy reads the endpoints from this dynamic metadata (the key the
# Gateway API inference extension's endpoint picker protocol uses)
LB_METADATA_NAMESPACE = "envoy.lb"
ENDPOINT_KEY = "x-gateway-destination-endpoint"


@dataclass
class _Placed:
    pool: str
    endpoint: str
    request: Placing


@dataclass
class _Running:
    """What this replica placed on one backend and still runs there."""

    requests: int = 0
    tokens: int = 0
    long: int = 0
    bound: int = 0

    def add(self, request: Placing, sign: int) -> None:
        self.requests += sign
        self.tokens += sign * request.cost
        self.long += sign * int(request.long)
        self.bound += sign * int(request.bound)


class PoolEngines(Protocol):
    """Each pool's engines now (control/discovery.py: its listed backends and what its dns://
    names resolve to) and those draining (control/engine_drains.py)."""

    def engines(self, pool: str) -> tuple[str, ...]: ...  # their base URLs

    def changing(self, pool: str) -> bool: ...  # changed lately: Envoy's cluster may not have followed yet

    def draining(self, pool: str) -> frozenset[str]: ...  # IP:PORT of those that get no new request

    def landed(self, pool: str, endpoint: str) -> None: ...  # a request not placed there ran there


class _Listed:
    def __init__(self, config: Callable[[], Config]):
        self._config = config

    def engines(self, pool: str) -> tuple[str, ...]:
        return self._config().pools[pool].capacity.backends

    def changing(self, pool: str) -> bool:
        return False

    def draining(self, pool: str) -> frozenset[str]:
        return frozenset()

    def landed(self, pool: str, endpoint: str) -> None:
        pass


class BackendPicker:
    def __init__(self, config: Callable[[], Config], engines: PoolEngines | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._clock = clock
        self._pool_engines = engines or _Listed(config)
        self._engines = self._pool_engines.engines
        self._placed: dict[str, _Placed] = {}  # ticket id -> where it runs
        self._running: dict[tuple[str, str], _Running] = {}  # (pool, endpoint) -> what runs there
        # (pool, base URL) -> (KV capacity, tokens others hold there, saturated), as of the last poll
        self._seen: dict[tuple[str, str], tuple[int | None, float, bool]] = {}
        self._long_waiting: dict[str, list[Placing]] = {}  # pool -> long prompts waiting for a lane
        self._spill: dict[str, SpillPace] = {}  # pool -> its engines' spill pace (core/spill.py)
        self._bound_at: dict[tuple[str, str], float] = {}  # (pool, endpoint) -> a latency-bound request last placed
        self._lanes: dict[str, str] = {}  # pool -> the lane its first waiting long prompt will open (core/long_lane.py)

    def observe(self, pool: str, readings: dict[str, BackendReading], placed: dict[str, int] | None = None) -> None:
        """The backends' metrics, just polled, and the cost every replica placed on each
        (`placed`, from the queue store). Load placed by others is the larger of what other
        replicas placed (`placed` minus this replica's ledger: reservations, prompt and
        max_tokens) and what the backend holds beyond this replica's ledger (requests that
        bypassed the sidecar); it is counted until the next poll. The ledger itself moves at
        once both ways: a request that just ended still shows in the metrics for up to a poll,
        and must not push the next one elsewhere."""
        capacity = self._config().pools[pool].capacity
        placed = placed or {}
        for key in [key for key in self._seen if key[0] == pool and key[1] not in readings]:
            del self._seen[key]  # an engine gone (a name that no longer resolves to it, a reload)
        endpoints = {backend_endpoint(url) for url in readings}
        for gone in [key for key in self._bound_at if key[0] == pool and key[1] not in endpoints]:
            del self._bound_at[gone]
        for url, reading in readings.items():
            endpoint = backend_endpoint(url)
            cap = reading.kv_capacity_tokens or capacity.kv_tokens_per_backend
            mine = self._running[(pool, endpoint)].tokens if endpoint and (pool, endpoint) in self._running else 0
            by_replicas = max(0, placed.get(endpoint or "", 0) - mine)
            measured = 0.0 if reading.saturated or cap is None else max(0.0, reading.kv_usage * cap - mine)
            self._seen[(pool, url)] = (cap, max(float(by_replicas), measured), reading.saturated)

    def engines_changing(self, pool: str) -> bool:
        """Whether `pool`'s engines changed lately: a pick may then name an engine Envoy's cluster
        does not have yet (or no longer has), and Envoy's running it elsewhere says nothing of
        whether it follows the picks."""
        return self._pool_engines.changing(pool)

    def picks(self, pool: str) -> bool:
        """Whether the sidecar picks `pool`'s backends (`pick` returns None otherwise)."""
        return self._config().pools[pool].capacity.picks_backend

    def pick(self, pool: str, ticket_id: str, request: Placing) -> str | None:
        """The endpoints for Envoy, best first ("IP:PORT,IP:PORT"); None when the pool does not
        pick, or has no engine now (its names resolve to none: Envoy's cluster has no host
        either). The request is counted on the first one until `release`."""
        capacity = self._config().pools[pool].capacity
        if not capacity.picks_backend:
            return None
        loads = self._loads(pool)
        if not loads:
            return None
        now = self._clock()
        order = self._order(pool, loads, request, now)
        self._placed[ticket_id] = _Placed(pool, order[0], request)
        self._running.setdefault((pool, order[0]), _Running()).add(request, 1)
        if request.bound:
            self._bound_at[(pool, order[0])] = now
        if capacity.keep_long_apart:
            self._spill_pace(pool).started(next(load for load in loads if load.endpoint == order[0]), request, now)
        return ",".join(order)

    def _order(self, pool: str, loads: list[BackendLoad], request: Placing, now: float) -> list[str]:
        capacity = self._config().pools[pool].capacity
        waiting = self._long_waiting.get(pool)
        avoid = lane(loads, waiting[0], self._lanes.get(pool)) if capacity.keep_long_apart and waiting else None
        if avoid is None:
            self._lanes.pop(pool, None)
        else:
            self._lanes[pool] = avoid
        spent = self._spill_pace(pool).spent(loads, now) if capacity.keep_long_apart else frozenset()
        return backend_order(loads, request, capacity.max_num_seqs, capacity.keep_long_apart, avoid, spent)

    def _spill_pace(self, pool: str) -> SpillPace:
        rate = self._config().pools[pool].capacity.spill_tokens_per_s
        pace = self._spill.get(pool)
        if pace is None:
            pace = self._spill[pool] = SpillPace(rate)
        pace.tokens_per_s = rate  # (a reload may change it)
        return pace

    def may_start(self, pool: str, request: Placing) -> bool:
        """Whether `request` may be placed now: a long prompt when it has an engine of its own
        (core/long_lane.py), one of a class without a latency target unless it would start
        beside latency-bound requests only for want of room elsewhere, before its turn there
        (core/spill.py). Always, unless the pool picks and keeps long prompts apart."""
        capacity = self._config().pools[pool].capacity
        if not (capacity.picks_backend and capacity.keep_long_apart):
            return True
        loads = self._loads(pool)
        if request.long:  # (whatever its class)
            return long_may_start(loads, request)
        if request.bound or not loads:
            return True
        now = self._clock()
        return self._spill_pace(pool).may_spill(loads, request, self._order(pool, loads, request, now)[0], now)

    def beside_bound(self, pool: str, request: Placing) -> bool:
        """Whether `request` would be placed now on an engine serving latency-bound requests while
        another serves none (a spill: core/spill.py), where the pool picks and keeps prompts apart."""
        capacity = self._config().pools[pool].capacity
        loads = self._loads(pool) if capacity.picks_backend and capacity.keep_long_apart else []
        if not loads:
            return False
        return spills(loads, self._order(pool, loads, request, self._clock())[0])

    def long_waiting(self, pool: str, request: Placing, waits: bool) -> None:
        """The long prompt `request` starts (`waits`) or stops waiting for a lane: while one
        does, the latency-bound requests keep off the engine it will take (the first to wait)."""
        waiting = self._long_waiting.setdefault(pool, [])
        if waits:
            waiting.append(request)
        else:
            waiting.remove(request)
        if not waiting:
            del self._long_waiting[pool]

    def leaving(self, pool: str, endpoint: str) -> bool:
        """Whether `endpoint` is an engine of `pool` on its way out: draining, or gone from the
        pool's engines while this replica still runs requests there."""
        if endpoint in self._pool_engines.draining(pool):
            return True
        return (pool, endpoint) in self._running and endpoint not in {backend_endpoint(u) for u in self._engines(pool)}

    def landed(self, pool: str, endpoint: str) -> None:
        """A request placed elsewhere ran on `endpoint` (Envoy's upstream.address): a draining
        engine counts it in its drain (control/engine_drains.py)."""
        if endpoint in self._pool_engines.draining(pool):
            self._pool_engines.landed(pool, endpoint)

    def _loads(self, pool: str) -> list[BackendLoad]:
        capacity = self._config().pools[pool].capacity
        draining = self._pool_engines.draining(pool)  # they get no new request
        loads = []
        lately = self._clock() - capacity.bound_lately_s
        for url in self._engines(pool):
            endpoint = backend_endpoint(url)
            assert endpoint is not None  # the config checked it (and discovery makes http://IP:PORT)
            if endpoint in draining:
                continue
            # not polled yet (just listed by a reload, or discovered): as if saturated, until the first poll
            cap, others, saturated = self._seen.get((pool, url), (capacity.kv_tokens_per_backend, 0.0, True))
            running = self._running.get((pool, endpoint), _Running())
            # what it may hold: the pool's safety factor kept free on each engine, as on the pool
            held = None if cap is None else int(cap * capacity.safety_factor)
            bound_lately = self._bound_at.get((pool, endpoint), -math.inf) > lately
            loads.append(BackendLoad(endpoint, held, running.tokens + others, running.requests, saturated,
                                     running.long, running.bound, bound_lately))
        return loads

    def moved(self, ticket_id: str, endpoint: str) -> bool:
        """The request runs on `endpoint` (Envoy's `upstream.address`), not where it was placed:
        its charge moves there, if that is one of its pool's backends. Whether it moved."""
        placed = self._placed.get(ticket_id)
        if placed is None or placed.endpoint == endpoint:
            return False
        if endpoint not in {backend_endpoint(url) for url in self._engines(placed.pool)}:
            return False
        old = self._running[(placed.pool, placed.endpoint)]
        old.add(placed.request, -1)
        if old.requests <= 0:
            del self._running[(placed.pool, placed.endpoint)]
        self._running.setdefault((placed.pool, endpoint), _Running()).add(placed.request, 1)
        if placed.request.bound:  # (the engine it left may have served it alone: it ages out there)
            self._bound_at[(placed.pool, endpoint)] = self._clock()
        placed.endpoint = endpoint
        return True

    def release(self, ticket_id: str) -> None:
        placed = self._placed.pop(ticket_id, None)
        if placed is None:
            return
        key = (placed.pool, placed.endpoint)
        entry = self._running[key]
        entry.add(placed.request, -1)
        if entry.requests <= 0:
            del self._running[key]

    def running(self, pool: str) -> dict[str, tuple[int, int]]:
        """(requests, tokens) this replica placed on each backend of `pool` that still run."""
        return {endpoint: (r.requests, r.tokens) for (p, endpoint), r in self._running.items() if p == pool}
