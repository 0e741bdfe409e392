"""The control store in Redis, shared by every replica.

Each replica sends the outcomes it counted since its last sync (`sync`, every quarter second)
and reads back the windows summed over all replicas, every pool's breaker state and the
controls. State changes are compare-and-swap on a version (`swap_breaker`, `swap_controls`): of
two replicas seeing the same trip, one wins and acts (pages, rolls the canary back), the other
adopts its result. Permits (`take_probe`, `claim_once`) and attempts (`begin_attempt`) are
single atomic scripts (stores/lua/control_*.lua). Time is Redis `TIME`.
"""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from ..core.breaker import BreakerState
from ..core.config import Retries
from ..core.retries import AttemptStart, Verdict
from .control import Controls, Deltas, Synced
from .redis_connection import RedisAddress, close_quietly, drop_idle_connections
from .scripts import script

PROBE_TTL_MS = 120_000
CONNECT_TIMEOUT_S = 5.0  # the first connection (a cluster's: its slots too), at start
_SCRIPTS = ("sync", "swap", "take_probe", "return_probe", "begin_attempt", "renew_attempts", "finish_attempt")


def _pairs(flat: list) -> dict[str, str]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


class RedisControlStore:
    """The same operations over Redis (standalone, Cluster or found through Sentinel)."""

    shared = True

    def __init__(self, address: RedisAddress, pools: list[str], levels: dict[str, dict[str, tuple[float, int]]],
                 retries: Retries, key_prefix: str = "extproc", op_timeout_s: float = 0.25, lease_s: float = 10.0):
        """`levels`: pool -> level -> (bucket seconds, buckets)."""
        self.address = address
        self.pools = pools
        self.levels = levels
        self.retries = retries
        self.op_timeout_s = op_timeout_s
        self.lease_ms = int(lease_s * 1000)
        self._prefix = {pool: f"{{{key_prefix}:{pool}}}" for pool in pools}
        self._control_key = f"{{{key_prefix}}}:control"
        self._attempt_prefix = f"{key_prefix}:attempt:"
        self._client = address.connect(op_timeout_s)
        self._scripts = {name: self._client.register_script(script("control", name)) for name in _SCRIPTS}
        self._offset: float | None = None  # Redis time minus this host's monotonic clock
        self._background: set[asyncio.Task] = set()  # permits given back for callers that left

    def clock(self) -> float:
        """Seconds on Redis's clock, estimated from the last sync (this host's monotonic
        clock until the first one)."""
        return time.monotonic() + (self._offset or 0.0)

    async def _bounded(self, awaitable):
        try:
            return await asyncio.wait_for(awaitable, self.op_timeout_s)
        except RedisConnectionError:  # Redis went away: the idle connections are as dead as this one
            await drop_idle_connections(self._client)
            raise

    async def start(self) -> None:
        """Connect now (to a cluster: learn its slots), so that the first decision does not pay
        for it within `op_timeout_s` (on a busy host, a cluster's first call took longer and was
        refused as Redis down). Redis down at start is found by the calls, as later."""
        try:
            await asyncio.wait_for(self._client.ping(), CONNECT_TIMEOUT_S)
        except (RedisError, OSError, asyncio.TimeoutError):
            pass

    async def stop(self) -> None:
        await close_quietly(self._client)

    def _sync_args(self, pool: str, deltas: Deltas) -> list:
        args: list = [len(self.levels[pool])]
        for level, (bucket_s, buckets) in self.levels[pool].items():
            counts = deltas.get(pool, {}).get(level, {})
            args += [level, max(1, round(bucket_s * 1000)), buckets, len(counts)]
            for index, (requests, failures) in counts.items():
                args += [index, requests, failures]
        return args

    async def sync(self, deltas: Deltas) -> Synced:
        sent = time.monotonic()
        if self.address.cluster:
            results = await self._bounded(asyncio.gather(
                *(self._scripts["sync"](keys=[self._prefix[p]], args=self._sync_args(p, deltas)) for p in self.pools)))
            control = await self._bounded(self._client.hgetall(self._control_key))
        else:
            async with self._client.pipeline(transaction=False) as pipe:
                for pool in self.pools:
                    await self._scripts["sync"](keys=[self._prefix[pool]], args=self._sync_args(pool, deltas), client=pipe)
                pipe.hgetall(self._control_key)
                *results, control = await self._bounded(pipe.execute())
        received = time.monotonic()
        synced = Synced(now=0.0, controls=Controls.from_fields(control))
        for pool, result in zip(self.pools, results, strict=True):
            now_ms, state, *flats = result
            self._offset = int(now_ms) / 1000 - (sent + received) / 2
            synced.states[pool] = BreakerState.from_fields(_pairs(state))
            synced.windows[pool] = {
                level: [(int(f[i]), int(f[i + 1]), int(f[i + 2])) for i in range(0, len(f), 3)]
                for level, f in zip(self.levels[pool], flats, strict=True)
            }
        synced.now = self.clock()
        return synced

    async def swap_breaker(self, pool: str, expected_version: int, state: BreakerState) -> BreakerState:
        args = [str(expected_version)] + [x for pair in state.as_fields().items() for x in pair]
        _, fields = await self._bounded(self._scripts["swap"](keys=[f"{self._prefix[pool]}:breaker"], args=args))
        return BreakerState.from_fields(_pairs(fields))

    def _probe_key(self, pool: str, opening: float) -> str:
        return f"{self._prefix[pool]}:probe:{round(opening * 1000)}"

    async def take_probe(self, pool: str, opening: float, limit: int) -> bool:
        key = self._probe_key(pool, opening)
        # A replica that dies holding a permit keeps it until the counter expires (PROBE_TTL_MS).
        taking = asyncio.ensure_future(
            self._bounded(self._scripts["take_probe"](keys=[key], args=[limit, PROBE_TTL_MS])))
        try:
            return bool(await asyncio.shield(taking))
        except asyncio.CancelledError:
            # The caller left with the call on its way: Redis runs it all the same, and a permit
            # it grants goes back when the answer comes (none within the bound: the TTL frees it).
            taking.add_done_callback(lambda done: self._give_back_probe(key, done))
            raise

    def _give_back_probe(self, key: str, taking: asyncio.Future) -> None:
        if not taking.cancelled() and taking.exception() is None and taking.result():
            task = asyncio.get_running_loop().create_task(self._return_probe(key))
            self._background.add(task)
            task.add_done_callback(self._given_back)

    def _given_back(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # (Redis unreachable: the counter's TTL frees the permit)

    async def return_probe(self, pool: str, opening: float) -> None:
        await self._return_probe(self._probe_key(pool, opening))

    async def _return_probe(self, key: str) -> None:
        await self._bounded(self._scripts["return_probe"](keys=[key]))

    async def claim_once(self, pool: str, what: str, every_s: float) -> bool:
        key = f"{self._prefix[pool]}:once:{what}"
        return bool(await self._bounded(self._client.set(key, "1", nx=True, px=max(1, int(every_s * 1000)))))

    async def swap_controls(self, expected_version: int, controls: Controls) -> Controls:
        args = [str(expected_version)] + [x for pair in controls.as_fields().items() for x in pair]
        _, fields = await self._bounded(self._scripts["swap"](keys=[self._control_key], args=args))
        return Controls.from_fields(_pairs(fields)) or Controls()

    async def controls(self) -> Controls | None:
        return Controls.from_fields(await self._bounded(self._client.hgetall(self._control_key)))

    async def begin_attempt(self, key: str, digest: str = "", fresh: bool = False) -> AttemptStart:
        verdict, attempts, failed_in, age_ms = await self._bounded(self._scripts["begin_attempt"](
            keys=[self._attempt_prefix + key],
            args=[self.retries.max_attempts, self.lease_ms, int(self.retries.window_s * 1000), digest, int(fresh)]))
        return AttemptStart(Verdict(verdict), int(attempts), failed_in or None, int(age_ms) / 1000)

    async def renew_attempts(self, keys: list[str]) -> None:
        if not keys:
            return
        names = [self._attempt_prefix + key for key in keys]
        if self.address.cluster:  # each key may live in another slot
            await self._bounded(asyncio.gather(*(self._scripts["renew_attempts"](keys=[n], args=[self.lease_ms]) for n in names)))
        else:
            await self._bounded(self._scripts["renew_attempts"](keys=names, args=[self.lease_ms]))

    async def finish_attempt(self, key: str, failed_in: str | None) -> None:
        await self._bounded(self._scripts["finish_attempt"](
            keys=[self._attempt_prefix + key], args=[failed_in or "", int(self.retries.window_s * 1000)]))
