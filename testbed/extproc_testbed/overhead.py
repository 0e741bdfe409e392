"""What the sidecar costs per request, measured side by side in one run.

    extproc bench overhead [--out bench/results] [--seconds 6] [--rounds 3] [--concurrency 32]

Four setups, each its own Envoy (the production template, `--concurrency 1`) in front of the
same fast upstream (a second Envoy answering a fixed completion with `direct_response`, so the
backend is not what gets measured), loaded in alternating rounds:

- `envoy_only`: no ext_proc filter;
- `floor`: a bare pass-through ext_proc in Python, same processing mode (what any Python
  ext_proc pays);
- `floor_answers`: the same pass-through answering as the sidecar answers an admitted request
  (its headers, route clearing, metadata, early end), and as the sidecar writes them (gRPC's
  reader-writer API, wire bytes), deciding nothing: what the answers cost Envoy and gRPC, so
  that what the sidecar costs beyond it is its decisions;
- `sidecar`: the sidecar with its in-process queue, at the default log level (`info`: one
  decision line per decision and per release, as users run it);
- `sidecar_redis`: the sidecar with the Redis queue, at the default log level;
- `sidecar_log_off`, `sidecar_redis_log_off`: the same at `--log-level warning` (no decision
  lines).

`--workers 1,2` adds `sidecar_workers_N`: `extproc serve --workers N` sharing Redis.

Each round runs the floor before the first setup and again after every setup; a setup's ratio to
the floor is its rate over the mean of the two floor runs beside it, and the figure is the
median of those over the rounds (`vs_floor_rounds` in overhead.json). On a shared machine the
speed drifts within a round by more than the differences measured, and a floor measured a
minute away says little.

The load generator is `wrk` (one thread, `--latency`) where it is installed, else a Python
client. Everything shares this machine's cores: read the ratios, not the absolute numbers. Each
setup's CPU per request is counted for its ext_proc process and for its Envoy: on a machine
whose cores are all busy, what Envoy spends per request is part of the ratio too, and so is
what redis-server spends for the setups with the Redis queue (counted for those).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from extproc.core.config import default_config_text
from .envoy_config import EnvoyLayout, render_file
from .machine import describe_machine
from .provenance import provenance
from .redis_server import RedisServer
from .report import overhead_table, write_results
from .stack import LOOPBACK, ManagedProcess, envoy_binary, free_port, http_get, metric_sum, parse_samples, wait_until
from .traffic import ANONYMOUS_RIGHTS

BODY = {"model": "deepseek-sim", "messages": [{"role": "user", "content": "Is ticket 1234 resolved?"}],
        "max_tokens": 1}
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "deepseek-sim",
          "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "ok"}}],
          "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}
HEADERS = {"content-type": "application/json", "x-ticket-type": "complaint"}


def upstream_config(port: int, admin: int) -> dict:
    """An Envoy that answers every request at once with a fixed completion."""
    return {
        "admin": {"address": {"socket_address": {"address": LOOPBACK, "port_value": admin}}},
        "static_resources": {"listeners": [{
            "name": "upstream",
            "address": {"socket_address": {"address": LOOPBACK, "port_value": port}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                             ".HttpConnectionManager",
                    "stat_prefix": "upstream",
                    "route_config": {"virtual_hosts": [{
                        "name": "all", "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"},
                                    "direct_response": {"status": 200, "body": {"inline_string": json.dumps(ANSWER)}}}],
                        "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}],
                    }]},
                    "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                },
            }]}],
        }]},
    }


def sidecar_config(max_inflight: int, redis_url: str | None = None) -> dict:
    """The shipped configuration, measuring the path and not queueing: room for every request
    (`max_inflight`), no backends to poll, no GPU probe, no shadow copies. The run reports the
    requests that waited in line all the same (`extproc_queued_total`: 0 expected)."""
    config = yaml.safe_load(default_config_text())
    config["anonymous"] = ANONYMOUS_RIGHTS
    for pool in config["pools"].values():
        pool["max_inflight"] = max_inflight
        pool["capacity"]["backends"] = []
        # With no backends the capacity loop counts one engine of max_num_seqs slots, and the
        # latency cap keeps a share of them for latency-bound classes: both above the load's
        # concurrency, or requests would wait in line and the waiting path would be measured.
        pool["capacity"]["max_num_seqs"] = max_inflight
        # (with no backends Envoy places the requests: the cap's floor is the quarter all the same)
        pool["capacity"]["latency_floor_share_envoy_placed"] = 0.25
    config["probes"]["nvml"] = "off"
    config["shadow"]["share"] = 0.0
    if redis_url:
        config["redis"] = {"url": redis_url}
    return config


@dataclass
class Setup:
    name: str
    url: str
    processes: list[ManagedProcess] = field(default_factory=list)
    metrics_url: str | None = None
    ext_proc: ManagedProcess | None = None  # whose CPU time each round counts (its workers included)
    envoy: ManagedProcess | None = None  # the front Envoy, whose CPU time each round counts too
    redis_pid: int | None = None  # the redis-server its store uses (shared: only its rounds load it)


class Rig:
    """Every process of every setup, started once and stopped together."""

    def __init__(self, work: Path, concurrency: int, workers: list[int]):
        self.work = work
        self.concurrency = concurrency
        self.workers = workers
        self.processes: list[ManagedProcess] = []
        self.setups: dict[str, Setup] = {}
        self.redis: RedisServer | None = None
        self.upstream_port = free_port()

    def _start(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.work / f"{name}.log")
        proc.start()
        self.processes.append(proc)
        return proc

    def _envoy(self, name: str, extproc_port: int | None, relay_port: int | None) -> tuple[ManagedProcess, int, int]:
        listen, admin = free_port(), free_port()
        layout = EnvoyLayout(
            listen=(LOOPBACK, listen), admin=(LOOPBACK, admin),
            extproc=[(LOOPBACK, extproc_port)] if extproc_port else [],
            clusters={"vllm_primary": [(LOOPBACK, self.upstream_port)], "vllm_fallback": [(LOOPBACK, self.upstream_port)]},
            relay=(LOOPBACK, relay_port) if relay_port else None,
            without_sidecar=extproc_port is None,
        )
        path = render_file(layout, self.work / f"{name}-envoy.yaml")
        proc = self._start(f"{name}-envoy", [envoy_binary(), "-c", str(path), "--concurrency", "1",
                                             "--use-dynamic-base-id", "--log-level", "error"])
        return proc, listen, admin

    def _sidecar_config(self, redis_url: str | None) -> Path:
        path = self.work / f"sidecar-{len(self.setups)}.yaml"
        path.write_text(yaml.safe_dump(sidecar_config(4 * self.concurrency, redis_url)))
        return path

    def start(self) -> Rig:
        up_admin = free_port()
        (self.work / "upstream.yaml").write_text(yaml.safe_dump(upstream_config(self.upstream_port, up_admin)))
        self._start("upstream", [envoy_binary(), "-c", str(self.work / "upstream.yaml"), "--concurrency", "1",
                                 "--use-dynamic-base-id", "--log-level", "error"])
        self.redis = RedisServer(self.work / "redis").start()

        envoy, port, admin = self._envoy("envoy_only", None, None)
        self.setups["envoy_only"] = Setup("envoy_only", f"http://{LOOPBACK}:{port}", [envoy], envoy=envoy)

        for name, options in (("floor", []), ("floor_answers", ["--answer-like-sidecar"])):
            floor_port = free_port()
            floor = self._start(name, [sys.executable, "-m", "extproc_testbed.passthrough", "--port", str(floor_port),
                                       *options])
            envoy, port, admin = self._envoy(name, floor_port, None)
            self.setups[name] = Setup(name, f"http://{LOOPBACK}:{port}", [floor, envoy], ext_proc=floor, envoy=envoy)

        sidecars = [("sidecar", None, 1, "info"), ("sidecar_redis", self.redis.url, 1, "info"),
                    ("sidecar_log_off", None, 1, "warning"), ("sidecar_redis_log_off", self.redis.url, 1, "warning")]
        sidecars += [(f"sidecar_workers_{n}", self.redis.url, n, "info") for n in self.workers]
        for name, redis_url, workers, log_level in sidecars:
            grpc_port, metrics_port, admin_port, relay_port = free_port(), free_port(), free_port(), free_port()
            argv = [sys.executable, "-m", "extproc", "--log-level", log_level, "serve",
                    "--config", str(self._sidecar_config(redis_url)), "--grpc-port", str(grpc_port),
                    "--metrics-port", str(metrics_port), "--admin-port", str(admin_port),
                    "--relay-url", f"http://{LOOPBACK}:{relay_port}"]
            if workers > 1:
                argv += ["--workers", str(workers)]
            sidecar = self._start(name, argv)
            envoy, port, admin = self._envoy(name, grpc_port, relay_port)
            self.setups[name] = Setup(name, f"http://{LOOPBACK}:{port}", [sidecar, envoy],
                                      f"http://{LOOPBACK}:{metrics_port}/metrics", ext_proc=sidecar, envoy=envoy,
                                      redis_pid=self.redis.process.pid if redis_url else None)

        for setup in self.setups.values():
            wait_until(lambda s=setup: _answers(s.url), 60, f"{setup.name} to answer", setup.processes[-1])
        return self

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        if self.redis is not None:
            self.redis.kill()


def _answers(url: str) -> bool:
    request = aiohttp.ClientTimeout(total=2)

    async def once() -> int:
        async with aiohttp.ClientSession(timeout=request) as session:
            async with session.post(f"{url}/v1/chat/completions", json=BODY, headers=HEADERS) as response:
                return response.status

    try:
        return asyncio.run(once()) == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


@dataclass
class Round:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    cpu_ms_per_request: float | None = None  # the ext_proc process's CPU time (user + system)
    envoy_cpu_ms_per_request: float | None = None  # the front Envoy's
    redis_cpu_ms_per_request: float | None = None  # redis-server's, for a setup with the Redis queue


def cpu_seconds(proc: ManagedProcess | int) -> float:
    """CPU time a process (or pid) and its children (a supervisor's workers) have used so far."""
    import psutil  # installed with the test and bench tools

    process = psutil.Process(proc if isinstance(proc, int) else proc.process.pid)
    return sum(sum(p.cpu_times()[:2]) for p in (process, *process.children(recursive=True)))


_WRK_LUA = """wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["content-type"] = "application/json"
wrk.headers["x-ticket-type"] = "complaint"
"""


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def load_with_wrk(url: str, seconds: float, concurrency: int, work: Path) -> Round:
    script = work / "post.lua"
    script.write_text(_WRK_LUA.format(body=json.dumps(BODY)))
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{seconds:g}s", "--latency", "-s", str(script),
                          f"{url}/v1/chat/completions"], capture_output=True, text=True, timeout=seconds + 30).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return Round(rps, p50, p99, int(errors.group(1)) if errors else 0)


def load_with_python(url: str, seconds: float, concurrency: int, work: Path) -> Round:
    async def run() -> Round:
        latencies: list[float] = []
        errors = 0
        stop_at = time.monotonic() + seconds

        async def worker(session: aiohttp.ClientSession) -> None:
            nonlocal errors
            while time.monotonic() < stop_at:
                started = time.monotonic()
                async with session.post(f"{url}/v1/chat/completions", json=BODY, headers=HEADERS) as response:
                    await response.read()
                    if response.status != 200:
                        errors += 1
                        continue
                latencies.append(time.monotonic() - started)

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        q = statistics.quantiles(latencies, n=100)
        return Round(len(latencies) / seconds, 1000 * q[49], 1000 * q[98], errors)

    return asyncio.run(run())


def sidecar_figures(metrics_url: str | None) -> tuple[float | None, int | None]:
    """(mean decision time in ms, requests that waited in line) from a sidecar's /metrics."""
    if metrics_url is None:
        return None, None
    status, text = http_get(metrics_url)
    if status != 200:
        return None, None
    samples = parse_samples(text)  # with --workers, one series per worker: their sums over their counts
    count = metric_sum(samples, "extproc_decision_seconds_count")
    decision = 1000 * metric_sum(samples, "extproc_decision_seconds_sum") / count if count else None
    return decision, int(metric_sum(samples, "extproc_queued_total"))


def _median_of(runs: list[Round], field: str) -> float | None:
    values = [getattr(r, field) for r in runs if getattr(r, field) is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(rounds: dict[str, list[Round]], decisions: dict[str, float | None],
              paired: dict[str, list[float]], queued: dict[str, int | None] | None = None) -> dict:
    """Medians over the rounds. `paired`: each setup's runs, each over the floor runs beside it
    (`paired_with_floor`); its ratio to the floor is their median (a setup no floor run answered
    beside, in any round, falls back to the medians' ratio)."""
    setups = {}
    for name, runs in rounds.items():
        setups[name] = {
            "requests_per_s": round(statistics.median(r.requests_per_s for r in runs), 1),
            "requests_per_s_rounds": [round(r.requests_per_s, 1) for r in runs],
            "p50_ms": round(statistics.median(r.p50_ms for r in runs), 2),
            "p99_ms": round(statistics.median(r.p99_ms for r in runs), 2),
            "errors": sum(r.errors for r in runs),
            "decision_ms": None if decisions.get(name) is None else round(decisions[name], 3),
            "queued": (queued or {}).get(name),  # requests that waited in line: none, or the waiting path was measured
            "cpu_ms_per_request": _median_of(runs, "cpu_ms_per_request"),
            "envoy_cpu_ms_per_request": _median_of(runs, "envoy_cpu_ms_per_request"),
            "redis_cpu_ms_per_request": _median_of(runs, "redis_cpu_ms_per_request"),
        }
        if name in paired:
            setups[name]["vs_floor_rounds"] = [round(r, 3) for r in paired[name]]
    rps = {name: s["requests_per_s"] for name, s in setups.items()}
    ratios = {f"{name}/envoy_only": round(rps[name] / rps["envoy_only"], 3) for name in rps if name != "envoy_only"}
    ratios.update({f"{name}/floor": round(statistics.median(paired[name]) if name in paired else rps[name] / rps["floor"], 3)
                   for name in rps if name.startswith(("sidecar", "floor_"))})
    return {"setups": setups, "ratios": ratios}


def floor_between(names: list[str]) -> list[str]:
    """One round's order: the floor runs before and after every setup measured against it, so
    each is compared with the floor as the machine ran just then (a shared machine's speed
    drifts by more than the differences measured over a round)."""
    order = [name for name in names if name == "envoy_only"] + ["floor"]
    for name in names:
        if name not in ("envoy_only", "floor"):
            order += [name, "floor"]
    return order


def paired_with_floor(runs: list[tuple[str, Round]]) -> list[tuple[str, float]]:
    """Each setup's requests per second over the mean of the floor runs on either side of it."""
    pairs = []
    for i, (name, result) in enumerate(runs):
        if name in ("envoy_only", "floor"):
            continue
        beside = [r.requests_per_s for n, r in (runs[i - 1], runs[i + 1]) if n == "floor"]
        if len(beside) == 2 and all(beside):
            pairs.append((name, result.requests_per_s / statistics.mean(beside)))
    return pairs


def run(out: Path, seconds: float, rounds: int, concurrency: int, workers: list[int]) -> dict:
    origin = provenance()  # before anything is written
    work = Path(tempfile.mkdtemp(prefix="extproc-overhead-"))
    use_wrk = shutil.which("wrk") is not None
    load = load_with_wrk if use_wrk else load_with_python
    rig = Rig(work, concurrency, workers)
    results: dict[str, list[Round]] = {}
    paired: dict[str, list[float]] = {}
    try:
        print(f"starting {7 + len(workers)} setups (logs in {work})", flush=True)
        rig.start()
        for setup in rig.setups.values():  # warm-up
            load(setup.url, 1, concurrency, work)
        sequence = floor_between(list(rig.setups))
        for i in range(rounds):
            runs: list[tuple[str, Round]] = []
            for name in sequence:
                setup = rig.setups[name]
                counted = {field: proc for field, proc in (("cpu_ms_per_request", setup.ext_proc),
                                                           ("envoy_cpu_ms_per_request", setup.envoy),
                                                           ("redis_cpu_ms_per_request", setup.redis_pid)) if proc}
                before = {field: cpu_seconds(proc) for field, proc in counted.items()}
                result = load(setup.url, seconds, concurrency, work)
                served = result.requests_per_s * seconds
                if served:
                    for field, proc in counted.items():
                        setattr(result, field, 1000 * (cpu_seconds(proc) - before[field]) / served)
                results.setdefault(name, []).append(result)
                runs.append((name, result))
                print(f"round {i + 1}/{rounds} {name:<20} {result.requests_per_s:>8.0f} req/s  "
                      f"p50 {result.p50_ms:6.1f} ms  p99 {result.p99_ms:6.1f} ms", flush=True)
            for name, ratio in paired_with_floor(runs):
                paired.setdefault(name, []).append(ratio)
        figures = {name: sidecar_figures(setup.metrics_url) for name, setup in rig.setups.items()}
    finally:
        rig.stop()
    summary = summarize(results, {name: f[0] for name, f in figures.items()}, paired,
                        {name: f[1] for name, f in figures.items()})
    summary.update({
        "load_generator": f"wrk -t1 -c{concurrency} --latency" if use_wrk else f"python aiohttp, {concurrency} clients",
        "seconds_per_round": seconds, "rounds": rounds, "concurrency": concurrency,
        "goals": {"sidecar/floor": 0.8, "sidecar_redis/floor": 0.6},
        "command": " ".join(["extproc", "bench", "overhead", *sys.argv[3:]]),
        "machine": describe_machine(origin["machine"]),
        "provenance": origin,
    })
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(args) -> int:
    workers = [int(n) for n in args.workers.split(",")] if args.workers else []
    summary = run(Path(args.out), args.seconds, args.rounds, args.concurrency, [n for n in workers if n > 1])
    print(overhead_table(summary))
    waited = {name: s["queued"] for name, s in summary["setups"].items() if s.get("queued")}
    if waited:
        print(f"requests that waited in line (the waiting path was measured too): {waited}")
    points = {int(k.rsplit("_", 1)[1]): v["requests_per_s"] for k, v in summary["setups"].items()
              if k.startswith("sidecar_workers_")}
    if points:
        from . import plots  # matplotlib: installed with the test and bench tools, not the server

        points[1] = summary["setups"]["sidecar_redis"]["requests_per_s"]
        plots.throughput_against_workers(Path(args.out), points)
    for goal, target in summary["goals"].items():
        print(f"{goal}: {summary['ratios'][goal]:.3f} (goal {target})")
    write_results(Path(args.out))
    return 0


def add_parser(bench) -> None:
    p = bench.add_parser("overhead", help="what the sidecar costs per request, beside Envoy alone and a bare ext_proc")
    p.add_argument("--out", default="bench/results", help="where overhead.json goes (default bench/results)")
    p.add_argument("--seconds", type=float, default=6.0, help="length of one round of one setup")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--workers", default="", help="also measure `serve --workers N` for these N (e.g. 1,2)")
    p.set_defaults(func=main)
