"""Faults under load, with nothing lost: real Envoy, real sidecar(s), simulated vLLM backends, a
steady mixed load at about 70 % of the pool's measured capacity, and one fault per run.

    extproc bench faults [--out DIR] [--seconds N] [--only NAME ...]

The faults (each on a fresh stack, each run stops by itself):

- `envoy_restart`: Envoy is stopped while requests wait in the sidecar's line (SIGTERM a third
  of the way in, SIGKILL two thirds in) and started again on the same ports. The sidecar must
  give every slot back (in-flight and queue depth 0, slots admitted == released); clients see a
  connection error or a 503, never a hang.
- `replica_kill`: two sidecar replicas share the Redis queue; the one holding leases is
  SIGKILLed. The other keeps admitting within one lease, no request reaches a backend twice, and
  the dead replica's leases come back (the pool's in-flight in Redis returns to 0 at idle).
- `redis_failover`: the same two replicas find Redis through Sentinel; the master is SIGKILLed
  mid-burst and Sentinel promotes the replica. The replicas follow; counts reconcile at idle.
- `backend_pause`: one of the pool's two backends is SIGSTOPped for 10 s, then SIGCONTed.

Every request ends one way, as its client saw it:
`ok` (200, the whole answer: the `[DONE]` of a stream, a JSON completion otherwise),
`refused` (429 or 503 with an OpenAI-style JSON error, `error.type` and `error.code`, and a
`retry-after`, or `x-should-retry: false` where no retry can help),
`other` (named: a connection refused or reset, a stream cut, another status or body),
`hung` (no answer within the client's generous timeout: must be 0).
After each run, once the stack is idle, `leaked` counts slots still held (must be 0): the
pool's in-flight and queue depth on every live replica and in Redis, and slots admitted but
not released by a live replica.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from .chaos import drill_config
from .fault_load import (
    CLIENT_TIMEOUT_S,
    ENDINGS,
    POOL,
    Load,
    backend_duplicates,
    depth_of,
    measure_capacity,
    poll,
    redis_counts,
    settle,
    sidecar_counts,
)
from .provenance import provenance, provenance_line
from .stack import SimSpec, Stack, StackPorts

TIME_SCALE = "0.5"  # sims run at half the engine's unscaled time: ~0.5 s per request in this mix
MAX_INFLIGHT = 4  # slots of the primary pool (two backends)
LOAD_SHARE = 0.7  # of the measured capacity
LEASE_S = 2.0
FAULTS = ("envoy_restart", "replica_kill", "redis_failover", "backend_pause")


def faults_config(ports: StackPorts, redis: dict | None = None) -> dict:
    config = drill_config(ports, MAX_INFLIGHT, 4)
    config["pools"][POOL]["tiers"] = {"yellow": 8, "orange": 40, "red": 60, "hard_max": 100}
    config.update({"limits": {"max_message_timeout_s": 120}, "drain_timeout_s": 5})
    if redis is not None:
        config["redis"] = {"lease_s": LEASE_S, "op_timeout_s": 0.25, "recheck_s": 0.5, **redis}
    return config


# ---------------------------------------------------------------------------------------------
# A run: a stack, the load, one fault


@dataclass
class Run:
    name: str
    stack: Stack
    seconds: float
    rate: float | None
    seed: int
    live: list[int] = field(default_factory=lambda: [0])
    redis_client: Callable[[], object] = field(default=lambda: None)  # the Redis the queue is in now
    notes: dict = field(default_factory=dict)
    load_started: float = 0.0


async def run_phase(run: Run, fault: Callable[[Run, Load], Awaitable[None]], calibrate_s: float,
                    timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    stack = run.stack
    if run.rate is None:
        capacity = await measure_capacity(stack, MAX_INFLIGHT, calibrate_s, run.seed)
        run.notes["capacity_rps"] = round(capacity, 2)
        rate = LOAD_SHARE * capacity
        await settle(lambda: {"replicas": sidecar_counts(stack, run.live), "redis": redis_counts(run.redis_client())},
                     15)  # the calibration's requests done before the fault's load starts
    else:
        rate = run.rate
    run.notes["rate_rps"] = round(rate, 2)
    depths: list[int] = []
    started = run.load_started = time.monotonic()
    fault_done = asyncio.Event()

    async def watch_line() -> None:
        while not fault_done.is_set():
            d = await asyncio.to_thread(depth_of, stack, run.live[0])
            if d >= 0:
                depths.append(d)
            await asyncio.sleep(0.5)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        load = Load(session, f"{stack.url}/v1/chat/completions", random.Random(run.seed), run.name, timeout_s)

        async def do_fault() -> None:
            try:
                await fault(run, load)
            except Exception as error:  # noqa: BLE001 - the run goes on; the report says what failed
                run.notes["fault_error"] = f"{type(error).__name__}: {error}"
            finally:
                fault_done.set()

        watcher = asyncio.create_task(watch_line())
        injector = asyncio.create_task(do_fault())
        # The load runs `seconds`, and on until the fault is over, plus a short tail after it.
        tail_from: list[float] = []

        def over() -> bool:
            now = time.monotonic()
            if fault_done.is_set() and not tail_from:
                tail_from.append(now)
            return now - started >= run.seconds and bool(tail_from) and now - tail_from[0] >= 2.0

        await load.steady(rate, over)
        await injector
        await watcher
        results = await load.results()
    run.notes["load_s"] = round(time.monotonic() - started, 1)
    run.notes["line_mean"] = round(sum(depths) / len(depths), 2) if depths else None
    run.notes["line_max"] = max(depths, default=None)
    idle = await settle(lambda: {"replicas": sidecar_counts(stack, run.live),
                                 "redis": redis_counts(run.redis_client())}, 3 * LEASE_S + 15)
    return summarize(run, results, idle)


def summarize(run: Run, results: list[dict], idle: dict) -> dict:
    endings = Counter(r["ending"] for r in results)
    by_detail = {ending: dict(Counter(r["detail"] for r in results if r["ending"] == ending).most_common())
                 for ending in ("refused", "other", "hung")}
    counted = sum(endings[e] for e in ENDINGS)
    replicas = [r for r in idle["replicas"].values() if r is not None]
    return {
        "fault": run.name,
        "requests": len(results),
        "ok": endings["ok"],
        "refused": endings["refused"],
        "other": endings["other"],
        "hung": endings["hung"],
        "uncounted": len(results) - counted,  # an ending outside the four: must be 0
        "leaked": idle["leaked"],
        "refused_by": by_detail["refused"],
        "other_by": by_detail["other"],
        "hung_by": by_detail["hung"],
        "slots_admitted": sum(r["admitted"] for r in replicas),
        "slots_released": sum(r["released"] for r in replicas),
        "idle": idle,
        **run.notes,
    }


# ---------------------------------------------------------------------------------------------
# The faults


async def at(run: Run, share: float) -> None:
    """Sleep until `share` of the run's seconds have passed since the load started."""
    await asyncio.sleep(max(0.0, run.load_started + run.seconds * share - time.monotonic()))


async def with_a_line(run: Run, load: Load, replica: int = 0, timeout_s: float = 5.0) -> int:
    """A burst on top of the load, until requests wait in the sidecar's line: that depth."""
    load.burst(MAX_INFLIGHT + 4)
    waited = await poll(lambda: depth_of(run.stack, replica) >= 1, timeout_s, every_s=0.05)
    return depth_of(run.stack, replica) if waited is not None else 0


async def envoy_restart(run: Run, load: Load) -> None:
    stack = run.stack
    restarts = []
    for share, sig in ((1 / 3, signal.SIGTERM), (2 / 3, signal.SIGKILL)):
        await at(run, share)
        line = await with_a_line(run, load)
        before = await asyncio.to_thread(sidecar_counts, stack, [0])
        down_at = time.monotonic()
        stack.envoy.signal(sig)
        await asyncio.to_thread(stack.envoy.process.wait, 15)
        # While Envoy is down nothing can be in flight or in line: every stream was cut.
        freed = await poll(lambda: (lambda c: c is not None and c["inflight"] == 0 and c["depth"] == 0)(
            sidecar_counts(stack, [0])[0]), 15)
        await asyncio.to_thread(stack.start_envoy)  # same ports; returns once it sees the sidecar healthy
        restarts.append({
            "signal": signal.Signals(sig).name, "line_at_fault": line,
            "inflight_at_fault": (before[0] or {}).get("inflight"),
            "sidecar_idle_after_s": freed, "envoy_down_s": round(time.monotonic() - down_at, 2),
        })
    run.notes["restarts"] = restarts
    check = all(r["line_at_fault"] >= 1 and r["sidecar_idle_after_s"] is not None for r in restarts)
    run.notes["check"] = ("line released at each restart" if check
                          else "a restart found no line, or the sidecar kept slots while Envoy was down")


def lease_owners(client) -> dict[str, str]:
    return {lease: value.split("|")[0] for lease, value in client.hgetall(f"{{extproc:{POOL}}}:li").items()}


async def replica_kill(run: Run, load: Load) -> None:
    stack, client = run.stack, run.redis_client()
    await at(run, 1 / 3)
    await with_a_line(run, load)
    owners = await asyncio.to_thread(lease_owners, client)
    pids = {i: p.pid for i, p in enumerate(stack.sidecars)}
    holding = {i: [lease for lease, owner in owners.items() if f"-{pid}-" in owner] for i, pid in pids.items()}
    victim = max(holding, key=lambda i: len(holding[i]))
    survivor = 1 - victim
    survivor_admitted = (await asyncio.to_thread(sidecar_counts, stack, [survivor]))[survivor]["admitted"]
    stack.sidecars[victim].signal(signal.SIGKILL)
    run.live = [survivor]
    dead = set(holding[victim])
    admits = poll(lambda: sidecar_counts(stack, [survivor])[survivor]["admitted"] > survivor_admitted,
                  4 * LEASE_S + 10, every_s=0.05)
    back = poll(lambda: not dead & set(client.hkeys(f"{{extproc:{POOL}}}:li")), 4 * LEASE_S + 10, every_s=0.05)
    admits_after, back_after = await asyncio.gather(admits, back)
    run.notes.update({
        "victim_leases": len(dead), "survivor_admits_after_s": admits_after,
        "dead_leases_back_after_s": back_after, "lease_s": LEASE_S,
    })
    check = (admits_after is not None and admits_after <= LEASE_S
             and back_after is not None and back_after <= LEASE_S + 1.0)
    run.notes["check"] = ("survivor admitted within one lease; dead leases reaped" if check
                          else "survivor slow to admit, or dead leases not reaped within a lease (+1 s)")


async def redis_failover(run: Run, load: Load) -> None:
    stack = run.stack
    primary, replica, sentinel = run.notes.pop("_redis")
    seq_key = f"{{extproc:{POOL}}}:seq"  # arrivals counted by the queue script
    await at(run, 1 / 2)
    await with_a_line(run, load)
    degraded_seen = [0]
    watching = [True]

    async def watch_degraded() -> None:  # did the replicas notice the master go?
        while watching[0]:
            counts = await asyncio.to_thread(sidecar_counts, stack, run.live)
            degraded_seen[0] = max([degraded_seen[0]] + [c["store_degraded"] for c in counts.values() if c])
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch_degraded())
    down_at = time.monotonic()
    try:
        primary.kill()
        promoted = await poll(lambda: sentinel.master_port_now() == replica.port, 30)
        new_master = replica.client()
        seq_at_promotion = int(new_master.get(seq_key) or 0)
        # Admissions land on the new master again (its arrival counter moves), and no replica
        # is still in its local fallback mode.
        followed = await poll(lambda: int(new_master.get(seq_key) or 0) > seq_at_promotion
                              and all(c is not None and c["store_degraded"] == 0
                                      for c in sidecar_counts(stack, run.live).values()), 30)
    finally:
        watching[0] = False
        await watcher
    run.notes.update({
        "promoted_after_s": promoted,
        "queueing_on_new_master_after_s": None if followed is None else round(time.monotonic() - down_at, 2),
        "sidecars_went_degraded": bool(degraded_seen[0]),
    })
    run.notes["check"] = ("Sentinel promoted the replica; both sidecars queue on the new master"
                          if promoted is not None and followed is not None
                          else "no promotion, or the sidecars did not come back to Redis")


async def backend_pause(run: Run, load: Load, pause_s: float | None = None) -> None:
    pause_s = run.notes.get("pause_s", 10.0) if pause_s is None else pause_s
    sim = run.stack.sims[0]  # primary backend 0
    await at(run, 1 / 3)
    sim.signal(signal.SIGSTOP)
    depths = []
    until = time.monotonic() + pause_s
    try:
        while time.monotonic() < until:
            depths.append(await asyncio.to_thread(depth_of, run.stack))
            await asyncio.sleep(min(0.5, max(0.0, until - time.monotonic())))
    finally:
        sim.signal(signal.SIGCONT)
    run.notes.update({"pause_s": pause_s, "line_max_while_paused": max(depths, default=None)})
    run.notes["check"] = "backend resumed"


# ---------------------------------------------------------------------------------------------
# Stacks for each fault


def _sim_specs() -> tuple[SimSpec, SimSpec]:
    args = ("--time-scale", TIME_SCALE)
    return SimSpec("deepseek-sim", args), SimSpec("deepseek-sim-small", args)


def _stack(work: Path, replicas: int, redis: dict | None, redis_url: str | None = None) -> Stack:
    work.mkdir(parents=True, exist_ok=True)
    ports = StackPorts.random(primary=2, replicas=replicas)
    path = work / "extproc.yaml"
    path.write_text(yaml.safe_dump(faults_config(ports, redis)))
    primary, fallback = _sim_specs()
    return Stack(work, ports, path, primary=primary, fallback=fallback, redis_url=redis_url)


def _no_redis() -> None:
    return None


def _fixed_redis(client) -> Callable[[], object]:
    return lambda: client


def _master_redis(sentinel, primary, replica) -> Callable[[], object]:
    """The master Sentinel names now (the replica once promoted)."""
    def current():
        return replica.client() if sentinel.master_port_now() == replica.port else primary.client()
    return current


def run_fault(name: str, seconds: float = 30.0, workdir: Path | None = None, rate: float | None = None,
              seed: int = 11, calibrate_s: float = 5.0, pause_s: float = 10.0,
              timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    """One fault on a fresh stack; returns its figures (see `summarize`)."""
    from .redis_server import RedisSentinel, RedisServer

    work = workdir or Path(tempfile.mkdtemp(prefix=f"extproc-faults-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    cleanup: list[Callable[[], None]] = []
    started = time.monotonic()
    try:
        notes: dict = {}
        redis_client = _no_redis
        if name == "envoy_restart":
            stack, fault, live = _stack(work, 1, None), envoy_restart, [0]
        elif name == "backend_pause":
            stack, fault, live = _stack(work, 1, None), backend_pause, [0]
            notes["pause_s"] = pause_s
        elif name == "replica_kill":
            server = RedisServer(work / "redis").start()
            cleanup.append(server.kill)
            stack, fault, live = _stack(work, 2, {"url": server.url}), replica_kill, [0, 1]
            redis_client = _fixed_redis(server.client())
        elif name == "redis_failover":
            primary = RedisServer(work / "redis-primary").start()
            cleanup.append(primary.kill)
            replica = RedisServer(work / "redis-replica").start()
            cleanup.append(replica.kill)
            replica.client().replicaof("127.0.0.1", primary.port)
            sentinel = RedisSentinel(work / "sentinel", primary.port).start()
            cleanup.append(sentinel.kill)
            deadline = time.monotonic() + 30
            while sentinel.knows_replicas() < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("Sentinel never saw the replica")
                time.sleep(0.2)
            stack = _stack(work, 2, {"sentinels": [f"127.0.0.1:{sentinel.port}"]})
            fault, live = redis_failover, [0, 1]
            notes["_redis"] = (primary, replica, sentinel)
            redis_client = _master_redis(sentinel, primary, replica)
        else:
            raise ValueError(f"unknown fault {name!r} (one of {', '.join(FAULTS)})")
        stack.start()
        cleanup.insert(0, stack.stop)  # the stack first, then Redis
        run = Run(name, stack, seconds, rate, seed, live, redis_client, notes)
        summary = asyncio.run(run_phase(run, fault, calibrate_s, timeout_s))
        summary["processes_alive"] = {p.name: p.alive() for p in [stack.envoy, *stack.sidecars, *stack.sims]}
        summary["duplicates_at_backends"] = backend_duplicates(stack)
    finally:
        for stop in cleanup:
            try:
                stop()
            except Exception:  # noqa: BLE001 - stop everything else regardless
                pass
    summary["seconds_total"] = round(time.monotonic() - started, 1)
    summary["logs"] = str(work)
    return summary


# ---------------------------------------------------------------------------------------------
# Report


def _fmt(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def fault_check(s: dict) -> str:
    if "skipped" in s:
        return s["skipped"]
    parts = [s.get("check", "")]
    if s["fault"] == "envoy_restart":
        parts.append("; ".join(f"{r['signal']}: line {r['line_at_fault']}, idle in {r['sidecar_idle_after_s']}s, "
                               f"down {r['envoy_down_s']}s" for r in s.get("restarts", [])))
    if s["fault"] == "replica_kill":
        parts.append(f"victim held {s.get('victim_leases')} leases, survivor admitted after "
                     f"{s.get('survivor_admits_after_s')}s, leases back after {s.get('dead_leases_back_after_s')}s "
                     f"(lease {s.get('lease_s')}s)")
    if s["fault"] == "redis_failover":
        parts.append(f"promoted {s.get('promoted_after_s')}s after the kill, sidecars queueing on the new master "
                     f"{s.get('queueing_on_new_master_after_s')}s after it (local mode meanwhile: "
                     f"{s.get('sidecars_went_degraded')})")
    if s["fault"] == "backend_pause":
        parts.append(f"paused {s.get('pause_s')}s, line max {s.get('line_max_while_paused')} while paused")
    if "duplicates_at_backends" in s:
        parts.append(f"admitted twice: {len(s['duplicates_at_backends'])}")
    if s.get("fault_error"):
        parts.append(f"fault error: {s['fault_error']}")
    return "; ".join(p for p in parts if p)


def markdown(summaries: list[dict], command: str, origin: dict | None = None) -> str:
    lines = [
        "# Faults under load",
        "",
        f"`{command}`: real Envoy, sidecar(s) and simulated backends (time scale {TIME_SCALE}), "
        f"a steady mixed load (40 % streamed, three classes) at {int(LOAD_SHARE * 100)} % of the pool's "
        f"measured capacity ({MAX_INFLIGHT} slots, two backends), one fault per run. "
        f"Client timeout {CLIENT_TIMEOUT_S:.0f} s; `leaked`: slots still held once idle.",
        "",
        "| fault | requests | 200 | refused (JSON 429/503) | other errors | hung | leaked "
        "| rate req/s (capacity) | line mean/max |",
        "|---|---:|---:|---|---|---:|---:|---|---|",
    ]
    for s in summaries:
        if "skipped" in s:
            lines.append(f"| {s['fault']} | - | - | - | - | - | - | skipped | {s['skipped']} |")
            continue
        refused = f"{s['refused']} ({_fmt(s['refused_by'])})" if s["refused"] else "0"
        other = f"{s['other']} ({_fmt(s['other_by'])})" if s["other"] else "0"
        lines.append(
            f"| {s['fault']} | {s['requests']} | {s['ok']} | {refused} | {other} | {s['hung']} | {s['leaked']} | "
            f"{s.get('rate_rps')} ({s.get('capacity_rps', '-')}) | {s.get('line_mean')}/{s.get('line_max')} |"
        )
    lines += ["", "What each fault checked:", ""]
    lines += [f"- **{s['fault']}**: {fault_check(s)}" for s in summaries]
    lines += ["", "Slots admitted / released by the live replicas at idle: "
              + ", ".join(f"{s['fault']} {s['slots_admitted']}/{s['slots_released']}"
                          for s in summaries if "skipped" not in s), "", provenance_line({"provenance": origin}), ""]
    return "\n".join(lines)


def run_all(faults: list[str], seconds: float, out: Path, seed: int = 11,
            command: str = "extproc bench faults") -> list[dict]:
    """Each fault in turn; faults.json holds {"faults": [one summary per fault], "provenance"}."""
    origin = provenance()  # before anything is written
    summaries = []
    for name in faults:
        try:
            summary = run_fault(name, seconds=seconds, seed=seed)
        except Exception as error:  # noqa: BLE001 - a stack that would not start: say so, go on
            summary = {"fault": name, "skipped": f"could not run: {type(error).__name__}: {error}"}
        summaries.append(summary)
        print(f"{name}: {json.dumps({k: summary.get(k) for k in ('requests', *ENDINGS, 'leaked', 'skipped')})}",
              flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps({"faults": summaries, "provenance": origin}, indent=2, default=str))
    table = markdown(summaries, command, origin)
    (out / "faults.md").write_text(table)
    print(table)
    return summaries


def main(args) -> int:
    faults = args.only or list(FAULTS)
    command = f"extproc bench faults --seconds {args.seconds:g}" + (f" --only {' '.join(faults)}" if args.only else "")
    summaries = run_all(faults, args.seconds, Path(args.out), args.seed, command)
    bad = [s for s in summaries if "skipped" not in s and (s["hung"] or s["leaked"] or s["uncounted"])]
    return 1 if bad else 0


def add_parser(benches) -> None:
    faults = benches.add_parser("faults", help="faults under load (Envoy restart, replica kill, Redis failover, "
                                               "backend pause): every request's ending counted, no slot leaked")
    faults.add_argument("--out", default="bench/results/faults", help="write faults.json and faults.md here")
    faults.add_argument("--seconds", type=float, default=30.0, help="load per fault run (the fault comes inside it)")
    faults.add_argument("--only", nargs="+", choices=FAULTS, help="run only these faults")
    faults.add_argument("--seed", type=int, default=11)
    faults.set_defaults(func=main)
