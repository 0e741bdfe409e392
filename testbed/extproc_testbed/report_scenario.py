"""The burst scenario's Markdown for bench/RESULTS.md: its section (scenario.json; with engines
in both behaviours when the KV cache overflows, side by side), the further runs of it (the
spread), and the matrix (matrix/matrix.json). Pure functions over the results' dicts."""

from __future__ import annotations

from .provenance import provenance_line
from .traffic import CLASSES, SLO_CLASS, SLO_P99_S


def _fmt(value, unit: str = "", missing: str = "—") -> str:
    return missing if value is None else f"{value:g}{unit}"


BEHAVIOUR_WORDS = {
    "queue": "with `queue` (the engines preempt and recompute when their KV cache overflows, as vLLM does: what a "
             "reader's engines do), overload only slows the engines, and the columns show what the sidecar's "
             "priority and bounded waits buy",
    "crash": "with `crash` (an engine whose KV cache overflows dies and is back 90 s later: the seed's GPU "
             "out-of-memory crashes), overload kills engines, and the columns show what admission buys by keeping "
             "them alive",
}


def behaviour_runs(summary: dict) -> dict[str, dict]:
    """Each engine behaviour the results hold (`kv_exhausted`: the one in `setups`, crash in results
    written before it was named; `other_behaviours`) -> its setups, queue first."""
    runs = {summary.get("kv_exhausted", "crash"): summary["setups"],
            **{name: run["setups"] for name, run in summary.get("other_behaviours", {}).items()}}
    return dict(sorted(runs.items(), key=lambda item: item[0] != "queue"))


def side_by_side(summary: dict) -> list[str]:
    """The same trace with the engines in each behaviour, Envoy alone beside the sidecar (nothing
    when the results hold one behaviour)."""
    runs = behaviour_runs(summary)
    if len(runs) < 2:
        return []
    deadlines = summary["setups"]["sidecar"]["classes"]
    rows = [("**answered in time, all requests**", lambda s: _fmt(s.get("in_time"))),
            ("availability", lambda s: _fmt(s.get("availability"))),
            ("simulated OOM crashes", lambda s: _fmt(s.get("oom_crashes"))),
            ("engine preemptions", lambda s: _fmt(s.get("engine_preemptions"))),
            (f"**{SLO_CLASS}: p99 of those sent during the burst (failures counted)**",
             lambda s: _fmt(s["classes"][SLO_CLASS].get("burst_p99_s"), " s", "failed")),
            *((f"{name}: in time (within {_fmt(deadlines[name].get('deadline_s'), ' s')})",
               lambda s, name=name: _fmt(s["classes"][name].get("in_time"))) for name in CLASSES),
            ("goodput within the deadlines (tokens/s)", lambda s: _fmt(s.get("goodput_in_time_tokens_per_s")))]
    lines = ["The same trace with the simulated engines in each behaviour when their KV cache overflows: "
             + "; ".join(BEHAVIOUR_WORDS.get(name, f"`{name}`") for name in runs) + ".", "",
             "| | " + " | ".join(f"{name}: Envoy alone | {name}: Envoy + sidecar" for name in runs) + " |",
             "|---|" + "---|---|" * len(runs)]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(f"{cell(setups['envoy_only'])} | {cell(setups['sidecar'])}"
                                                   for setups in runs.values()) + " |")
    return lines + ["", f"In detail, the run with the engines in `{summary.get('kv_exhausted', 'crash')}` mode "
                        "(any search, step load or ablation below ran in it too):", ""]


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
        *side_by_side(summary),
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
              f"{summary['seconds']} s.", "", provenance_line(summary), ""]
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


def seeds_lines(cells: dict) -> list[str]:
    """The cells run on several seeds (`--seeds`): each run's loans within 2 s, sidecar / Envoy alone."""
    seeded = {name: cell for name, cell in cells.items() if len(cell.get("seeds") or ()) > 1}
    if not seeded:
        return []
    return ["", f"A cell run on several seeds (the traffic drawn anew each time) reads above as all its runs' requests "
            "together: shares of all of them, goodput per second of one run, crashes and attempts summed over the "
            "runs; its slow loans' engines are each run's own (two per run); its plot draws every run's loans on one "
            "time axis over the first run's cap and line. Loans within "
            f"{SLO_P99_S:g} s in each run, sidecar / Envoy alone: " + "; ".join(
                f"{name}: " + ", ".join(
                    f"seed {b['seed']} {_fmt(b['loans_in_time'])} / {_fmt(a['loans_in_time'])}"
                    for b, a in zip(cell["setups"]["sidecar"]["by_seed"], cell["setups"]["envoy_only"]["by_seed"],
                                    strict=True))
                for name, cell in seeded.items()) + "."]


def _picks_ignored(seen: float | None) -> str:
    return "—" if seen is None else "yes" if seen else "no"


def matrix_section(summary: dict, folder: str = "matrix") -> list[str]:
    """The matrix (results/`folder`/matrix.json): per cell, the sidecar against Envoy alone, and
    where the slow loans' time went. A folder other than `matrix` holds the same cells on other
    draws of the traffic (`--out bench/results/NAME` writes NAME/matrix)."""
    cells = summary["cells"]
    if not cells:
        return []
    first = next(iter(cells.values()))
    t = first["traffic"]
    threshold = first.get("long_prefill_token_threshold", 0)
    title = "## The matrix: what users vary (`extproc bench scenario --matrix`)" if folder == "matrix" else \
        f"## The matrix on other draws of the traffic (`results/{folder}/matrix.json`)" if not threshold else \
        f"## The matrix with engines run with `--long-prefill-token-threshold {threshold}` (`results/{folder}/matrix.json`)"
    lines = [
        title,
        "",
        f"An independent burst: {t['branches']} branches; {t['steady_rps']:g} req/s for {t['steady_s']:g} s, a burst "
        f"of {t['burst_rps']:g} req/s for {t['burst_s']:g} s, {t['steady_rps']:g} req/s for {t['recovery_s']:g} s "
        f"(unscaled seconds); loans / complaints / archive queries {' / '.join(f'{w:g} %' for w in t['mix'])}; "
        f"{t['long_share'] * 100:g} % of complaints and archive queries with {t['long_tokens'][0]}-"
        f"{t['long_tokens'][1]}-token prompts. Two simulated engines in crash mode, `--scheduling-policy priority`"
        f"{f', `--long-prefill-token-threshold {threshold}`' if threshold else ''}. "
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
        runs = len(cell.get("seeds") or ())
        lines.append(f"| {name}{f' ({runs} seeds)' if runs > 1 else ''} | **{pair(lb['in_time'], la['in_time'])}** | "
                     f"{_fmt(lb['burst_p50_s'])}, **{_fmt(lb['burst_p99_s'], ' s', 'failed')}** / "
                     f"{_fmt(la['burst_p50_s'])}, {_fmt(la['burst_p99_s'], ' s', 'failed')} | {deadline} | "
                     f"{pair(b['availability'], a['availability'])} | "
                     f"{pair(b.get('goodput_in_time_rps'), a.get('goodput_in_time_rps'))} | "
                     f"{pair(b['oom_crashes'], a['oom_crashes'])} | "
                     f"{pair(b.get('attempts_per_request'), a.get('attempts_per_request'))} | "
                     f"{_picks_ignored(b.get('engine_picks_ignored'))} | "
                     f"{'; '.join(misses) or 'none'} |")
    lines += seeds_lines(cells)
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
    lines += ["", f"Plots: `results/{folder}/CELL.png`, per cell the loans' latency over time, both setups, beside the "
              "sidecar's concurrency cap for latency-bound classes (`extproc_latency_limit`) and its requests in "
              "flight; \"picks ignored\": whether `extproc_engine_picks_ignored` read 1 at any time in the run. "
              f"The slowest loans one by one: `slow_loans.slowest` in `results/{folder}/matrix.json`.", "",
              "Run by " + "; ".join(f"`{command}` (time scale {scale:g})" for command, scale in commands)
              + f"; {sum(c['seconds'] for c in cells.values())} s in all. Machine: {'; '.join(machines)}.", ""]
    by_origin: dict[str, list[str]] = {}  # cells run at different times: each cell keeps its own
    for name, cell in cells.items():
        by_origin.setdefault(provenance_line(cell, "").removeprefix(": "), []).append(name)
    lines += [f"- Provenance of {', '.join(names)}: {line}" for line, names in by_origin.items()] + [""]
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
        mode = "" if summary.get("kv_exhausted", "crash") == "crash" else f" ({summary['kv_exhausted']} mode)"
        lines.append(f"| {name}{mode} | {summary['backends']} | {_fmt(loan.get('burst_p99_s'), ' s', 'failed')} | "
                     + " / ".join(_fmt(b["classes"][c].get("in_time")) for c in CLASSES)
                     + f" | {_fmt(b.get('in_time'))} / {_fmt(a.get('in_time'))} | {b['availability']} / "
                     f"{a['availability']} | {_fmt(b.get('goodput_in_time_tokens_per_s'))} / "
                     f"{_fmt(a.get('goodput_in_time_tokens_per_s'))} | {b['oom_crashes']} / {a['oom_crashes']} |")
    return lines + ["", *(provenance_line(summary, f"- Provenance of {name}") for name, summary in repeats.items()
                          if summary is not None), ""]
