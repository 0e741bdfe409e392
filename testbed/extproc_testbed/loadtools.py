"""`extproc bench loadtools`: the reports of guidellm and inference-perf, run with the shipped
configurations under bench/guidellm/ and bench/inference-perf/, boiled down to what RESULTS.md
shows (request rates, TTFT, TPOT, latency percentiles, failures by status) and kept beside it.

It never runs the tools (they live in venvs of their own, see bench/README.md): it reads the
reports they wrote, copies them small (guidellm's JSON without its per-request records; the
summary and per-stage files of inference-perf) into bench/results/loadtools/, writes
loadtools.json there and refreshes bench/RESULTS.md (its section: report.loadtools_section).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections import Counter
from pathlib import Path

from .provenance import provenance
from .report import loadtools_section, write_results
from .traffic import CLASSES

# httpx's raise_for_status: "Client error '429 Too Many Requests' for url ..."
_STATUS = re.compile(r"'([1-5]\d\d) [A-Za-z]")


def _pct(stats: dict | None, key: str, scale: float = 1.0) -> float | None:
    if not stats:
        return None
    value = stats.get("percentiles", stats).get(key)
    return None if value is None else round(value * scale, 3)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _error_status(record: dict) -> str:
    """The HTTP status of one of guidellm's errored requests, read from its error text."""
    found = _STATUS.search(json.dumps(record))
    return found.group(1) if found else "other"


def guidellm_benchmark(benchmark: dict) -> dict:
    """One strategy of a guidellm report (synchronous, throughput, constant@R)."""
    strategy = benchmark["config"]["strategy"]
    name = strategy["type_"] + (f"@{strategy['rate']:.2f}" if strategy.get("rate") else "")
    m = benchmark["metrics"]
    ok = lambda key: m[key]["successful"]  # noqa: E731
    errored = benchmark.get("requests", {}).get("errored", [])
    statuses = Counter(_error_status(r) for r in errored)
    return {
        "strategy": name,
        "requests": m["request_totals"],
        "requests_per_s": round(ok("requests_per_second")["mean"], 2),
        "ttft_ms": {p: _round(_pct(ok("time_to_first_token_ms"), p), 1) for p in ("p50", "p95", "p99")},
        "tpot_ms": {p: _round(_pct(ok("time_per_output_token_ms"), p), 2) for p in ("p50", "p99")},
        "latency_s": {p: _pct(ok("request_latency"), p, 1) for p in ("p50", "p95", "p99")},
        "prompt_tokens_p50": _pct(ok("prompt_token_count"), "p50"),
        "errored_by_status": dict(statuses) if errored else {},
        "headers": _guidellm_headers(benchmark),
    }


def _guidellm_headers(benchmark: dict) -> dict:
    for records in benchmark.get("requests", {}).values():
        for record in records or ():
            try:
                return json.loads(record["request_args"]).get("headers") or {}
            except (KeyError, TypeError, ValueError):
                continue
    return {}


def guidellm_report(report: dict) -> list[dict]:
    return [guidellm_benchmark(b) for b in report["benchmarks"]]


_GUIDELLM_KEPT = ("request_totals", "requests_per_second", "request_concurrency", "request_latency",
                  "prompt_token_count", "output_token_count", "time_to_first_token_ms", "time_per_output_token_ms",
                  "inter_token_latency_ms", "output_tokens_per_second")


def small_guidellm(report: dict) -> dict:
    """The report without its per-request records (megabytes) and its text, image and audio
    statistics: the request counts, rates, latency and token distributions stay."""
    report = json.loads(json.dumps(report))
    for benchmark in report.get("benchmarks", []):
        benchmark.pop("requests", None)
        metrics = benchmark.get("metrics", {})
        for key in list(metrics):
            if key not in _GUIDELLM_KEPT:
                del metrics[key]
                continue
            for partition in ("incomplete", "total"):
                if isinstance(metrics[key], dict) and isinstance(metrics[key].get(partition), dict):
                    del metrics[key][partition]
            for part in metrics[key].values() if isinstance(metrics[key], dict) else ():
                if isinstance(part, dict):
                    for drop in ("pdf", "mean_ci", "percentile_cis"):
                        part.pop(drop, None)
    return report


def _ip_stats(stats: dict | None, scale: float = 1.0, digits: int = 3) -> dict:
    if not stats:
        return {}
    return {p: round(stats[k] * scale, digits) for p, k in (("p50", "median"), ("p90", "p90"), ("p99", "p99"))
            if stats.get(k) is not None}


def inference_perf_stage(metrics: dict, stage: dict | None = None) -> dict:
    """One stage (or the summary) of inference-perf's lifecycle metrics."""
    ok = metrics.get("successes", {})
    latency = ok.get("latency", {})
    failures = metrics.get("failures", {})
    out = {
        "requests": {"successful": ok.get("count", 0), "failed": failures.get("count", 0)},
        "requests_per_s": round(ok.get("throughput", {}).get("requests_per_sec", 0.0), 2),
        "ttft_ms": _ip_stats(latency.get("time_to_first_token"), 1000, 1),
        "tpot_ms": _ip_stats(latency.get("time_per_output_token"), 1000, 2),
        "latency_s": _ip_stats(latency.get("request_latency")),
        "prompt_tokens": _ip_stats(ok.get("prompt_len") or ok.get("prompt_tokens")),
        "failed_by_label": {label: v.get("count", 0) for label, v in (failures.get("by_label") or {}).items()},
    }
    if stage is not None:
        out["rate"] = stage.get("rate")
    return out


def inference_perf_run(folder: Path) -> dict:
    """A run's folder: summary_lifecycle_metrics.json, stage_N_lifecycle_metrics.json, config.yaml."""
    summary = json.loads((folder / "summary_lifecycle_metrics.json").read_text())
    stages = []
    rates = _ip_rates(folder)
    for path in sorted(folder.glob("stage_*_lifecycle_metrics.json"), key=lambda p: int(p.name.split("_")[1])):
        index = int(path.name.split("_")[1])
        stage = inference_perf_stage(json.loads(path.read_text()),
                                     {"rate": rates[index] if index < len(rates) else None})
        stages.append(stage)
    return {"summary": inference_perf_stage(summary), "stages": stages}


def _ip_rates(folder: Path) -> list[float]:
    """The stages' rates, from the config.yaml inference-perf saved beside its reports."""
    path = folder / "config.yaml"
    if not path.exists():
        return []
    rates = re.findall(r"^\s*-?\s*rate:\s*([\d.]+)", path.read_text(), flags=re.M)
    return [float(r) for r in rates]


def collect(out: Path, sweep: Path | None, guidellm_mix: Path | None, inference_perf_mix: Path | None,
            commands: dict[str, str], note: str, origin: dict | None = None) -> dict:
    """Copy the reports (small) into `out` and write out/loadtools.json (`origin`: its provenance,
    the command's own as it starts; the reports' runs are named by `commands`)."""
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"commands": commands, "note": note, "provenance": origin}
    if sweep is not None:
        report = json.loads(sweep.read_text())
        summary["guidellm_sweep"] = guidellm_report(report)
        (out / "guidellm-sweep.json").write_text(json.dumps(small_guidellm(report)))
    if guidellm_mix is not None:
        summary["guidellm_mix"] = {}
        for name in CLASSES:
            path = guidellm_mix / f"{name}.json"
            if path.exists():
                report = json.loads(path.read_text())
                summary["guidellm_mix"][name] = guidellm_report(report)
                (out / f"guidellm-mix-{name}.json").write_text(json.dumps(small_guidellm(report)))
    if inference_perf_mix is not None:
        summary["inference_perf_mix"] = {}
        for name in CLASSES:
            folder = inference_perf_mix / name
            if (folder / "summary_lifecycle_metrics.json").exists():
                summary["inference_perf_mix"][name] = inference_perf_run(folder)
                target = out / f"inference-perf-mix-{name}"
                target.mkdir(exist_ok=True)
                for path in [*folder.glob("*_lifecycle_metrics.json"), folder / "config.yaml"]:
                    if path.exists():
                        shutil.copy(path, target / path.name)
    (out / "loadtools.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def cmd_loadtools(args: argparse.Namespace) -> int:
    origin = provenance()  # before anything is written
    out = Path(args.out)
    commands = {k: v for k, v in (("guidellm_sweep", args.sweep_command), ("guidellm_mix", args.mix_command),
                                  ("inference_perf_mix", args.inference_perf_command)) if v}
    summary = collect(out, Path(args.guidellm_sweep) if args.guidellm_sweep else None,
                      Path(args.guidellm_mix) if args.guidellm_mix else None,
                      Path(args.inference_perf_mix) if args.inference_perf_mix else None, commands, args.note or "",
                      origin)
    print("\n".join(loadtools_section(summary)))
    print(f"wrote {write_results(out)}")
    return 0


def add_parser(bench) -> None:
    p = bench.add_parser("loadtools", help="summarise guidellm and inference-perf reports into RESULTS.md")
    p.add_argument("--guidellm-sweep", help="guidellm's JSON report of bench/guidellm/sweep.yaml")
    p.add_argument("--guidellm-mix", help="the folder bench/guidellm/run-mix.sh wrote (CLASS.json)")
    p.add_argument("--inference-perf-mix", help="the folder bench/inference-perf/run-mix.sh wrote (CLASS/)")
    p.add_argument("--sweep-command", help="the command that ran the sweep, for RESULTS.md")
    p.add_argument("--mix-command", help="the command that ran guidellm's mix, for RESULTS.md")
    p.add_argument("--inference-perf-command", help="the command that ran inference-perf's mix, for RESULTS.md")
    p.add_argument("--note", help="a line for RESULTS.md: the machine, what else ran on it")
    p.add_argument("--out", default="bench/results/loadtools")
    p.set_defaults(func=cmd_loadtools)
