"""The capacity model (core/capacity_model.py), driven directly with an injected clock: per-engine
capacity at the classes' latency targets, the engines the demand needs now and on its trend, and
the scale-in protections."""

from __future__ import annotations

import pytest

from extproc.core.capacity_model import CapacityModel, ModelSettings

TARGETS = {"loan_approval": 2.0, "complaint": None, "archive_query": None}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def model(clock: Clock, **settings) -> CapacityModel:
    return CapacityModel(TARGETS, max_num_seqs=8, settings=ModelSettings(**settings), started_at=clock.now)


def feed(m: CapacityModel, clock: Clock, seconds: float, rates: dict[str, float], service_s: dict[str, float],
         backends: int = 1, step: float = 1.0, queued=None, above_green=False):
    """Arrivals at `rates` (per second) for `seconds`, each served in `service_s`; an estimate per
    `step`. Returns the estimates."""
    estimates = []
    owed = {c: 0.0 for c in rates}
    t = 0.0
    while t < seconds - 1e-9:
        clock.advance(step)
        t += step
        for c, rate in rates.items():
            owed[c] += rate * step
            while owed[c] >= 1:
                owed[c] -= 1
                m.arrived(clock.now, c)
                m.served(clock.now, c, service_s[c])
        estimates.append(m.estimate(clock.now, backends, queued, above_green))
    return estimates


def test_unmeasured_capacity_is_unknown_and_the_pool_keeps_its_engines():
    clock = Clock()
    m = model(clock)
    for _ in range(9):  # nine completions: not a measurement yet
        m.arrived(clock.advance(1), "loan_approval")
        m.served(clock.now, "loan_approval", 30.0)
    estimate = m.estimate(clock.now, backends=3)
    assert estimate.capacity_rps["loan_approval"] is None
    assert estimate.needed_now is None and estimate.desired == 3


def test_capacity_per_engine_is_littles_law_at_the_target_utilisation():
    clock = Clock()
    m = model(clock, target_utilisation=0.8, window_s=30)
    estimate = feed(m, clock, 60, {"complaint": 30.0}, {"complaint": 0.5})[-1]
    # 8 slots / 0.5 s x 0.8 = 12.8 requests per second per engine
    assert estimate.capacity_rps["complaint"] == pytest.approx(12.8)
    assert estimate.demand_rps["complaint"] == pytest.approx(30.0, rel=0.05)
    assert estimate.needed_now == pytest.approx(30 / 12.8, rel=0.05)
    assert estimate.desired == 3


def test_each_class_gets_its_own_capacity_and_the_pool_adds_their_work():
    clock = Clock()
    m = model(clock, target_utilisation=1.0)
    estimate = feed(m, clock, 60, {"loan_approval": 4.0, "archive_query": 8.0},
                    {"loan_approval": 0.4, "archive_query": 2.0})[-1]
    assert estimate.capacity_rps["loan_approval"] == pytest.approx(20.0)  # 8 / 0.4
    assert estimate.capacity_rps["archive_query"] == pytest.approx(4.0)  # 8 / 2
    assert estimate.needed_now == pytest.approx(4 / 20 + 8 / 4, rel=0.05)
    assert estimate.desired == 3


def test_a_class_never_measured_borrows_the_pools_service_time():
    clock = Clock()
    m = model(clock, target_utilisation=1.0)
    feed(m, clock, 10, {"complaint": 2.0}, {"complaint": 1.0})
    m.arrived(clock.now, "archive_query")
    estimate = m.estimate(clock.now, 1)
    assert estimate.capacity_rps["archive_query"] == pytest.approx(8.0)


def test_what_waits_in_line_is_demand_to_drain():
    clock = Clock()
    m = model(clock, target_utilisation=1.0, drain_s=30)
    feed(m, clock, 30, {"complaint": 8.0}, {"complaint": 1.0})
    estimate = m.estimate(clock.now, 1, queued={"complaint": 60})
    assert estimate.demand_rps["complaint"] == pytest.approx(8.0 + 2.0, rel=0.05)
    assert estimate.needed_now == pytest.approx(10 / 8, rel=0.05)


def test_an_arrival_heard_by_one_replica_of_two_stands_for_two():
    """Two replicas share one line (Redis), Envoy spreading the requests over both: each hears
    half the arrivals, and weighs each as two. The line is the pool's already: not doubled. A
    third replica joining changes no arrival already weighed (no false step in the demand)."""
    clock = Clock()
    m = model(clock, target_utilisation=1.0, drain_s=30, window_s=30)
    for _ in range(120):  # 4 a second heard for 30 s, each standing for two
        m.arrived(clock.advance(0.25), "complaint", weight=2.0)
    for _ in range(10):
        m.served(clock.now, "complaint", 1.0)
    estimate = m.estimate(clock.now, 1, queued={"complaint": 60})
    assert estimate.demand_rps["complaint"] == pytest.approx(8.0 + 2.0, rel=0.05)
    for _ in range(4):  # a third replica: one second of arrivals, each standing for three
        m.arrived(clock.advance(0.25), "complaint", weight=3.0)
    later = m.estimate(clock.now, 1, queued={"complaint": 60})
    assert later.demand_rps["complaint"] == pytest.approx((29 * 4 * 2 + 4 * 3) / 30 + 2.0, rel=0.05)
    clock.advance(60)  # all forgotten: the sum with them
    assert m.estimate(clock.now, 1).demand_rps["complaint"] == 0


def test_demand_older_than_the_window_is_forgotten():
    clock = Clock()
    m = model(clock, window_s=10, target_utilisation=1.0, scale_in_hold_s=0)
    feed(m, clock, 20, {"complaint": 16.0}, {"complaint": 1.0})
    quiet = m.estimate(clock.advance(11), 2)
    assert quiet.demand_rps["complaint"] == 0
    assert quiet.desired == 1  # min_backends


def test_the_latency_bound_classes_limit_concurrency_where_the_fit_crosses_their_mark():
    clock = Clock()
    m = CapacityModel(TARGETS, max_num_seqs=32, settings=ModelSettings(engine_latency_share=0.5))
    for n in (4, 8, 12, 16, 20, 24):
        for _ in range(20):  # engine latency 0.1 + 0.05 n s; the mark: half of the 2 s target
            m.responded(clock.advance(0.1), "loan_approval", 0.1 + 0.05 * n, n)
    assert m.slo_concurrency() == 18  # 0.1 + 0.05 x 18 = 1.0 s


def test_classes_without_a_target_do_not_limit_concurrency():
    clock = Clock()
    m = model(clock)
    for n in (2, 8):
        for _ in range(10):
            m.responded(clock.advance(0.1), "archive_query", 30.0 * n, n)
    assert m.slo_concurrency() == 8


def test_every_level_inside_the_target_leaves_the_engines_own_limit():
    clock = Clock()
    m = model(clock)
    for _ in range(10):
        m.responded(clock.advance(0.1), "loan_approval", 0.3, 4)  # flat: one level only
    assert m.slo_concurrency() == 8


def test_a_flat_fit_keeps_the_highest_level_under_the_mark_below_the_first_that_misses():
    clock = Clock()
    m = CapacityModel(TARGETS, max_num_seqs=32)
    for n, seconds in ((2, 0.6), (4, 1.8), (6, 0.5)):  # noisy: no rising line
        for _ in range(10):
            m.responded(clock.advance(0.1), "loan_approval", seconds, n)
    assert m.slo_concurrency() == 2


def test_light_load_alone_never_lowers_the_engines_limit():
    clock = Clock()
    m = CapacityModel(TARGETS, max_num_seqs=8)
    for n, seconds in ((1, 0.2), (2, 0.9)):  # rising, but both under the 1 s mark
        for _ in range(10):
            m.responded(clock.advance(0.1), "loan_approval", seconds, n)
    m.responded(clock.advance(0.1), "loan_approval", 5.0, 3)  # one slow first byte: too few to count
    assert m.slo_concurrency() == 8


def test_the_kv_cache_limits_how_many_requests_an_engine_holds():
    clock = Clock()
    m = CapacityModel(TARGETS, max_num_seqs=32, kv_tokens_per_engine=24576, kv_safety=0.85)
    for _ in range(10):
        m.served(clock.advance(0.1), "complaint", 1.0, cost_tokens=3000)
    assert m.engine_limit() == 6  # 24576 x 0.85 / 3000
    assert m.slo_concurrency() == 6


def test_a_rising_demand_asks_for_engines_ahead_of_need():
    clock = Clock()
    m = model(clock, target_utilisation=1.0, window_s=10, trend_s=60, horizon_s=60)
    estimates = []
    for second in range(60):  # 2 req/s more every 10 s
        rate = 4.0 + 0.2 * second
        estimates += feed(m, clock, 1, {"complaint": rate}, {"complaint": 1.0})
    last = estimates[-1]
    assert last.needed_ahead > last.needed_now + 1  # the trend adds about 12 req/s in 60 s: 1.5 engines
    assert last.desired == pytest.approx(last.needed_ahead, abs=1)
    assert last.desired > round(last.needed_now + 0.5)


def test_a_step_in_demand_asks_for_no_more_growth_than_it_saw():
    clock = Clock()
    m = model(clock, target_utilisation=1.0, window_s=10, trend_s=60, horizon_s=60, scale_in_hold_s=0)
    feed(m, clock, 60, {"complaint": 8.0}, {"complaint": 1.0})  # 1 engine's work, for a minute
    after = feed(m, clock, 20, {"complaint": 24.0}, {"complaint": 1.0})  # then 3 at once
    # a line through the step would climb about 2 engines a minute; the step added 2 engines' work
    assert max(e.needed_ahead - e.needed_now for e in after) <= 2 + 1e-6
    assert max(e.desired for e in after) == 5
    assert after[-1].needed_now == pytest.approx(3, abs=0.05)


def test_a_backlog_is_drained_now_not_extrapolated():
    clock = Clock()
    m = model(clock, target_utilisation=1.0, window_s=10, trend_s=20, horizon_s=60, drain_s=10, scale_in_hold_s=0)
    feed(m, clock, 30, {"complaint": 8.0}, {"complaint": 1.0})
    growing = [feed(m, clock, 1, {"complaint": 8.0}, {"complaint": 1.0}, queued={"complaint": 8 * k})[-1]
               for k in range(1, 21)]  # the line grows, the arrivals do not
    assert growing[-1].needed_now == pytest.approx(1 + 160 / 10 / 8, abs=0.05)  # the backlog to drain in 10 s
    assert growing[-1].needed_ahead == pytest.approx(growing[-1].needed_now)


def test_scale_in_waits_for_the_stabilization_window():
    clock = Clock()
    m = model(clock, target_utilisation=1.0, window_s=5, trend_s=5, horizon_s=0, scale_in_hold_s=60)
    busy = feed(m, clock, 20, {"complaint": 32.0}, {"complaint": 1.0})[-1]
    assert busy.desired == 4
    quiet = feed(m, clock, 30, {"complaint": 4.0}, {"complaint": 1.0})
    assert quiet[-1].wanted == 1 and quiet[-1].desired == 4 and quiet[-1].held
    later = feed(m, clock, 40, {"complaint": 4.0}, {"complaint": 1.0})
    assert later[-1].desired == 1 and not later[-1].held


def test_no_scale_in_while_the_pool_is_above_green():
    clock = Clock()
    m = model(clock, target_utilisation=1.0, window_s=5, trend_s=5, horizon_s=0, scale_in_hold_s=0)
    feed(m, clock, 20, {"complaint": 32.0}, {"complaint": 1.0})
    yellow = feed(m, clock, 20, {"complaint": 4.0}, {"complaint": 1.0}, above_green=True)
    assert yellow[-1].wanted == 1 and yellow[-1].desired == 4
    green = feed(m, clock, 2, {"complaint": 4.0}, {"complaint": 1.0})
    assert green[-1].desired == 1
    # while above green the count still grows
    grown = feed(m, clock, 10, {"complaint": 48.0}, {"complaint": 1.0}, above_green=True)
    assert grown[-1].desired == 6


def test_a_need_beyond_the_maximum_is_flagged_not_followed():
    clock = Clock()
    m = model(clock, target_utilisation=1.0, max_backends=3)
    estimate = feed(m, clock, 30, {"complaint": 40.0}, {"complaint": 1.0})[-1]
    assert estimate.beyond_max and estimate.desired == 3
    assert estimate.as_dict()["beyond_max"] is True


def test_the_minimum_holds_without_demand():
    clock = Clock()
    m = model(clock, min_backends=2, scale_in_hold_s=0)
    feed(m, clock, 5, {"complaint": 1.0}, {"complaint": 0.1})
    estimate = m.estimate(clock.advance(100), 4)
    assert estimate.desired == 2


def test_samples_stay_bounded_at_any_rate_and_the_newest_service_times_count():
    """Thousands of requests a second: the model keeps the most recent service times, costs and
    latencies only (bounded memory, and a tick that walks a bounded number), while the demand
    still counts every arrival of the window."""
    from extproc.core.capacity_model import SAMPLES_KEPT

    clock = Clock()
    m = model(clock, window_s=30)
    for i in range(5 * SAMPLES_KEPT):  # slow at first, then fast: the old samples leave
        clock.advance(0.001)
        m.arrived(clock.now, "complaint")
        m.served(clock.now, "complaint", 10.0 if i < 4 * SAMPLES_KEPT else 1.0, cost_tokens=100)
        m.responded(clock.now, "loan_approval", 0.5, concurrency=4)
    estimate = m.estimate(clock.now, backends=1)
    samples = m._samples("complaint")
    assert len(samples.service) == len(samples.cost) == SAMPLES_KEPT
    assert len(m._latency) <= 4 * SAMPLES_KEPT
    assert m.service_s("complaint") == pytest.approx(1.0)  # only the newest completions
    assert estimate.demand_rps["complaint"] == pytest.approx(1000, rel=0.01)  # one a millisecond, every one


def test_before_a_whole_window_of_demand_the_pool_keeps_its_engines():
    """The first seconds' few services and latencies are noise: an estimate made on them, held by
    the stabilization window, would keep engines running for minutes. Until a whole window of
    demand was seen, the model wants what runs."""
    clock = Clock()
    m = model(clock, window_s=30)
    early = feed(m, clock, 20, {"complaint": 10.0}, {"complaint": 5.0}, backends=2)
    assert all(e.wanted == 2 and e.desired == 2 for e in early)  # 50 engines' worth of work, 20 s in
    later = feed(m, clock, 15, {"complaint": 10.0}, {"complaint": 5.0}, backends=2)
    assert later[-1].desired > 2  # then the need stands
