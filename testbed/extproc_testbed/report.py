"""bench/RESULTS.md, written from the latest results (overhead.json, scenario.json, matrix.json) in one place,
so the figures, the commands that produced them, the machine they ran on and the commit they ran
(each section's provenance line) stay together. All the benchmarks' Markdown is here and in
report_scenario.py (the commands print some of it too); it reads the results, never runs anything."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .provenance import provenance_line
from .report_scenario import matrix_section, repeats_section, scenario_section


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def overhead_table(summary: dict) -> str:
    lines = ["| setup | req/s | p50 | p99 | decision (mean) | waited in line | ext_proc CPU / request "
             "| Envoy CPU / request | Redis CPU / request | vs Envoy alone | vs the floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    def cell(value: float | None, form: str) -> str:
        return "—" if value is None else format(value, form)

    for name, s in summary["setups"].items():
        timings = [cell(s.get(field), ".3f") + ("" if s.get(field) is None else " ms")
                   for field in ("decision_ms", "cpu_ms_per_request", "envoy_cpu_ms_per_request",
                                 "redis_cpu_ms_per_request")]
        timings.insert(1, cell(s.get("queued"), "d"))
        ratios = [cell(summary["ratios"].get(f"{name}/{base}"), ".2f") for base in ("envoy_only", "floor")]
        lines.append(f"| {name} | {s['requests_per_s']:.0f} | {s['p50_ms']:.1f} ms | {s['p99_ms']:.1f} ms | "
                     + " | ".join(timings + ratios) + " |")
    return "\n".join(lines)


def overhead_section(summary: dict) -> list[str]:
    ratios = summary["ratios"]
    goals = summary["goals"]
    lines = [
        "## What it costs per request",
        "",
        f"`{summary['command']}` — {summary['rounds']} alternating rounds of {summary['seconds_per_round']:g} s per "
        f"setup, load by {summary['load_generator']}, medians over the rounds; the floor runs again after every "
        "setup, and a setup's ratio to it is its rate over the two floor runs beside it (median over the rounds). "
        "Each setup is the production Envoy "
        "template in front of a second Envoy answering with `direct_response`; `floor` is a bare Python ext_proc "
        "in the same processing mode; `floor_answers` is that ext_proc answering as the sidecar answers an admitted "
        "request, as it writes them (gRPC's reader-writer API, wire bytes), deciding nothing. \"waited in line\" "
        "counts the sidecar's requests that had to wait for a slot (`extproc_queued_total`): 0, or the waiting path "
        "was measured too.",
        "",
        overhead_table(summary),
        "",
        "| goal | measured | target |",
        "|---|---|---|",
    ]
    for goal, target in goals.items():
        mark = "met" if ratios[goal] >= target else "not met"
        lines.append(f"| {goal} | {ratios[goal]:.3f} | ≥ {target} ({mark}) |")
    workers = {k: v for k, v in summary["setups"].items() if k.startswith("sidecar_workers_")}
    if workers:
        lines += ["", "Throughput against `serve --workers N` (Redis queue shared by the workers): "
                  + ", ".join(f"N={k.rsplit('_', 1)[1]}: {v['requests_per_s']:.0f} req/s" for k, v in workers.items())
                  + f"; N=1: {summary['setups']['sidecar_redis']['requests_per_s']:.0f} req/s."]
    lines += ["", f"Machine: {summary['machine']}.", "", provenance_line(summary), ""]
    return lines


def soak_section(summary: dict) -> list[str]:
    leaks, rss, fds, keys, objects = (summary[k] for k in ("leaks", "rss_mib", "open_fds", "redis_keys", "objects"))
    endings = ", ".join(f"{k}: {v}" for k, v in summary["endings"].items())
    events = Counter(e["event"].split(" ")[0] if e["event"].startswith("engine") else e["event"]
                     for e in summary["events"])
    lines = [
        "## The soak",
        "",
        f"`{summary.get('command', 'extproc bench soak')}` — {summary['minutes']:g} minutes of mixed load at "
        f"{summary['rate']:g} req/s through real Envoy, one sidecar on a real Redis queue, two simulated engines "
        f"and a fallback; {events.get('engine', 0)} engine crashes and {events.get('reload', 0)} reloads (SIGHUP) "
        f"on the way; a quiet moment every {summary['cycle_s']:g} s ({summary['quiet_moments']} in all). "
        f"{summary['requests']} requests: {endings}.",
        "",
        "| at every quiet moment | worst seen | must be |",
        "|---|---|---|",
        f"| slots in flight | {leaks['slots_in_flight_at_quiet_max']:g} | 0 |",
        f"| requests waiting | {leaks['slots_waiting_at_quiet_max']:g} | 0 |",
        f"| slots taken − given back | {leaks['slots_taken_minus_given_back_max']:g} | 0 |",
        f"| leases held in Redis | {leaks['leases_at_quiet_max']:g} | 0 |",
        "",
        "| after warm-up (the third quiet moment on) | first | last | growth |",
        "|---|---|---|---|",
        f"| resident memory | {rss['first']} MiB | {rss['last']} MiB | {rss['growth_per_hour']:+g} MiB/hour |",
        f"| open file descriptors | {fds['first']} | {fds['last']} | max {fds['max']} |",
        f"| Redis keys | {keys['first']} | {keys['last']} | max {keys['max']} |",
        f"| Python objects (gc-tracked) | {objects['first']} | {objects['last']} | "
        f"{objects['growth_per_hour']:+g}/hour |",
        "",
        "Types that grew most between the first and the last quiet moment after warm-up: "
        + ", ".join(f"`{k}` {v:+d}" for k, v in objects["grown_most"].items() if v) + ".",
        "",
        f"Machine: {summary['machine']}; the run took {summary['seconds']} s.",
        "",
        provenance_line(summary),
        "",
    ]
    return lines


def write_results(results_dir: Path) -> Path:
    """Write RESULTS.md next to the results folder (bench/results -> bench/RESULTS.md). A run
    written into a folder of its own inside it (bench/results/repeat-1) refreshes the whole
    page, from bench/results."""
    if results_dir.parent.name == "results":
        results_dir = results_dir.parent
    lines = ["# Benchmark results", "",
             "Written by `extproc bench ...` from the JSON files in `bench/results/`; rerun a command to refresh "
             "its section.", ""]
    scenario = _load(results_dir / "scenario.json")
    if scenario is not None:
        lines += scenario_section(scenario)
    small = _load(results_dir / "small-pool" / "scenario.json")
    if small is not None:
        lines += scenario_section(small, "On a small pool, with the shipped defaults")
    repeats = {path.parent.name: _load(path) for path in sorted(results_dir.glob("*/scenario.json"))
               if path.parent.name != "small-pool"}
    if repeats:
        lines += repeats_section(repeats)
    lines += vllm_scenario_section(results_dir)
    # the matrix, then the same cells on other draws of the traffic (`--out bench/results/NAME`)
    for path in [results_dir / "matrix" / "matrix.json", *sorted(results_dir.glob("*/matrix/matrix.json"))]:
        if (matrix := _load(path)) is not None:
            lines += matrix_section(matrix, str(path.parent.relative_to(results_dir)))
    overhead = _load(results_dir / "overhead.json")
    if overhead is not None:
        lines += overhead_section(overhead)
    soak = _load(results_dir / "soak.json")
    if soak is not None:
        lines += soak_section(soak)
    lines += capacity_sections(results_dir)
    loadtools = _load(results_dir / "loadtools" / "loadtools.json")
    if loadtools is not None:
        lines += loadtools_section(loadtools)
    path = results_dir.parent / "RESULTS.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def vllm_scenario_section(results_dir: Path) -> list[str]:
    """The burst on real vLLM-CPU engines (vllm/scenario-vllm.json; scenario_vllm_report.py)."""
    from .scenario_vllm_report import section

    summary = _load(results_dir / "vllm" / "scenario-vllm.json")
    return [] if summary is None else section(summary)


def capacity_sections(results_dir: Path) -> list[str]:
    """The capacity staircase (capacity.json) and the autoscaling run (autoscale.json)."""
    from .autoscale import table
    from .capacity_bench import section

    lines: list[str] = []
    capacity = _load(results_dir / "capacity.json")
    if capacity is not None:
        lines += ["## Capacity: the staircase (`extproc bench capacity`)", "",
                  f"`{capacity['command']}`, {capacity['backends']} simulated engines ({capacity['pool']}), "
                  f"{capacity['step_seconds']:g} s per step; SLO: {capacity['slo']}. Rates in requests per unscaled "
                  "second; the model's columns are what `extproc_capacity_rps` and `extproc_desired_backends` read at "
                  "the end of each step.", "", *section(capacity), "", provenance_line(capacity), ""]
    autoscale = _load(results_dir / "autoscale.json")
    if autoscale is not None:
        t = autoscale["traffic"]
        lines += ["## Autoscaling: fixed pool, queue depth, prediction (`extproc bench scenario --autoscale`)", "",
                  f"Steady {t['steady_rps']:g} req/s for {t['steady_s']:g} s, a burst of {t['burst_rps']:g} req/s for "
                  f"{t['burst_s']:g} s, recovery {t['steady_rps']:g} req/s for {t['recovery_s']:g} s (unscaled); "
                  f"{autoscale['base_backends']} engines at the start, at most {autoscale['max_backends']}, each "
                  f"started {autoscale['cold_start_s']:g} s after it is asked for and billed from then; scale-in after "
                  f"a {autoscale['stabilization_s']:g} s stabilization window. \"Enough engines\": "
                  f"{autoscale['peak_backends']}, the fixed pool sized for the peak.", "", *table(autoscale), "",
                  "![engines and queue depth over time, three policies](results/autoscale.png)", "",
                  provenance_line(autoscale), ""]
    day = _load(results_dir / "day.json")
    if day is not None:
        lines += day_section(day)
    return lines


def day_section(day: dict) -> list[str]:
    """The compressed day (day.json, `extproc bench scenario --day`)."""
    from .day_report import tables

    t, run = day["traffic"], day["run_settings"]
    return ["## Capacity over a day (`extproc bench scenario --day`)", "",
            f"A working day in {24 * t['hour_s']:g} unscaled seconds ({day['compression']:g}x a real one; wall time "
            f"x{day['time_scale']:g}): a night at a fifth of the peak's {t['peak_rps']:g} req/s, a morning ramp, two "
            f"peaks and the seed's burst (twice the peak, 40 minutes of the day) inside the first, an evening fall. "
            f"Engines of {run['max_num_seqs']} sequences; an engine serves {run['cold_start_s']:.2g} s after it is "
            f"asked for ({day['deployed']['cold_start_s']:g} s of a real day) and is billed from then until it is "
            f"stopped, a scaling policy's engines drained first; the model's scale-in hold "
            f"{run['model']['scale_in_hold_s']:.2g} s ({day['deployed']['scale_in_hold_s']:g} s), one engine out per "
            f"{run['scale_in_every_s']:.2g} s at most; the queue rule: AverageValue {day['queue_per_engine']:g} "
            "waiting per engine, the HPA's 300 s window (compressed). The settings are the manifests' "
            "(docs/deploy.md#what-to-set-and-why). Envoy is the template (it follows the sidecar's engine picks); "
            "the pool has no fallback pool, so nothing is degraded off the bill. Engine-hours are hours of the day.",
            "",
            *tables(day), "", "![engines billed against the load over the day, every policy](results/day.png)", "",
            provenance_line(day), ""]


def _command_line(commands: dict, key: str) -> list[str]:
    return [f"`{commands[key]}`", ""] if commands.get(key) else []


def _fmt_stats(values: dict, keys: tuple[str, ...]) -> str:
    return " / ".join("—" if values.get(k) is None else f"{values[k]:g}" for k in keys)


def _by_status(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items() if v) or "none"


def loadtools_section(summary: dict) -> list[str]:
    """The load tools' runs (loadtools.json, written by `extproc bench loadtools`)."""
    lines = ["## The load tools platform teams use: guidellm and inference-perf", "",
             "The shipped configurations (`bench/guidellm/`, `bench/inference-perf/`; how to install and run "
             "them: `bench/README.md`) against `extproc demo` (two simulated engines and a fallback behind the "
             "sidecar, shipped defaults), offline, with a local tokenizer (`bench/make_tokenizer.py`). **Neither "
             "tool retries a refused request or reads `retry-after`: each 429 or 503 below is one refusal the "
             "sidecar answered, counted by the tool as a failed request.** Latencies are the tools' own "
             "(client side, through Envoy). Written by `extproc bench loadtools` from the tools' reports.", ""]
    if summary.get("note"):
        lines += [summary["note"], ""]
    commands = summary.get("commands", {})
    if "guidellm_sweep" in summary:
        lines += ["### guidellm sweep, as the loan_approval class", "", *_command_line(commands, "guidellm_sweep"),
                  "| strategy | requests ok / errored | req/s | TTFT p50 / p95 / p99 (ms) | TPOT p50 / p99 (ms) | "
                  "latency p50 / p95 / p99 (s) | errors by status |", "|---|---|---|---|---|---|---|"]
        for b in summary["guidellm_sweep"]:
            r = b["requests"]
            lines.append(f"| {b['strategy']} | {r['successful']} / {r['errored'] + r.get('incomplete', 0)} | "
                         f"{b['requests_per_s']:g} | {_fmt_stats(b['ttft_ms'], ('p50', 'p95', 'p99'))} | "
                         f"{_fmt_stats(b['tpot_ms'], ('p50', 'p99'))} | {_fmt_stats(b['latency_s'], ('p50', 'p95', 'p99'))} | "
                         f"{_by_status(b['errored_by_status'])} |")
        lines.append("")
    if summary.get("guidellm_mix"):
        lines += ["### guidellm at constant rates, the three classes at once", "",
                  *_command_line(commands, "guidellm_mix"),
                  "| class | rate (req/s) | requests ok / errored | req/s answered | TTFT p50 / p99 (ms) | "
                  "TPOT p50 / p99 (ms) | latency p50 / p99 (s) | errors by status |", "|---|---|---|---|---|---|---|---|"]
        for name, benches in summary["guidellm_mix"].items():
            for b in benches:
                r = b["requests"]
                lines.append(f"| {name} | {b['strategy'].split('@')[-1]} | {r['successful']} / "
                             f"{r['errored'] + r.get('incomplete', 0)} | {b['requests_per_s']:g} | "
                             f"{_fmt_stats(b['ttft_ms'], ('p50', 'p99'))} | {_fmt_stats(b['tpot_ms'], ('p50', 'p99'))} | "
                             f"{_fmt_stats(b['latency_s'], ('p50', 'p99'))} | {_by_status(b['errored_by_status'])} |")
        lines.append("")
    if summary.get("inference_perf_mix"):
        lines += ["### inference-perf staircase, the three classes at once", "",
                  *_command_line(commands, "inference_perf_mix"),
                  "TPOT, not ITL: inference-perf's ITL median reads 0 for streamed chunks.", "",
                  "| class | stage rate (req/s) | ok / failed | req/s answered | TTFT p50 / p90 / p99 (ms) | "
                  "TPOT p50 / p99 (ms) | latency p50 / p99 (s) | prompt tokens p50 / p99 | failures |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, run in summary["inference_perf_mix"].items():
            for s in run["stages"]:
                r = s["requests"]
                lines.append(f"| {name} | {s.get('rate') if s.get('rate') is not None else '—'} | "
                             f"{r['successful']} / {r['failed']} | {s['requests_per_s']:g} | "
                             f"{_fmt_stats(s['ttft_ms'], ('p50', 'p90', 'p99'))} | {_fmt_stats(s['tpot_ms'], ('p50', 'p99'))} | "
                             f"{_fmt_stats(s['latency_s'], ('p50', 'p99'))} | {_fmt_stats(s['prompt_tokens'], ('p50', 'p99'))} | "
                             f"{_by_status(s['failed_by_label'])} |")
        lines.append("")
    lines += ["Raw reports (guidellm's JSON without its per-request records; inference-perf's summary and "
              "per-stage files): `bench/results/loadtools/`.", "", provenance_line(summary), ""]
    return lines
