"""`extproc bench scenario --day`, run: the day's policies one after another (day.py), then the
pool sized for the peak and the scaling policies on the burst held (day_peak.py); into
OUT/day.json, day-series.json and day.png.

`--peak-only` runs only the second part and writes it into an OUT/day.json a day run left
there, the day's figures as they ran (the held burst's runs keep their own provenance, in
`sized_for_peak.provenance`)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

from .day import (
    DEPLOYED,
    HOUR_S,
    POLICIES,
    DayTraffic,
    compression,
    model_error,
    policy_row,
    setup_for,
    summarize_day,
)
from .day_peak import PEAK_SIZES, policies_on_held_burst, size_for_peak
from .provenance import provenance

SCALING = ("predicted", "queue")


def with_peak(summary: dict, peak: dict, traffic: DayTraffic) -> dict:
    """The day's summary with the pool sized for the peak: each policy's engine-hours against
    it, and the model's error in the burst against it."""
    sized = peak.get("engine_hours")
    for row in summary["policies"]:
        row["engine_hours_vs_sized_for_peak"] = None if not sized else round(row["engine_hours"] / sized, 3)
    return {**summary, "sized_for_peak": peak,
            "model_error_by_phase": model_error(summary["policies"], traffic, peak)}


def same_day(summary: dict, traffic: DayTraffic, args) -> dict:
    """The day's summary a --peak-only run adds to, refused unless it ran the same day and settings."""
    ran = {"traffic": summary.get("traffic"), "time_scale": summary.get("time_scale"),
           "queue_per_engine": summary.get("queue_per_engine")}
    asked = {"traffic": dataclasses.asdict(traffic), "time_scale": args.time_scale,
             "queue_per_engine": args.queue_per_engine}
    differ = [key for key in ran if json.loads(json.dumps(ran[key])) != json.loads(json.dumps(asked[key]))]
    if differ:
        raise SystemExit(f"--peak-only: the day.json there ran another {', '.join(differ)}; run the day again "
                         "(without --peak-only) or ask for the same")
    return summary


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traffic = DayTraffic(hour_s=args.hour_s, peak_rps=args.peak_rps, seed=17)
    origin = provenance()  # before anything is written
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {message}", flush=True)

    def setup(policy: str):
        return setup_for(policy, traffic, args.time_scale, args.queue_per_engine)

    work = Path(tempfile.mkdtemp(prefix="extproc-day-"))
    progress(f"logs in {work}; a day of {traffic.duration_s:g} unscaled seconds, {compression(traffic):g}x a real one")
    if args.peak_only:
        summary = same_day(json.loads((out / "day.json").read_text()), traffic, args)
    else:
        from .day_report import plot

        rows = []
        for policy in args.policies:
            rows.append(policy_row(setup(policy), traffic, work / policy.replace(":", "-"), progress))
            progress(f"{policy}: held {rows[-1]['held_slo']}, {rows[-1]['in_time_by_class']}, "
                     f"{rows[-1]['engine_hours']} engine-hours")
        summary = summarize_day(rows, traffic, args, origin, time.monotonic() - started)
        (out / "day-series.json").write_text(json.dumps({"provenance": origin, **{r["policy"]: r["series"]
                                                                                   for r in rows}}) + "\n")
        plot(out / "day.png", rows, traffic)
    if args.peak_sizes:
        peak = size_for_peak(setup, traffic, args.peak_sizes, work, progress, DEPLOYED["max_backends"])
        scaling = [row["policy"] for row in summary["policies"] if row["policy"] in SCALING]
        peak["policies"] = policies_on_held_burst(setup, traffic, scaling, work, progress)
        summary = with_peak(summary, peak, traffic)
        if args.peak_only:  # the day's figures ran elsewhere: say whose the burst held's are
            summary["provenance"] = {**summary["provenance"], "note": (
                f"the burst held (sized_for_peak) by --peak-only at {str(origin.get('commit'))[:7]}, "
                "replacing what this run found")}
    (out / "day.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(args) -> int:
    from .day_report import tables

    args.policies = args.policies or list(POLICIES)
    args.queue_per_engine = args.queue_per_engine or float(DEPLOYED["max_num_seqs"])
    summary = run(args)
    print("\n".join(tables(summary)))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--day", action="store_true",
                   help="instead: a working day compressed (night, ramp, two peaks, the burst, evening), the pool "
                        "scaled by each policy in turn (fixed:N, queue, predicted); into OUT/day.json")
    p.add_argument("--hour-s", type=_positive, default=HOUR_S, help="with --day: unscaled seconds per hour of the day")
    p.add_argument("--peak-rps", type=_positive, default=14.0,
                   help="with --day: requests per unscaled second at the day's peak (the burst is twice that)")
    p.add_argument("--peak-sizes", type=_sizes, default=PEAK_SIZES, metavar="N,N,...",
                   help="with --day: the fixed pools tried, ascending, on the burst held until one carries it (the "
                        "pool sized for the peak; day_peak.py); empty: none")
    p.add_argument("--peak-only", action="store_true",
                   help="with --day: only the pool sized for the peak and the scaling policies on the burst held, "
                        "written into the day.json a day run left in OUT")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text}: a number above 0")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(sorted({int(n) for n in text.split(",") if n.strip()}))
    if any(n < 1 for n in sizes):
        raise ValueError(f"{text}: engine counts of at least 1")
    return sizes
