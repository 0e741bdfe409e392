"""A queue store in Redis, shared by every sidecar replica in front of one pool.

Every operation that must be atomic is one Lua script (stores/lua/queue_*.lua): enqueue,
dispatch as many head tickets as capacity allows, cancel, release, renew, set limits.
Admissions reach the waiting replica through its wake list, popped by one BLPOP loop per pool:
no polling. Admitted tickets hold leases that this replica renews (batched, one pipeline per
round) while their exchange lasts; a replica that dies stops renewing and its slots come back
within one lease. Only the owner can release or renew a lease, and nothing can after it
expired. A lease that Redis lost (not expired) is counted again by its owner's next renewal.
A script call whose caller left while it was on its way still runs: what its answer grants (a
slot, a place in line) is given back when the answer comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..core.admission import CancelResult, PoolLimits, Ticket
from ..core.appointments import AppointmentRequest
from .queue import Lease, LeaseFlags, PoolSnapshot, StoreClosed, Waiter, WaitExpired, count_by_class_and_branch
from .redis_batch import ScriptBatch
from .redis_connection import RedisAddress, close_quietly, default_replica_id, drop_idle_connections
from .scripts import script

log = logging.getLogger("extproc.redis")

_SCRIPTS = ("enqueue", "cancel", "release", "renew", "limits", "snapshot", "waiting", "book", "place",
            "placements")


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
        on_error: Callable[[BaseException], None] | None = None,
    ):
        self.address = RedisAddress(address) if isinstance(address, str) else address
        self.replica = replica_id or default_replica_id()
        self.lease_ms = int(lease_s * 1000)
        self.op_timeout_s = op_timeout_s
        self.ticket_ttl_ms = int((max_wait_s + ttl_margin_s) * 1000)
        self.limits: dict[str, PoolLimits] = {pool: PoolLimits(n) for pool, n in max_inflight.items()}
        self._share = long_share or {}
        self._promote_ms = -1 if promote_after_s is None else int(promote_after_s * 1000)
        self._prefix = {pool: f"{{{key_prefix}:{pool}}}" for pool in max_inflight}
        self._notify = on_change or (lambda pool, snapshot: None)
        self._on_error = on_error or (lambda error: None)  # a background call failed
        self._client = self.address.connect(op_timeout_s)
        scripts = {name: self._client.register_script(script("queue", name)) for name in _SCRIPTS}
        # A release: owner and lease length, then the ids (the releases of one pool go as one call).
        self._calls = ScriptBatch(self._client, scripts, self.address.cluster, op_timeout_s, mergeable={"release": 2})
        self._futures: dict[str, asyncio.Future[None]] = {}
        self._leases: dict[str, dict[str, Lease]] = {pool: {} for pool in max_inflight}
        self._depth: dict[str, int] = {pool: 0 for pool in max_inflight}
        self._replicas: dict[str, int] = {}  # pool -> the replicas its last renewal counted
        self._tasks: list[asyncio.Task] = []
        self._wake_clients: list = []
        self._stopping = asyncio.Event()
        self._closed = False

    @property
    def cluster(self) -> bool:
        return self.address.cluster

    def _wake_key(self, pool: str) -> str:
        return f"{self._prefix[pool]}:wake:{self.replica}"

    def _run(self, name: str, pool: str, *args, urgent: bool = True) -> asyncio.Future:
        """One script call on `pool`'s keys, handed to Redis at once (see ScriptBatch)."""
        return self._calls.submit(name, self._prefix[pool], args, urgent)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        for pool, limits in self.limits.items():
            await self.set_limits(pool, limits)
        await self.renew_all()  # this replica counts among the live ones, and counts them, from now
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
            await close_quietly(client)
        for leases in self._leases.values():
            for lease in list(leases.values()):
                try:
                    await self.release(lease)
                except Exception:  # Redis gone: the leases expire by themselves
                    break
        await self._calls.close()
        await close_quietly(self._client)

    async def ping(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self._client.ping(), self.op_timeout_s))
        except Exception:
            return False

    async def drop_idle_connections(self) -> None:
        """After an outage: the pooled connections from before it are dead (redis_connection.py),
        and so may be the script calls' own, if no call is on it."""
        self._calls.drop_idle()
        await drop_idle_connections(self._client)

    # -- the QueueStore interface -------------------------------------------------------------

    async def enqueue(self, pool: str, ticket: Ticket) -> Lease | Waiter:
        if self._closed:
            raise StoreClosed()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[ticket.id] = future  # before the script: the wake may come at once
        answer = self._run("enqueue", pool, *self._enqueue_args(ticket))
        try:
            admitted, state = await asyncio.shield(answer)
        except asyncio.CancelledError:
            # The caller left with the call on its way: Redis runs it all the same, and what its
            # answer grants (a slot, a place in line) is given back when the answer comes.
            self._futures.pop(ticket.id, None)
            answer.add_done_callback(lambda done: self._give_back(pool, ticket, done))
            raise
        except BaseException:
            self._futures.pop(ticket.id, None)
            raise
        self._seen(pool, self._parse_snapshot(state))
        if ticket.id in admitted:
            self._futures.pop(ticket.id, None)
            return self._lease(pool, ticket)
        return Waiter(pool, ticket, future)

    def _enqueue_args(self, ticket: Ticket) -> tuple:
        """The enqueue script's arguments (queue_enqueue.lua)."""
        return (ticket.id, self.replica, repr(float(ticket.score)), ticket.class_name, ticket.branch_id, ticket.cost,
                int(ticket.long), self.ticket_ttl_ms, self.lease_ms, int(ticket.bounded),
                max(0, round(ticket.waited_s * 1000)))

    def _give_back(self, pool: str, ticket: Ticket, answer: asyncio.Future) -> None:
        """The answer to an enqueue whose caller left: its slot is released, or its place in
        line withdrawn. No answer within the bound: whether Redis ran it is unknown, and the
        ticket's TTL (in line) or its lease, which nobody renews (admitted), bounds what it holds."""
        if answer.cancelled() or answer.exception() is not None:
            log.warning("enqueue of %s left without its answer; its TTL or lease will end it", ticket.id)
        elif ticket.id in answer.result()[0]:
            self.release_soon(Lease(pool, ticket))
        else:
            self._withdraw(pool, ticket)

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
        self._withdraw(waiter.pool, waiter.ticket)

    def _withdraw(self, pool: str, ticket: Ticket) -> None:
        """Hand the ticket's leaving the line over now; a slot it turns out to hold goes back."""
        answer = self._run("cancel", pool, ticket.id, self.lease_ms)
        answer.add_done_callback(lambda done: self._settle_withdrawal(pool, ticket, done))

    def _settle_withdrawal(self, pool: str, ticket: Ticket, answer: asyncio.Future) -> None:
        if answer.cancelled() or answer.exception() is not None:
            log.warning("could not withdraw ticket %s; its TTL or lease will", ticket.id)
        elif answer.result()[0] == "holds":  # admitted meanwhile: the slot is this replica's to give back
            self.release_soon(self._lease(pool, ticket))

    async def _leave_line(self, waiter: Waiter) -> CancelResult:
        answer = self._run("cancel", waiter.pool, waiter.ticket.id, self.lease_ms)
        try:
            result, _ = await asyncio.shield(answer)
        except asyncio.CancelledError:  # cancelled again on its way: the answer settles it alone
            answer.add_done_callback(lambda done: self._settle_withdrawal(waiter.pool, waiter.ticket, done))
            raise
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
        return self._run("release", lease.pool, self.replica, self.lease_ms, lease.ticket.id, urgent=False)

    def place(self, lease: Lease, endpoint: str) -> None:
        if lease.released:
            return
        answer = self._run("place", lease.pool, self.replica, lease.ticket.id, endpoint, urgent=False)
        answer.add_done_callback(self._background_result)

    def _background_result(self, answer: asyncio.Future) -> None:
        if not answer.cancelled() and answer.exception() is not None:
            self._on_error(answer.exception())

    async def placements(self, pool: str) -> dict[str, int]:
        flat = await self._run("placements", pool)
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def set_limits(self, pool: str, limits: PoolLimits) -> None:
        self.limits[pool] = limits
        budget, cap = limits.budget_tokens, limits.latency_cap
        await self._run(
            "limits", pool, max(1, limits.max_inflight), -1 if budget is None else budget,
            self._share.get(pool, 1.0) if limits.long_share is None else limits.long_share, self._promote_ms,
            self.lease_ms, -1 if cap is None else cap,
            max(1, limits.spread), int(limits.long_alone), max(1, limits.engines),
            max(0, round(limits.long_quiet_s * 1000)),
        )

    async def book_appointment(self, pool: str, request: AppointmentRequest) -> float | None:
        latest = request.latest_s
        later = [x for name, horizon_s in request.served_later for x in (name, max(0, round(horizon_s * 1000)))]
        delay_ms = await self._run(
            "book", pool, request.class_name, max(0, round(request.earliest_s * 1000)),
            max(0, round(request.spacing_s * 1000)), -1 if latest is None else max(0, round(latest * 1000)),
            max(0, round(request.horizon_s * 1000)), request.name or "", int(request.again),
            len(request.served_first), *request.served_first, *later)
        return None if int(delay_ms) < 0 else int(delay_ms) / 1000

    async def snapshot(self, pool: str) -> PoolSnapshot:
        snapshot = self._parse_snapshot(await self._run("snapshot", pool))
        self._depth[pool] = snapshot.depth
        return snapshot

    async def waiting_by_branch(self, pool: str) -> dict[str, dict[str, int]]:
        flat = await self._run("waiting", pool)
        return count_by_class_and_branch(zip(flat[::2], flat[1::2], strict=True))

    async def snapshots(self) -> dict[str, PoolSnapshot]:
        """Every pool's snapshot: one pipeline (one call per pool on a cluster: ScriptBatch)."""
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
        call each on a cluster: ScriptBatch)."""
        pools = list(self._prefix)
        results = await asyncio.gather(*(self._run("renew", pool, *self._renewal(pool)) for pool in pools))
        for pool, result in zip(pools, results, strict=True):
            await self._settle_renewal(pool, result)

    def replicas(self, pool: str) -> int | None:
        """The replicas sharing `pool`, live as of this replica's last renewal (None: not
        counted yet): each renews every third of a lease, and one that has not for a lease is
        gone."""
        return self._replicas.get(pool)

    async def _settle_renewal(self, pool: str, result: list) -> None:
        lost, restored, _admitted, replicas = result
        self._replicas[pool] = int(replicas)
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
        """The renew script's arguments: owner, lease length, then id, cost, flags per lease."""
        args: list = [self.replica, self.lease_ms]
        for ticket_id, lease in self._leases[pool].items():
            args += [ticket_id, lease.ticket.cost, int(LeaseFlags.of(lease.ticket))]
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
                task = asyncio.current_task()
                if task is None or task.cancelling():  # this loop is being stopped
                    raise
                continue  # a call of the read was cancelled, not the loop: read again next time
            except Exception as error:
                self._on_error(error)  # noticed without waiting for the next request
                continue
            for pool, snapshot in snapshots.items():
                try:
                    self._seen(pool, snapshot)
                except Exception:  # a listener's error must not end the reports: the gauges would freeze
                    log.exception("reporting pool %s's shared state failed", pool)
