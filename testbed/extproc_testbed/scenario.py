"""What the sidecar buys under a burst: the seed's situation on a simulated pool, the same traffic
through (a) Envoy alone, configured as a careful platform team would, and (b) Envoy + the sidecar.

    extproc bench scenario [--out bench/results] [--backends 4] [--kv-exhausted crash|queue|both] [--search] [--steps]
    extproc bench scenario --autoscale [--policies fixed,queue,predicted]   (autoscale.py)
    extproc bench scenario --day [--policies predicted,queue,fixed:4,fixed:3] [--peak-sizes 5,6,7] [--peak-only] (day_run.py)
    extproc bench scenario --matrix [--cells plain-32-ignore,...]            (scenario_matrix.py)
    extproc bench scenario --engine vllm [--backends 2]                      (scenario_vllm.py)

The traffic (`Traffic`): 200 branches; loan approvals (20 %, urgent 0-3), complaints (30 %,
VIP 0-2), archive queries (50 %, a third of them bulk); prompts mostly around 500 tokens, 4.5 %
of 1k-4k, 0.5 % of 8.5k-12.8k (the tail, up to the usable context); a steady phase, a burst
well beyond capacity, a recovery phase. Clients
retry like real ones: on 429, 503, 5xx or a reset, after `retry-after` (or 1, 2 s with jitter),
at most three attempts, one idempotency-key per request.

The pool: N simulated vLLM servers in `crash` mode (an engine that overfills its KV cache dies,
fails what it held, and is back 90 s later: the seed's GPU out-of-memory crashes), 8 sequences
and 24,576 tokens of KV cache each. `--kv-exhausted queue` runs them as vLLM behaves instead
(preempt and recompute: overload slows the engines, never kills them); `--kv-exhausted both`
runs the same trace both ways, one after the other: `setups` holds the crash run (named by
`kv_exhausted`), `other_behaviours.queue.setups` the queue run.

(a) Envoy alone: the production template without the ext_proc filter, per-cluster circuit
breakers sized to the backends (8 requests in flight and 8 pending per backend), outlier
detection, one retry on another host for connect failures and resets, within a retry budget.
(b) Envoy + the sidecar: the same template with the filter, the sidecar reading the backends'
KV capacity and usage; a quarter of the same backends (at least one) kept for long prompts
(`long_pool`), so their prefill never stalls the short tickets' steps; the sidecar picks each
request's backend by KV tokens (`pick_backend`), so no engine of a pool overfills. Envoy alone
cannot do either: it does not count tokens.

Every duration is scaled by `--time-scale` so a run takes well under a minute here; every
latency is reported in the simulated backends' unscaled seconds, comparable with the seed's.

Here: the command (`run`: the setups, the searches, scenario.json, the plots). The traffic and its
client are in traffic.py, the setups' configuration in scenario_setups.py, one run and its summary
in scenario_run.py, the Markdown in report_scenario.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from . import autoscale, day_run, scenario_matrix, scenario_vllm
from .machine import describe_machine
from .provenance import provenance
from .report import write_results
from .report_scenario import scenario_section
from .scenario_run import ablation_row, run_setup, smallest_meeting_slo, step_load, strip
from .scenario_setups import KV_TOKENS, MAX_NUM_SEQS, MECHANISMS
from .traffic import CLASSES, SLO_CLASS, SLO_P99_S, Traffic


BEHAVIOURS = {"crash": ["crash"], "queue": ["queue"], "both": ["crash", "queue"]}


def pool_text(kv_exhausted: str) -> str:
    """The pool in words, its engines' behaviour when their KV cache overflows named."""
    mode = "crash mode (an engine whose KV cache overflows dies, 90 s recovery)" if kv_exhausted == "crash" \
        else "queue mode (an engine whose KV cache overflows preempts and recomputes, as vLLM does)"
    return f"simulated vLLM, {mode}, {MAX_NUM_SEQS} sequences and {KV_TOKENS} KV tokens per backend"


def run(args) -> dict:
    origin = provenance()  # before anything is written
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="extproc-scenario-"))
    traffic = Traffic.small_pool() if args.small_pool else Traffic()
    traffic = traffic if args.size == 1 else traffic.scaled(args.size)
    behaviours = BEHAVIOURS[args.kv_exhausted]
    kv = behaviours[0]  # the searches, the step load and the ablation run with the engines in this mode
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {message}", flush=True)

    progress(f"traffic: {traffic}; time scale {args.time_scale}; engines on KV exhausted: "
             f"{' and '.join(behaviours)}; logs in {work}")
    runs = {}
    for behaviour in behaviours:  # the same trace, engines in each behaviour
        folder = "" if behaviour == kv else f"{behaviour}-"
        runs[behaviour] = {setup: run_setup(setup, args.backends, traffic, args.time_scale,
                                            work / f"{folder}{setup}-{args.backends}", progress,
                                            shipped=args.small_pool, kv_exhausted=behaviour)
                           for setup in ("envoy_only", "sidecar")}
        for setup, result in runs[behaviour].items():
            progress(f"{behaviour}: {setup} N={args.backends}: availability {result['availability']}, crashes "
                     f"{result['oom_crashes']}, preemptions {result['engine_preemptions']}, loan p99 "
                     f"{result['classes'][SLO_CLASS]['p99_s']} s")
    main = runs[kv]
    minimum: dict[str, int | None] = {}
    tried: dict[str, dict[int, bool]] = {}
    if args.search:
        known = {"envoy_only": {args.backends: main["envoy_only"]}, "sidecar": {args.backends: main["sidecar"]}}
        minimum["sidecar"], tried["sidecar"] = smallest_meeting_slo(
            "sidecar", args.backends, args.max_backends, traffic, args.time_scale, work, progress, known["sidecar"],
            args.min_backends, kv)
        minimum["envoy_only"], tried["envoy_only"] = smallest_meeting_slo(
            "envoy_only", minimum["sidecar"] or args.max_backends, args.max_backends, traffic, args.time_scale, work,
            progress, known["envoy_only"], args.min_backends, kv)
    ablation = []
    if args.ablation:
        variants = [frozenset([m]) for m in MECHANISMS] + [frozenset(MECHANISMS)]
        for off in variants:
            name = "without " + " and ".join(sorted(off))
            result = run_setup("sidecar", args.backends, traffic, args.time_scale,
                               work / f"ablation-{'-'.join(sorted(off))}", progress, off, kv_exhausted=kv)
            ablation.append({"variant": name, "off": sorted(off), **ablation_row(result)})
            progress(f"{name}: {ablation[-1]}")
        ablation.insert(0, {"variant": "all on", "off": [], **ablation_row(main["sidecar"])})
        ablation.append({"variant": "Envoy alone", "off": None, **ablation_row(main["envoy_only"])})
    levels = step_load(args.backends, args.time_scale, work, progress, args.step_rps, args.step_seconds, kv) \
        if args.steps else []
    summary = {
        "kv_exhausted": kv,  # the engines' behaviour in `setups` (and the searches, step load, ablation)
        "setups": {setup: strip(result) for setup, result in main.items()},
        # the same trace with the engines in each other behaviour asked for (--kv-exhausted both)
        "other_behaviours": {behaviour: {"pool": pool_text(behaviour),
                                         "setups": {setup: strip(result) for setup, result in runs[behaviour].items()}}
                             for behaviour in behaviours[1:]},
        "backends": args.backends,
        "min_backends_for_slo": minimum,
        "backends_tried": {k: {str(n): ok for n, ok in v.items()} for k, v in tried.items()},
        "max_backends_tried": args.max_backends if args.search else None,
        "slo": f"{SLO_CLASS} p99 under {SLO_P99_S:g} s, failed requests counted as missing it",
        "step_load": levels,
        "ablation": ablation,
        "traffic": traffic.__dict__,
        "sidecar_config": "shipped defaults" if args.small_pool else "tuned for the pool (a long pool, backends picked)",
        "time_scale": args.time_scale,
        "pool": pool_text(kv),
        "command": " ".join(["extproc", "bench", "scenario", *sys.argv[3:]]),
        "machine": describe_machine(origin["machine"]),
        "seconds": round(time.monotonic() - started),
        "provenance": origin,
    }
    (out / "scenario.json").write_text(json.dumps(summary, indent=2) + "\n")
    from . import plots  # matplotlib: installed with the test and bench tools, not the server

    plots.scenario_plots(out, main, CLASSES, SLO_P99_S)
    return summary


def main(args) -> int:
    if (args.seeds or args.long_prefill_token_threshold) and not args.matrix:
        raise SystemExit("--seeds and --long-prefill-token-threshold are for --matrix")
    if args.backends is None:
        args.backends = 2 if args.engine == "vllm" else 4
    if args.engine == "vllm":
        return scenario_vllm.main(args)
    if args.autoscale:
        return autoscale.main(args)
    if args.day:
        return day_run.main(args)
    if args.matrix:
        return scenario_matrix.main(args)
    summary = run(args)
    path = write_results(Path(args.out))
    print("\n".join(scenario_section(summary)))
    print(f"written: {Path(args.out) / 'scenario.json'}, {path}")
    return 0


def _tokens(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: a token count, 0 or more")
    return value


def add_parser(bench) -> None:
    p = bench.add_parser("scenario", help="the seed's burst through Envoy alone and through the sidecar")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--backends", type=int, help="vLLM servers in the pool (default: 4 simulated, 2 real)")
    p.add_argument("--time-scale", type=float, default=0.5, help="multiply every simulated duration")
    p.add_argument("--size", type=float, default=1.0, help="shorten every phase by this factor (smoke runs)")
    p.add_argument("--kv-exhausted", choices=sorted(BEHAVIOURS), default="crash",
                   help="what the simulated engines do when their KV cache overflows: crash (die, back 90 s later: "
                        "the seed's GPU out-of-memory crashes), queue (preempt and recompute, as vLLM does), or both, "
                        "one after the other on the same trace, side by side in the results (with both, the "
                        "searches, the step load and the ablation run in crash mode)")
    p.add_argument("--search", action="store_true", help="also find the smallest pool keeping loan p99 under 2 s")
    p.add_argument("--max-backends", type=int, default=8)
    p.add_argument("--min-backends", type=int, default=1)
    p.add_argument("--steps", action="store_true", help="also run the step load")
    p.add_argument("--ablation", action="store_true",
                   help="also run the sidecar with each mechanism left out in turn: " + ", ".join(MECHANISMS))
    p.add_argument("--step-rps", type=lambda s: [float(x) for x in s.split(",")], default=[10, 20, 30, 40, 60, 80])
    p.add_argument("--step-seconds", type=float, default=20.0)
    p.add_argument("--small-pool", action="store_true",
                   help="a platform team's first try: the sidecar on its shipped defaults (no long pool), the "
                        "small pool's traffic (a 4x burst, 5 %% long prompts among complaints and archive queries); "
                        "with --backends 2")
    p.add_argument("--matrix", action="store_true",
                   help="the independent burst through every cell (Envoy: template or plain least request; engines "
                        "of 8 or 32 sequences; clients honouring or ignoring retry-after), Envoy alone beside the "
                        "sidecar in each; into OUT/matrix/")
    p.add_argument("--cells", help="with --matrix, the cells to run, comma-separated (e.g. plain-32-ignore)")
    p.add_argument("--seeds", type=scenario_matrix.seeds_arg, metavar="N,N,...",
                   help="with --matrix, the traffic's seeds: each cell runs once per seed, its figures pooled "
                        "(default: the traffic's own, one run)")
    p.add_argument("--long-prefill-token-threshold", type=_tokens, default=0, metavar="TOKENS",
                   help="with --matrix, the engines run with vLLM's --long-prefill-token-threshold TOKENS (a long "
                        "prompt's chunks leave room in each step for the requests behind it; default 0: vLLM's "
                        "default, no cap)")
    autoscale.add_arguments(p)
    day_run.add_arguments(p)
    scenario_vllm.add_arguments(p)
    p.set_defaults(func=main)
