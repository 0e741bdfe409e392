"""The admission decision, pure: queue-depth tiers, where a request goes, and the waiting line
of one pool. No asyncio, gRPC or clocks here; callers pass in what they observed.

Theory of operation
-------------------
Each pool has `max_inflight` slots. A request that arrives when a slot is free and nobody is
waiting takes the slot at once; otherwise it joins the pool's line, ordered by (score, arrival
sequence): lower score first, first come first served within equal scores. Every release hands
the freed slot to the head of the line. A ticket leaves the line exactly one way: admitted,
cancelled (client gone), or expired (its class's wait ran out) -- `cancel` tells the caller
which, so a slot handed over at the same instant a waiter gave up is never lost.

Before joining a line, `place` looks at the pool's tier (from its queue depth) and may send a
degradable class to the fallback pool (orange and above) or shed it (red, unprotected classes;
any class at the hard maximum).
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import ClassPolicy, Config, Tiers
from .outcomes import Outcome


class Tier(enum.IntEnum):
    GREEN = 0
    YELLOW = 1  # scale-out signal
    ORANGE = 2  # degrade: degradable classes go to the fallback pool
    RED = 3  # shed unprotected classes


def tier_for(depth: int, tiers: Tiers) -> Tier:
    if depth > tiers.red:
        return Tier.RED
    if depth > tiers.orange:
        return Tier.ORANGE
    if depth > tiers.yellow:
        return Tier.YELLOW
    return Tier.GREEN


@dataclass(frozen=True)
class Placement:
    """Where a classified request should wait, or why it must not."""

    pool: str
    degraded: bool = False
    shed: Outcome | None = None


def place(class_name: str, config: Config, depth_of: Callable[[str], int]) -> Placement:
    policy: ClassPolicy = config.classes[class_name]
    pool_name = config.default_pool
    degraded = False
    pool = config.pools[pool_name]
    if (
        policy.degradable
        and pool.fallback is not None
        and tier_for(depth_of(pool_name), pool.tiers) >= Tier.ORANGE
    ):
        pool_name, degraded = pool.fallback, True
        pool = config.pools[pool_name]
    depth = depth_of(pool_name)
    if depth >= pool.tiers.hard_max:
        return Placement(pool_name, degraded, Outcome.SHED_QUEUE_FULL)
    if tier_for(depth, pool.tiers) is Tier.RED and not policy.protected:
        return Placement(pool_name, degraded, Outcome.SHED_OVERLOADED)
    return Placement(pool_name, degraded)


@dataclass(order=True, frozen=True)
class Ticket:
    score: float
    seq: int
    id: str = field(compare=False)
    class_name: str = field(compare=False)
    branch_id: str = field(compare=False, default="unknown")


class CancelResult(enum.Enum):
    REMOVED = "removed"  # it was waiting; now it is gone
    HOLDS_SLOT = "holds_slot"  # it had already been admitted: the caller owns a slot
    UNKNOWN = "unknown"  # never seen, or already finished


class PoolLine:
    """One pool's slots and waiting line."""

    def __init__(self, max_inflight: int):
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.max_inflight = max_inflight
        self.inflight = 0
        self._heap: list[Ticket] = []
        self._waiting: dict[str, Ticket] = {}
        self._admitted: set[str] = set()
        self._by_class: Counter[str] = Counter()

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def depth_by_class(self) -> dict[str, int]:
        return {name: count for name, count in self._by_class.items() if count}

    def offer(self, ticket: Ticket) -> bool:
        """Admit `ticket` now (True) or put it in line (False)."""
        if ticket.id in self._waiting or ticket.id in self._admitted:
            raise ValueError(f"ticket {ticket.id} offered twice")
        if self.inflight < self.max_inflight and not self._waiting:
            self.inflight += 1
            self._admitted.add(ticket.id)
            return True
        heapq.heappush(self._heap, ticket)
        self._waiting[ticket.id] = ticket
        self._by_class[ticket.class_name] += 1
        return False

    def cancel(self, ticket_id: str) -> CancelResult:
        ticket = self._waiting.pop(ticket_id, None)
        if ticket is not None:
            self._by_class[ticket.class_name] -= 1
            if len(self._heap) > 2 * len(self._waiting) + 64:
                self._heap = list(self._waiting.values())
                heapq.heapify(self._heap)
            return CancelResult.REMOVED  # otherwise its heap entry is skipped lazily
        if ticket_id in self._admitted:
            return CancelResult.HOLDS_SLOT
        return CancelResult.UNKNOWN

    def release(self, ticket_id: str) -> list[Ticket]:
        """Give back an admitted ticket's slot; return the tickets admitted in its place."""
        if ticket_id not in self._admitted:
            return []  # already released: exactly once
        self._admitted.discard(ticket_id)
        self.inflight -= 1
        return self._fill()

    def _fill(self) -> list[Ticket]:
        admitted: list[Ticket] = []
        while self.inflight < self.max_inflight and self._heap:
            ticket = heapq.heappop(self._heap)
            if self._waiting.pop(ticket.id, None) is None:
                continue  # cancelled while waiting
            self._by_class[ticket.class_name] -= 1
            self.inflight += 1
            self._admitted.add(ticket.id)
            admitted.append(ticket)
        if not self._waiting:
            self._heap.clear()  # drop cancelled leftovers
        return admitted
