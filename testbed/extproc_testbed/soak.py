"""The soak: a steady mixed load for N minutes, with the faults of an ordinary day, and what the
sidecar holds at every quiet moment.

    extproc bench soak --minutes 30 [--rate 6] [--cycle-s 60] [--out bench/results]

Real Envoy, one sidecar on a real Redis queue (leases and all), two simulated vLLM engines and a
fallback. Clients are mixed: three classes, half of them streaming, 15 % giving up after
0.01-0.4 s (most of them mid-request). Every few minutes one engine crashes (and recovers), and
the sidecar reloads its config (SIGHUP). Each cycle ends with a quiet moment: no new requests until every client is done; then
the soak records:

- slots in flight and waiting (the sidecar's gauges), slots taken and given back (its counters),
  leases held in Redis, and Redis's key count: at a quiet moment all of them must be back where
  they were (no slot or lease leaked, no key space that grows);
- the sidecar's resident memory and open file descriptors (/proc);
- the Python objects it holds, by type (`kill -USR2`: extproc/ops/diagnostics.py).

Memory growth is stated per hour: the least-squares slope of the resident memory over the
quiet moments after the first two (imports and caches warm up first).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from .chaos import drill_config
from .machine import describe_machine
from .provenance import provenance
from .redis_server import RedisServer
from .stack import SimSpec, Stack, StackPorts, http_get, metric_sum, parse_samples

TIME_SCALE = "0.2"
CLASSES = ("loan_approval", "complaint", "archive_query")
OBJECTS_LINE = re.compile(r"object counts (\{.*\})$")


@dataclass
class Schedule:
    minutes: float
    rate: float = 10.0  # arrivals per second
    cycle_s: float = 60.0  # load, then a quiet moment
    quiet_s: float = 4.0  # no new requests; then wait for the last clients and sample
    reload_every_s: float = 180.0
    crash_every_s: float = 240.0


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    stream = rng.random() < 0.5
    give_up_after = rng.uniform(0.01, 0.4) if rng.random() < 0.15 else None
    body = {"model": "deepseek-sim", "stream": stream, "max_tokens": rng.randint(8, 128),
            "messages": [{"role": "user", "content": "ticket " + "x" * rng.randint(100, 3000)}]}
    headers = {"x-ticket-type": rng.choice(CLASSES), "x-branch-id": f"branch-{rng.randint(1, 200)}"}
    try:
        async with asyncio.timeout(give_up_after):
            async with session.post(url, json=body, headers=headers) as response:
                async for _ in response.content.iter_any():
                    pass
                return str(response.status)
    except TimeoutError:
        return "gave up"
    except aiohttp.ClientError as error:
        return type(error).__name__


class Soak:
    def __init__(self, schedule: Schedule, work: Path, seed: int = 11):
        self.schedule = schedule
        self.work = work
        self.rng = random.Random(seed)
        self.endings: Counter[str] = Counter()
        self.samples: list[dict] = []
        self.events: list[dict] = []

    # -- what the sidecar holds ---------------------------------------------------------------

    def sample(self, stack: Stack, redis: RedisServer, started: float) -> dict:
        pid = stack.sidecar.pid
        samples = parse_samples(http_get(stack.metrics_url)[1])
        client = redis.client()
        leases = sum(client.zcard(f"{{extproc:{pool}}}:lease") for pool in ("primary", "fallback"))
        status = Path(f"/proc/{pid}/status").read_text()
        rss_kib = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))
        return {
            "t_s": round(time.monotonic() - started, 1),
            "inflight": metric_sum(samples, "extproc_inflight"),
            "inflight_by_pool": {pool: metric_sum(samples, "extproc_inflight", pool=pool) for pool in ("primary", "fallback")},
            "waiting": metric_sum(samples, "extproc_queue_depth"),
            "slots_taken": metric_sum(samples, "extproc_slots_admitted_total"),
            "slots_given_back": metric_sum(samples, "extproc_slots_released_total"),
            "leases": leases,
            "redis_inflight": sum(int(client.hget(f"{{extproc:{pool}}}:st", "inflight") or 0)
                                  for pool in ("primary", "fallback")),
            "redis_lease_records": sum(client.hlen(f"{{extproc:{pool}}}:li") for pool in ("primary", "fallback")),
            "store_degraded": metric_sum(samples, "extproc_store_degraded"),
            "redis_keys": client.dbsize(),
            "redis_key_names": sorted(client.keys("*")),
            "rss_mib": round(rss_kib / 1024, 2),
            "open_fds": len(os.listdir(f"/proc/{pid}/fd")),
            "objects": self.object_counts(stack),
        }

    def object_counts(self, stack: Stack) -> dict:
        log = stack.sidecar.log_path
        size = log.stat().st_size
        stack.sidecar.signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with log.open("rb") as f:
                f.seek(size)
                for line in f.read().decode("utf-8", "replace").splitlines():
                    match = OBJECTS_LINE.search(line)
                    if match:
                        return json.loads(match.group(1))
            time.sleep(0.1)
        raise RuntimeError("the sidecar wrote no object counts after SIGUSR2")

    # -- the day ------------------------------------------------------------------------------

    async def run(self, stack: Stack, redis: RedisServer) -> None:
        s = self.schedule
        url = f"{stack.url}/v1/chat/completions"
        started = time.monotonic()
        end = started + s.minutes * 60
        next_reload, next_crash, crashes = started + s.reload_every_s, started + s.crash_every_s, 0
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            self.samples.append(await loop.run_in_executor(None, self.sample, stack, redis, started))
            while time.monotonic() < end:
                cycle_end = min(end, time.monotonic() + s.cycle_s) - s.quiet_s
                clients: set[asyncio.Task] = set()
                while time.monotonic() < cycle_end:
                    task = asyncio.create_task(one_request(session, url, self.rng))
                    clients.add(task)
                    task.add_done_callback(lambda t: self.endings.update([t.result()]))
                    now = time.monotonic()
                    if now >= next_reload:
                        stack.sidecar.signal(signal.SIGHUP)
                        self.events.append({"t_s": round(now - started, 1), "event": "reload"})
                        next_reload += s.reload_every_s
                    if now >= next_crash:
                        engine = crashes % len(stack.ports.primary)
                        await loop.run_in_executor(None, post_json, f"{stack.sim_url(engine)}/sim/faults",
                                                   {"crash": True})
                        self.events.append({"t_s": round(now - started, 1), "event": f"engine {engine} crashed"})
                        crashes += 1
                        next_crash += s.crash_every_s
                    await asyncio.sleep(self.rng.expovariate(s.rate))
                await asyncio.sleep(s.quiet_s)
                if clients:
                    await asyncio.wait(clients)  # every client is done: the sidecar should hold nothing
                await asyncio.sleep(1.0)  # the streams' closes reach the sidecar
                self.samples.append(await loop.run_in_executor(None, self.sample, stack, redis, started))
                print(f"[{self.samples[-1]['t_s']:7.0f}s] " + json.dumps(
                    {k: v for k, v in self.samples[-1].items() if k not in ("objects", "redis_key_names", "inflight_by_pool")}), flush=True)


def post_json(url: str, payload: dict) -> None:
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"content-type": "application/json"})
    urllib.request.urlopen(request, timeout=5).read()


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour (0 with fewer than two)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var * 3600


def summarize(soak: Soak) -> dict:
    quiet = soak.samples[1:]  # the first sample is before any load
    warm = quiet[2:] if len(quiet) > 3 else quiet
    first, last = (warm[0], warm[-1]) if warm else ({}, {})
    grown = {}
    if warm:
        before, after = first["objects"]["by_type"], last["objects"]["by_type"]
        # (a type missing from either list is below its top 40 there: not comparable)
        grown = dict(Counter({k: after[k] - before[k] for k in after if k in before}).most_common(8))
    return {
        "requests": sum(soak.endings.values()),
        "endings": dict(soak.endings.most_common()),
        "quiet_moments": len(quiet),
        "leaks": {
            "slots_in_flight_at_quiet_max": max((q["inflight"] for q in quiet), default=0),
            "slots_waiting_at_quiet_max": max((q["waiting"] for q in quiet), default=0),
            "leases_at_quiet_max": max((q["leases"] for q in quiet), default=0),
            "slots_taken_minus_given_back_max": max((q["slots_taken"] - q["slots_given_back"] for q in quiet),
                                                    default=0),
        },
        "redis_keys": {"first": first.get("redis_keys"), "last": last.get("redis_keys"),
                       "max": max((q["redis_keys"] for q in warm), default=None)},
        "rss_mib": {"first": first.get("rss_mib"), "last": last.get("rss_mib"),
                    "growth_per_hour": round(slope_per_hour([(q["t_s"], q["rss_mib"]) for q in warm]), 2)},
        "open_fds": {"first": first.get("open_fds"), "last": last.get("open_fds"),
                     "max": max((q["open_fds"] for q in warm), default=None)},
        "objects": {"first": first.get("objects", {}).get("objects"), "last": last.get("objects", {}).get("objects"),
                    "growth_per_hour": round(slope_per_hour([(q["t_s"], q["objects"]["objects"]) for q in warm])),
                    "grown_most": grown},
        "events": soak.events,
    }


def run_soak(schedule: Schedule, workdir: Path | None = None, seed: int = 11) -> dict:
    work = workdir or Path(tempfile.mkdtemp(prefix="extproc-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    redis = RedisServer(work / "redis").start()
    ports = StackPorts.random(primary=2)
    (work / "extproc.yaml").write_text(yaml.safe_dump(drill_config(ports, fallback_slots=4)))
    sim_args = ("--time-scale", TIME_SCALE, "--recovery-s", "30")
    stack = Stack(work, ports, work / "extproc.yaml", primary=SimSpec("deepseek-sim", sim_args),
                  fallback=SimSpec("deepseek-sim-small", sim_args), redis_url=redis.url)
    soak = Soak(schedule, work, seed)
    started = time.monotonic()
    try:
        stack.start()
        asyncio.run(soak.run(stack, redis))
    finally:
        stack.stop()
        redis.kill()
    return {**summarize(soak), "samples": soak.samples, "minutes": schedule.minutes, "rate": schedule.rate,
            "cycle_s": schedule.cycle_s, "seconds": round(time.monotonic() - started), "logs": str(work),
            "machine": describe_machine()}  # (main adds the provenance taken as it started)


def main(args) -> int:
    schedule = Schedule(args.minutes, rate=args.rate, cycle_s=args.cycle_s)
    origin = provenance()  # before anything is written
    summary = run_soak(schedule, seed=args.seed)
    summary["provenance"] = origin
    summary["command"] = f"extproc bench soak --minutes {args.minutes:g} --rate {args.rate:g} --cycle-s {args.cycle_s:g}"
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2))
    if args.out:
        from .report import write_results

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(summary, indent=2))
        print("written:", out / "soak.json", write_results(out))
    return 0


def add_parser(bench) -> None:
    soak = bench.add_parser("soak", help="a steady mixed load with crashes and reloads: what leaks, what grows")
    soak.add_argument("--minutes", type=float, default=30.0)
    soak.add_argument("--rate", type=float, default=10.0, help="arrivals per second (Poisson)")
    soak.add_argument("--cycle-s", type=float, default=60.0, help="seconds between quiet moments")
    soak.add_argument("--seed", type=int, default=11)
    soak.add_argument("--out", help="write soak.json here and refresh RESULTS.md next to it")
    soak.set_defaults(func=main)
