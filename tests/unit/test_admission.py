"""The pure admission core (tiers, placement, the waiting line) and the in-process store."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from extproc.core.admission import CancelResult, PoolLimits, PoolLine, Ticket, Tier, tier_for
from extproc.core.breaker import Permit
from extproc.core.config import load_config
from extproc.core.outcomes import Outcome
from extproc.core.pool_config import Tiers
from extproc.core.routing import RoutingView, route

CONFIG = load_config()  # primary: yellow 30, orange 50, red 80, hard_max 200; archive degradable


def test_tiers_follow_the_seed_thresholds():
    tiers = Tiers()
    assert [tier_for(d, tiers) for d in (0, 30, 31, 50, 51, 80, 81)] == [
        Tier.GREEN, Tier.GREEN, Tier.YELLOW, Tier.YELLOW, Tier.ORANGE, Tier.ORANGE, Tier.RED
    ]


def depths(primary: int, fallback: int = 0) -> RoutingView:
    return RoutingView({"primary": primary, "fallback": fallback}.__getitem__, lambda pool: (Permit.YES, None))


def place(class_name: str, view: RoutingView):
    return route(class_name, "0001", "deepseek-sim", CONFIG, view)


def test_placement_by_tier():
    assert place("complaint", depths(10)).refusal is None
    assert place("archive_query", depths(50)) .pool == "primary"  # not yet orange
    degraded = place("archive_query", depths(51))
    assert degraded.pool == "fallback" and degraded.reason == "degraded" and degraded.refusal is None
    assert degraded.model == "deepseek-sim-small"  # the paired model
    assert place("complaint", depths(51)).pool == "primary"  # not degradable
    assert place("complaint", depths(81)).refusal is Outcome.SHED_OVERLOADED
    assert place("loan_approval", depths(81)).refusal is None  # protected
    assert place("loan_approval", depths(200)).refusal is Outcome.SHED_QUEUE_FULL
    assert place("archive_query", depths(100, 81)).refusal is Outcome.SHED_OVERLOADED  # fallback red too


def ticket(i: int, score: float, cls: str = "c") -> Ticket:
    return Ticket(score=score, seq=i, id=f"t{i}", class_name=cls)


def test_line_serves_by_score_then_arrival_and_releases_exactly_once():
    line = PoolLine(1)
    assert line.offer(ticket(0, 1.0)) == [ticket(0, 1.0)]
    for i, score in enumerate([2.0, 1.0, 0.0, 1.0], start=1):
        assert line.offer(ticket(i, score)) == []
    order = []
    holder = "t0"
    while True:
        admitted = line.release(holder)
        assert line.release(holder) == []  # a second release changes nothing
        if not admitted:
            break
        (holder_ticket,) = admitted
        holder = holder_ticket.id
        order.append(holder)
    assert order == ["t3", "t2", "t4", "t1"]
    assert line.inflight == 0 and line.depth == 0


def test_cancel_tells_waiting_from_admitted():
    line = PoolLine(1)
    line.offer(ticket(0, 0))
    line.offer(ticket(1, 0))
    assert line.cancel("t1") is CancelResult.REMOVED
    assert line.cancel("t0") is CancelResult.HOLDS_SLOT
    assert line.cancel("nope") is CancelResult.UNKNOWN
    assert line.release("t0") == [] and line.inflight == 0


def test_where_envoy_places_a_long_ticket_waits_for_a_quiet_spell_of_latency_bound_arrivals():
    """With `long_alone` and `long_quiet_s`, a long ticket starts once no latency-bound ticket
    runs *and* they arrive no oftener than one per `long_quiet_s`: none in the last spell, nor
    four in the last four. In a burst of loans, none running at one instant, or a quiet spell,
    says little about the next moment (one comes to its engine in its prefill and waits)."""
    line = PoolLine(8)
    line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=0.0)
    assert line.offer(Ticket(0, 1, "loan", "loan"), now=0.0)
    long = Ticket(2, 2, "long", "archive", cost=9000, long=True, bounded=False)
    assert line.offer(long, now=0.5) == []  # a loan runs
    assert line.release("loan", now=1.0) == []  # none runs, but one came 1 s ago
    short = Ticket(2, 3, "short", "archive", bounded=False)
    assert line.offer(short, now=1.2) == [short]  # it blocks nobody behind it
    assert line.offer(Ticket(0, 4, "loan2", "loan"), now=1.5)  # another comes: the quiet starts again
    assert line.release("loan2", now=1.6) == []
    assert line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=3.4) == []
    assert line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=3.5) == [long]
    assert line.release("long", now=3.6) == []
    # one quiet spell is not enough where they came thick of late: four within 4 x 2 s hold it too
    for i, t in enumerate((10.0, 10.5, 11.0, 11.5)):
        line.release(line.offer(Ticket(0, 10 + i, f"burst{i}", "loan"), now=t)[0].id, now=t)
    second = Ticket(2, 20, "long2", "archive", cost=9000, long=True, bounded=False)
    assert line.offer(second, now=14.0) == []  # 2.5 s since the last, but four in the last 4 s
    assert line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=17.9) == []
    assert line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=18.0) == [second]
    assert line.release("long2", now=18.1) == []
    # a long one of a latency-bound class waits only for none to run: it is a loan too
    long_loan = Ticket(0, 5, "long-loan", "loan", cost=9000, long=True)
    assert line.offer(Ticket(0, 6, "loan3", "loan"), now=20.0)
    assert line.offer(long_loan, now=20.1) == []
    assert line.release("loan3", now=20.2) == [long_loan]
    # 0: it goes as soon as none runs, as before the quiet spell was asked for
    line = PoolLine(8)
    line.set_limits(PoolLimits(8, None, long_alone=True), now=0.0)
    assert line.offer(Ticket(0, 1, "loan", "loan"), now=0.0)
    assert line.offer(long, now=0.1) == []
    assert line.release("loan", now=0.2) == [long]
    # arrivals are kept only while a long ticket would count them: none before Envoy placed the
    # pool; and a quiet spell counts once the line has watched it (from the moment it starts)
    line = PoolLine(8)
    for i in range(4):
        line.release(line.offer(Ticket(0, i, f"loan{i}", "loan"), now=0.1 * i)[0].id, now=0.1 * i)
    line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=0.5)
    # turned off and on again within the spell (replicas that disagree write it so): none started over
    line.set_limits(PoolLimits(8, None), now=0.8)
    line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=1.0)
    assert line.offer(long, now=1.0) == []  # watched for half a second: no spell seen yet
    assert line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=2.4) == []
    # (had the four loans before counted, four in 4 x 2 s would hold it until 8.0 s)
    assert line.set_limits(PoolLimits(8, None, long_alone=True, long_quiet_s=2.0), now=2.5) == [long]


class LineMachine(RuleBasedStateMachine):
    """PoolLine against a plain reference model: a sorted list and a counter."""

    def __init__(self):
        super().__init__()
        self.capacity = 3
        self.line = PoolLine(self.capacity)
        self.waiting: list[tuple[float, int]] = []
        self.admitted: set[int] = set()
        self.seq = 0

    def _ref_fill(self) -> list[int]:
        self.waiting.sort()
        out = []
        while len(self.admitted) < self.capacity and self.waiting:
            _, seq = self.waiting.pop(0)
            self.admitted.add(seq)
            out.append(seq)
        return out

    @rule(score=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0]))
    def offer(self, score):
        seq = self.seq
        self.seq += 1
        now = bool(self.line.offer(Ticket(score, seq, f"t{seq}", "c")))
        expected_now = len(self.admitted) < self.capacity and not self.waiting
        assert now == expected_now
        if now:
            self.admitted.add(seq)
        else:
            self.waiting.append((score, seq))

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(sorted(self.admitted)))
        self.admitted.discard(seq)
        got = [t.seq for t in self.line.release(f"t{seq}")]
        assert got == self._ref_fill()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def cancel(self, data):
        score, seq = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove((score, seq))
        assert self.line.cancel(f"t{seq}") is CancelResult.REMOVED

    @rule(seq=st.integers(0, 50))
    def release_unknown_or_twice(self, seq):
        if seq not in self.admitted:
            assert self.line.release(f"t{seq}") == []

    @invariant()
    def counts_match(self):
        assert self.line.inflight == len(self.admitted) <= self.capacity
        assert self.line.depth == len(self.waiting)
        # work-conserving: nobody waits while a slot is free
        assert not (self.waiting and len(self.admitted) < self.capacity)


TestLineMachine = LineMachine.TestCase
TestLineMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)

# The stores themselves (in-process and Redis) are covered by tests/stores/test_store_contract.py.


def test_each_rule_for_long_prompts_is_said_in_words():
    """The queue page's and `extproc admin state`'s words for what keeps a pool's long prompts from
    its latency-bound requests (LoadController.long_rule)."""
    from extproc.ops.state import long_prompts_said

    assert "kept apart in time" in long_prompts_said("wait_for_quiet", 0.0)
    assert "none came in the last 3 s, nor 4 in the last 12 s" in long_prompts_said("wait_for_quiet", 3.0)
    assert "none came" not in long_prompts_said("wait_for_quiet", 0.0)
    assert long_prompts_said("wait_for_quiet", 2.0).endswith(
        "; one still in its prefill when a latency-bound request arrives yields its engine, once")
    assert "placed on engines apart" in long_prompts_said("placed_apart", 2.0)
    assert "fewer than two engines answer" in long_prompts_said("one_engine", 2.0)
    assert "keep_long_apart is off" in long_prompts_said("not_kept_apart", 2.0)
    assert long_prompts_said(None, 2.0) is None
