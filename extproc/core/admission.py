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

The tiers (`tier_for`) are read from a pool's queue depth; routing.py acts on them: a degradable
class goes to the fallback pool from orange on, an unprotected one is shed at red, any class at
the hard maximum.
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from .pool_config import Tiers


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


@dataclass(frozen=True, slots=True)
class Ticket:
    score: float
    seq: int  # arrival order (a shared store assigns its own)
    id: str
    class_name: str
    branch_id: str = "unknown"
    cost: int = 0  # tokens of KV cache it may hold
    long: bool = False  # counted against the long-request share
    bounded: bool = True  # may go past the pool's latency cap (its class has a latency target)
    waited_s: float = 0.0  # since its first attempt: a request that comes back keeps its place


@dataclass(frozen=True)
class PoolLimits:
    """What a pool may hold at once (see PoolLine): the count and the token budget its engines'
    readings allow (capacity.pool_limits), and what the load control adds to them
    (control/load_control.py)."""

    max_inflight: int
    budget_tokens: int | None = None  # None: no token budget
    latency_cap: int | None = None  # the classes without a latency target run only this many at once
    spread: int = 1  # the backends the sidecar places requests on itself (1: Envoy places them)
    # Long tickets run one at a time and only while no latency-bound one does: nobody keeps them
    # on engines of their own (the pool's placement is Envoy's), and a long prefill slows every
    # request that shares its engine's steps or waits for them.
    long_alone: bool = False
    # ...and, with long_alone, a long ticket of a class without a latency target only once the
    # latency-bound tickets arrive no oftener than one per this long: none in the last
    # `long_quiet_s`, nor QUIET_ARRIVALS in the last QUIET_ARRIVALS x `long_quiet_s` (0: at once).
    # Whoever comes to a long prompt's engine in its prefill waits for it, and Envoy may send a
    # loan there; one quiet spell alone says little in a burst (its next loan comes as soon).
    # A spell counts once the line has watched it: the moment it starts counting is an arrival.
    long_quiet_s: float = 0.0
    # the share of the budget long tickets may hold together, as the engines that answer now
    # allow it (core/capacity.long_lane_share); None: the share the line was built with
    long_share: float | None = None
    engines: int = 1  # the engines the budget counts: a long ticket alone may take one's part of it


# The latency-bound arrivals a long ticket's quiet spell counts (PoolLimits.long_quiet_s): the
# rate of the last four, and the last one's distance, both at most one per `long_quiet_s`.
QUIET_ARRIVALS = 4

# How long a branch with nobody in line is remembered after its last new ticket (PoolLine).
FORGET_BRANCH_AFTER_S = 60.0


class CancelResult(enum.Enum):
    REMOVED = "removed"  # it was waiting; now it is gone
    HOLDS_SLOT = "holds_slot"  # it had already been admitted: the caller owns a slot
    UNKNOWN = "unknown"  # never seen, or already finished


class _Admit(enum.Enum):
    """Whether a ticket is admitted now (PoolLine._admits), and if not, whether those behind it may pass."""

    YES = "yes"
    NO = "no"  # wait; and so does everyone behind it (order is kept)
    LANE_FULL = "lane_full"  # a long request over the long share: others may pass it
    LONG_NEXT = "long_next"  # ...one that may go alone: others may pass it, long ones after it may not


@dataclass(slots=True)
class _Branch:
    """What the fairness rounds keep of one branch of one class."""

    next_round: int  # the round its next new ticket gets, at the earliest
    seen_at: float  # when its last new ticket arrived
    waiting: int = 0  # its new tickets in line


class PoolLine:
    """One pool's slots, token budget and waiting line (see the theory of operation above).

    Order: (score, fairness round, first arrival). Inside a class, each branch's n-th waiting
    ticket gets round n (counted from the round the class is serving), so a branch's burst is
    served round-robin with the other branches instead of ahead of them. A ticket that comes
    back (`waited_s` since its first attempt) keeps its place: it joins the round being served,
    ordered by its first arrival. A ticket that has waited `promote_after_s` in line is served
    next whatever its score (aging: bounded starvation). A branch with nobody in line that sent
    no new ticket for `forget_after_s` is forgotten: its next ticket joins the round being
    served, as a new branch's does, so the rounds keep only the branches of the last while.

    A ticket is admitted while the count stays within `max_inflight` and the admitted cost
    within `budget_tokens` (None: no token budget). Long tickets together may hold at most
    `long_share` of the budget; a long ticket held back only by that share does not block the
    tickets behind it, so short requests keep flowing during a burst of long ones, but no long
    ticket after it in line passes it (long tickets start in order). One long ticket alone may
    take more than the share, up to one engine's part of the budget (`engines`): a prompt bigger
    than the share would otherwise wait for an empty pool, as one bigger than an engine's part
    still does, passed by all. A lone ticket is always admitted into an empty pool, so a
    shrunken budget cannot wedge the line.
    With `long_alone` (the pool's placement is Envoy's), a long ticket waits, without blocking
    those behind it, until no `bounded` ticket and no other long one runs (long prompts let in
    together would prefill back to back on one engine, and whoever arrives there waits), and, if
    it is not `bounded` itself, until `bounded` tickets arrive no oftener than one per
    `long_quiet_s` (`_bounded_lately`).

    When the sidecar picks each request's backend (`spread` backends, the least loaded first),
    a ticket of cost c is admitted only while `inflight cost + spread x c <= budget`: the
    average backend then has room for c beside its load, so the least loaded one surely has,
    and no single backend overfills however the pool's tokens are split among them.
    """

    def __init__(self, max_inflight: int, budget_tokens: int | None = None, long_share: float = 1.0,
                 promote_after_s: float | None = None, forget_after_s: float = FORGET_BRANCH_AFTER_S):
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self.max_inflight = max_inflight
        self.budget_tokens = budget_tokens
        self.long_share = long_share
        self.promote_after_s = promote_after_s
        self.forget_after_s = forget_after_s
        self.latency_cap: int | None = None
        self.long_alone = False
        self.long_quiet_s = 0.0
        self.bounded_arrived: deque[float] = deque(maxlen=QUIET_ARRIVALS)  # the last `bounded` ones, with long_alone
        self.spread = 1
        self.engines = 1
        self.inflight = 0
        self.unbounded_inflight = 0  # admitted tickets that are not `bounded` (held to latency_cap)
        self.released_total = 0  # slots given back since start (the drain rate is read from it)
        self.inflight_cost = 0
        self.long_cost = 0
        self._heap: list[tuple[float, int, float, int, str]] = []  # (score, round, first arrival, seq, id)
        self._waiting: dict[str, tuple[Ticket, int]] = {}  # id -> (ticket, round)
        self._arrivals: dict[str, float] = {}  # id -> enqueued at, oldest first
        self._admitted: dict[str, Ticket] = {}
        self._by_class: Counter[str] = Counter()
        self._branches: OrderedDict[tuple[str, str], _Branch] = OrderedDict()  # the latest new ticket's last
        self._serving_round: dict[str, int] = {}

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def waiting_tickets(self) -> list[Ticket]:
        """The tickets in line, in no particular order (for the live queue page)."""
        return [ticket for ticket, _ in self._waiting.values()]

    @property
    def depth_by_class(self) -> dict[str, int]:
        return {name: count for name, count in self._by_class.items() if count}

    @property
    def inflight_tokens(self) -> int:
        return self.inflight_cost

    def offer(self, ticket: Ticket, now: float = 0.0) -> list[Ticket]:
        """Put `ticket` in line and admit what fits; returns the tickets admitted: `ticket`
        itself, or a ticket whose wait passed `promote_after_s` since the last change."""
        if ticket.id in self._waiting or ticket.id in self._admitted:
            raise ValueError(f"ticket {ticket.id} offered twice")
        serving = self._serving_round.get(ticket.class_name, 0)
        branch = None
        if ticket.waited_s > 0:
            round_ = serving  # it comes back: at the front of the fairness rounds, by first arrival
        else:
            branch = self._branch_arrived(ticket, serving, now)
            round_ = branch.next_round - 1
        if ticket.bounded and self.long_alone and self.long_quiet_s:  # (only where a long ticket counts them)
            self.bounded_arrived.append(now)
        if not self._waiting and self._admits(ticket, now) is _Admit.YES:
            # Nobody in line and it fits: admitted as `_fill` would admit it from the line,
            # without joining the line and leaving it.
            self._admit(ticket, round_)
            return [ticket]
        if branch is not None:
            branch.waiting += 1
        heapq.heappush(self._heap, (ticket.score, round_, now - ticket.waited_s, ticket.seq, ticket.id))
        self._waiting[ticket.id] = (ticket, round_)
        self._arrivals[ticket.id] = now
        self._by_class[ticket.class_name] += 1
        return self._fill(now)

    def _branch_arrived(self, ticket: Ticket, serving: int, now: float) -> _Branch:
        """A new ticket of its branch arrived: the branch's round for it is `next_round - 1`."""
        self._forget_quiet_branches(now)
        key = (ticket.class_name, ticket.branch_id)
        branch = self._branches.get(key)
        if branch is None:
            branch = self._branches[key] = _Branch(serving + 1, now)
        else:
            branch.next_round = max(branch.next_round, serving) + 1
            branch.seen_at = now
            self._branches.move_to_end(key)
        return branch

    def _forget_quiet_branches(self, now: float) -> None:
        """Forget the branches with nobody in line that sent no new ticket for `forget_after_s`
        (oldest first, as new tickets arrive: each branch once)."""
        branches = self._branches
        while branches:
            key, branch = next(iter(branches.items()))
            if now - branch.seen_at < self.forget_after_s:
                return
            if branch.waiting:  # in line all this while: remembered, as if seen now
                branch.seen_at = now
                branches.move_to_end(key)
            else:
                del branches[key]

    def _left_line(self, ticket: Ticket) -> None:
        self._by_class[ticket.class_name] -= 1
        if ticket.waited_s <= 0:  # (a new ticket: its branch counts it in line)
            self._branches[(ticket.class_name, ticket.branch_id)].waiting -= 1

    def cancel(self, ticket_id: str) -> CancelResult:
        entry = self._waiting.pop(ticket_id, None)
        if entry is not None:
            self._arrivals.pop(ticket_id, None)
            self._left_line(entry[0])
            if len(self._heap) > 2 * len(self._waiting) + 64:
                self._heap = [item for item in self._heap if item[4] in self._waiting]
                heapq.heapify(self._heap)
            return CancelResult.REMOVED  # otherwise its heap entry is skipped lazily
        if ticket_id in self._admitted:
            return CancelResult.HOLDS_SLOT
        return CancelResult.UNKNOWN

    def release(self, ticket_id: str, now: float = 0.0) -> list[Ticket]:
        """Give back an admitted ticket's slot; return the tickets admitted in its place."""
        ticket = self._admitted.pop(ticket_id, None)
        if ticket is None:
            return []  # already released: exactly once
        self.inflight -= 1
        self.released_total += 1
        self.inflight_cost -= ticket.cost
        if ticket.long:
            self.long_cost -= ticket.cost
        if not ticket.bounded:
            self.unbounded_inflight -= 1
        return self._fill(now)

    def set_limits(self, limits: PoolLimits, now: float = 0.0) -> list[Ticket]:
        """New limits (from the load probes); returns tickets admitted if they grew. Tickets
        that are not `bounded` are admitted only while fewer than `latency_cap` of them run."""
        self.max_inflight = max(1, limits.max_inflight)
        self.budget_tokens = limits.budget_tokens
        self.latency_cap = limits.latency_cap
        self.spread = max(1, limits.spread)
        self.engines = max(1, limits.engines)
        if limits.long_alone and limits.long_quiet_s and not (self.long_alone and self.long_quiet_s):
            self._watch_from(now, limits.long_quiet_s)
        self.long_alone = limits.long_alone
        self.long_quiet_s = limits.long_quiet_s
        if limits.long_share is not None:
            self.long_share = limits.long_share
        return self._fill(now)

    def _admit(self, ticket: Ticket, round_: int) -> None:
        """`ticket` (out of the line, or never in it) takes its slot; its class's fairness round
        `round_` is being served."""
        if round_ > self._serving_round.get(ticket.class_name, 0):
            self._serving_round[ticket.class_name] = round_
        self._admitted[ticket.id] = ticket
        self.inflight += 1
        self.inflight_cost += ticket.cost
        if ticket.long:
            self.long_cost += ticket.cost
        if not ticket.bounded:
            self.unbounded_inflight += 1

    def _admits(self, ticket: Ticket, now: float, long_held: bool = False) -> _Admit:
        if self.inflight >= self.max_inflight:
            return _Admit.NO
        if not ticket.bounded and self.latency_cap is not None and self.unbounded_inflight >= self.latency_cap:
            return _Admit.LANE_FULL  # latency-bound requests behind it may still go
        if ticket.long and self.long_alone and (self.inflight > self.unbounded_inflight or self.long_cost
                                                or not ticket.bounded and self._bounded_lately(now)):
            return _Admit.LANE_FULL  # latency-bound requests or another long one run (or came): it waits
        if self.budget_tokens is None or self.inflight == 0:
            return _Admit.YES
        if ticket.long:  # the share bounds long tickets beside each other; alone, one may take an engine's part
            if long_held:
                return _Admit.LANE_FULL  # a long one ahead of it waits for the lane: they go in order
            alone_fits = ticket.cost <= self.budget_tokens / self.engines
            over_share = self.long_cost + ticket.cost > self.budget_tokens * self.long_share
            if over_share and (self.long_cost > 0 or not alone_fits):
                return _Admit.LONG_NEXT if alone_fits else _Admit.LANE_FULL
        return _Admit.YES if self.inflight_cost + ticket.cost * self.spread <= self.budget_tokens else _Admit.NO

    def _watch_from(self, now: float, quiet_s: float) -> None:
        """It starts keeping `bounded` arrivals: a quiet spell counts once seen, so `now` counts
        as one (unless one came within the spell already: a rule turned off and on again within
        it, as replicas that disagree write it, adds nothing)."""
        if not self.bounded_arrived or not 0 <= now - self.bounded_arrived[-1] < quiet_s:
            self.bounded_arrived.append(now)

    def _bounded_lately(self, now: float) -> bool:
        """Whether `bounded` tickets came oftener than one per `long_quiet_s` of late: one in the
        last `long_quiet_s`, or QUIET_ARRIVALS in QUIET_ARRIVALS times that."""
        arrived, quiet = self.bounded_arrived, self.long_quiet_s
        if not arrived or not quiet:
            return False
        return 0 <= now - arrived[-1] < quiet or len(arrived) == QUIET_ARRIVALS and \
            0 <= now - arrived[0] < QUIET_ARRIVALS * quiet

    def _next_candidate(self, now: float, passed: set[str], popped: list) -> Ticket | None:
        if self.promote_after_s is not None:
            for ticket_id, enqueued_at in self._arrivals.items():
                if now - enqueued_at < self.promote_after_s:
                    break
                if ticket_id not in passed:
                    return self._waiting[ticket_id][0]
        while self._heap:
            ticket_id = self._heap[0][4]
            if ticket_id in self._waiting and ticket_id not in passed:
                return self._waiting[ticket_id][0]
            item = heapq.heappop(self._heap)
            if ticket_id in self._waiting:
                popped.append(item)  # passed over this time; back in line afterwards
        return None

    def _fill(self, now: float) -> list[Ticket]:
        admitted: list[Ticket] = []
        passed: set[str] = set()
        popped: list[tuple[float, int, float, int, str]] = []
        long_held = False
        while (ticket := self._next_candidate(now, passed, popped)) is not None:
            verdict = self._admits(ticket, now, long_held)
            if verdict is _Admit.NO:
                break
            if verdict is not _Admit.YES:
                passed.add(ticket.id)
                long_held = long_held or verdict is _Admit.LONG_NEXT
                continue
            _, round_ = self._waiting.pop(ticket.id)
            del self._arrivals[ticket.id]
            self._left_line(ticket)
            self._admit(ticket, round_)
            admitted.append(ticket)
        for item in popped:
            heapq.heappush(self._heap, item)
        if not self._waiting:
            self._heap.clear()  # drop cancelled leftovers
        return admitted
