"""What happens while the shared queue (Redis) is unreachable.

`DegradableQueueStore` puts the Redis store first. The first Redis error trips it into the
configured degraded mode (`redis.on_failure`), with a log line and a metric, until a background
ping finds Redis again:

- `local`: an in-process store with this replica's share of each pool's capacity: one over the
  replicas (`redis.replicas`, else as many as Redis counted live at this replica's last renewal
  before it failed, else two), or `redis.local_share` when set. The replicas' shares then add up
  to at most the pool, unless a pool has fewer slots than replicas (each keeps one);
- `open`: admit at once, without queueing or counting;
- `closed`: answer 503 with retry-after.

Requests already waiting in Redis are not lost in the switch: each is woken and placed again in
the degraded mode, so each gets an answer. Leases keep the store that issued them; Redis-held
leases that cannot be released expire by themselves within one lease.

When Redis answers again, the counts are made whole: the pools' limits are written again, the
requests admitted meanwhile (in `local` or `open` mode) and still running are counted in Redis
too, and the renewal that follows counts again any Redis lease that Redis lost (restarted
empty, or failed over before the write reached the replica). Over-admission after a write loss
lasts until that renewal, at most a third of a lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import redis

from ..core.admission import PoolLimits, Ticket
from ..core.appointments import AppointmentRequest
from ..core.config import Config
from ..core.outcomes import store_unavailable
from .local_queue import LocalQueueStore
from .queue import Lease, PoolSnapshot, SharedQueueStore, Waiter

T = TypeVar("T")

log = logging.getLogger("extproc.redis")

REDIS_ERRORS = (redis.RedisError, OSError, asyncio.TimeoutError)
# Replicas assumed while none are configured and Redis never counted them (it failed first).
ASSUMED_REPLICAS = 2


class RedisUnavailable(Exception):
    """Raised into Redis waiters when the store trips."""


class DegradableQueueStore:
    """Redis first; while Redis is unreachable, the degraded mode (see the module's doc). The
    Redis store it wraps reports the failures of its background calls to `trip` (its `on_error`,
    given when it is built: stores/factory.py)."""

    def __init__(
        self,
        shared: SharedQueueStore,
        local: LocalQueueStore,
        on_failure: str,
        local_share: float | None,
        recheck_s: float,
        retry_after_s: int,
        on_mode_change: Callable[[bool], None] = lambda degraded: None,
        clock: Callable[[], float] = time.monotonic,
        replicas: int | None = None,
    ):
        self.shared = shared
        self.local = local
        self.on_failure = on_failure
        self.local_share = local_share  # None: one over the replicas
        self.replicas = replicas  # None: as many as Redis counts
        self.recheck_s = recheck_s
        self.retry_after_s = retry_after_s
        self._on_mode_change = on_mode_change
        self.clock = clock
        self.degraded = False
        self._issuer: dict[str, str] = {}  # ticket id -> "local" | "open" (absent: Redis)
        self._held_elsewhere: dict[str, Lease] = {}  # leases issued while degraded, still held
        self._adopted: dict[str, Lease] = {}  # ticket id -> its Redis copy, once Redis is back
        self._recovery: asyncio.Task | None = None

    def reconfigure(self, config: Config, old: Config) -> None:
        """A reload's settings: the answer while Redis is down (`closed`), and the life of a
        ticket waiting in Redis, which outlives the longest wait."""
        self.retry_after_s = config.retry_after_s.overloaded

        def longest(settings: Config) -> float:
            return max(policy.max_wait_s for policy in settings.classes.values())

        self.shared.ticket_ttl_ms += int((longest(config) - longest(old)) * 1000)

    # -- mode ---------------------------------------------------------------------------------

    def trip(self, error: BaseException) -> None:
        """Redis failed: the degraded mode, until it answers again."""
        if self.degraded:
            return
        self.degraded = True
        log.error("Redis unreachable (%s: %s): queue store now %r until it answers again",
                  type(error).__name__, error, self.on_failure)
        self._on_mode_change(True)
        self.shared.fail_waiters(RedisUnavailable())
        self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        while True:
            while not await self.shared.ping():
                await asyncio.sleep(self.recheck_s)
            await self.shared.drop_idle_connections()  # those from before the outage are dead
            try:
                await self._reconcile()
                break
            except REDIS_ERRORS as error:
                log.warning("Redis answered, then failed again (%s); still %r", error, self.on_failure)
                await asyncio.sleep(self.recheck_s)
        self.degraded = False
        log.warning("Redis answers again: shared queue restored")
        self._on_mode_change(False)

    async def _reconcile(self) -> None:
        """Make Redis's counts whole again before it takes requests."""
        for pool, limits in self.shared.limits.items():
            await self.shared.set_limits(pool, limits)
        for ticket_id, lease in list(self._held_elsewhere.items()):
            if ticket_id not in self._adopted:
                copy = Lease(lease.pool, lease.ticket)
                self.shared.adopt(copy)
                self._adopted[ticket_id] = copy
        await self.shared.renew_all()

    # -- the QueueStore interface -------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.shared.start()
        except REDIS_ERRORS as error:
            self.trip(error)
        for pool, limits in self.shared.limits.items():
            await self._set_local_limits(pool, limits)

    async def stop(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
        await self.shared.stop()

    async def enqueue(self, pool: str, ticket: Ticket) -> Lease | Waiter:
        if not self.degraded:
            try:
                return await self.shared.enqueue(pool, ticket)
            except REDIS_ERRORS as error:
                self.trip(error)
        return await self._degraded_enqueue(pool, ticket)

    async def _degraded_enqueue(self, pool: str, ticket: Ticket) -> Lease | Waiter:
        if self.on_failure == "closed":
            raise store_unavailable(self.retry_after_s)
        self._issuer[ticket.id] = self.on_failure
        if self.on_failure == "open":
            return self._issued_elsewhere(Lease(pool, ticket))
        result = await self.local.enqueue(pool, ticket)
        return self._issued_elsewhere(result) if isinstance(result, Lease) else result

    def _issued_elsewhere(self, lease: Lease) -> Lease:
        self._held_elsewhere[lease.ticket.id] = lease
        return lease

    async def wait(self, waiter: Waiter, timeout_s: float) -> Lease:
        if self._issuer.get(waiter.ticket.id) == "local":
            return self._issued_elsewhere(await self.local.wait(waiter, timeout_s))
        started = self.clock()
        try:
            return await self.shared.wait(waiter, timeout_s)
        except (RedisUnavailable, *REDIS_ERRORS) as error:
            self.trip(error)
        # Placed again in the degraded mode, with what is left of its wait.
        result = await self._degraded_enqueue(waiter.pool, waiter.ticket)
        if isinstance(result, Lease):
            return result
        return self._issued_elsewhere(await self.local.wait(result, timeout_s - (self.clock() - started)))

    def withdraw(self, waiter: Waiter) -> None:
        if self._issuer.pop(waiter.ticket.id, None) == "local":
            self.local.withdraw(waiter)
        else:
            self.shared.withdraw(waiter)

    async def release(self, lease: Lease) -> None:
        # Every release is handed over before the first await: a caller cancelled meanwhile
        # (Envoy resets the stream at the end of an exchange) cannot leave one undone.
        self._held_elsewhere.pop(lease.ticket.id, None)
        pending = []
        copy = self._adopted.pop(lease.ticket.id, None)
        if copy is not None:
            pending.append(self.shared.release_soon(copy))
        issuer = self._issuer.pop(lease.ticket.id, None)
        if issuer == "open":
            lease.released = True
        elif issuer == "local":
            await self.local.release(lease)  # in-process: never suspends
        else:
            pending.append(self.shared.release_soon(lease))
        for answer in pending:
            if answer is None:
                continue
            try:
                await answer
            except REDIS_ERRORS as error:
                self.trip(error)  # the lease expires by itself within lease_s

    async def _read(self, shared: Callable[..., Awaitable[T]], local: Callable[..., Awaitable[T]], *args) -> T:
        """A read answered by Redis while it answers, else (or when it fails now) by the
        in-process store."""
        if not self.degraded:
            try:
                return await shared(*args)
            except REDIS_ERRORS as error:
                self.trip(error)
        return await local(*args)

    def place(self, lease: Lease, endpoint: str) -> None:
        issuer = self._issuer.get(lease.ticket.id)
        if issuer == "local":
            self.local.place(lease, endpoint)
        elif issuer != "open":
            self.shared.place(lease, endpoint)

    async def placements(self, pool: str) -> dict[str, int]:
        return await self._read(self.shared.placements, self.local.placements, pool)

    async def snapshot(self, pool: str) -> PoolSnapshot:
        return await self._read(self.shared.snapshot, self.local.snapshot, pool)

    async def book_appointment(self, pool: str, request: AppointmentRequest) -> float | None:
        return await self._read(self.shared.book_appointment, self.local.book_appointment, pool, request)

    async def waiting_by_branch(self, pool: str) -> dict[str, dict[str, int]]:
        return await self._read(self.shared.waiting_by_branch, self.local.waiting_by_branch, pool)

    def depth(self, pool: str) -> int:
        return self.local.depth(pool) if self.degraded else self.shared.depth(pool)

    def share(self, pool: str) -> float:
        """This replica's share of `pool` while Redis is unreachable (see the module's doc)."""
        if self.local_share is not None:
            return self.local_share
        return 1 / (self.replicas or self.shared.replicas(pool) or ASSUMED_REPLICAS)

    def replicas_hearing(self, pool: str) -> int:
        """Over how many replicas the arrivals at `pool` are spread (each arrival one replica
        hears stands for that many, in the capacity model): as many as Redis counts live, else
        `redis.replicas`, else 1 (alone until counted). While degraded, 1: the line and the
        in-flight count this replica reads are then its own, and so are its arrivals."""
        if self.degraded:
            return 1
        return self.shared.replicas(pool) or self.replicas or 1

    async def _set_local_limits(self, pool: str, limits: PoolLimits) -> None:
        share = self.share(pool)
        budget, cap = limits.budget_tokens, limits.latency_cap
        await self.local.set_limits(pool, replace(
            limits, max_inflight=max(1, int(limits.max_inflight * share)),
            budget_tokens=None if budget is None else int(budget * share),
            latency_cap=None if cap is None else max(1, int(cap * share))))

    async def set_limits(self, pool: str, limits: PoolLimits) -> None:
        await self._set_local_limits(pool, limits)
        if self.degraded:
            self.shared.limits[pool] = limits  # written to Redis on recovery
            return
        try:
            await self.shared.set_limits(pool, limits)
        except REDIS_ERRORS as error:
            self.trip(error)

    async def close(self) -> None:
        await self.local.close()
        await self.shared.close()

