"""The admission decision, pure: queue-depth tiers, where a request goes, and the waiting line
of one pool. No asyncio, gRPC or clocks here; callers pass in what they observed.

Theory of operation
-------------------
Each pool has `max_inflight` slots and, when its KV capacity is known, a token budget (see
capacity.py). A request that fits when it arrives, with nobody ahead of it, is admitted at once;
otherwise it joins the pool's line, ordered by (score, arrival sequence): lower score first,
first come first served within equal scores. Every release, and every growth of the limits,
admits from the head of the line while the head fits. A ticket leaves the line exactly one way: admitted,
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
    cost: int = field(compare=False, default=0)  # tokens of KV cache it may hold
    long: bool = field(compare=False, default=False)  # counted against the long-request share


class CancelResult(enum.Enum):
    REMOVED = "removed"  # it was waiting; now it is gone
    HOLDS_SLOT = "holds_slot"  # it had already been admitted: the caller owns a slot
    UNKNOWN = "unknown"  # never seen, or already finished


class _Fit(enum.Enum):
    YES = "yes"
    NO = "no"  # wait; and so does everyone behind it (order is kept)
    LANE_FULL = "lane_full"  # a long request over the long share: others may pass it


class PoolLine:
    """One pool's slots, token budget and waiting line.

    A ticket is admitted while the count stays within `max_inflight` and the admitted cost
    within `budget_tokens` (None: no token budget). Long tickets together may hold at most
    `long_share` of the budget; a long ticket held back only by that share does not block the
    tickets behind it, so short requests keep flowing during a burst of long ones. A lone
    ticket is always admitted into an empty pool, so a shrunken budget cannot wedge the line.
    """

    def __init__(self, max_inflight: int, budget_tokens: int | None = None, long_share: float = 1.0):
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.max_inflight = max_inflight
        self.budget_tokens = budget_tokens
        self.long_share = long_share
        self.inflight = 0
        self.inflight_cost = 0
        self.long_cost = 0
        self._heap: list[Ticket] = []
        self._waiting: dict[str, Ticket] = {}
        self._admitted: dict[str, Ticket] = {}
        self._by_class: Counter[str] = Counter()

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def depth_by_class(self) -> dict[str, int]:
        return {name: count for name, count in self._by_class.items() if count}

    def offer(self, ticket: Ticket) -> list[Ticket]:
        """Put `ticket` in line and admit what fits; returns the tickets admitted (at most
        `ticket` itself, since everyone already waiting was checked at the last change)."""
        if ticket.id in self._waiting or ticket.id in self._admitted:
            raise ValueError(f"ticket {ticket.id} offered twice")
        heapq.heappush(self._heap, ticket)
        self._waiting[ticket.id] = ticket
        self._by_class[ticket.class_name] += 1
        return self._fill()

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
        ticket = self._admitted.pop(ticket_id, None)
        if ticket is None:
            return []  # already released: exactly once
        self.inflight -= 1
        self.inflight_cost -= ticket.cost
        if ticket.long:
            self.long_cost -= ticket.cost
        return self._fill()

    def set_limits(self, max_inflight: int, budget_tokens: int | None) -> list[Ticket]:
        """New limits (from the load probes); returns tickets admitted if they grew."""
        self.max_inflight = max(1, max_inflight)
        self.budget_tokens = budget_tokens
        return self._fill()

    def _fits(self, ticket: Ticket) -> _Fit:
        if self.inflight >= self.max_inflight:
            return _Fit.NO
        if self.budget_tokens is None or self.inflight == 0:
            return _Fit.YES
        if ticket.long and self.long_cost + ticket.cost > self.budget_tokens * self.long_share:
            return _Fit.LANE_FULL
        return _Fit.YES if self.inflight_cost + ticket.cost <= self.budget_tokens else _Fit.NO

    def _fill(self) -> list[Ticket]:
        admitted: list[Ticket] = []
        passed: list[Ticket] = []
        while self._heap:
            ticket = self._heap[0]
            if ticket.id not in self._waiting:
                heapq.heappop(self._heap)  # cancelled while waiting
                continue
            fit = self._fits(ticket)
            if fit is _Fit.NO:
                break
            heapq.heappop(self._heap)
            if fit is _Fit.LANE_FULL:
                passed.append(ticket)
                continue
            del self._waiting[ticket.id]
            self._by_class[ticket.class_name] -= 1
            self._admitted[ticket.id] = ticket
            self.inflight += 1
            self.inflight_cost += ticket.cost
            if ticket.long:
                self.long_cost += ticket.cost
            admitted.append(ticket)
        for ticket in passed:
            heapq.heappush(self._heap, ticket)
        if not self._waiting:
            self._heap.clear()  # drop cancelled leftovers
        return admitted
