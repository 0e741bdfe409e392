"""The fixed pool sized for the peak (day.py's baseline): the fewest engines that carry the day's
burst held, found by running it; and the scaling policies on the same held burst.

Why held. In the compressed day the burst lasts 40 minutes of the day but a few dozen seconds of
the requests' clock (a request, and each class's deadline, last as long as on a real day): about
one complaint's deadline. A pool too small for the burst then carries it by letting complaints
and archive queries wait it out, which a real day's 40 minutes would not allow: every deadline
is far shorter than the burst. So the smallest fixed pool that held the compressed day is not the
pool a platform team must run for that day. The one sized for the peak is found apart
(`HeldBurst`): `LEAD_S` at the rate just before the day's burst (the pool warmed, as in the day),
then the burst's rate for `held_s` (twice the longest deadline), on `N` engines from the start.

`N` carries the peak when every class keeps its target over the burst (requests sent from its
start) and, over its second half, the pool answered at least `KEPT_UP` of what arrived then: a
pool short of the burst's rate by more than 1.5 % shows it there as a line that grows, however
long the deadlines let the line get. (Near full load the line's length still wanders; 1.5 % of the
second half's arrivals is some fifty requests at 28 req/s.) The sizes given are tried in
ascending order until one carries: the one below it did not, where it was tried; where the
first size tried carried, it is a bound ("at most").

The scaling policies run the same held burst from their own pool (`policies_on_held_burst`):
whether they carry it too, with the day's compressed start-up, and how many engines they ran
in its second half. A real engine's start-up (two minutes, not 1.7 s) is not in this run: until
new engines serve, the engines running and the waiting room carry the burst (docs/deploy.md).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .autoscale import held_slo, run_policy
from .day import BURST_PHASE, DayTraffic
from .provenance import provenance
from .scenario_run import summarize
from .traffic import SLO_CLASS, Outcome, in_time_by_class

LEAD_S = 60.0  # unscaled seconds at the rate just before the day's burst
KEPT_UP = 0.985  # of the second half's arrivals, answered in it
PEAK_SIZES = (5, 6, 7, 8, 9, 10)


@dataclass(frozen=True)
class HeldBurst(DayTraffic):
    """The day's tickets (mix, prompts, seed): `lead_s` at the rate before its burst, then the
    burst's rate to the end."""

    lead_s: float = LEAD_S

    def phase_at(self, t: float) -> str:
        return BURST_PHASE if t >= self.lead_s else "lead-in"

    def phases(self) -> list[str]:
        return ["lead-in", BURST_PHASE]


def held_s(day: DayTraffic) -> float:
    """How long the burst is held: twice the longest deadline (the traffic's own)."""
    return 2 * max(day.deadlines_s.values())


def held_traffic(day: DayTraffic, lead_s: float = LEAD_S) -> HeldBurst:
    start, _, level = day.burst
    before = day.fraction_at(start - 1e-6)
    total = lead_s + held_s(day)
    fields = {f.name: getattr(day, f.name) for f in dataclasses.fields(day)}
    return HeldBurst(**{**fields, "hour_s": total / 24, "curve": ((0.0, before), (24.0, before)),
                        "burst": (24 * lead_s / total, 24.0, level), "lead_s": lead_s})


def kept_up(outcomes: list[Outcome], start: float, end: float) -> float:
    """Of the requests that arrived in [start, end), the share of as many answered in it."""
    arrived = sum(start <= o.sent_at < end for o in outcomes)
    answered = sum(o.ok and o.latency_s is not None and start <= o.sent_at + o.latency_s < end for o in outcomes)
    return answered / arrived if arrived else 1.0


def judge(outcomes: list[Outcome], series: list[dict], traffic: HeldBurst) -> dict:
    """Whether the run carried the held burst (see the module), and what it ran."""
    burst = [o for o in outcomes if o.sent_at >= traffic.lead_s]
    shares = in_time_by_class(burst)
    held = held_slo({"in_time_by_class": shares})
    half = traffic.lead_s + (traffic.duration_s - traffic.lead_s) / 2
    keeping = kept_up(outcomes, half, traffic.duration_s)
    second_half = [p for p in series if half <= p["t"] < traffic.duration_s]
    return {
        "in_time_by_class": shares, "held_slo": held, "kept_up": round(keeping, 4),
        "carried": held and keeping >= KEPT_UP,
        "offered_rps": round(len(burst) / (traffic.duration_s - traffic.lead_s), 2),
        "loan_p99_s": summarize(burst, [], 0, traffic)["classes"][SLO_CLASS]["p99_with_failures_s"],
        "queue_depth_max": max((p["queue_depth"] for p in series if p["t"] >= traffic.lead_s), default=None),
        "engines_billed_second_half": round(sum(p["billed"] for p in second_half) / len(second_half), 2)
        if second_half else None,
        # what the capacity model said the pool needs once its window is all burst (the predicted
        # run's; the median, rounded up as the day's phases are): its error against the pool that carried
        "model_needed_second_half": model_need(second_half),
    }


def model_need(points: list[dict]) -> int | None:
    """The median of the model's `needed_now` over `points`, rounded up (None: it said nothing)."""
    said = sorted(p["needed_now"] for p in points if p.get("needed_now") is not None and p["needed_now"] >= 0)
    return math.ceil(statistics.median(said) - 1e-9) if said else None


def size_for_peak(setup_for, day: DayTraffic, sizes: tuple[int, ...], work: Path, progress,
                  max_backends: int | None = None) -> dict:
    """Try `fixed:N` for N in `sizes` (ascending) on the held burst until one carries it."""
    traffic = held_traffic(day)
    origin = provenance()
    tried = []
    for engines in sorted(set(sizes)):
        outcomes, series, _ = run_policy(setup_for(f"fixed:{engines}"), traffic, work / f"peak-{engines}", progress)
        tried.append({"engines": engines, **judge(outcomes, series, traffic)})
        progress(f"the held burst on {engines} engines: carried {tried[-1]['carried']}, "
                 f"kept up {tried[-1]['kept_up']}, {tried[-1]['in_time_by_class']}")
        if tried[-1]["carried"]:
            break
    carried = next((t["engines"] for t in tried if t["carried"]), None)
    return {"lead_s": traffic.lead_s, "held_s": held_s(day), "rate_rps": round(day.peak_rps * day.burst[2], 2),
            "day_burst_s": round(day.hour_s * (day.burst[1] - day.burst[0]), 1), "kept_up_at_least": KEPT_UP,
            "engines": carried, "engine_hours": None if carried is None else carried * 24.0,
            # one fewer was not tried (the first size tried, or a gap in the sizes): only a bound
            "is_bound": carried is not None and carried - 1 not in {t["engines"] for t in tried},
            "beyond_max_backends": carried is not None and max_backends is not None and carried > max_backends,
            "tried": tried, "provenance": origin}


def policies_on_held_burst(setup_for, day: DayTraffic, policies: list[str], work: Path, progress) -> list[dict]:
    """The scaling policies on the held burst, each from its own pool (the day's settings)."""
    traffic = held_traffic(day)
    rows = []
    for policy in policies:
        outcomes, series, _ = run_policy(setup_for(policy), traffic, work / f"held-{policy}", progress)
        rows.append({"policy": policy, **judge(outcomes, series, traffic),
                     "engines_at_most": max((p["billed"] for p in series), default=None)})
        progress(f"the held burst, {policy}: carried {rows[-1]['carried']}, kept up {rows[-1]['kept_up']}, "
                 f"{rows[-1]['engines_billed_second_half']} engines in its second half")
    return rows
