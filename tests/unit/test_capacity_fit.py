"""The capacity model's service-time fit and the sizing from it (core/capacity_model.py), pure,
with a stepped clock: a synthetic pool of engines whose service time grows with the requests
each runs (S(n) = 0.5 + 0.25 n seconds, at most 8 each) makes the observations, as the sidecar
would see them (arrivals, the ticks' per-engine concurrency, completions with their service
time), through a step in demand, a ramp, overload and a night (issue 35, item 2)."""

from __future__ import annotations

import math

import pytest

from extproc.core.capacity_model import CapacityModel, ModelSettings, ServiceFit

from .test_capacity_model import Clock

BASE_S, PER_REQUEST_S, SEQS = 0.5, 0.25, 8
SIZED_AT = 0.8 * SEQS  # n*: target_utilisation (0.8) x N (8: no latency-bound class in these runs)
TARGETS = {"loan_approval": 2.0, "complaint": None}


def service_s(n: float) -> float:
    return BASE_S + PER_REQUEST_S * n


PER_ENGINE_RPS = SIZED_AT / service_s(SIZED_AT)  # 6.4 / 2.1 = 3.05 requests a second


def right_count(demand_rps: float) -> int:
    """The engines a demand needs, run at n* (what the model should ask for)."""
    return math.ceil(demand_rps / PER_ENGINE_RPS)


class Engines:
    """`count` engines; each second they serve what arrives and what waits, at the concurrency
    Little's law gives (n = rate x S(n)), at most SEQS each: beyond, the rest waits (backlog)
    and the engines run full. Engines asked for start after `startup_s`; scale-in is at once."""

    def __init__(self, count: int, startup_s: float = 60.0):
        self.count = count
        self.startup_s = startup_s
        self.starting: list[float] = []
        self.backlog = self.peak_backlog = 0.0

    def second(self, arrivals: float) -> tuple[float, float]:
        offered = (arrivals + self.backlog) / self.count  # per engine, this second
        n = SEQS if offered * PER_REQUEST_S >= 1 else min(SEQS, offered * BASE_S / (1 - offered * PER_REQUEST_S))
        done = min(arrivals + self.backlog, self.count * n / service_s(n))
        self.backlog = arrivals + self.backlog - done
        self.peak_backlog = max(self.peak_backlog, self.backlog)
        return n, done

    def follow(self, now: float, desired: int) -> None:
        self.count += sum(1 for t in self.starting if t <= now)
        self.starting = [t for t in self.starting if t > now]
        if desired < self.count:
            self.count, self.starting = desired, []
        elif desired > self.count + len(self.starting):
            self.starting += [now + self.startup_s] * (desired - self.count - len(self.starting))


def run(m: CapacityModel, clock: Clock, engines: Engines, seconds: int, demand, follow: bool = False,
        wobble: float = 0.3, period: float = 10.0):
    """`seconds` of demand (req/s, or a function of the seconds since the start of the run) into
    the engines, wobbling +-`wobble` over `period` s (arrivals are never even); an estimate each
    second. Returns [(seconds since the start, demand, engines serving, estimate)]."""
    rate = demand if callable(demand) else (lambda _t: demand)
    out = []
    owed = finished = 0.0
    for second in range(seconds):
        t = clock.now
        arrivals = rate(second) * (1 + wobble * math.sin(2 * math.pi * second / period))
        n, done = engines.second(arrivals)
        m.ran_at(t, n)  # the tick's reading: what the engines run from now
        owed += arrivals
        for i in range(int(owed)):
            m.arrived(t + (i + 0.5) / int(owed), "complaint")
        owed -= int(owed)
        finished += done
        for i in range(int(finished)):  # concurrency not told: the model reads it off the ticks
            m.served(t + (i + 0.5) / int(finished), "complaint", service_s(n))
        finished -= int(finished)
        estimate = m.estimate(clock.advance(1), engines.count)
        out.append((second, rate(second), engines.count, estimate))
        if follow:
            engines.follow(clock.now, estimate.desired)
    return out


def model(clock: Clock, **settings) -> CapacityModel:
    return CapacityModel(TARGETS, max_num_seqs=SEQS, settings=ModelSettings(**settings), started_at=clock.now)


def old_count(m: CapacityModel, demand_rps: float) -> int:
    """What the model asked before the fit: N x u over the mean service time read."""
    return math.ceil(demand_rps * m.service_s("complaint") / SIZED_AT)


# -- the fit ---------------------------------------------------------------------------------------

def test_the_fit_is_the_line_of_service_time_against_concurrency():
    clock = Clock()
    m = model(clock)
    for n in range(1, 9):
        for _ in range(10):
            m.served(clock.advance(0.1), "complaint", service_s(n), concurrency=n)
    fit = m.service_fit("complaint")
    assert fit.base_s == pytest.approx(BASE_S) and fit.per_request_s == pytest.approx(PER_REQUEST_S)
    assert fit.upto is None
    estimate = m.estimate(clock.now, 1)
    assert estimate.sizing_concurrency == pytest.approx(6.4)
    assert estimate.capacity_rps["complaint"] == pytest.approx(6.4 / 2.1)  # n* / S(n*)
    assert estimate.as_dict()["service_fit"]["complaint"] == {"base_s": 0.5, "per_request_s": 0.25, "upto": None}
    # the utilisation margin costs 5 % of what an engine gives at N (3.2 req/s at 8), not a quarter
    assert estimate.capacity_rps["complaint"] / (8 / service_s(8)) == pytest.approx(0.952, abs=0.001)


def test_one_level_seen_in_overload_gives_what_the_engines_gave_there():
    """Every completion at 8 a engine, 2.5 s each: below 8 the engine gives no more than the
    3.2 req/s it gave there, so the stretched times do not shrink the capacity (before: 6.4 / 2.5
    = 2.56 req/s, a quarter more engines)."""
    clock = Clock()
    m = model(clock)
    for _ in range(20):
        m.served(clock.advance(0.1), "complaint", service_s(8), concurrency=8)
    assert m.service_fit("complaint") == ServiceFit(0.0, 2.5 / 8, upto=8)
    assert m.estimate(clock.now, 1).capacity_rps["complaint"] == pytest.approx(3.2)


def test_one_level_seen_at_light_load_says_nothing_of_growth():
    clock = Clock()
    m = model(clock)
    for _ in range(20):
        m.served(clock.advance(0.1), "complaint", service_s(1), concurrency=1)
    assert m.service_s("complaint", 6.4) == pytest.approx(0.75)  # the time seen, as before the fit


def test_a_service_time_that_falls_with_concurrency_is_its_mean():
    clock = Clock()
    m = model(clock)
    for n, seconds in ((1, 1.2), (4, 0.8)):
        for _ in range(10):
            m.served(clock.advance(0.1), "complaint", seconds, concurrency=n)
    assert m.service_fit("complaint") == ServiceFit(pytest.approx(1.0), 0.0)


def test_a_negative_intercept_becomes_a_line_through_the_origin():
    clock = Clock()
    m = model(clock)
    for n in (2, 4):
        for _ in range(10):
            m.served(clock.advance(0.1), "complaint", 0.5 * n - 0.5, concurrency=n)  # 0.5 and 1.5 s
    fit = m.service_fit("complaint")
    assert fit.base_s == 0 and fit.per_request_s == pytest.approx((2 * 0.5 + 4 * 1.5) / (4 + 16))


def test_a_completion_ran_at_the_time_weighted_mean_of_the_ticks_readings():
    clock = Clock()
    m = model(clock)
    m.ran_at(1000.0, 2)
    m.ran_at(1010.0, 6)
    assert m.mean_load(1006.0, 1014.0) == pytest.approx(4.0)  # 4 s at 2, 4 s at 6
    assert m.mean_load(990.0, 1004.0) == pytest.approx(2.0)  # before the first reading: the first
    assert m.mean_load(1012.0, 1012.0) == 6
    m.served(1014.0, "complaint", 8.0)
    assert m._samples("complaint").service[-1] == (1014.0, 8.0, pytest.approx(4.0))


def test_the_pool_is_sized_at_the_latency_bound_concurrency():
    """A latency-bound class whose first byte reaches the mark (0.75 x 2 s) at 6 a engine: the
    engines are sized at 0.8 x 6 = 4.8 requests, where the fit says 1.7 s each."""
    clock = Clock()
    m = model(clock)
    for n in range(1, 9):
        for _ in range(10):
            m.responded(clock.advance(0.1), "loan_approval", 0.25 + 0.2 * n, n)  # 1.45 s at 6, 1.65 at 7
            m.served(clock.now, "complaint", service_s(n), concurrency=n)
    estimate = m.estimate(clock.now, 1)
    assert estimate.per_engine_concurrency == 6 and estimate.sizing_concurrency == pytest.approx(4.8)
    assert estimate.capacity_rps["complaint"] == pytest.approx(4.8 / service_s(4.8))


# -- the sizing, through the synthetic engines ---------------------------------------------------------

@pytest.mark.parametrize("serving, was", [(6, 1), (3, 3), (2, 4)], ids=["light", "serving", "overloaded"])
def test_the_count_for_a_demand_is_the_same_at_light_load_and_in_overload(serving, was):
    """8 req/s need 3 engines at n* (8 / 3.05 = 2.6). Measured on 6 engines (about 1 request
    each), on 3 (about 4 each) or on 2 (full, 8 each, 2.5 s a request, a backlog growing), the
    model asks 3. Before the fit it asked 1, 3 and 4: from the mean service time read at the load
    it saw (0.78 s, 1.9 s, 2.5 s). (Without the backlog: what waits in line is demand to drain, its own term.)"""
    clock = Clock()
    m = model(clock, scale_in_hold_s=0)
    engines = Engines(serving)
    last = run(m, clock, engines, 240, 8.0)[-1][3]
    assert engines.backlog > 100 if serving == 2 else engines.backlog < 8
    assert last.needed_now == pytest.approx(8 / PER_ENGINE_RPS, rel=0.12)
    assert math.ceil(last.needed_now) == right_count(8.0) == 3
    assert last.desired == 3
    assert old_count(m, 8.0) == was


def test_overload_after_light_load_moves_along_the_fit():
    """Light load first (0.6 to 1.5 a engine), then overload (8): the line through both is the
    engines', and the count stays 3; once the light load's completions are forgotten (300 s),
    the line keeps its slope through what the full engines show."""
    clock = Clock()
    m = model(clock, scale_in_hold_s=0)
    run(m, clock, Engines(6), 120, 8.0)
    engines = Engines(2)
    both = run(m, clock, engines, 120, 8.0)[-1][3]
    fit = both.service_fit["complaint"]
    assert fit.base_s == pytest.approx(BASE_S, abs=0.15) and fit.per_request_s == pytest.approx(PER_REQUEST_S, rel=0.15)
    assert both.desired == 3
    full = run(m, clock, engines, 300, 8.0)[-1][3]
    assert {n for _, _, n in m._samples("complaint").service} == {8}
    fit = full.service_fit["complaint"]
    assert fit.upto is None and fit.per_request_s == pytest.approx(PER_REQUEST_S, rel=0.15)
    assert fit.at(8) == pytest.approx(service_s(8))
    assert full.desired == 3


def test_a_step_in_demand_asks_for_the_right_count():
    """2.4 req/s (1 engine) then 8 (3 engines) at once: the one engine runs full until the
    others start (60 s), and its stretched service times do not raise the count the demand
    needs above the right one; the trend adds no more than the step's own
    growth (a step is not a ramp: 2 engines at most, for a while), and the pool settles at 3."""
    clock = Clock()
    m = model(clock, scale_in_hold_s=0)
    engines = Engines(1)
    run(m, clock, engines, 240, 2.4, follow=True)
    assert engines.count == 1 and engines.peak_backlog < 3
    full = run(m, clock, engines, 60, 8.0, follow=True)
    assert engines.count == 1 and engines.backlog > 200  # a minute at 8 req/s on one full engine
    after = full + run(m, clock, engines, 240, 8.0, follow=True)
    assert max(e.needed_now for *_, e in after) <= 8 / PER_ENGINE_RPS * 1.12  # 2.9: ceil 3
    assert max(e.desired for *_, e in after) <= right_count(8.0) + (right_count(8.0) - right_count(2.4))
    assert after[-1][3].desired == 3 and engines.count == 3
    assert max(e.desired for *_, e in after[-120:]) == 3


def test_a_ramp_is_met_ahead_of_need():
    """2 to 12 req/s over 10 minutes, engines ready 60 s after they are asked for: from the
    moment the trend is read (half of trend_s), the model asks at least what the demand a
    minute later needs, so the engines serving always suffice; and never more than a
    horizon's trend beyond."""
    clock = Clock()
    m = model(clock, scale_in_hold_s=0)
    engines = Engines(1)
    ramp = run(m, clock, engines, 600, lambda t: 2 + t / 60, follow=True)
    for second, demand, serving, e in ramp:
        if second >= 90:
            assert e.desired >= right_count(min(12.0, demand + 1)), second  # a minute ahead
            assert e.desired <= right_count(demand + 2) + 1, second  # the trend_s's growth, ahead
        if second >= 150:
            assert serving >= right_count(demand), second
    assert engines.backlog < 10


def test_a_night_scales_in_to_the_minimum_after_the_hold():
    """A day's 8 req/s on 3 engines, then the night's fifth (1.6 req/s: one engine): the count
    wanted falls once the window has seen the night, the count asked only after the
    stabilization window (300 s), then to min_backends."""
    clock = Clock()
    m = model(clock, scale_in_hold_s=300, min_backends=1)
    engines = Engines(3)
    day = run(m, clock, engines, 300, 8.0, follow=True)
    assert day[-1][3].desired == 3
    night = run(m, clock, engines, 420, 1.6, follow=True)
    wanted_one = next(second for second, *_, e in night if e.wanted == 1)
    assert wanted_one <= 40  # the window (30 s) has seen the night
    assert all(e.desired == 3 and e.held for second, *_, e in night if wanted_one <= second < 290)
    assert night[-1][3].desired == 1 and engines.count == 1 and not night[-1][3].held
    # the night's need read right (1.6 / 3.05 = 0.52), also once the day's completions are
    # forgotten (300 s) and the night's lie at one level
    assert all(e.needed_now == pytest.approx(1.6 / PER_ENGINE_RPS, rel=0.15) for *_, e in night[40:])
