"""The testbed's commands, which `extproc` adds when this distribution is installed (the entry point
`extproc.commands`): `extproc sim`, the simulated vLLM server; `extproc demo`, the whole stack on
this machine; `extproc bench`, the drills and benchmarks."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from extproc import event_loop
from extproc.core.config import ConfigError, load_config

from . import capacity_bench, chaos, faults, loadtools, overhead, scenario, schedule_compare, soak


def _load(path: str | None):
    try:
        return load_config(path)
    except ConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)


def cmd_sim(args: argparse.Namespace) -> int:
    from .sim import SimParams, run_sim

    params = SimParams(
        model=args.model,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        prefill_s_per_token=args.prefill_s_per_token,
        decode_s_per_token=args.decode_s_per_token,
        decode_contention=args.decode_contention,
        default_output_tokens=args.default_output_tokens,
        on_kv_exhausted=args.on_kv_exhausted,
        recovery_s=args.recovery_s,
        time_scale=args.time_scale,
        max_num_queued_reqs=args.max_num_queued_reqs,
        api_keys=tuple(args.api_key or ()),
    )
    try:
        event_loop.run(run_sim(params, args.host, args.port))
    except OSError as error:
        print(f"extproc sim: cannot listen on {args.host}:{args.port}: {error.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.config:
        _load(args.config)  # fail early with the key named
    if args.replicas < 1:
        print("extproc demo: --replicas must be at least 1", file=sys.stderr)
        return 2
    if args.replicas > 1 and not args.redis_url:
        print("extproc demo: several replicas share their queue through Redis: pass --redis-url", file=sys.stderr)
        return 2
    if args.replicas > 1 and args.workers > 1:
        print("extproc demo: choose --replicas or --workers, not both", file=sys.stderr)
        return 2
    if args.workers > 1 and not args.redis_url:  # the workers share one queue: a throwaway Redis
        from .redis_server import RedisServer

        embedded_redis = RedisServer(Path(tempfile.mkdtemp(prefix="extproc-demo-redis-"))).start()
        args.redis_url = embedded_redis.url
        try:
            return _run_demo(args)
        finally:
            embedded_redis.kill()
    return _run_demo(args)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import LARGE_MODEL, SMALL_MODEL, key_lines, write_demo_config
    from .stack import SimSpec, Stack, StackError, StackPorts, shift_backend_ports

    ports = StackPorts.shifted(args.port_offset, args.replicas)
    if args.port is not None:
        ports.envoy = args.port
    workdir = Path(tempfile.mkdtemp(prefix="extproc-demo-"))
    sim_args = ("--time-scale", str(args.time_scale))
    engines = "simulated vLLM" if args.engine == "sim" else "vLLM-CPU (tiny model)"
    config_path = Path(args.config) if args.config else write_demo_config(workdir / "demo.yaml")
    if args.port_offset:  # the configuration's backends are the demo's engines: at their ports too
        config_path = shift_backend_ports(config_path, args.port_offset, workdir / "extproc.yaml")
    stack = Stack(
        workdir,
        ports,
        config_path,
        primary=SimSpec(LARGE_MODEL, sim_args, engine=args.engine),
        fallback=SimSpec("deepseek-sim-small", sim_args, engine=args.engine),
        archive=SimSpec(SMALL_MODEL, sim_args, engine=args.engine),
        redis_url=args.redis_url,
        workers=args.workers,
    )
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # stop the children on SIGTERM as on Ctrl-C
    signal.signal(signal.SIGINT, interrupt)  # Ctrl-C, even when started with SIGINT ignored (a background job)
    if args.engine == "vllm":
        print("starting four real vLLM servers (20 to 60 s; `make vllm-venv` installs vLLM)...", flush=True)
    try:
        stack.start()
    except StackError as error:
        print(f"extproc demo: {error}", file=sys.stderr)
        return 2
    keys = "\n".join(f"    {line}" for line in key_lines())

    def urls(pool: str) -> str:
        return ", ".join(f"http://127.0.0.1:{p}" for p in ports.pool_ports(pool))

    envoy = f"http://127.0.0.1:{ports.envoy}"
    replicas = "\n                   ".join(
        f"127.0.0.1:{g} (gRPC + health), metrics http://127.0.0.1:{m}/metrics, admin 127.0.0.1:{a}\n"
        f"                   live queue page http://127.0.0.1:{m}/queue"
        for g, m, a in ports.replicas
    )
    if args.redis_url:
        replicas += f"\n                   sharing one queue in Redis at {args.redis_url}"
    print(
        f"""
extproc demo is running (logs in {workdir}):
  Envoy            {envoy}   (admin http://127.0.0.1:{ports.envoy_admin})
  ext_proc sidecar {replicas}
  {engines:<16} {LARGE_MODEL}: primary {urls("primary")}; its fallback (deepseek-sim-small) {urls("fallback")}
                   {SMALL_MODEL}: archive {urls("archive")}

Sample API keys (each bounds what its caller may claim):
{keys}

Try: a loan approval on the large model, an archive query on the small one, and the models a
key may use (the archive clerk's: {SMALL_MODEL} alone; {LARGE_MODEL} gets 403):
  curl -s {envoy}/v1/chat/completions \\
    -H 'content-type: application/json' -H 'authorization: Bearer sk-demo-loans-0001' \\
    -H 'x-ticket-type: loan_approval' -H 'x-urgent-level: 2' \\
    -d '{{"model": "{LARGE_MODEL}", "messages": [{{"role": "user", "content": "Approve loan #42?"}}], "max_tokens": 16}}'
  curl -s {envoy}/v1/chat/completions \\
    -H 'content-type: application/json' -H 'authorization: Bearer sk-demo-archive-0003' \\
    -H 'x-ticket-type: archive_query' \\
    -d '{{"model": "{SMALL_MODEL}", "messages": [{{"role": "user", "content": "Find statement 2019-07"}}], "max_tokens": 16}}'
  curl -s {envoy}/v1/models -H 'authorization: Bearer sk-demo-archive-0003'

Ctrl-C stops everything.""",
        flush=True,
    )
    try:
        children = [stack.envoy, *stack.sidecars, *stack.sims]
        while all(p.alive() for p in children if p is not None):
            time.sleep(0.5)
        dead = [p for p in children if p is not None and not p.alive()]
        for proc in dead:
            print(f"extproc demo: {proc.name} exited:\n{proc.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    finally:
        stack.stop()


def add_commands(sub) -> None:
    """Add `sim`, `demo` and `bench` to the `extproc` command's subcommands."""
    sim = sub.add_parser("sim", help="run a simulated vLLM server")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8001)
    sim.add_argument("--model", default="deepseek-sim")
    sim.add_argument("--kv-tokens", type=int, default=65536, help="KV-cache capacity in tokens")
    sim.add_argument("--block-size", type=int, default=128, help="KV block size in tokens (vLLM's on the CPU; 16 on GPUs)")
    sim.add_argument("--max-num-seqs", type=int, default=32)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="tokens per engine step (vLLM's default for its API server on GPUs under 70 GiB and A100s)")
    sim.add_argument("--long-prefill-token-threshold", type=int, default=0,
                     help="at most this many tokens of one prompt per step beside other requests (0: no cap, vLLM's default)")
    sim.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                     help="priority: the body's `priority` orders the line and picks whom to preempt (lower first)")
    sim.add_argument("--max-model-len", type=int, default=32768)
    sim.add_argument("--prefill-s-per-token", type=float, default=0.00018)
    sim.add_argument("--decode-s-per-token", type=float, default=0.005)
    sim.add_argument("--decode-contention", type=float, default=0.04,
                     help="decode step slowdown per additional running request")
    sim.add_argument("--default-output-tokens", type=int, default=64, help="output tokens when max_tokens is absent")
    sim.add_argument("--on-kv-exhausted", choices=["queue", "crash"], default="queue")
    sim.add_argument("--recovery-s", type=float, default=90.0, help="downtime after a crash (scaled)")
    sim.add_argument("--time-scale", type=float, default=1.0, help="multiply every simulated duration")
    sim.add_argument("--max-num-queued-reqs", type=int, default=None,
                     help="the most requests waiting in the engine; more get 503 (vLLM's flag; default: no limit)")
    sim.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                     help="as vLLM's: the API's routes answer 401 without 'Authorization: Bearer KEY'")
    sim.set_defaults(func=cmd_sim)

    demo = sub.add_parser("demo", help="run Envoy + sidecar + (simulated or real) vLLM servers for two models on "
                                       "this machine")
    demo.add_argument("--config", help="sidecar config file (default: the embedded defaults, a second model's pool and three "
                           "sample tenants)")
    demo.add_argument("--port", type=int, help="Envoy listener port (default 10000, plus the offset)")
    demo.add_argument("--port-offset", type=int, default=0,
                      help="add N to every port the demo listens on (Envoy, the sidecar, the engines), to run "
                           "beside another demo or the tests")
    demo.add_argument("--time-scale", type=float, default=1.0, help="the simulated engines' time scale")
    demo.add_argument("--engine", choices=["sim", "vllm"], default="sim",
                      help="the backends: simulated vLLM, or real vLLM-CPU servers running a tiny model "
                           "(needs .venv-vllm: make vllm-venv)")
    demo.add_argument("--redis-url", help="share the queue through this Redis")
    demo.add_argument("--replicas", type=int, default=1, help="sidecar replicas (with --redis-url)")
    demo.add_argument("--workers", type=int, default=1,
                      help="server processes per replica (shares a Redis: an embedded one without --redis-url)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="drills and benchmarks on this machine (simulated backends)")
    benches = bench.add_subparsers(dest="bench_command", required=True)
    capacity_bench.add_parser(benches)
    chaos.add_parser(benches)
    faults.add_parser(benches)
    loadtools.add_parser(benches)
    overhead.add_parser(benches)
    scenario.add_parser(benches)
    schedule_compare.add_parser(benches)
    soak.add_parser(benches)
