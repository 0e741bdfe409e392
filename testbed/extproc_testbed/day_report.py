"""The day's report (day.py): its tables for bench/RESULTS.md and its plot, engines against the
load over the day for every policy."""

from __future__ import annotations

from pathlib import Path

from .traffic import CLASSES


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


def tables(summary: dict) -> list[str]:
    peak = summary["fixed_peak_backends"]
    lines = ["| policy | in time (loan / complaint / archive) | every class ≥ 99 % | loan p99 s | availability | "
             "engines at most | engine-hours | of the pool sized for the peak | of the smallest fixed pool that "
             "held the day | drains (longest s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["policies"]:
        t = row["in_time_by_class"]
        ratios = [row.get("engine_hours_vs_sized_for_peak"), row["engine_hours_vs_fixed_peak"]]
        lines.append(f"| {row['policy']} | {' / '.join(_share(t[c]) for c in CLASSES)} | "
                     f"{'yes' if row['held_slo'] else 'no'} | {row['loan_p99_s']} | {row['availability']} | "
                     f"{row['max_billed']} | {row['engine_hours']} | "
                     f"{' | '.join('–' if r is None else f'{r:.0%}' for r in ratios)} | "
                     f"{row['drains']} ({row['drain_s_max'] if row['drain_s_max'] is not None else '–'}) |")
    if peak is None:
        sized = "none of the fixed pools run held every class over the day"
    else:
        bound = "at most " if summary.get("fixed_peak_is_smallest_run") else ""
        sized = (f"{bound}{peak} engines"
                 + (" (the smallest run: fewer were not tried)" if bound else
                    f" ({peak - 1} did not)" if summary.get("fixed_one_fewer_run") else ""))
    lines += ["", f"The smallest fixed pool that held every class over the day: {sized}.", ""]
    lines += peak_lines(summary.get("sized_for_peak"), summary.get("deployed", {}).get("cold_start_s"),
                        summary.get("run_settings", {}).get("cold_start_s"))
    fixed = sorted((int(r["policy"].split(":")[1]), r["engine_hours"]) for r in summary["policies"]
                   if r["policy"].startswith("fixed:"))
    bills = [(f"fixed:{n}'s (the day)", hours) for n, hours in fixed]
    peak = summary.get("sized_for_peak") or {}
    if peak.get("engine_hours"):
        bills.insert(0, (f"the pool sized for the peak's ({'at most ' if peak['is_bound'] else ''}"
                         f"{peak['engines']} engines)", peak["engine_hours"]))
    for row in summary["policies"]:
        if not row["policy"].startswith("fixed") and bills:
            shares = ", ".join(f"{row['engine_hours'] / hours:.0%} of {name}" for name, hours in bills)
            lines.append(f"- {row['policy']}: {row['engine_hours']} engine-hours, {shares}.")
    slow = [(row["policy"], row["slow_loans"]) for row in summary["policies"] if row.get("slow_loans")]
    if slow:
        lines += ["", "Loans answered after 2 s (where their time went, the median): " + "; ".join(
            f"{policy} {s['slow']} (prefill {s['medians_s']['prefill_s']} s, in line {s['medians_s']['line_s']} s)"
            for policy, s in slow) + "."]
    lines.append("")
    policies = [row["policy"] for row in summary["policies"]]
    lines += ["| phase of the day | offered req/s | " + " | ".join(f"{p}: engines (held)" for p in policies)
              + " | model: engines needed | smallest fixed pool that held | model's error |",
              "|---|---|" + "---|" * len(policies) + "---|---|---|"]
    errors = summary["model_error_by_phase"]
    for phase, first in summary["policies"][0]["by_phase"].items():
        cells = []
        for row in summary["policies"]:
            p = row["by_phase"][phase]
            cells.append(f"{p['engines_billed_mean']} ({'yes' if p['held'] else 'no'})")
        e = errors[phase]
        smallest, error = e["smallest_fixed_held"], e["error_engines"]
        if smallest is None:
            smallest_text, error_text = f"more than {e['largest_fixed_run']}", "–"
        elif smallest == e["smallest_fixed_run"]:  # the smallest run held: fewer might have too
            smallest_text, error_text = f"≤ {smallest}", "–" if error is None else f"≥ {error:+d}"
        else:
            smallest_text, error_text = str(smallest), "–" if error is None else f"{error:+d}"
        said = e["model_needed_now"]
        if e.get("against"):
            smallest_text += f" ({e['against']})"
            said = f"{said} ({e['against']}, second half)"
        lines.append(f"| {phase} | {first['offered_rps']} | {' | '.join(cells)} | {said} | "
                     f"{smallest_text} | {error_text} |")
    return lines


def peak_lines(peak: dict | None, real_start_s: float | None = None, start_s: float | None = None) -> list[str]:
    """The pool sized for the peak (day_peak.py): each size tried on the burst held, and the
    scaling policies on the same held burst (their engines start in `start_s` of the requests'
    clock, `real_start_s` of the day's)."""
    if not peak:
        return ["The pool sized for the peak was not searched (`--peak-sizes`).", ""]
    tried = peak["tried"]
    if peak["engines"] is None:
        found = f"more than {tried[-1]['engines']} engines (none tried carried it)"
    else:
        below = next((t for t in tried if t["engines"] == peak["engines"] - 1), None)
        found = (f"{'at most ' if peak['is_bound'] else ''}{peak['engines']} engines, "
                 f"{peak['engine_hours']:g} engine-hours over the day"
                 + (f" ({peak['engines'] - 1} were not tried)" if peak["is_bound"] else
                    f" ({peak['engines'] - 1} did not carry it: {_why_not(below)})"))
    lines = [f"The pool sized for the peak: {found}. In the day the burst lasts {peak['day_burst_s']:g} s of the "
             f"requests' clock, short enough for a smaller pool to let complaints and archive queries wait it out; a "
             f"real day's 40 minutes would not. So the pool sized for the peak is the fewest engines that carry the "
             f"burst's {peak['rate_rps']:g} req/s held for {peak['held_s']:g} unscaled seconds (twice the longest "
             f"deadline; after {peak['lead_s']:g} s at the rate before the day's burst): every class ≥ 99 % within its "
             f"deadline over the burst, and at least {peak['kept_up_at_least']:.1%} of the second half's arrivals "
             f"answered in it (a pool that falls behind shows it there, however long the deadlines let the line get).",
             ""]
    if peak.get("beyond_max_backends"):
        lines += ["**It is more engines than the scaling policies may run (`max_backends`).**", ""]
    if peak.get("policies") and start_s is not None:
        lines += [f"The scaling policies' engines start here in {start_s:.2g} s of the requests' clock (the day's "
                  f"{real_start_s:g} s, compressed): their rows hold for engines that start that fast, which a real "
                  f"engine does not; a fixed pool needs none. The model's need: the median of what it said over "
                  f"the second half, rounded up.", ""]
    lines += ["| the burst held, on | in time (loan / complaint / archive) | every class ≥ 99 % | answered / arrived, "
              "second half | engines billed, second half | model: engines needed, second half | loan p99 s | "
              "line at most | carried |",
              "|---|---|---|---|---|---|---|---|---|"]
    runs = [(f"fixed: {t['engines']} engines", t) for t in tried]
    runs += [(f"{p['policy']} (up to {p['engines_at_most']})", p) for p in peak.get("policies", [])]
    for name, t in runs:
        shares = t["in_time_by_class"]
        lines.append(f"| {name} | {' / '.join(_share(shares[c]) for c in CLASSES)} | "
                     f"{'yes' if t['held_slo'] else 'no'} | {t['kept_up']} | {t['engines_billed_second_half']} | "
                     f"{t.get('model_needed_second_half', '–')} | {t['loan_p99_s']} | {t['queue_depth_max']} | "
                     f"{'yes' if t['carried'] else 'no'} |")
    return lines + ["", f"Provenance of the burst held: {_origin(peak.get('provenance'))}.", ""]


def _why_not(run: dict) -> str:
    """Why a size did not carry the burst held: a class late, or the arrivals outrunning it."""
    if not run["held_slo"]:
        late = [c for c in CLASSES if (run["in_time_by_class"].get(c) or 0) < 0.99]
        return f"{', '.join(late)} under 99 % in time"
    return f"every class in time, but it answered {run['kept_up']:.1%} of the second half's arrivals"


def _origin(origin: dict | None) -> str:
    if not origin:
        return "not recorded"
    commit = (origin.get("commit") or "unknown")[:7]
    return f"commit {commit}{' (clean)' if origin.get('clean') else ''}, {str(origin.get('date', ''))[:10]}, " \
           f"`{origin.get('command', '')}`"


def plot(path: Path, rows: list[dict], traffic) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (engines, load) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, height_ratios=(2, 1))
    for row in rows:
        hours = [p["t"] / traffic.hour_s for p in row["series"]]
        engines.step(hours, [p["billed"] for p in row["series"]], where="post", label=f"{row['policy']}")
    predicted = next((r for r in rows if r["policy"] == "predicted"), None)
    if predicted is not None:
        hours = [p["t"] / traffic.hour_s for p in predicted["series"]]
        engines.plot(hours, [p["needed_now"] if p["needed_now"] >= 0 else float("nan") for p in predicted["series"]],
                     color="0.5", linewidth=0.8,
                     linestyle=":", label="model: engines needed now")
    steps = [h / 10 for h in range(0, 241)]
    load.plot(steps, [traffic.peak_rps * traffic.fraction_at(h) for h in steps], color="black")
    for axis in (engines, load):
        axis.axvspan(traffic.burst[0], traffic.burst[1], color="0.9")
        axis.set_xlim(0, 24)
        axis.set_xticks(range(0, 25, 2))
    engines.set_ylabel("engines billed")
    engines.legend(loc="upper left", fontsize=8)
    load.set_ylabel("offered req/s")
    load.set_xlabel("hour of the day (the burst shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
