"""bench/RESULTS.md, written from the latest results (overhead.json, scenario.json) in one place,
so the figures, the commands that produced them and the machine they ran on stay together."""

from __future__ import annotations

import json
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def overhead_section(summary: dict) -> list[str]:
    from .overhead import table

    ratios = summary["ratios"]
    goals = summary["goals"]
    lines = [
        "## What it costs per request",
        "",
        f"`{summary['command']}` — {summary['rounds']} alternating rounds of {summary['seconds_per_round']:g} s per "
        f"setup, load by {summary['load_generator']}, medians over the rounds. Each setup is the production Envoy "
        "template in front of a second Envoy answering with `direct_response`; `floor` is a bare Python ext_proc "
        "in the same processing mode.",
        "",
        table(summary),
        "",
        "| goal | measured | target |",
        "|---|---|---|",
    ]
    for goal, target in goals.items():
        mark = "met" if ratios[goal] >= target else "not met"
        lines.append(f"| {goal} | {ratios[goal]:.2f} | ≥ {target} ({mark}) |")
    workers = {k: v for k, v in summary["setups"].items() if k.startswith("sidecar_workers_")}
    if workers:
        lines += ["", "Throughput against `serve --workers N` (Redis queue shared by the workers): "
                  + ", ".join(f"N={k.rsplit('_', 1)[1]}: {v['requests_per_s']:.0f} req/s" for k, v in workers.items())
                  + f"; N=1: {summary['setups']['sidecar_redis']['requests_per_s']:.0f} req/s."]
    lines += ["", f"Machine: {summary['machine']}.", ""]
    return lines


def repeats_section(repeats: dict[str, dict | None]) -> list[str]:
    """Further runs of the burst (`--out bench/results/NAME`), one row each: the spread."""
    lines = ["## The burst again", "",
             "Further runs of `extproc bench scenario --backends N --out bench/results/NAME` (the same traffic and "
             "seed; what differs is the machine's timing).", "",
             "| run | backends | loan p99: all / sent in the burst (failures counted) | availability: sidecar / "
             "Envoy alone | OOM crashes: sidecar / Envoy alone |", "|---|---|---|---|---|"]
    for name, summary in repeats.items():
        if summary is None:
            continue
        a, b = summary["setups"]["envoy_only"], summary["setups"]["sidecar"]
        loan = b["classes"]["loan_approval"]
        lines.append(f"| {name} | {summary['backends']} | {_s(loan['p99_with_failures_s'])} / "
                     f"{_s(loan.get('burst_p99_s'))} | {b['availability']} / {a['availability']} | "
                     f"{b['oom_crashes']} / {a['oom_crashes']} |")
    return lines + [""]


def _s(value: float | None) -> str:
    return "failed" if value is None else f"{value:g} s"


def write_results(results_dir: Path) -> Path:
    """Write RESULTS.md next to the results folder (bench/results -> bench/RESULTS.md)."""
    lines = ["# Benchmark results", "",
             "Written by `extproc bench ...` from the JSON files in `bench/results/`; rerun a command to refresh "
             "its section.", ""]
    scenario = _load(results_dir / "scenario.json")
    if scenario is not None:
        from .scenario import results_section

        lines += results_section(scenario)
    repeats = {path.parent.name: _load(path) for path in sorted(results_dir.glob("*/scenario.json"))}
    if repeats:
        lines += repeats_section(repeats)
    overhead = _load(results_dir / "overhead.json")
    if overhead is not None:
        lines += overhead_section(overhead)
    path = results_dir.parent / "RESULTS.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
