"""`extproc bench scenario --day`: a bank's working day, compressed, through Envoy + the sidecar,
the pool's simulated engines started and stopped by a controller standing in for KEDA, once per
policy on the same trace.

The day (`DayTraffic`): the rate is a fraction of the peak, drawn through `CURVE`'s points (hour,
fraction): a night at a fifth of the peak, a morning ramp, a first peak, a lunch dip, a second
peak, an evening fall; inside the first peak the seed's burst (`BURST`: 200 branches at once,
twice the peak's rate for 40 minutes, from one second to the next). An hour of the day lasts
`--hour-s` unscaled seconds (50: the day in 20 minutes of the engines' time, 10 minutes of wall
time at the default `--time-scale 0.5`), `COMPRESSION` times faster than a real one.

Two clocks. A request lasts as long as on a real day (the engines' time is not compressed); so do
the sidecar's measurement windows (`REQUEST_CLOCK`: the demand's window, the trend's). What the
day's clock governs is compressed with it: an engine's start-up, the scale-in stabilization
window, the scale-in rate, each `DEPLOYED`'s value (what deploy/k8s/autoscaling and
deploy/k8s/extproc-config.yaml set; tests/e2e/test_autoscaling.py holds them together) divided
by `COMPRESSION`. The controller reads the sidecar's /metrics every half second of wall time (a
minute of the day; KEDA's pollingInterval is 15 s).

The policies, each through the sidecar on the same trace:
- `fixed:N`: N engines all day. The smallest N that held every class's target over the day is
  a floor no real day allows: its burst lasts 33 s of the requests' clock, so a small pool lets
  complaints and archive queries wait it out. The pool sized for the peak, whose engine-hours are
  the bill the scaling policies are held to, is found apart (day_peak.py): the fewest engines that
  carry the burst's rate held for twice the longest deadline;
- `queue`: the queue-depth rule as KEDA's Prometheus scaler is given it, AverageValue
  `--queue-per-engine` on the requests waiting (engines = ceil(waiting / target)), HPA's default
  300 s scale-in stabilization (compressed), never below `min_backends`;
- `predicted`: the sidecar's `extproc_desired_backends` (core/capacity_model.py), whose own
  `scale_in_hold_s` is the stabilization window; the HPA adds only a minute's
  (`hpa_scale_down_window_s`: a restarted sidecar replica's first readings, see `DEPLOYED`).
Both scaling policies take one engine out per `scale_in_every_s` at most, each drained first
(autoscale.Controller: the preStop's drain), and bill an engine from the moment it is asked for
until it is stopped.

Reported per policy: each class's share answered within its deadline, loans' p99, engine-hours
(hours of the day), and per phase of the day the engines billed and each class's attainment.
The model's error per phase: what it said the demand needed (`extproc_needed_backends{horizon=
"now"}`, rounded up, the median over the phase in the predicted run) against the smallest fixed
pool run that held every class in that phase.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from extproc.core.capacity_model import ModelSettings

from .autoscale import Setup, fixed_size, held_slo, run_policy
from .scenario_run import summarize
from .traffic import CLASSES, SLO_CLASS, Outcome, Traffic, in_time_by_class

HOUR_S = 50.0  # unscaled seconds per hour of the day (the default)
# (hour, fraction of the peak's rate), a straight line between each two
CURVE = ((0.0, 0.2), (6.0, 0.2), (7.0, 0.3), (9.0, 0.9), (11.0, 1.0), (12.0, 0.8), (12.5, 0.6), (13.0, 0.6),
         (14.0, 1.0), (16.5, 1.0), (19.0, 0.3), (24.0, 0.2))
BURST = (10.0, 10.0 + 40 / 60, 2.0)  # from, to (hours): the rate, a multiple of the peak's
PHASES = (("night", 0.0, 7.0), ("morning ramp", 7.0, 9.0), ("first peak", 9.0, 12.0), ("lunch", 12.0, 13.0),
          ("second peak", 13.0, 16.5), ("evening fall", 16.5, 19.0), ("late evening", 19.0, 24.0))
BURST_PHASE = "burst"

# What the day's clock governs, in a real day's seconds: the settings deploy/k8s ships (held
# together by tests/e2e/test_autoscaling.py), compressed for the run.
DEPLOYED = {
    "min_backends": 2,  # KEDA's minReplicaCount, autoscale.min_backends: one engine's loss never empties the pool
    "max_backends": 8,  # maxReplicaCount, autoscale.max_backends
    "max_num_seqs": 4,  # per engine (capacity.max_num_seqs; one GPU)
    "target_utilisation": 0.8,  # autoscale.target_utilisation
    "cold_start_s": 120.0,  # a vLLM server's start-up with its weights on the node: autoscale.horizon_s
    "scale_in_hold_s": 300.0,  # autoscale.scale_in_hold_s: the stabilization window of the model's trigger
    # the HPA's own on that trigger: short, for one reason (the model's hold is the window): a
    # sidecar replica that restarts has no memory, and for its first window_s its model reports
    # the engines serving, not those starting; this covers that
    "hpa_scale_down_window_s": 60.0,
    "scale_in_every_s": 120.0,  # the HPA's scale-down policy: one engine per 2 minutes
    "queue_rule_window_s": 300.0,  # the queue rule's HPA scale-in stabilization (the HPA's default)
}
# The sidecar's measurement windows, as deployed (the capacity model's defaults), on the
# requests' clock: a request lasts as long as on a real day, so these are not compressed (in the
# run they span half an hour and more of the day: the model follows the day more slowly there).
REQUEST_CLOCK = {key: getattr(ModelSettings(), key) for key in ("window_s", "trend_s", "drain_s")}
POLICIES = ("predicted", "queue", "fixed:4", "fixed:3")


@dataclass(frozen=True)
class DayTraffic(Traffic):
    """The day's offered load (`Traffic`'s tickets and clients; the rate follows `curve`)."""

    hour_s: float = HOUR_S
    peak_rps: float = 14.0  # requests per unscaled second at the curve's 1.0
    curve: tuple[tuple[float, float], ...] = CURVE
    burst: tuple[float, float, float] = BURST

    @property
    def duration_s(self) -> float:
        return 24 * self.hour_s

    def hour(self, t: float) -> float:
        return t / self.hour_s

    def fraction_at(self, hour: float) -> float:
        start, end, level = self.burst
        if start <= hour < end:
            return level
        for (h0, f0), (h1, f1) in zip(self.curve, self.curve[1:], strict=False):
            if h0 <= hour < h1:
                return f0 + (f1 - f0) * (hour - h0) / (h1 - h0)
        return self.curve[-1][1]

    def rate_at(self, t: float) -> float:
        return self.peak_rps * self.fraction_at(self.hour(t))

    def phase_at(self, t: float) -> str:
        hour = self.hour(t)
        if self.burst[0] <= hour < self.burst[1]:
            return BURST_PHASE
        return next((name for name, start, end in PHASES if start <= hour < end), PHASES[-1][0])

    def phases(self) -> list[str]:
        return [name for name, _, _ in PHASES[:3]] + [BURST_PHASE] + [name for name, _, _ in PHASES[3:]]

    def mean_rate(self, phase: str, step_s: float = 1.0) -> float:
        """The phase's mean offered rate (requests per unscaled second)."""
        rates = [self.rate_at(t) for t in _steps(self.duration_s, step_s) if self.phase_at(t) == phase]
        return sum(rates) / len(rates) if rates else 0.0


def _steps(duration: float, step: float):
    t = 0.0
    while t < duration:
        yield t
        t += step


def compression(traffic: DayTraffic) -> float:
    """How many times faster than a real day the run's day goes."""
    return 3600.0 / traffic.hour_s


def setup_for(policy: str, traffic: DayTraffic, time_scale: float, queue_per_engine: float) -> Setup:
    """The policy's run: the day's clock compressed, the requests' not (see the module)."""
    k = compression(traffic)
    d = DEPLOYED
    model = {**REQUEST_CLOCK, "min_backends": d["min_backends"], "max_backends": d["max_backends"],
             "target_utilisation": d["target_utilisation"], "horizon_s": d["cold_start_s"] / k,
             "scale_in_hold_s": d["scale_in_hold_s"] / k}
    fixed = policy.startswith("fixed")
    base = fixed_size(policy, d["min_backends"]) if fixed else d["min_backends"]
    hold = {"queue": d["queue_rule_window_s"], "predicted": d["hpa_scale_down_window_s"]}.get(policy, 0.0)
    return Setup(policy, base, max(base, d["max_backends"]), time_scale, d["cold_start_s"] / k, queue_per_engine,
                 model, max_num_seqs=d["max_num_seqs"], hold_s=hold / k, drains=not fixed,
                 scale_in_every_s=0.0 if fixed else d["scale_in_every_s"] / k)


def engine_hours(series: list[dict], traffic: DayTraffic, phase: str | None = None) -> float:
    """Engines billed, integrated over the day (or over one phase), in hours of the day."""
    total, piece = 0.0, traffic.hour_s / 120  # a phase's edges are found to half a minute of the day
    for a, b in zip(series, series[1:], strict=False):
        t, end = a["t"], min(b["t"], traffic.duration_s)
        while t < end:
            step = min(piece, end - t)
            if phase is None or traffic.phase_at(t + step / 2) == phase:
                total += a["billed"] * step
            t += step
    return total / traffic.hour_s


def held(shares: dict[str, float | None]) -> bool:
    return held_slo({"in_time_by_class": shares})


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def phase_rows(outcomes: list[Outcome], series: list[dict], traffic: DayTraffic) -> dict[str, dict]:
    rows = {}
    for phase in traffic.phases():
        points = [p for p in series if p["t"] < traffic.duration_s and traffic.phase_at(p["t"]) == phase]
        shares = in_time_by_class([o for o in outcomes if traffic.phase_at(o.sent_at) == phase])
        needed = _median([p["needed_now"] for p in points if p.get("needed_now") is not None and p["needed_now"] >= 0])
        rows[phase] = {
            "offered_rps": round(traffic.mean_rate(phase), 2), "in_time_by_class": shares, "held": held(shares),
            "engines_billed_mean": round(sum(p["billed"] for p in points) / len(points), 2) if points else None,
            "engine_hours": round(engine_hours(series, traffic, phase), 2),
            "model_needed_now": None if needed is None else math.ceil(needed - 1e-9),
            "model_desired": _median([p["desired"] for p in points]),
        }
    return rows


def policy_row(setup: Setup, traffic: DayTraffic, work: Path, progress) -> dict:
    outcomes, series, controller = run_policy(setup, traffic, work, progress)
    summary = summarize(outcomes, [], 0, traffic)
    shares = in_time_by_class(outcomes)
    return {
        "policy": setup.policy, "held_slo": held(shares), "in_time_by_class": shares,
        "availability": summary["availability"],
        "availability_by_class": {name: summary["classes"][name]["availability"] for name in CLASSES},
        "loan_p99_s": summary["classes"][SLO_CLASS]["p99_with_failures_s"],
        "engine_hours": round(engine_hours(series, traffic), 1),
        "max_billed": max((p["billed"] for p in series), default=None),
        "drains": len(controller.drain_times), "drain_s_max": max(controller.drain_times, default=None),
        "by_phase": phase_rows(outcomes, series, traffic),
        "slow_loans": {**summary["slow_loans"], "slowest": summary["slow_loans"]["slowest"][:20]},
        "series": series,
    }


def model_error(rows: list[dict], traffic: DayTraffic, peak: dict | None = None) -> dict[str, dict]:
    """Per phase: the model's count (the predicted run's) against the smallest fixed pool run
    that held every class in that phase (None: none of those run held it); in the burst, where
    `peak` (day_peak.size_for_peak) was searched, the model's need on the burst held against the
    pool that carried it."""
    predicted = next((r for r in rows if r["policy"] == "predicted"), None)
    fixed = sorted((fixed_size(r["policy"], 0), r) for r in rows if r["policy"].startswith("fixed:"))
    errors = {}
    for phase in traffic.phases():
        smallest = next((n for n, r in fixed if r["by_phase"][phase]["held"]), None)
        said = predicted["by_phase"][phase]["model_needed_now"] if predicted else None
        errors[phase] = {"model_needed_now": said, "smallest_fixed_held": smallest,
                         "smallest_fixed_run": fixed[0][0] if fixed else None,
                         "largest_fixed_run": fixed[-1][0] if fixed else None,
                         "error_engines": None if said is None or smallest is None else said - smallest}
    if peak and peak.get("tried"):
        engines = peak["engines"]
        # the model's need over the held burst's second half (the day's burst is shorter than the
        # model's window: its median there is a need still climbing), else the day's
        held_run = next((r for r in peak.get("policies", []) if r["policy"] == "predicted"), {})
        said = held_run.get("model_needed_second_half", errors[BURST_PHASE]["model_needed_now"])
        errors[BURST_PHASE] = {"model_needed_now": said, "smallest_fixed_held": engines,
                               "smallest_fixed_run": peak["tried"][0]["engines"],
                               "largest_fixed_run": peak["tried"][-1]["engines"], "against": "the burst held",
                               "error_engines": None if said is None or engines is None else said - engines}
    return errors


def summarize_day(rows: list[dict], traffic: DayTraffic, args, origin: dict, seconds: float) -> dict:
    run = sorted(fixed_size(r["policy"], 0) for r in rows if r["policy"].startswith("fixed:"))
    held_fixed = sorted(fixed_size(r["policy"], 0) for r in rows if r["policy"].startswith("fixed:") and r["held_slo"])
    peak = held_fixed[0] if held_fixed else None
    peak_bill = None if peak is None else peak * 24.0
    policies = [{k: v for k, v in row.items() if k != "series"} for row in rows]
    for row in policies:
        row["engine_hours_vs_fixed_peak"] = None if not peak_bill else round(row["engine_hours"] / peak_bill, 3)
    return {
        "traffic": {k: v for k, v in dataclasses.asdict(traffic).items()}, "time_scale": args.time_scale,
        "compression": compression(traffic), "deployed": DEPLOYED, "request_clock": REQUEST_CLOCK,
        "run_settings": dataclasses.asdict(setup_for("predicted", traffic, args.time_scale, args.queue_per_engine)),
        "queue_per_engine": args.queue_per_engine, "fixed_peak_backends": peak, "fixed_peak_engine_hours": peak_bill,
        # whether fewer engines were tried (and failed): else `peak` is only an upper bound
        "fixed_peak_is_smallest_run": peak is not None and peak == run[0],
        "fixed_one_fewer_run": peak is not None and peak - 1 in run,
        "sized_for_peak": None,  # day_run.with_peak
        "policies": policies, "model_error_by_phase": model_error(rows, traffic),
        "seconds": round(seconds), "provenance": origin,
    }
