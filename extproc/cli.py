"""The `extproc` command: serve, admin, check-config, vllm-args; and, where the testbed is installed
(testbed/, a distribution of its own), sim, demo and bench."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import entry_points
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


TESTBED_COMMANDS = {
    "sim": "run a simulated vLLM server",
    "demo": "run Envoy + sidecar + (simulated or real) vLLM servers for two models on this machine",
    "bench": "drills and benchmarks on this machine (simulated backends)",
}


def _add_testbed_commands(sub) -> None:
    """The testbed's commands come from its distribution, through the entry point group
    `extproc.commands`; the product never imports it. Without it, each says how to get it."""
    for plugin in entry_points(group="extproc.commands"):
        try:
            plugin.load()(sub)
        except Exception as error:  # a broken install must not stop `serve` or `check-config`
            print(f"extproc: the commands of {plugin.value} cannot be loaded ({type(error).__name__}: {error})",
                  file=sys.stderr)
    for name, help_text in TESTBED_COMMANDS.items():
        if name in sub.choices:
            continue
        stub = sub.add_parser(name, help=f"{help_text} (needs the testbed)", add_help=False)
        stub.set_defaults(func=_testbed_missing)  # whatever follows it: main() reads no further


def _testbed_missing(args: argparse.Namespace) -> int:
    print(f"extproc {args.command}: this command is part of the testbed, which is not installed here. From a "
          "checkout: `make demo` or `make test` install it, or `pip install -e ./testbed`.", file=sys.stderr)
    return 2


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

    vllm = sub.add_parser("vllm-args", help="recommend vLLM flags for this host's GPUs")
    vllm.add_argument("--gpus", type=int, help="GPU count (default: read through NVML)")
    vllm.add_argument("--gpu-memory-gib", type=float, help="memory per GPU in GiB")
    vllm.add_argument("--max-model-len", type=int, default=16384)
    vllm.add_argument("--context-reserve", type=float, default=0.2)
    vllm.set_defaults(func=cmd_vllm_args)

    from .ops.admin_client import add_parser as add_admin_parser
    add_admin_parser(sub)
    _add_testbed_commands(sub)

    check = sub.add_parser("check-config", help="validate a config file (and what it relies on in an envoy.yaml)")
    check.add_argument("file")
    check.add_argument("--envoy", metavar="ENVOY_YAML",
                       help="also say which settings the sidecar relies on this Envoy configuration leaves out "
                            "(exit 1 when any)")
    check.set_defaults(func=cmd_check_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.func is not _testbed_missing:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    _setup_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
