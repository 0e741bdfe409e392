"""What the latency limiter's floor does and does not promise, on simulated time.

The floor (`capacity.latency_floor_share`) bounds the *cap* on the classes without a latency
target: however slow the latency-bound requests are, the cap never shuts those classes out of
slots that are free. It reserves nothing: the latency-bound classes may take every slot, and
the line serves them first. So while they alone keep the pool full, a class without a target
waits (until its `max_wait_s` runs out) unless aging (`queue.promote_after_s`, off by default)
bounds the wait."""

from __future__ import annotations

from extproc.core.admission import PoolLimits, PoolLine, Ticket
from extproc.core.capacity import LatencyLimiter
from extproc.core.config import QueueSettings
from extproc.core.pool_config import Capacity

SLOTS = 8
TARGET_S = 2.0
LOAN_S = 3.0  # every loan takes 1.5 x its target: the cap is cut as far as it goes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def shipped_limiter() -> LatencyLimiter:
    """The limiter as the load controller sets it up, with the shipped pool settings."""
    capacity = Capacity()
    return LatencyLimiter().configure(capacity.latency_window_s, 1.0, capacity.latency_floor_share,
                                      capacity.latency_headroom_share)


def loan(i: int) -> Ticket:
    return Ticket(0.0, i, f"loan-{i}", "loan_approval")


def complaint(i: int) -> Ticket:
    return Ticket(1.0, 10_000 + i, f"complaint-{i}", "complaint", bounded=False)


class Pool:
    """A pool of SLOTS under the limiter: the clock moves in steps of `step_s`; at each step
    the oldest running loan ends, two loans arrive (more than the pool serves: there is
    always a loan in line), and every second the limiter judges the loans' latency."""

    def __init__(self, promote_after_s: float | None = None, step_s: float = 0.25):
        self.clock = Clock()
        self.limiter = shipped_limiter()
        self.line = PoolLine(SLOTS, promote_after_s=promote_after_s)
        self.step_s = step_s
        self.running: list[str] = []  # admitted, oldest first
        self.admitted: dict[str, float] = {}  # ticket id -> when it was admitted
        self.caps: list[int | None] = []
        self._next = 0

    def _took(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            self.running.append(ticket.id)
            self.admitted[ticket.id] = self.clock()

    def offer(self, ticket: Ticket) -> None:
        self._took(self.line.offer(ticket, self.clock()))

    def new_loan(self) -> None:
        self.offer(loan(self._next))
        self._next += 1

    def run_until(self, end_s: float) -> None:
        while self.clock() + self.step_s <= end_s + 1e-9:
            self.clock.now = round(self.clock() + self.step_s, 6)
            now = self.clock()
            oldest_loan = next(i for i in self.running if i.startswith("loan-"))
            self.running.remove(oldest_loan)
            self._took(self.line.release(oldest_loan, now))
            self.new_loan()
            self.new_loan()
            if now == int(now):  # once a second: the loans that reached their first byte meanwhile
                for j in range(int(1 / self.step_s)):
                    self.limiter.observe(now - j * self.step_s, LOAN_S, TARGET_S)
                cap = self.limiter.update(now, SLOTS)
                self.caps.append(cap)
                self._took(self.line.set_limits(PoolLimits(SLOTS, latency_cap=cap), now))


def test_aging_is_off_by_default():
    assert QueueSettings().promote_after_s is None


def test_the_floor_keeps_free_slots_open_to_the_classes_without_a_target_however_slow_the_loans():
    pool = Pool()
    for _ in range(30):  # thirty seconds of slow loans, four of them at a time, never filling the pool
        pool.clock.now += 1
        for j in range(10):
            pool.limiter.observe(pool.clock() - j / 10, LOAN_S, TARGET_S)
        pool.caps.append(pool.limiter.update(pool.clock(), SLOTS))
    floor = pool.limiter.floor(SLOTS)
    assert floor == 2 and pool.caps[-1] == floor  # cut as far as it goes, and no further
    pool.line.set_limits(PoolLimits(SLOTS, latency_cap=pool.caps[-1]), pool.clock())
    for _ in range(4):
        pool.new_loan()
    for i in range(3):
        pool.offer(complaint(i))
    # two complaints run beside the loans; the third waits although two slots are free: the
    # floor bounds the cap, it is not a share of the pool set aside
    assert sorted(i for i in pool.admitted if i.startswith("complaint")) == ["complaint-0", "complaint-1"]
    assert (pool.line.inflight, pool.line.depth_by_class) == (6, {"complaint": 1})


def test_latency_bound_classes_that_fill_the_pool_starve_a_class_without_a_target():
    pool = Pool()
    for _ in range(SLOTS + 2):  # the pool full of loans, two more in line
        pool.new_loan()
    pool.offer(complaint(0))
    pool.run_until(600)  # ten minutes of simulated time, 2400 loans served
    floor = pool.limiter.floor(SLOTS)
    assert pool.caps[-1] == floor  # the cap on complaints is at its floor, 2 of the 8 slots...
    assert pool.line.unbounded_inflight == 0  # ...and not one complaint runs:
    assert "complaint-0" not in pool.admitted  # every slot that freed went to a loan
    assert pool.line.depth_by_class["complaint"] == 1
    assert pool.line.inflight == SLOTS and len(pool.admitted) > 2400


def test_aging_bounds_the_wait_of_a_class_without_a_target():
    pool = Pool(promote_after_s=5.0)
    for _ in range(SLOTS + 2):
        pool.new_loan()
    pool.offer(complaint(0))
    pool.run_until(60)
    # served at the first slot that freed once it had waited promote_after_s, ahead of the loans
    assert pool.admitted["complaint-0"] == 5.0
    assert pool.caps[-1] == pool.limiter.floor(SLOTS)  # the loans stay as slow: the cap did not help it in


def test_a_floor_raised_under_a_cap_binds_at_once_and_a_lowered_one_lets_the_cap_go_lower():
    """The floor follows where the requests are placed (`latency_floor_share_envoy_placed` while
    Envoy places them): raised under a cap already cut to the old floor, the cap is the new
    floor at once, whatever the latency; lowered, further cuts may go down to it."""
    capacity, ceiling = Capacity(), 64
    limiter = LatencyLimiter().configure(capacity.latency_window_s, 1.0, capacity.latency_floor_share_envoy_placed,
                                         capacity.latency_headroom_share)
    now = 0.0
    for _ in range(30):  # loans at 1.5 x their target: cut to the (lower) floor
        for _ in range(10):
            limiter.observe(now, LOAN_S, TARGET_S)
        now += 1.0
        limiter.update(now, ceiling, in_use=ceiling)
    low = limiter.floor(ceiling)
    assert limiter.applied(ceiling) == low == 8
    limiter.configure(capacity.latency_window_s, 1.0, capacity.latency_floor_share, capacity.latency_headroom_share)
    high = limiter.floor(ceiling)
    assert high == 16
    assert limiter.applied(ceiling) == high  # before any update
    for _ in range(5):  # the latency between the marks: the cap holds, at the new floor
        for _ in range(10):
            limiter.observe(now, 0.5 * TARGET_S, TARGET_S)
        now += 1.0
        assert limiter.update(now, ceiling, in_use=ceiling) == high
    limiter.configure(capacity.latency_window_s, 1.0, capacity.latency_floor_share_envoy_placed,
                      capacity.latency_headroom_share)
    for _ in range(10):  # slow loans again: the cuts go below the old floor, down to the new one
        for _ in range(10):
            limiter.observe(now, LOAN_S, TARGET_S)
        now += 1.0
        limiter.update(now, ceiling, in_use=ceiling)
    assert limiter.applied(ceiling) == low
