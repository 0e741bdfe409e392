"""The queue store's contract: where tickets wait and slots are counted.

`QueueStore` is what the admission gate uses, and every implementation keeps it (one contract
suite runs over all of them: tests/stores/test_store_contract.py): `LocalQueueStore` in this process
(local_queue.py), `RedisQueueStore` shared by every replica (redis_queue.py), and
`DegradableQueueStore`, Redis first and a degraded mode while Redis is down (degradable_queue.py).
A store that several replicas share adds `SharedQueueStore`: what the degradable store needs of it.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Protocol

from ..core.admission import PoolLimits, Ticket
from ..core.appointments import AppointmentRequest


class WaitExpired(Exception):
    """The ticket's wait ran out before a slot was free; it has left the line."""


class StoreClosed(Exception):
    """The store stopped handing out slots (the server is draining)."""


class LeaseFlags(enum.IntFlag):
    """What an admitted ticket counts against, kept with its lease (the Redis scripts are given
    the same bits: stores/scripts.py)."""

    LONG = 1  # the long-request share of the budget
    UNBOUNDED = 2  # the latency cap: its class has no latency target

    @classmethod
    def of(cls, ticket: Ticket) -> LeaseFlags:
        return (cls.LONG if ticket.long else cls(0)) | (cls(0) if ticket.bounded else cls.UNBOUNDED)


@dataclass(slots=True)
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

    def place(self, lease: Lease, endpoint: str) -> None:
        """The admitted lease runs on backend `endpoint` ("IP:PORT"): counted there until it is
        released (or, in a shared store, reaped), or placed again elsewhere. A lease released
        already is not placed. Handed over at once, without suspending; never raises."""

    async def placements(self, pool: str) -> dict[str, int]:
        """The cost of the leases placed on each backend of `pool` (by every replica, for a
        shared store): what the backend picker counts as placed by others."""

    async def snapshot(self, pool: str) -> PoolSnapshot:
        """Depth, in-flight count and cost of `pool` (across replicas for a shared store)."""

    async def waiting_by_branch(self, pool: str) -> dict[str, dict[str, int]]:
        """Read-only: `pool`'s waiting tickets counted by class, then branch (across replicas
        for a shared store). For the queue page; not on the request path."""

    def depth(self, pool: str) -> int:
        """The queue depth the tiers act on, without waiting: exact for an in-process store; a
        shared store answers with the depth it saw last, refreshed by its own operations."""

    async def set_limits(self, pool: str, limits: PoolLimits) -> None:
        """Apply new limits from the load probes; admit waiters if they grew."""

    async def book_appointment(self, pool: str, request: AppointmentRequest) -> float | None:
        """An appointment in `pool`'s book (core/appointments.book, across replicas for a shared
        store): seconds from now, or None when none is left within its latest time."""

    async def close(self) -> None:
        """Stop admitting: every waiter gets StoreClosed; leases stay valid until released."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class SharedQueueStore(QueueStore, Protocol):
    """A queue store shared by several replicas (Redis): what the degradable store relies on to
    notice it failing and to make its counts whole when it answers again (the failures of its
    background calls it reports to the `on_error` it was built with)."""

    limits: dict[str, PoolLimits]  # the limits last set, per pool: written again on recovery
    ticket_ttl_ms: int  # how long a ticket waiting in it lives: beyond the longest wait

    async def ping(self) -> bool:
        """Whether the store answers, within its operation timeout."""

    def fail_waiters(self, error: BaseException) -> None:
        """Wake every waiter of this replica with `error` (the store became unreachable)."""

    def release_soon(self, lease: Lease) -> asyncio.Future | None:
        """Hand the release over now (nothing can cancel it); await the result to hear of a
        failure. None when the lease was released already."""

    def adopt(self, lease: Lease) -> None:
        """Hold a lease issued elsewhere (while the store was unreachable) from now on: the
        next renewal counts it in the shared store."""

    async def renew_all(self) -> None:
        """Renew every lease this replica holds; counts again any the store lost."""

    def replicas(self, pool: str) -> int | None:
        """The replicas sharing `pool` that were live at this replica's last renewal (None:
        not counted yet)."""


def count_by_class_and_branch(pairs) -> dict[str, dict[str, int]]:
    """{class: {branch: waiting}} from (class, branch) pairs: what `waiting_by_branch` answers."""
    counts: dict[str, dict[str, int]] = {}
    for class_name, branch in pairs:
        branches = counts.setdefault(class_name, {})
        branches[branch] = branches.get(branch, 0) + 1
    return counts
