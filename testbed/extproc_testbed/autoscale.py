"""`extproc bench scenario --autoscale`: a burst of minutes through Envoy + the sidecar, the pool's
simulated engines started and stopped by a controller standing in for KEDA, under three policies:

- `fixed`: the base pool, never scaled (it must shed in the burst); `fixed:N`, a fixed pool of N
  engines (run a few to find the smallest fixed pool that holds the peak: the bill to compare with);
- `queue`: the queue-depth rule KEDA is given in llm-d's guide, a Prometheus trigger on the
  waiting requests with an AverageValue target: engines = ceil(waiting / `--queue-per-engine`),
  never below the base;
- `predicted`: the sidecar's own `extproc_desired_backends` (core/capacity_model.py).

Both scaling policies scale in only after the HPA's 300 s stabilization window (the most wanted
over it; scaled like every duration), and a started engine serves only after `--cold-start-s`
(60 s, unscaled: a vLLM server's start-up), billed from the moment it is asked for. The engines
are real `extproc sim` processes on fixed ports, all listed in Envoy's cluster and the sidecar's
backends: one not started reads as down. Reported per policy: availability per class, loan p99,
engine-minutes (the hardware bill, unscaled), and the time from the burst's start to enough
engines (the fixed pool sized for the peak); beside them the bill of that peak-sized fixed pool.
"Sized for the peak" is measured when `fixed:N` runs are among the policies: the smallest N whose
run kept every class's SLO (99 % answered within its deadline); `--peak-backends` otherwise. The
capacity model runs under every policy: what it asked for in the last half of the burst, against
that smallest pool, is its prediction error.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .capacity_bench import autoscale_settings, sim_args, write_config
from .scenario_setups import MAX_NUM_SEQS
from .provenance import provenance
from .scenario_run import summarize
from .stack import SimSpec, Stack, StackPorts, http_get, metric_sum, parse_samples, wait_until
from .traffic import CLASSES, SLO_CLASS, Traffic, drive

POLICIES = ("fixed", "queue", "predicted")
SLO_SHARE = 0.99  # a class keeps its SLO when this share is answered within its deadline
STABILIZATION_S = 300.0  # the HPA's scale-in stabilization window (deploy/k8s/autoscaling)
# A drained engine (unscaled seconds): at least this long before it may be stopped (what the
# sidecar named it for before the drain reaches it), at most this long in all.
DRAIN_LEAST_S, DRAIN_MOST_S = 1.0, 60.0


@dataclass(frozen=True)
class Setup:
    """How one policy's run is set up: its pool, its engines, its autoscaler."""

    policy: str
    base: int  # engines at the start (a fixed pool's size)
    maximum: int  # engines the stack can start
    time_scale: float
    cold_start_s: float  # unscaled: from asked for to serving
    queue_per_engine: float  # the queue rule's AverageValue target
    model: dict  # the capacity model's settings (`pools.primary.autoscale`), unscaled seconds
    max_num_seqs: int = MAX_NUM_SEQS  # per engine
    hold_s: float = STABILIZATION_S  # unscaled: the controller's scale-in stabilization window
    drains: bool = False  # drain an engine before it is stopped
    scale_in_every_s: float = 0.0  # unscaled: at most one engine out per this long (0: no limit)

    @classmethod
    def of(cls, policy: str, args) -> Setup:
        """The burst-of-minutes run's (`--autoscale`)."""
        base = fixed_size(policy, args.base_backends) if policy.startswith("fixed") else args.base_backends
        return cls(policy, base, max(args.max_backends, base), args.time_scale, args.cold_start_s,
                   args.queue_per_engine, {"min_backends": args.base_backends, "max_backends": args.max_backends,
                                           "horizon_s": args.cold_start_s})


@dataclass
class Engine:
    state: str = "off"  # off, starting (asked for, not serving yet), on, draining (on its way off)
    ready_at: float = 0.0  # wall clock, while starting
    drained: bool = False  # the sidecar was told to drain it: told to take it back when it starts again


@dataclass
class Controller:
    """Follows a policy's engine count every half second (wall). Scale-in waits for the policy's
    stabilization window (`hold_s`: the most wanted over it). With `drains`, an engine on its way
    out is first drained, as a pod's preStop does (deploy/k8s/autoscaling/vllm-drain.yaml): the
    sidecar is told (the admin API's DrainEngine) and names it for no new request, then the engine
    is stopped once its own /metrics shows nothing running or waiting (at most `DRAIN_MOST_S`);
    billed until then."""

    stack: Stack
    setup: Setup
    started: float
    engines: list[Engine] = field(default_factory=list)
    series: list[dict] = field(default_factory=list)
    drain_times: list[float] = field(default_factory=list)  # unscaled seconds each drain took
    _wanted: list[tuple[float, int]] = field(default_factory=list)
    _tasks: set = field(default_factory=set)
    _last_scale_in: float = -math.inf

    def __post_init__(self) -> None:
        self.engines = [Engine("on" if i < self.setup.base else "off") for i in range(self.setup.maximum)]

    def unscaled(self, wall: float) -> float:
        return (wall - self.started) / self.setup.time_scale

    def target(self, samples: dict, now: float) -> int:
        if self.setup.policy.startswith("fixed"):
            return self.setup.base  # (a fixed:N policy's base is N)
        if self.setup.policy == "queue":
            waiting = metric_sum(samples, "extproc_queue_depth", pool="primary")
            raw = max(self.setup.base, math.ceil(waiting / self.setup.queue_per_engine))
        else:
            raw = max(self.setup.base, int(metric_sum(samples, "extproc_desired_backends", pool="primary")))
        raw = min(self.setup.maximum, raw)
        self._wanted.append((now, raw))
        self._wanted = [(t, w) for t, w in self._wanted if t >= now - self.setup.hold_s * self.setup.time_scale]
        return max(w for _, w in self._wanted)  # scale-in only after the stabilization window

    async def step(self) -> None:
        now = time.monotonic()
        status, text = await asyncio.to_thread(http_get, self.stack.metrics_url, 1.0)
        samples = parse_samples(text) if status == 200 else {}
        asked = sum(e.state in ("starting", "on") for e in self.engines)
        target = self.target(samples, now) if samples else asked
        for i, engine in enumerate(self.engines):
            if engine.state == "starting" and now >= engine.ready_at:
                if engine.drained:
                    await asyncio.to_thread(self.engine_admin, "undrain", i)
                    engine.drained = False
                await asyncio.to_thread(self.stack.sims[i].start)
                engine.state = "on"
        for engine in self.engines:
            if asked >= target:
                break
            if engine.state == "off":
                engine.state, engine.ready_at = "starting", now + self.setup.cold_start_s * self.setup.time_scale
                asked += 1
        excess = asked - target
        if self.setup.scale_in_every_s:  # the HPA's scale-down policy: one engine per period
            period = self.setup.scale_in_every_s * self.setup.time_scale
            excess = min(excess, 0 if now - self._last_scale_in < period else 1)
        for i in reversed(range(len(self.engines))):
            if excess <= 0:
                break
            engine = self.engines[i]
            if engine.state in ("starting", "on"):
                excess -= 1
                self._last_scale_in = now
                if engine.state == "on" and self.setup.drains:
                    engine.state = "draining"
                    task = asyncio.get_running_loop().create_task(self.drain(i))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    continue
                if engine.state == "on":
                    await asyncio.to_thread(self.stack.sims[i].stop)
                engine.state = "off"
        self.series.append({
            "t": round(self.unscaled(now), 2), "target": target,
            "serving": sum(e.state == "on" for e in self.engines), "billed": sum(e.state != "off" for e in self.engines),
            "draining": sum(e.state == "draining" for e in self.engines),
            "queue_depth": metric_sum(samples, "extproc_queue_depth", pool="primary"),
            "desired": metric_sum(samples, "extproc_desired_backends", pool="primary"),
            "needed_now": metric_sum(samples, "extproc_needed_backends", pool="primary", horizon="now"),
            "needed_ahead": metric_sum(samples, "extproc_needed_backends", pool="primary", horizon="ahead"),
            "per_engine_concurrency": metric_sum(samples, "extproc_per_engine_concurrency", pool="primary"),
            "capacity_rps": {c: metric_sum(samples, "extproc_capacity_rps", pool="primary", **{"class": c})
                             for c in CLASSES},
            "demand_rps": {c: metric_sum(samples, "extproc_demand_rps", pool="primary", **{"class": c})
                           for c in CLASSES},
        })

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.step()
                except Exception as error:  # one bad read: the next half second tries again
                    print(f"controller: {error!r}", flush=True)
                await asyncio.sleep(0.5)
        finally:
            for task in list(self._tasks):
                task.cancel()

    async def drain(self, index: int) -> None:
        """Drain engine `index`, then stop it (see the class)."""
        began = time.monotonic()
        engine = self.engines[index]
        try:
            await asyncio.to_thread(self.engine_admin, "drain", index)
            engine.drained = True
            # what the sidecar named it for before it was told may still be on its way through Envoy
            await asyncio.sleep(DRAIN_LEAST_S * self.setup.time_scale)
            end, unanswered = began + DRAIN_MOST_S * self.setup.time_scale, 0
            while time.monotonic() < end and unanswered < 5:  # (five reads unanswered: it is gone, as the preStop reads it)
                busy = await asyncio.to_thread(self.engine_busy, index)
                if busy == 0:
                    break
                unanswered = unanswered + 1 if busy < 0 else 0
                await asyncio.sleep(0.1)
        finally:
            await asyncio.to_thread(self.stack.sims[index].stop)
            engine.state = "off"
            self.drain_times.append(round((time.monotonic() - began) / self.setup.time_scale, 2))

    def engine_admin(self, action: str, index: int) -> None:
        """Tell the sidecar to drain engine `index`, or to take it back, as an operator or a
        preStop would (`extproc admin engine drain|undrain`)."""
        endpoint = f"127.0.0.1:{self.stack.ports.primary[index]}"
        command = [sys.executable, "-m", "extproc", "admin", "--address", f"127.0.0.1:{self.stack.ports.admin}",
                   "engine", action, "primary", endpoint]
        if action == "drain":
            command += ["--deadline-s", f"{DRAIN_MOST_S * self.setup.time_scale:g}"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            print(f"controller: {' '.join(command[3:])}: {done.stderr.strip()}", flush=True)

    def engine_busy(self, index: int) -> float:
        """What engine `index` runs and holds in line, by its own /metrics (-1: no answer)."""
        status, text = http_get(f"{self.stack.sim_url(index)}/metrics", 1.0)
        if status != 200:
            return -1.0
        samples = parse_samples(text)
        return metric_sum(samples, "vllm:num_requests_running") + metric_sum(samples, "vllm:num_requests_waiting")


def fixed_size(policy: str, base: int) -> int:
    """`fixed` is the base pool; `fixed:N` a fixed pool of N engines."""
    return int(policy.split(":", 1)[1]) if ":" in policy else base


def held_slo(row: dict) -> bool:
    return all(v is None or v >= SLO_SHARE for v in row["in_time_by_class"].values())  # None: none sent


def burst_reading(series: list[dict], traffic: Traffic, key: str) -> float | None:
    """The median of `key` over the last half of the burst (the model settled on it)."""
    start, end = traffic.steady_s + traffic.burst_s / 2, traffic.steady_s + traffic.burst_s
    values = sorted(p[key] for p in series if start <= p["t"] < end and p.get(key) is not None)
    return values[len(values) // 2] if values else None


def engine_minutes(series: list[dict], duration_s: float) -> float:
    total = 0.0
    for a, b in zip(series, series[1:], strict=False):
        total += a["billed"] * (min(b["t"], duration_s) - a["t"]) if a["t"] < duration_s else 0.0
    return total / 60


def time_to_enough(series: list[dict], burst_at: float, enough: int) -> float | None:
    for point in series:
        if point["t"] >= burst_at and point["serving"] >= enough:
            return round(point["t"] - burst_at, 1)
    return None


def run_policy(setup: Setup, traffic: Traffic, work: Path, progress) -> tuple[list, list[dict], Controller]:
    """Drive `traffic` through a stack whose engines `setup`'s controller starts and stops."""
    work.mkdir(parents=True, exist_ok=True)
    policy, base, engines = setup.policy, setup.base, setup.maximum
    ports = StackPorts.random(primary=engines)
    settings = autoscale_settings(setup.time_scale, **setup.model)
    config = write_config(work, ports, setup.time_scale, settings, max_num_seqs=setup.max_num_seqs)
    engine_args = sim_args(setup.time_scale, max_num_seqs=setup.max_num_seqs)
    stack = Stack(work, ports, config, primary=SimSpec("deepseek-sim", engine_args),
                  fallback=SimSpec("deepseek-sim-small", engine_args))
    stack.start()
    try:
        for i in range(base, engines):
            stack.sims[i].stop()  # not started yet: read as down
        # The run starts from a pool at rest: the stack started every engine, and the capacity
        # model's stabilization window still holds what it saw then; once it wants the base pool
        # (its hold is `scale_in_hold_s`, scaled), the traffic begins.
        wait_until(lambda: metric_sum(parse_samples(http_get(stack.metrics_url)[1]), "extproc_desired_backends",
                                      pool="primary") <= base,
                   60 + 2 * settings["scale_in_hold_s"], "the capacity model to want the base pool")
        controller = Controller(stack, setup, time.monotonic())

        async def go():
            controller.started = time.monotonic()
            task = asyncio.get_running_loop().create_task(controller.run())
            try:
                return await drive(stack.url, traffic, setup.time_scale,
                                   lambda phase, t, n: progress(f"{policy}: {phase}, t={t:.0f}s, {n} requests, "
                                                                f"serving {controller.series[-1]['serving'] if controller.series else '?'}"))
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        outcomes = asyncio.run(go())
    finally:
        stack.stop()
    return outcomes, controller.series, controller


def burst_row(setup: Setup, traffic: Traffic, work: Path, progress) -> dict:
    policy = setup.policy
    outcomes, series, _ = run_policy(setup, traffic, work, progress)
    summary = summarize(outcomes, [], 0, traffic)
    return {
        "policy": policy,
        "availability": summary["availability"],
        "availability_by_class": {name: summary["classes"][name]["availability"] for name in CLASSES},
        "in_time_by_class": {name: summary["classes"][name]["in_time"] for name in CLASSES},
        "loan_p99_s": summary["classes"][SLO_CLASS]["p99_with_failures_s"],
        "engine_minutes": round(engine_minutes(series, traffic.duration_s), 1),
        "max_serving": max((p["serving"] for p in series), default=None),
        "model_desired_in_burst": burst_reading(series, traffic, "desired"),
        "model_needed_now_in_burst": burst_reading(series, traffic, "needed_now"),
        "series": series,
    }


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    traffic = Traffic(steady_rps=args.steady_rps, burst_rps=args.burst_rps, steady_s=args.steady_s,
                      burst_s=args.burst_s, recovery_s=args.recovery_s, seed=11)
    origin = provenance()  # before anything is written
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {message}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="extproc-autoscale-"))
    progress(f"logs in {work}")
    rows = [burst_row(Setup.of(policy, args), traffic, work / policy, progress) for policy in args.policies]
    held = sorted(fixed_size(r["policy"], args.base_backends) for r in rows
                  if r["policy"].startswith("fixed") and held_slo(r))
    peak = held[0] if held else args.peak_backends
    peak_bill = peak * traffic.duration_s / 60
    for row in rows:
        row["time_to_enough_s"] = time_to_enough(row["series"], traffic.steady_s, peak)
        row["held_slo"] = held_slo(row)
        if row["model_desired_in_burst"] is not None:
            row["model_error_engines"] = row["model_desired_in_burst"] - peak
    summary = {
        "traffic": traffic.__dict__, "time_scale": args.time_scale, "cold_start_s": args.cold_start_s,
        "base_backends": args.base_backends, "max_backends": args.max_backends, "peak_backends": peak,
        "peak_measured": bool(held),
        "queue_per_engine": args.queue_per_engine, "stabilization_s": STABILIZATION_S,
        "fixed_peak_engine_minutes": round(peak_bill, 1),
        "policies": [{k: v for k, v in row.items() if k != "series"} for row in rows],
        "seconds": round(time.monotonic() - started),
        "provenance": origin,
    }
    for row in summary["policies"]:
        row["engine_minutes_vs_fixed_peak"] = round(row["engine_minutes"] / peak_bill - 1, 3)
    (out / "autoscale.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "autoscale-series.json").write_text(json.dumps({"provenance": origin,
                                                           **{r["policy"]: r["series"] for r in rows}}) + "\n")
    plot(out / "autoscale.png", rows, traffic)
    return summary


def plot(path: Path, rows: list[dict], traffic: Traffic) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (engines, queue) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for row in rows:
        t = [p["t"] for p in row["series"]]
        engines.step(t, [p["serving"] for p in row["series"]], where="post", label=f"{row['policy']} serving")
        queue.plot(t, [p["queue_depth"] for p in row["series"]], label=row["policy"])
    for axis in (engines, queue):
        axis.axvspan(traffic.steady_s, traffic.steady_s + traffic.burst_s, color="0.9")
        axis.legend(loc="upper right", fontsize=8)
    engines.set_ylabel("engines serving")
    queue.set_ylabel("requests waiting")
    queue.set_xlabel("unscaled seconds (burst shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(summary: dict) -> list[str]:
    lines = ["| policy | available (loan / complaint / archive) | in time (loan / complaint / archive) | SLO held | "
             "loan p99 s | engines at most | engine-minutes | vs fixed pool sized for the peak | "
             "time to enough engines s | model asked in the burst |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary["policies"]:
        a, t = row["availability_by_class"], row["in_time_by_class"]
        lines.append(f"| {row['policy']} | {' / '.join(str(a[c]) for c in CLASSES)} | "
                     f"{' / '.join(str(t[c]) for c in CLASSES)} | {'yes' if row['held_slo'] else 'no'} | "
                     f"{row['loan_p99_s']} | {row['max_serving']} | {row['engine_minutes']} | "
                     f"{row['engine_minutes_vs_fixed_peak']:+.0%} | {row['time_to_enough_s']} | "
                     f"{row['model_desired_in_burst']} |")
    if not summary["peak_measured"]:
        lines.append(f"| fixed, sized for the peak ({summary['peak_backends']}, assumed) | (not run) | | | | | "
                     f"{summary['fixed_peak_engine_minutes']} | 0% | 0 | |")
    return lines


def main(args) -> int:
    args.policies = args.policies or list(POLICIES)
    args.queue_per_engine = args.queue_per_engine or 10.0
    summary = run(args)
    print("\n".join(table(summary)))
    return 0


def add_arguments(p) -> None:
    p.add_argument("--autoscale", action="store_true",
                   help="instead: a burst of minutes, the pool scaled by a controller (fixed, queue depth, prediction)")
    p.add_argument("--policies", type=lambda s: s.split(","),
                   help=f"the policies, comma-separated (--autoscale: {','.join(POLICIES)}; --day: day.POLICIES)")
    p.add_argument("--base-backends", type=int, default=2)
    p.add_argument("--peak-backends", type=int, default=4, help="the fixed pool sized for the peak")
    p.add_argument("--cold-start-s", type=float, default=60.0, help="an engine's start-up, unscaled seconds")
    p.add_argument("--queue-per-engine", type=float,
                   help="the queue rule's AverageValue target (--autoscale: 10; --day: an engine's sequences)")
    p.add_argument("--steady-rps", type=float, default=6.0)
    p.add_argument("--burst-rps", type=float, default=16.0)
    p.add_argument("--steady-s", type=float, default=60.0)
    p.add_argument("--burst-s", type=float, default=240.0)
    p.add_argument("--recovery-s", type=float, default=240.0)
