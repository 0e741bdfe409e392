"""A queue store in Redis, shared by every sidecar replica in front of one pool.

Every operation that must be atomic is one Lua script (redis_scripts.lua): enqueue, dispatch
as many head tickets as capacity allows, cancel, release, renew, set limits. Admissions reach
the waiting replica through its wake list, popped by one BLPOP loop per pool: no polling.
Admitted tickets hold leases that this replica renews (batched, one pipeline per round) while
their exchange lasts; a replica that dies stops renewing and its slots come back within one
lease. Only the owner can release or renew a lease, and nothing can after it expired. A lease
that Redis lost (not expired) is counted again by its owner's next renewal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.connection import parse_url
from redis.exceptions import NoScriptError, RedisError

from ..core.admission import CancelResult, Ticket
from .queue import Lease, PoolSnapshot, StoreClosed, Waiter, WaitExpired, count_by_class_and_branch

log = logging.getLogger("extproc.redis")

_PRELUDE = resources.files("extproc.stores").joinpath("lua/queue.lua").read_text("utf-8")
_LINGER_S = 0.002  # a release waits at most this long to go to Redis with other calls

_ENQUEUE = """
local id, owner, score, class, branch = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local cost, long, ttl, lease = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local now = now_ms()
local key = class .. '|' .. branch
local round = math.max(tonumber(redis.call('HGET', P .. ':rr', key) or '0'),
                       tonumber(redis.call('HGET', P .. ':rn', class) or '0'))
redis.call('HSET', P .. ':rr', key, round + 1)
local seq = redis.call('INCR', P .. ':seq')
local m = string.format('%012d:%012d:%s:%s', round, seq, class, id)
redis.call('HSET', P .. ':tk:' .. id, 'm', m, 'o', owner, 'c', cost, 'l', long, 'k', class, 'b', ARGV[10], 'r', branch)
redis.call('PEXPIRE', P .. ':tk:' .. id, ttl)
redis.call('ZADD', P .. ':wait', score, m)
redis.call('ZADD', P .. ':arrive', now, m)
redis.call('HINCRBY', P .. ':dc', class, 1)
local admitted = dispatch(now, lease, id)
return {admitted, pool_state()}
"""

_CANCEL = """
local id = ARGV[1]
local m = redis.call('HGET', P .. ':tk:' .. id, 'm')
if m then
  local _, class = parse_member(m)
  drop_waiting(m, class)
  redis.call('DEL', P .. ':tk:' .. id)
  return {'removed', dispatch(now_ms(), tonumber(ARGV[2]))}
end
if redis.call('HEXISTS', P .. ':li', id) == 1 then return {'holds', {}} end
return {'unknown', {}}
"""

# ARGV: owner, lease ms, then the ids of the leases to release (one or many, of this owner).
_RELEASE = """
local owner, released = ARGV[1], {}
for i = 3, #ARGV do
  local info = redis.call('HGET', P .. ':li', ARGV[i])
  if info and string.match(info, '^(.*)|%d+|%d$') == owner then
    free_slot(ARGV[i])
    released[i - 2] = 1
  else
    released[i - 2] = 0
  end
end
return {released, dispatch(now_ms(), tonumber(ARGV[2]))}
"""

_RENEW = """
local now = now_ms()
local owner, lease = ARGV[1], tonumber(ARGV[2])
reap(now, lease)
local lost, restored = {}, {}
for i = 3, #ARGV, 3 do
  local id, cost, flags = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local info = redis.call('HGET', P .. ':li', id)
  if info then
    if string.match(info, '^(.*)|%d+|%d$') == owner then
      redis.call('ZADD', P .. ':lease', 'XX', now + lease, id)
    else
      table.insert(lost, id)
    end
  elseif redis.call('ZSCORE', P .. ':reaped', id) then
    table.insert(lost, id) -- expired and reaped: its slot went to someone else
  else
    -- Redis lost it (restarted empty, or failed over before the write replicated) while the
    -- request still runs: count it again, so over-admission ends with this renewal.
    hold_slot(id, owner, cost, flags, now + lease)
    redis.call('HINCRBY', P .. ':st', 'inflight', 1)
    redis.call('HINCRBY', P .. ':st', 'cost', cost)
    if flags % 2 == 1 then redis.call('HINCRBY', P .. ':st', 'lcost', cost) end
    if flags >= 2 then redis.call('HINCRBY', P .. ':st', 'ubinf', 1) end
    table.insert(restored, id)
  end
end
return {lost, restored, dispatch(now, lease)}
"""

_LIMITS = """
redis.call('HSET', P .. ':st', 'max', ARGV[1], 'budget', ARGV[2], 'share', ARGV[3], 'promote', ARGV[4], 'lcap', ARGV[6],
           'spread', ARGV[7])
return dispatch(now_ms(), tonumber(ARGV[5]))
"""

_SNAPSHOT = """
return pool_state()
"""

# The queue page's view of the line: class and branch of every waiting ticket, as a flat list
# (a ticket enqueued before tickets kept their branch reads "unknown").
_WAITING = """
local out = {}
for _, m in ipairs(redis.call('ZRANGE', P .. ':wait', 0, -1)) do
  local id, class = parse_member(m)
  table.insert(out, class)
  table.insert(out, redis.call('HGET', P .. ':tk:' .. id, 'r') or 'unknown')
end
return out
"""


async def _close_quietly(client) -> None:
    try:
        await asyncio.wait_for(client.aclose(), 1)
    except (Exception, asyncio.CancelledError):
        pass


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class RedisAddress:
    """Where the shared queue lives: a Redis URL, a Cluster (any node's URL), or the master that
    Sentinel names (`url` then only gives the database and credentials)."""

    url: str | None = None
    cluster: bool = False
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str = "extproc"

    def connect(self, timeout_s: float, blocking: bool = False):
        """A client whose every call is bounded: nothing hangs on a stopped Redis."""
        socket_timeout = timeout_s + 2.0 if blocking else timeout_s
        options = dict(socket_timeout=socket_timeout, socket_connect_timeout=timeout_s, decode_responses=True)
        if self.sentinels:
            # Asks the sentinels for the master on every new connection, so a failover is
            # followed once the old master's connections fail.
            from_url = parse_url(self.url) if self.url else {}
            credentials = {k: v for k, v in from_url.items() if k in ("db", "username", "password")}
            sentinel = Sentinel(
                list(self.sentinels), sentinel_kwargs=dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            )
            return sentinel.master_for(self.sentinel_master, retry_on_timeout=False, **credentials, **options)
        if self.url is None:
            raise ValueError("a Redis address needs a url or sentinels")
        if self.cluster:
            return RedisCluster.from_url(self.url, **options)
        return aioredis.from_url(self.url, retry_on_timeout=False, **options)


class RedisQueueStore:
    """The QueueStore interface over Redis (standalone, Cluster, or found through Sentinel)."""

    def __init__(
        self,
        address: str | RedisAddress,
        max_inflight: dict[str, int],
        *,
        key_prefix: str = "extproc",
        replica_id: str | None = None,
        lease_s: float = 10.0,
        op_timeout_s: float = 0.5,
        ttl_margin_s: float = 5.0,
        max_wait_s: float = 60.0,
        long_share: dict[str, float] | None = None,
        promote_after_s: float | None = None,
        on_change: Callable[[str, PoolSnapshot], None] | None = None,
    ):
        self.address = RedisAddress(address) if isinstance(address, str) else address
        self.replica = replica_id or default_replica_id()
        self.lease_ms = int(lease_s * 1000)
        self.op_timeout_s = op_timeout_s
        self.ticket_ttl_ms = int((max_wait_s + ttl_margin_s) * 1000)
        self.limits: dict[str, tuple[int, int | None, int | None, int]] = {
            pool: (n, None, None, 1) for pool, n in max_inflight.items()}
        self._share = long_share or {}
        self._promote_ms = -1 if promote_after_s is None else int(promote_after_s * 1000)
        self._prefix = {pool: f"{{{key_prefix}:{pool}}}" for pool in max_inflight}
        self._notify = on_change or (lambda pool, snapshot: None)
        self.on_error: Callable[[BaseException], None] = lambda error: None  # a background call failed
        self._client = self.address.connect(op_timeout_s)
        self._scripts = {
            name: self._client.register_script(_PRELUDE + body)
            for name, body in (("enqueue", _ENQUEUE), ("cancel", _CANCEL), ("release", _RELEASE),
                               ("renew", _RENEW), ("limits", _LIMITS), ("snapshot", _SNAPSHOT),
                               ("waiting", _WAITING))
        }
        self._futures: dict[str, asyncio.Future[None]] = {}
        self._batch: list = []  # script calls waiting for the end of this turn of the event loop
        self._flush_at: float | None = None  # when the pending batch goes (loop time)
        self._flush_handle: asyncio.Handle | None = None
        self._sending: set[asyncio.Task] = set()
        self._leases: dict[str, dict[str, Lease]] = {pool: {} for pool in max_inflight}
        self._depth: dict[str, int] = {pool: 0 for pool in max_inflight}
        self._tasks: list[asyncio.Task] = []
        self._wake_clients: list = []
        self._stopping = asyncio.Event()
        self._closed = False

    @property
    def cluster(self) -> bool:
        return self.address.cluster

    def _wake_key(self, pool: str) -> str:
        return f"{self._prefix[pool]}:wake:{self.replica}"

    async def _run(self, name: str, pool: str, *args) -> object:
        return await self._submit(name, pool, args)

    def _submit(self, name: str, pool: str, args: tuple, urgent: bool = True) -> asyncio.Future:
        """Hand one script call to Redis at once (before any suspension, so a caller cancelled
        afterwards cannot take it back) and return its answer to come. Calls made in the same
        turn of the event loop (under load, several requests' enqueues and releases) go
        together, in one pipeline; a call that is not `urgent` (a release: nobody waits on its
        answer) may wait `_LINGER_S` for company. Every call is bounded by `op_timeout_s`."""
        loop = asyncio.get_running_loop()
        if self.cluster:  # a pipeline would span slots: one call each
            return loop.create_task(self._call_alone(name, pool, args))
        future = loop.create_future()
        self._batch.append((self._scripts[name], self._prefix[pool], args, future))
        if urgent:
            if self._flush_at is None or self._flush_at > loop.time():
                if self._flush_handle is not None:
                    self._flush_handle.cancel()
                self._flush_at = loop.time()
                self._flush_handle = loop.call_soon(self._flush)
        elif self._flush_at is None:
            self._flush_at = loop.time() + _LINGER_S
            self._flush_handle = loop.call_later(_LINGER_S, self._flush)
        return future

    async def _call_alone(self, name: str, pool: str, args: tuple) -> object:
        async with asyncio.timeout(self.op_timeout_s):
            return await self._scripts[name](keys=[self._prefix[pool]], args=list(args))

    def _flush(self) -> None:
        self._flush_at = self._flush_handle = None
        batch, self._batch = self._batch, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list) -> None:
        try:
            async with asyncio.timeout(self.op_timeout_s):
                results = await self._pipeline(batch)
                if any(isinstance(r, NoScriptError) for r in results):  # Redis restarted: load them again
                    for script in {script for script, *_ in batch}:
                        script.sha = await self._client.script_load(script.script)
                    results = await self._pipeline(batch)
        except BaseException as error:  # noqa: BLE001 - every caller must hear of it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(error if isinstance(error, Exception) else RedisError(str(error)))
            return
        for (*_, future), result in zip(batch, results, strict=True):
            if not future.done():
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def _pipeline(self, batch: list) -> list:
        """Send a batch in one pipeline; the releases of one pool go as one call. Returns one
        answer per batch entry (a release's: whether it released)."""
        release = self._scripts["release"]
        calls: list[tuple] = []  # (script, key, args, [batch positions])
        grouped: dict[str, int] = {}  # pool key -> its release call in `calls`
        for position, (script, key, args, _) in enumerate(batch):
            if script is release:
                at = grouped.get(key)
                if at is None:
                    grouped[key] = len(calls)
                    calls.append((script, key, list(args), [position]))
                else:
                    calls[at][2].append(args[2])
                    calls[at][3].append(position)
            else:
                calls.append((script, key, args, [position]))
        # EVALSHA directly: a pipeline that knows of scripts asks SCRIPT EXISTS on every execute.
        async with self._client.pipeline(transaction=False) as pipe:
            for script, key, args, _ in calls:  # (not pipe.evalsha: its argument checks cost more than the call)
                pipe.execute_command("EVALSHA", script.sha, 1, key, *args)
            replies = await pipe.execute(raise_on_error=False)
        answers: list = [None] * len(batch)
        for (script, _, _, positions), reply in zip(calls, replies, strict=True):
            if script is release and not isinstance(reply, Exception):
                for position, released in zip(positions, reply[0], strict=True):
                    answers[position] = released
            else:
                for position in positions:
                    answers[position] = reply
        return answers

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        for pool, (max_inflight, budget, latency_cap, spread) in self.limits.items():
            await self.set_limits(pool, max_inflight, budget, latency_cap, spread)
        loop = asyncio.get_running_loop()
        for pool in self._prefix:
            self._tasks.append(loop.create_task(self._wake_loop(pool)))
        self._tasks.append(loop.create_task(self._renew_loop()))
        self._tasks.append(loop.create_task(self._report_loop()))

    async def stop(self) -> None:
        # The loops end by themselves within one BLPOP timeout: cancelling a task inside a
        # redis-py (cluster) call can leave it retrying, and a loop that never ends.
        self._stopping.set()
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=3)
            for task in stuck:
                task.cancel()
        for client in self._wake_clients:
            await _close_quietly(client)
        for leases in self._leases.values():
            for lease in list(leases.values()):
                try:
                    await self.release(lease)
                except Exception:  # Redis gone: the leases expire by themselves
                    break
        await _close_quietly(self._client)

    async def ping(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self._client.ping(), self.op_timeout_s))
        except Exception:
            return False

    # -- the QueueStore interface -------------------------------------------------------------

    async def enqueue(self, pool: str, ticket: Ticket) -> Lease | Waiter:
        if self._closed:
            raise StoreClosed()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[ticket.id] = future  # before the script: the wake may come at once
        try:
            admitted, state = await self._run(
                "enqueue", pool, ticket.id, self.replica, repr(float(ticket.score)), ticket.class_name,
                ticket.branch_id, ticket.cost, int(ticket.long), self.ticket_ttl_ms, self.lease_ms, int(ticket.bounded),
            )
        except BaseException:
            self._futures.pop(ticket.id, None)
            raise
        self._seen(pool, self._parse_snapshot(state))
        if ticket.id in admitted:
            self._futures.pop(ticket.id, None)
            return self._lease(pool, ticket)
        return Waiter(pool, ticket, future)

    def _seen(self, pool: str, snapshot: PoolSnapshot) -> None:
        self._depth[pool] = snapshot.depth
        self._notify(pool, snapshot)

    def depth(self, pool: str) -> int:
        """The shared depth as of this replica's last enqueue or background report (every
        0.25 s): placement reads it without a round trip to Redis."""
        return self._depth[pool]

    def _lease(self, pool: str, ticket: Ticket) -> Lease:
        lease = Lease(pool, ticket)
        self._leases[pool][ticket.id] = lease
        return lease

    async def wait(self, waiter: Waiter, timeout_s: float) -> Lease:
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await asyncio.shield(waiter.admitted)
            return self._lease(waiter.pool, waiter.ticket)
        except TimeoutError:
            if await self._leave_line(waiter) is CancelResult.HOLDS_SLOT:
                return self._lease(waiter.pool, waiter.ticket)  # admitted at the same instant
            raise WaitExpired() from None
        except asyncio.CancelledError:
            try:
                if await self._leave_line(waiter) is CancelResult.HOLDS_SLOT:
                    await self.release(self._lease(waiter.pool, waiter.ticket))
            except Exception:
                log.warning("could not withdraw ticket %s; its TTL or lease will", waiter.ticket.id)
            raise
        except StoreClosed:
            await self._leave_line(waiter)
            raise
        finally:
            self._futures.pop(waiter.ticket.id, None)

    def withdraw(self, waiter: Waiter) -> None:
        self._futures.pop(waiter.ticket.id, None)
        answer = self._submit("cancel", waiter.pool, (waiter.ticket.id, self.lease_ms))

        def settle(done: asyncio.Future) -> None:
            if done.cancelled() or done.exception() is not None:
                log.warning("could not withdraw ticket %s; its TTL or lease will", waiter.ticket.id)
            elif done.result()[0] == "holds":  # admitted meanwhile: the slot is this replica's to give back
                self.release_soon(self._lease(waiter.pool, waiter.ticket))

        answer.add_done_callback(settle)

    async def _leave_line(self, waiter: Waiter) -> CancelResult:
        result, _ = await self._run("cancel", waiter.pool, waiter.ticket.id, self.lease_ms)
        return {"removed": CancelResult.REMOVED, "holds": CancelResult.HOLDS_SLOT}.get(result, CancelResult.UNKNOWN)

    async def release(self, lease: Lease) -> None:
        answer = self.release_soon(lease)
        if answer is not None:
            await answer

    def release_soon(self, lease: Lease) -> asyncio.Future | None:
        """Hand the release to Redis now (nothing can cancel it); await the result to hear of
        a failure. None when the lease was released already."""
        if lease.released:
            return None
        lease.released = True
        self._leases[lease.pool].pop(lease.ticket.id, None)
        return self._submit("release", lease.pool, (self.replica, self.lease_ms, lease.ticket.id), urgent=False)

    async def set_limits(self, pool: str, max_inflight: int, budget_tokens: int | None,
                         latency_cap: int | None = None, spread: int = 1) -> None:
        self.limits[pool] = (max_inflight, budget_tokens, latency_cap, spread)
        await self._run(
            "limits", pool, max(1, max_inflight), -1 if budget_tokens is None else budget_tokens,
            self._share.get(pool, 1.0), self._promote_ms, self.lease_ms, -1 if latency_cap is None else latency_cap,
            max(1, spread),
        )

    async def claim_once(self, pool: str, what: str, every_s: float) -> bool:
        key = f"{self._prefix[pool]}:once:{what}"
        claimed = self._client.set(key, self.replica, nx=True, px=max(1, int(every_s * 1000)))
        return bool(await asyncio.wait_for(claimed, self.op_timeout_s))

    async def snapshot(self, pool: str) -> PoolSnapshot:
        snapshot = self._parse_snapshot(await self._run("snapshot", pool))
        self._depth[pool] = snapshot.depth
        return snapshot

    async def waiting_by_branch(self, pool: str) -> dict[str, dict[str, int]]:
        flat = await self._run("waiting", pool)
        return count_by_class_and_branch(zip(flat[::2], flat[1::2], strict=True))

    async def snapshots(self) -> dict[str, PoolSnapshot]:
        """Every pool's snapshot: one pipeline (one call per pool on a cluster), by `_submit`."""
        pools = list(self._prefix)
        results = await asyncio.gather(*(self._run("snapshot", pool) for pool in pools))
        return {pool: self._parse_snapshot(result) for pool, result in zip(pools, results, strict=True)}

    @staticmethod
    def _parse_snapshot(result: list) -> PoolSnapshot:
        depth, inflight, cost, max_inflight, budget, by_class, released, unbounded = result
        classes = {by_class[i]: int(by_class[i + 1]) for i in range(0, len(by_class), 2) if int(by_class[i + 1]) > 0}
        budget = int(budget)
        return PoolSnapshot(int(depth), int(inflight), int(max_inflight), classes, int(cost),
                            None if budget < 0 else budget, int(released), int(unbounded))

    async def close(self) -> None:
        self._closed = True
        for future in list(self._futures.values()):
            if not future.done():
                future.set_exception(StoreClosed())

    def fail_waiters(self, error: BaseException) -> None:
        """Wake every local waiter with `error` (Redis became unreachable)."""
        for future in list(self._futures.values()):
            if not future.done():
                future.set_exception(error)

    # -- background loops ---------------------------------------------------------------------

    async def _wake_loop(self, pool: str) -> None:
        """Hand admissions made by any replica's script to this replica's waiters."""
        client = self.address.connect(self.op_timeout_s, blocking=True)
        self._wake_clients.append(client)  # closed by stop(), not here: this task is cancelled
        key = self._wake_key(pool)
        while not self._stopping.is_set():
            try:
                item = await client.blpop([key], timeout=0.5)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.debug("wake loop %s: %s", pool, error)
                await self._pause(0.2)
                continue
            if item is None:
                continue
            future = self._futures.get(item[1])
            if future is not None and not future.done():
                future.set_result(None)
            # No local waiter: it withdrew at that instant and learned from `cancel` that
            # it holds the slot, so it owns the lease now.

    async def _pause(self, seconds: float) -> None:
        """Sleep, or return at once when the store stops."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _renew_loop(self) -> None:
        interval = self.lease_ms / 3000
        while not self._stopping.is_set():
            await self._pause(interval)
            if self._stopping.is_set():
                return
            try:
                await self.renew_all()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("lease renewal failed: %s", error)

    async def renew_all(self) -> None:
        """Renew every lease this replica holds, one script call per pool, in one pipeline (one
        call each on a cluster), by `_submit`."""
        pools = list(self._prefix)
        results = await asyncio.gather(*(self._run("renew", pool, *self._renewal(pool)) for pool in pools))
        for pool, result in zip(pools, results, strict=True):
            await self._settle_renewal(pool, result)

    async def _settle_renewal(self, pool: str, result: list) -> None:
        lost, restored, _admitted = result
        for ticket_id in lost:
            if ticket_id in self._leases[pool]:
                log.warning("lease of %s in %s expired before renewal", ticket_id, pool)
        for ticket_id in restored:
            if ticket_id in self._leases[pool]:
                log.warning("Redis had lost the lease of %s in %s while it ran: counted again", ticket_id, pool)
            else:
                # Released while this renewal was on its way, and the release reached Redis
                # first: the renewal counted it again, so release it once more.
                await self._run("release", pool, self.replica, self.lease_ms, ticket_id)

    def _renewal(self, pool: str) -> list:
        """The renew script's arguments: owner, lease length, then id, cost, long per lease."""
        args: list = [self.replica, self.lease_ms]
        for ticket_id, lease in self._leases[pool].items():
            args += [ticket_id, lease.ticket.cost, int(lease.ticket.long) + 2 * int(not lease.ticket.bounded)]
        return args

    def adopt(self, lease: Lease) -> None:
        """Hold a lease issued elsewhere (while Redis was unreachable) through Redis from now
        on: the next renewal counts it there."""
        self._leases[lease.pool][lease.ticket.id] = lease

    async def _report_loop(self) -> None:
        while not self._stopping.is_set():
            await self._pause(0.25)
            try:
                snapshots = await self.snapshots()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self.on_error(error)  # noticed without waiting for the next request
                continue
            for pool, snapshot in snapshots.items():
                self._seen(pool, snapshot)
