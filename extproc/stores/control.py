"""Where the third level's state lives: breaker windows and states, probe permits, the canary,
the shadow share, and the attempts of named requests.

`LocalControlStore` keeps it in this process. `RedisControlStore` keeps one copy in Redis,
shared by every replica: each replica sends the outcomes it counted since its last sync
(`sync`, every quarter second) and reads back the windows summed over all replicas, every
pool's breaker state and the controls. State changes are compare-and-swap on a version
(`swap_breaker`, `swap_controls`): of two replicas seeing the same trip, one wins and acts
(pages, rolls the canary back), the other adopts its result. Permits (`take_probe`,
`claim_once`) and attempts (`begin_attempt`) are single atomic scripts. Time is Redis `TIME`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.breaker import BreakerState
from ..core.canary import CanaryState
from ..core.config import Retries
from ..core.retries import AttemptLedger, AttemptStart, Verdict
from .redis_queue import RedisAddress

PROBE_TTL_MS = 120_000

# pool -> level -> bucket index -> (requests, failures)
Deltas = dict[str, dict[str, dict[int, tuple[int, int]]]]


@dataclass(frozen=True)
class Controls:
    """Operator-set runtime state (canary rollout, shadow share), versioned."""

    version: int = 0
    canary: CanaryState = CanaryState()
    shadow_share: float = 0.0

    def as_fields(self) -> dict[str, str]:
        return {
            "version": str(self.version), "canary_digits": self.canary.digits,
            "canary_rolled_back_at": "" if self.canary.rolled_back_at is None else repr(self.canary.rolled_back_at),
            "canary_reason": self.canary.reason or "", "shadow_share": repr(self.shadow_share),
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> Controls | None:
        if not fields:
            return None
        at = fields.get("canary_rolled_back_at", "")
        canary = CanaryState(fields.get("canary_digits", ""), float(at) if at else None,
                             fields.get("canary_reason") or None)
        return cls(int(fields["version"]), canary, float(fields.get("shadow_share", "0")))


@dataclass
class Synced:
    """What a sync brought back: the shared clock, summed windows, states, controls."""

    now: float
    windows: dict[str, dict[str, list[tuple[int, int, int]]]] = field(default_factory=dict)  # pool -> level -> buckets
    states: dict[str, BreakerState] = field(default_factory=dict)
    controls: Controls | None = None


class LocalControlStore:
    """Everything in this process; the breakers' own windows are the only count."""

    shared = False

    def __init__(self, retries: Retries, clock: Callable[[], float] = time.monotonic, lease_s: float = 10.0):
        self.clock = clock
        self._states: dict[str, BreakerState] = {}
        self._controls: Controls | None = None
        self._probes: dict[tuple[str, float], int] = {}
        self._claimed_until: dict[tuple[str, str], float] = {}
        self._ledger = AttemptLedger(retries, lease_s)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def sync(self, deltas: Deltas) -> Synced | None:
        return None

    async def swap_breaker(self, pool: str, expected_version: int, state: BreakerState) -> BreakerState:
        current = self._states.get(pool, BreakerState())
        if current.version != expected_version:
            return current
        self._states[pool] = state
        return state

    async def take_probe(self, pool: str, opening: float, limit: int) -> bool:
        key = (pool, opening)
        if self._probes.get(key, 0) >= limit:
            return False
        self._probes = {k: v for k, v in self._probes.items() if k[0] != pool or k[1] == opening}
        self._probes[key] = self._probes.get(key, 0) + 1
        return True

    async def return_probe(self, pool: str, opening: float) -> None:
        key = (pool, opening)
        if self._probes.get(key, 0) > 0:
            self._probes[key] -= 1

    async def claim_once(self, pool: str, what: str, every_s: float) -> bool:
        now = self.clock()
        if self._claimed_until.get((pool, what), now) > now:
            return False
        self._claimed_until[(pool, what)] = now + every_s
        return True

    async def swap_controls(self, expected_version: int, controls: Controls) -> Controls:
        current = self._controls or Controls()
        if current.version != expected_version:
            return current
        self._controls = controls
        return controls

    async def controls(self) -> Controls | None:
        return self._controls

    async def begin_attempt(self, key: str) -> AttemptStart:
        return self._ledger.begin(key, self.clock())

    async def renew_attempts(self, keys: list[str]) -> None:
        self._ledger.renew(keys, self.clock())

    async def finish_attempt(self, key: str, failed_in: str | None) -> None:
        self._ledger.finish(key, failed_in, self.clock())


_PRELUDE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS[1] pool prefix. ARGV: levels, then per level: name, bucket_ms, buckets, n, n x (index, requests, failures).
# Returns {now_ms, state fields (flat), then per level a flat list of index, requests, failures}.
_SYNC = _PRELUDE + """
local P = KEYS[1]
local now = now_ms()
local out = {now, redis.call('HGETALL', P .. ':breaker')}
local i = 2
for _ = 1, tonumber(ARGV[1]) do
  local name, bucket_ms, buckets, n = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  i = i + 4
  local key = P .. ':bw:' .. name
  for _ = 1, n do
    redis.call('HINCRBY', key, ARGV[i] .. ':r', ARGV[i + 1])
    redis.call('HINCRBY', key, ARGV[i] .. ':f', ARGV[i + 2])
    i = i + 3
  end
  local first_live = math.floor(now / bucket_ms) - buckets + 1
  local counts, flat = {}, {}
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do
    local index, kind = string.match(all[j], '^(-?%d+):(%a)$')
    index = tonumber(index)
    if index < first_live then
      redis.call('HDEL', key, all[j])
    else
      counts[index] = counts[index] or {0, 0}
      if kind == 'r' then counts[index][1] = tonumber(all[j + 1]) else counts[index][2] = tonumber(all[j + 1]) end
    end
  end
  for index, c in pairs(counts) do
    table.insert(flat, index); table.insert(flat, c[1]); table.insert(flat, c[2])
  end
  redis.call('PEXPIRE', key, bucket_ms * buckets * 2)
  table.insert(out, flat)
end
return out
"""

# KEYS[1] a hash with a version field. ARGV[1] expected version, then field, value pairs.
_SWAP = """
local current = redis.call('HGET', KEYS[1], 'version') or '0'
if current ~= ARGV[1] then return {0, redis.call('HGETALL', KEYS[1])} end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return {1, redis.call('HGETALL', KEYS[1])}
"""

# KEYS[1] the permit counter of one opening. ARGV[1] limit, ARGV[2] ttl ms.
_TAKE = """
local taken = tonumber(redis.call('GET', KEYS[1]) or '0')
if taken >= tonumber(ARGV[1]) then return 0 end
redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS[1] the permit counter of one opening: a probe that ended without an outcome gives its permit back.
_GIVE_BACK = """
if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then redis.call('DECR', KEYS[1]) end
return 1
"""

# KEYS[1] the attempt hash of one key. ARGV: max attempts, lease ms, window ms.
_BEGIN = _PRELUDE + """
local now = now_ms()
local e = redis.call('HMGET', KEYS[1], 'attempts', 'running_until', 'failed_in')
if not e[1] then
  redis.call('HSET', KEYS[1], 'attempts', 1, 'running_until', now + tonumber(ARGV[2]), 'failed_in', '')
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'first', 1, ''}
end
local attempts = tonumber(e[1])
if tonumber(e[2]) > now then return {'in_progress', attempts, e[3]} end
if attempts >= tonumber(ARGV[1]) then return {'too_many', attempts, e[3]} end
redis.call('HSET', KEYS[1], 'attempts', attempts + 1, 'running_until', now + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {'retry', attempts + 1, e[3]}
"""

# KEYS: attempt hashes of running attempts. ARGV[1] lease ms.
_RENEW = _PRELUDE + """
local now = now_ms()
for _, key in ipairs(KEYS) do
  if tonumber(redis.call('HGET', key, 'running_until') or '0') > 0 then
    redis.call('HSET', key, 'running_until', now + tonumber(ARGV[1]))
  end
end
return 1
"""

# KEYS[1] the attempt hash. ARGV[1] the pool it failed in ('' if it did not fail), ARGV[2] window ms.
_FINISH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'running_until', 0, 'failed_in', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


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
        self._scripts = {name: self._client.register_script(body) for name, body in (
            ("sync", _SYNC), ("swap", _SWAP), ("take", _TAKE), ("give_back", _GIVE_BACK), ("begin", _BEGIN),
            ("renew", _RENEW), ("finish", _FINISH))}
        self._offset: float | None = None  # Redis time minus this host's monotonic clock

    def clock(self) -> float:
        """Seconds on Redis's clock, estimated from the last sync (this host's monotonic
        clock until the first one)."""
        return time.monotonic() + (self._offset or 0.0)

    async def _bounded(self, awaitable):
        return await asyncio.wait_for(awaitable, self.op_timeout_s)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        try:
            await asyncio.wait_for(self._client.aclose(), 1)
        except (Exception, asyncio.CancelledError):
            pass

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

    async def take_probe(self, pool: str, opening: float, limit: int) -> bool:
        key = f"{self._prefix[pool]}:probe:{round(opening * 1000)}"
        # A replica that dies holding a permit keeps it until the counter expires (PROBE_TTL_MS).
        return bool(await self._bounded(self._scripts["take"](keys=[key], args=[limit, PROBE_TTL_MS])))

    async def return_probe(self, pool: str, opening: float) -> None:
        key = f"{self._prefix[pool]}:probe:{round(opening * 1000)}"
        await self._bounded(self._scripts["give_back"](keys=[key]))

    async def claim_once(self, pool: str, what: str, every_s: float) -> bool:
        key = f"{self._prefix[pool]}:once:{what}"
        return bool(await self._bounded(self._client.set(key, "1", nx=True, px=max(1, int(every_s * 1000)))))

    async def swap_controls(self, expected_version: int, controls: Controls) -> Controls:
        args = [str(expected_version)] + [x for pair in controls.as_fields().items() for x in pair]
        _, fields = await self._bounded(self._scripts["swap"](keys=[self._control_key], args=args))
        return Controls.from_fields(_pairs(fields)) or Controls()

    async def controls(self) -> Controls | None:
        return Controls.from_fields(await self._bounded(self._client.hgetall(self._control_key)))

    async def begin_attempt(self, key: str) -> AttemptStart:
        verdict, attempts, failed_in = await self._bounded(self._scripts["begin"](
            keys=[self._attempt_prefix + key],
            args=[self.retries.max_attempts, self.lease_ms, int(self.retries.window_s * 1000)]))
        return AttemptStart(Verdict(verdict), int(attempts), failed_in or None)

    async def renew_attempts(self, keys: list[str]) -> None:
        if not keys:
            return
        names = [self._attempt_prefix + key for key in keys]
        if self.address.cluster:  # each key may live in another slot
            await self._bounded(asyncio.gather(*(self._scripts["renew"](keys=[n], args=[self.lease_ms]) for n in names)))
        else:
            await self._bounded(self._scripts["renew"](keys=names, args=[self.lease_ms]))

    async def finish_attempt(self, key: str, failed_in: str | None) -> None:
        await self._bounded(self._scripts["finish"](
            keys=[self._attempt_prefix + key], args=[failed_in or "", int(self.retries.window_s * 1000)]))
