"""Queue stores: where tickets wait and slots are counted.

`QueueStore` is the interface the admission gate uses; `LocalQueueStore` keeps everything in
this process (the default). A store shared by several replicas implements the same interface.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..core.admission import CancelResult, PoolLine, Ticket


class WaitExpired(Exception):
    """The ticket's wait ran out before a slot was free; it has left the line."""


class StoreClosed(Exception):
    """The store stopped handing out slots (the server is draining)."""


@dataclass
class Lease:
    """An admitted ticket's claim on one slot of `pool`; released exactly once."""

    pool: str
    ticket: Ticket
    released: bool = False


@dataclass
class Waiter:
    pool: str
    ticket: Ticket
    admitted: asyncio.Future[None] = field(repr=False)


@dataclass(frozen=True)
class PoolSnapshot:
    depth: int
    inflight: int
    max_inflight: int
    depth_by_class: dict[str, int]
    inflight_tokens: int = 0
    budget_tokens: int | None = None
    released_total: int = 0  # slots given back so far (across replicas for a shared store)
    unbounded_inflight: int = 0  # admitted requests of classes without a latency target (held to the latency cap)


class QueueStore(Protocol):
    async def enqueue(self, pool: str, ticket: Ticket) -> Lease | Waiter:
        """Admit at once (a Lease) or put the ticket in line (a Waiter)."""

    async def wait(self, waiter: Waiter, timeout_s: float) -> Lease:
        """Wait for admission. Raises WaitExpired or StoreClosed; on cancellation the ticket
        leaves the line (or its slot is released if it was admitted at that instant)."""

    def withdraw(self, waiter: Waiter) -> None:
        """The waiter's exchange ended without waiting (its stream closed between `enqueue` and
        `wait`): the ticket leaves the line, or gives its slot back if it was admitted
        meanwhile. Handed over at once, without suspending; never raises."""

    async def release(self, lease: Lease) -> None:
        """Return the slot; a second release of the same lease does nothing. The release takes
        effect (or is handed to the shared store) before the first suspension, so cancelling
        the caller afterwards cannot undo it."""

    async def snapshot(self, pool: str) -> PoolSnapshot:
        """Depth, in-flight count and cost of `pool` (across replicas for a shared store)."""

    async def waiting_by_branch(self, pool: str) -> dict[str, dict[str, int]]:
        """Read-only: `pool`'s waiting tickets counted by class, then branch (across replicas
        for a shared store). For the queue page; not on the request path."""

    def depth(self, pool: str) -> int:
        """The queue depth the tiers act on, without waiting: exact for an in-process store; a
        shared store answers with the depth it saw last, refreshed by its own operations."""

    async def set_limits(self, pool: str, max_inflight: int, budget_tokens: int | None,
                         latency_cap: int | None = None, spread: int = 1) -> None:
        """Apply new limits from the load probes; admit waiters if they grew. Requests of
        classes without a latency target run only while fewer than `latency_cap` of them do; `spread`:
        see PoolLine."""

    async def claim_once(self, pool: str, what: str, every_s: float) -> bool:
        """True for the first claim of `what` for `pool` in each `every_s` (across replicas for
        a shared store): one replica acts, the others stand down."""

    async def close(self) -> None:
        """Stop admitting: every waiter gets StoreClosed; leases stay valid until released."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def count_by_class_and_branch(pairs) -> dict[str, dict[str, int]]:
    """{class: {branch: waiting}} from (class, branch) pairs: what `waiting_by_branch` answers."""
    counts: dict[str, dict[str, int]] = {}
    for class_name, branch in pairs:
        branches = counts.setdefault(class_name, {})
        branches[branch] = branches.get(branch, 0) + 1
    return counts


class LocalQueueStore:
    def __init__(
        self,
        max_inflight: dict[str, int],
        on_change: Callable[[str, PoolSnapshot], None] | None = None,
        long_share: dict[str, float] | None = None,
        promote_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        shares = long_share or {}
        self._lines = {
            pool: PoolLine(limit, long_share=shares.get(pool, 1.0), promote_after_s=promote_after_s)
            for pool, limit in max_inflight.items()
        }
        self._futures: dict[str, asyncio.Future[None]] = {}
        self._notify = on_change or (lambda pool, snapshot: None)
        self._clock = clock
        self._closed = False
        self._claimed_until: dict[tuple[str, str], float] = {}

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def _on_change(self, pool: str) -> None:
        # The line itself, read-only: it has every field of a PoolSnapshot, and copying them on
        # each of a request's two changes would cost more than everything else the store does.
        self._notify(pool, self._lines[pool])  # type: ignore[arg-type]

    async def enqueue(self, pool: str, ticket: Ticket) -> Lease | Waiter:
        if self._closed:
            raise StoreClosed()
        admitted = self._lines[pool].offer(ticket, self._clock())
        self._wake(admitted, except_id=ticket.id)
        self._on_change(pool)
        if any(t.id == ticket.id for t in admitted):
            return Lease(pool, ticket)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[ticket.id] = future
        return Waiter(pool, ticket, future)

    def _wake(self, admitted: list[Ticket], except_id: str | None = None) -> None:
        for ticket in admitted:
            future = self._futures.get(ticket.id)
            if ticket.id != except_id and future is not None and not future.done():
                future.set_result(None)

    async def set_limits(self, pool: str, max_inflight: int, budget_tokens: int | None,
                         latency_cap: int | None = None, spread: int = 1) -> None:
        self._wake(self._lines[pool].set_limits(max_inflight, budget_tokens, self._clock(), latency_cap, spread))
        self._on_change(pool)

    async def wait(self, waiter: Waiter, timeout_s: float) -> Lease:
        ticket_id = waiter.ticket.id
        try:
            # asyncio.timeout, not wait_for: wait_for can swallow a cancellation that arrives
            # just after the future resolved, and a cancelled waiter must never keep a slot.
            async with asyncio.timeout(max(0.0, timeout_s)):
                await asyncio.shield(waiter.admitted)
            return Lease(waiter.pool, waiter.ticket)
        except TimeoutError:
            if self._leave_line(waiter) is CancelResult.HOLDS_SLOT:
                return Lease(waiter.pool, waiter.ticket)  # admitted at the same instant
            raise WaitExpired() from None
        except asyncio.CancelledError:
            if self._leave_line(waiter) is CancelResult.HOLDS_SLOT:
                await self.release(Lease(waiter.pool, waiter.ticket))
            raise
        except StoreClosed:
            self._leave_line(waiter)
            raise
        finally:
            self._futures.pop(ticket_id, None)

    def withdraw(self, waiter: Waiter) -> None:
        self._futures.pop(waiter.ticket.id, None)
        if self._leave_line(waiter) is CancelResult.HOLDS_SLOT:
            self._release_now(Lease(waiter.pool, waiter.ticket))

    def _leave_line(self, waiter: Waiter) -> CancelResult:
        result = self._lines[waiter.pool].cancel(waiter.ticket.id)
        if result is CancelResult.REMOVED:
            self._on_change(waiter.pool)
        return result

    async def release(self, lease: Lease) -> None:
        self._release_now(lease)

    def _release_now(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self._wake(self._lines[lease.pool].release(lease.ticket.id, self._clock()))
        self._on_change(lease.pool)

    async def snapshot(self, pool: str) -> PoolSnapshot:
        return self._snapshot(pool)

    async def waiting_by_branch(self, pool: str) -> dict[str, dict[str, int]]:
        return count_by_class_and_branch((t.class_name, t.branch_id) for t in self._lines[pool].waiting_tickets())

    async def claim_once(self, pool: str, what: str, every_s: float) -> bool:
        now = self._clock()
        if self._claimed_until.get((pool, what), now) > now:
            return False
        self._claimed_until[(pool, what)] = now + every_s
        return True

    def depth(self, pool: str) -> int:
        return self._lines[pool].depth

    def _snapshot(self, pool: str) -> PoolSnapshot:
        line = self._lines[pool]
        return PoolSnapshot(
            line.depth, line.inflight, line.max_inflight, line.depth_by_class, line.inflight_cost, line.budget_tokens,
            line.released_total, line.unbounded_inflight,
        )

    async def close(self) -> None:
        self._closed = True
        for future in list(self._futures.values()):
            if not future.done():
                future.set_exception(StoreClosed())
