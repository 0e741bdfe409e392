"""The fixed pool sized for the peak (day.py's baseline): the fewest engines that carry the day's
burst held, found by running it.

Why held. In the compressed day the burst lasts 40 minutes of the day but 33 s of the requests'
clock (a request, and each class's deadline, last as long as on a real day): about one
complaint's deadline. A pool too small for the burst then carries it by letting complaints and
archive queries wait it out, which a real day's 40 minutes would not allow: every deadline is
far shorter than the burst. So the smallest fixed pool that held the compressed day is not the
pool a platform team must run for that day; the one sized for the peak is found apart, at the
burst's rate held for `HELD_S` unscaled seconds (twice the longest deadline), on `N` engines
from the start. `N` carries the peak when every class keeps its target and, over the second
half, the pool answered at least `KEPT_UP` of what arrived: a pool too small shows it there as a
line that grows, whatever the deadlines let it hide. The sizes in `PEAK_SIZES` are tried in
ascending order until one carries; the one below it did not.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .autoscale import held_slo, run_policy
from .scenario_run import summarize
from .traffic import DEADLINES_S, SLO_CLASS, Outcome, in_time_by_class

HELD_S = 2 * max(DEADLINES_S.values())  # unscaled seconds at the burst's rate
KEPT_UP = 0.97  # of the second half's arrivals answered in it (Poisson noise on ~3000 is ~2 %)
PEAK_SIZES = (5, 6, 7, 8, 9, 10)


def held_traffic(day):
    """The day's traffic (the same tickets, mix and seed) at its burst's rate throughout, for
    `HELD_S` unscaled seconds."""
    level = day.burst[2]
    return dataclasses.replace(day, hour_s=HELD_S / 24, curve=((0.0, level), (24.0, level)),
                               burst=(0.0, 0.0, level))


def kept_up(outcomes: list[Outcome], duration_s: float) -> float:
    """Of the requests that arrived in the second half, the share of as many answered in it."""
    half = duration_s / 2
    arrived = sum(half <= o.sent_at < duration_s for o in outcomes)
    answered = sum(o.ok and o.latency_s is not None and half <= o.sent_at + o.latency_s < duration_s
                   for o in outcomes)
    return answered / arrived if arrived else 1.0


def size_for_peak(setup_for, day, sizes: tuple[int, ...], work: Path, progress) -> dict:
    """Try `fixed:N` for N in `sizes` (ascending) on the held burst until one carries it."""
    traffic = held_traffic(day)
    tried = []
    for engines in sizes:
        policy = f"fixed:{engines}"
        outcomes, series, _ = run_policy(setup_for(policy), traffic, work / f"peak-{engines}", progress)
        shares = in_time_by_class(outcomes)
        held = held_slo({"in_time_by_class": shares})
        keeping = kept_up(outcomes, traffic.duration_s)
        summary = summarize(outcomes, [], 0, traffic)
        tried.append({
            "engines": engines, "in_time_by_class": shares, "held_slo": held, "kept_up": round(keeping, 4),
            "carried": held and keeping >= KEPT_UP,
            "loan_p99_s": summary["classes"][SLO_CLASS]["p99_with_failures_s"],
            "queue_depth_max": max((p["queue_depth"] for p in series), default=None),
        })
        progress(f"peak, {policy}: held {tried[-1]['held_slo']}, kept up {keeping:.3f}, {shares}")
        if tried[-1]["carried"]:
            break
    carried = next((t["engines"] for t in tried if t["carried"]), None)
    return {"held_s": HELD_S, "rate_rps": round(day.peak_rps * day.burst[2], 2), "kept_up_at_least": KEPT_UP,
            "engines": carried, "engine_hours": None if carried is None else carried * 24.0, "tried": tried}
