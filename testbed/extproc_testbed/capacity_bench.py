"""`extproc bench capacity`: the seed's phase one, a staircase of the scenario's mixed-token traffic
against a simulated pool behind Envoy + the sidecar, each step on a fresh stack. For each class it
records the highest rate at which the class's SLO held (answered within its deadline for 99 % of
its requests by default, failures counted as misses: for loans, p99 under 2 s), and beside it what the
sidecar's capacity model (core/capacity_model.py) said at the end of each step: the per-engine
capacity by class and the engines it wanted. The model's prediction of the pool's capacity for
the mix is `backends / sum_c(share_c / capacity_c)`; the staircase says how wrong that was.

    extproc bench capacity [--backends 2] [--rps 4,8,12,16,20,24] [--step-seconds 40] [--out bench/results]

Every duration is scaled by `--time-scale`; rates and latencies are reported in the simulated
engines' unscaled seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from .machine import describe_machine
from .provenance import provenance
from .scenario_run import summarize
from .scenario_setups import KV_TOKENS, MAX_NUM_SEQS, sidecar_config
from .stack import SimSpec, Stack, StackPorts, http_get, metric_sum, parse_samples
from .traffic import CLASSES, SLO_CLASS, SLO_P99_S, Traffic, drive

SHARES = {"loan_approval": 0.2, "complaint": 0.3, "archive_query": 0.5}  # traffic.ticket's mix
IN_TIME = 0.99  # the share of a class's requests answered within its deadline, for its SLO to hold (--in-time)


def autoscale_settings(time_scale: float, **overrides) -> dict:
    """The capacity model's settings in the sidecar's (scaled) seconds."""
    unscaled = {"window_s": 20.0, "trend_s": 60.0, "horizon_s": 60.0, "drain_s": 30.0, "scale_in_hold_s": 120.0,
                **overrides}
    return {key: value * time_scale if key.endswith("_s") else value for key, value in unscaled.items()}


def write_config(work: Path, ports: StackPorts, time_scale: float, autoscale: dict,
                 max_num_seqs: int = MAX_NUM_SEQS) -> Path:
    path = sidecar_config(work, ports, time_scale)
    config = yaml.safe_load(path.read_text())
    primary = config["pools"]["primary"]
    primary["autoscale"] = autoscale
    primary["capacity"]["max_num_seqs"] = max_num_seqs
    primary["max_inflight"] = len(ports.primary) * max_num_seqs
    path.write_text(yaml.safe_dump(config))
    return path


def sim_args(time_scale: float, max_num_seqs: int = MAX_NUM_SEQS) -> tuple[str, ...]:
    return ("--time-scale", str(time_scale), "--on-kv-exhausted", "crash", "--max-num-seqs", str(max_num_seqs),
            "--kv-tokens", str(KV_TOKENS), "--recovery-s", "90", "--scheduling-policy", "priority")


def model_reading(stack: Stack, time_scale: float) -> dict:
    """What the sidecar's capacity model says now, in unscaled requests per second."""
    status, text = http_get(stack.metrics_url, 2.0)
    if status != 200:
        return {}
    samples = parse_samples(text)
    capacity = {}
    for name in CLASSES:
        value = metric_sum(samples, "extproc_capacity_rps", pool="primary", **{"class": name})
        capacity[name] = round(value * time_scale, 3) if value > 0 else None
    return {"capacity_rps_per_engine": capacity,
            "desired_backends": metric_sum(samples, "extproc_desired_backends", pool="primary"),
            "per_engine_concurrency": metric_sum(samples, "extproc_per_engine_concurrency", pool="primary")}


def class_meets(summary: dict, name: str, in_time: float = IN_TIME) -> bool:
    """The class's SLO held: `in_time` of its requests answered within its deadline, failures
    counted as misses (for loans, whose deadline is 2 s, that is the seed's p99 < 2 s at 0.99)."""
    c = summary["classes"][name]
    return not c["requests"] or (c["in_time"] is not None and c["in_time"] >= in_time)


def run_step(backends: int, rps: float, step_s: float, time_scale: float, work: Path, progress, seed: int,
             in_time: float = IN_TIME) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    ports = StackPorts.random(primary=backends)
    config = write_config(work, ports, time_scale, autoscale_settings(time_scale))
    traffic = Traffic(steady_rps=rps, burst_rps=rps, steady_s=step_s, burst_s=0, recovery_s=0, seed=seed)
    stack = Stack(work, ports, config, primary=SimSpec("deepseek-sim", sim_args(time_scale)),
                  fallback=SimSpec("deepseek-sim-small", sim_args(time_scale)))
    stack.start()
    try:
        outcomes = asyncio.run(drive(stack.url, traffic, time_scale, lambda *a: None))
        reading = model_reading(stack, time_scale)
    finally:
        stack.stop()
    summary = summarize(outcomes, [], 0, traffic)
    step = {"rps": rps, "availability": summary["availability"],
            "classes": {name: {"rps": round(rps * SHARES[name], 2), "meets_slo": class_meets(summary, name, in_time),
                               "in_time": summary["classes"][name]["in_time"],
                               "p99_s": summary["classes"][name]["p99_with_failures_s"]} for name in CLASSES},
            "model": reading}
    step["meets_slo"] = all(c["meets_slo"] for c in step["classes"].values())
    progress(f"{rps:g} req/s: {'meets' if step['meets_slo'] else 'misses'} "
             + ", ".join(f"{n} {'ok' if c['meets_slo'] else 'MISS'}" for n, c in step["classes"].items())
             + f"; model: {reading}")
    return step


def predicted_pool_rps(capacity: dict[str, float | None], backends: int) -> float | None:
    """The mix's rate the pool carries by the model: backends / sum(share / capacity)."""
    if any(capacity.get(name) is None for name in CLASSES):
        return None
    return backends / sum(SHARES[name] / capacity[name] for name in CLASSES)


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="extproc-capacity-"))
    origin = provenance()  # before anything is written
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {message}", flush=True)

    steps = []
    for i, rps in enumerate(args.rps):
        steps.append(run_step(args.backends, rps, args.step_seconds, args.time_scale, work / f"step-{rps:g}", progress,
                              seed=200 + i, in_time=args.in_time))
        if not any(c["meets_slo"] for c in steps[-1]["classes"].values()):
            break  # every class broken: the next steps only break it more
    highest = {name: max((s["classes"][name]["rps"] for s in steps if s["classes"][name]["meets_slo"]), default=None)
               for name in CLASSES}
    held = [s["rps"] for s in steps if s["meets_slo"]]
    # the model's prediction, read at the highest step where the mix held (the engines were busy)
    reference = next((s for s in reversed(steps) if s["meets_slo"]), steps[-1])
    predicted = predicted_pool_rps(reference["model"].get("capacity_rps_per_engine", {}), args.backends)
    measured = max(held, default=None)
    summary = {
        "backends": args.backends, "time_scale": args.time_scale, "step_seconds": args.step_seconds,
        "highest_rps_meeting_slo_by_class": highest, "highest_mix_rps_meeting_slo": measured,
        "model_at_that_step": reference["model"], "model_predicted_mix_rps": None if predicted is None
        else round(predicted, 2),
        "prediction_error": None if predicted is None or not measured else round(predicted / measured - 1, 3),
        "steps": steps,
        "slo": f"each class: {args.in_time:.0%} answered within its deadline (failures count as misses; "
               f"{SLO_CLASS}: {SLO_P99_S:g} s)",
        "pool": f"simulated vLLM, crash mode, {MAX_NUM_SEQS} sequences and {KV_TOKENS} KV tokens per backend",
        "command": " ".join(["extproc", "bench", "capacity", *sys.argv[3:]]),
        "machine": describe_machine(origin["machine"]), "seconds": round(time.monotonic() - started),
        "provenance": origin,
    }
    (out / "capacity.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def section(summary: dict) -> list[str]:
    lines = ["| mix req/s | " + " | ".join(f"{n} req/s (SLO)" for n in CLASSES) + " | model: capacity per engine "
             "(loan / complaint / archive) | model: engines wanted |", "|" + "---|" * (len(CLASSES) + 3)]
    for s in summary["steps"]:
        cap = s["model"].get("capacity_rps_per_engine", {})
        lines.append(f"| {s['rps']:g} | " + " | ".join(
            f"{c['rps']:g} ({'held' if c['meets_slo'] else 'missed'})" for c in s["classes"].values())
            + " | " + " / ".join("–" if cap.get(n) is None else f"{cap[n]:g}" for n in CLASSES)
            + f" | {s['model'].get('desired_backends', '–'):g} |")
    lines.append("")
    lines.append(f"Highest rate meeting its SLO by class: {summary['highest_rps_meeting_slo_by_class']}; the mix: "
                 f"{summary['highest_mix_rps_meeting_slo']} req/s; the model predicted "
                 f"{summary['model_predicted_mix_rps']} req/s (error {summary['prediction_error']}).")
    return lines


def main(args) -> int:
    summary = run(args)
    print("\n".join(section(summary)))
    print(f"written: {Path(args.out) / 'capacity.json'}")
    return 0


def add_parser(bench) -> None:
    p = bench.add_parser("capacity", help="the staircase: per class, the highest rate at which its SLO holds")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--work", default=None, help="where the stacks' logs go (default: a new temporary folder)")
    p.add_argument("--backends", type=int, default=2, help="simulated vLLM servers in the pool")
    p.add_argument("--time-scale", type=float, default=0.5, help="multiply every simulated duration")
    p.add_argument("--rps", type=lambda s: [float(x) for x in s.split(",")], default=[4, 8, 12, 16, 20, 24],
                   help="the staircase's rates (requests per unscaled second, the seed's mix)")
    p.add_argument("--step-seconds", type=float, default=40.0, help="unscaled seconds per step")
    p.add_argument("--in-time", type=float, default=IN_TIME,
                   help="the share of each class answered within its deadline for its SLO to hold (0.99: p99)")
    p.set_defaults(func=main)
