"""The in-process queue store: every pool's line (core/admission.PoolLine) in this process,
waiters woken through futures. The default; with several replicas, each counts only its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..core.admission import CancelResult, PoolLimits, PoolLine, Ticket
from ..core.appointments import AppointmentRequest, book
from .queue import Lease, PoolSnapshot, StoreClosed, Waiter, WaitExpired, count_by_class_and_branch


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
        self._books: dict[str, dict[str, float]] = {}  # pool -> class -> the book's next free time
        self._kept: dict[str, dict[str, float]] = {}  # pool -> request name -> its appointment
        self._kept_limit = 1024  # past this many, the appointments already past are forgotten
        self._placed: dict[str, tuple[str, str, int]] = {}  # ticket id -> (pool, backend, cost)

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
        if admitted != [ticket]:  # (admitted alone: nobody else to wake)
            self._wake(admitted, except_id=ticket.id)
        self._on_change(pool)
        if any(t is ticket for t in admitted):
            return Lease(pool, ticket)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[ticket.id] = future
        return Waiter(pool, ticket, future)

    def _wake(self, admitted: list[Ticket], except_id: str | None = None) -> None:
        for ticket in admitted:
            future = self._futures.get(ticket.id)
            if ticket.id != except_id and future is not None and not future.done():
                future.set_result(None)

    async def set_limits(self, pool: str, limits: PoolLimits) -> None:
        self._wake(self._lines[pool].set_limits(limits, self._clock()))
        self._on_change(pool)

    async def book_appointment(self, pool: str, request: AppointmentRequest) -> float | None:
        now = self._clock()
        pages = self._books.setdefault(pool, {})
        kept = self._kept.setdefault(pool, {})
        booking = book(now, pages, request, kept.get(request.name) if request.name else None)
        if booking is None:
            return None
        pages.update(booking.next_free)
        if request.name:
            if len(kept) >= self._kept_limit:  # (the limit doubles past what is left: amortized)
                self._kept[pool] = kept = {name: at for name, at in kept.items() if at > now}
                self._kept_limit = max(1024, 2 * len(kept))
            kept[request.name] = booking.at
        return booking.at - now

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

    def place(self, lease: Lease, endpoint: str) -> None:
        if not lease.released:
            self._placed[lease.ticket.id] = (lease.pool, endpoint, lease.ticket.cost)

    async def placements(self, pool: str) -> dict[str, int]:
        placed: dict[str, int] = {}
        for pool_, endpoint, cost in self._placed.values():
            if pool_ == pool:
                placed[endpoint] = placed.get(endpoint, 0) + cost
        return placed

    def _release_now(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self._placed.pop(lease.ticket.id, None)
        self._wake(self._lines[lease.pool].release(lease.ticket.id, self._clock()))
        self._on_change(lease.pool)

    async def snapshot(self, pool: str) -> PoolSnapshot:
        return self._snapshot(pool)

    async def waiting_by_branch(self, pool: str) -> dict[str, dict[str, int]]:
        return count_by_class_and_branch((t.class_name, t.branch_id) for t in self._lines[pool].waiting_tickets())

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
