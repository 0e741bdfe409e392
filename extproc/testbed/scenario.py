"""What the sidecar buys under a burst: the seed's situation on a simulated pool, the same traffic
through (a) Envoy alone, configured as a careful platform team would, and (b) Envoy + the sidecar.

    extproc bench scenario [--out bench/results] [--backends 4] [--search] [--steps]

The traffic (`Traffic`): 200 branches; loan approvals (20 %, urgent 0-3), complaints (30 %,
VIP 0-2), archive queries (50 %, a third of them bulk); prompts mostly around 500 tokens, 4.5 %
of 1k-4k, 0.5 % of 8.5k-12.8k (the tail, up to the usable context); a steady phase, a burst
well beyond capacity, a recovery phase. Clients
retry like real ones: on 429, 503, 5xx or a reset, after `retry-after` (or 1, 2 s with jitter),
at most three attempts, one idempotency-key per request.

The pool: N simulated vLLM servers in `crash` mode (an engine that overfills its KV cache dies,
fails what it held, and is back 90 s later), 8 sequences and 32k tokens of KV cache each.

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
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from ..core.config import ClassPolicy, RetryAfter, default_config_text
from ..core.pool_config import Aimd, BreakerSettings, Capacity
from .envoy_config import template_path
from .machine import describe_machine
from .stack import SimSpec, Stack, StackPorts, http_get, metric_sum, parse_samples

CLASSES = ("loan_approval", "complaint", "archive_query")
SLO_CLASS, SLO_P99_S = "loan_approval", 2.0
MAX_NUM_SEQS, KV_TOKENS = 8, 24576
OFFLOAD_REQUEST_TOKENS = 1000  # the medium prompts (1k-4k) of classes without a latency target: to the long pool


@dataclass(frozen=True)
class Traffic:
    """The offered load, in unscaled seconds and requests per unscaled second."""

    branches: int = 200
    steady_rps: float = 14.0
    burst_rps: float = 60.0
    steady_s: float = 30.0
    burst_s: float = 30.0
    recovery_s: float = 40.0
    long_share: float = 0.005  # 8.5k-12.8k tokens: one ticket in two hundred
    medium_share: float = 0.045  # 1k-4k tokens
    seed: int = 7

    @property
    def duration_s(self) -> float:
        return self.steady_s + self.burst_s + self.recovery_s

    def rate_at(self, t: float) -> float:
        return self.burst_rps if self.steady_s <= t < self.steady_s + self.burst_s else self.steady_rps

    def phase_at(self, t: float) -> str:
        if t < self.steady_s:
            return "steady"
        return "burst" if t < self.steady_s + self.burst_s else "recovery"

    def scaled(self, factor: float) -> Traffic:
        """The same shape, `factor` times shorter (for a smoke run)."""
        return dataclasses.replace(self, steady_s=self.steady_s * factor, burst_s=self.burst_s * factor,
                                   recovery_s=self.recovery_s * factor)


def ticket(rng: random.Random, traffic: Traffic) -> dict:
    """One ticket of the seed's mix: its class, claims, prompt size and output budget."""
    class_name = rng.choices(CLASSES, (20, 30, 50))[0]
    headers = {"x-ticket-type": class_name, "x-branch-id": f"{rng.randrange(traffic.branches):04d}"}
    if class_name == "loan_approval":
        headers["x-urgent-level"] = str(rng.choice((0, 0, 1, 2, 3)))
    elif class_name == "complaint":
        headers["x-vip-level"] = str(rng.choice((0, 0, 1, 2)))
    elif rng.random() < 1 / 3:
        headers["x-bulk"] = "true"
    draw = rng.random()
    long = draw < traffic.long_share
    if long:  # the tail, up to the usable context (16k x 0.8 minus the answer)
        prompt_tokens = rng.randint(8500, 12800)
    elif draw < traffic.long_share + traffic.medium_share:
        prompt_tokens = rng.randint(1000, 4000)
    else:
        prompt_tokens = max(50, int(rng.lognormvariate(math.log(480), 0.35)))
    max_tokens = 256 if long else 64
    body = {"model": "deepseek-sim", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * (4 * prompt_tokens)}]}  # 1/4 token per Latin character
    return {"class": class_name, "headers": headers, "body": body, "long": long}


@dataclass
class Outcome:
    """One logical request: every attempt, and how it ended."""

    class_name: str
    sent_at: float  # unscaled seconds since the start
    long: bool
    attempts: list[tuple[float, int | str]] = field(default_factory=list)  # (unscaled time, status or error)
    ok: bool = False
    latency_s: float | None = None  # unscaled, first attempt to answer
    queue_wait_s: float | None = None
    completion_tokens: int = 0


class Client:
    """Sends the tickets, retrying like an application does."""

    def __init__(self, url: str, time_scale: float, session: aiohttp.ClientSession, started: float):
        self.url = f"{url}/v1/chat/completions"
        self.scale = time_scale
        self.session = session
        self.started = started
        self.timeout_s = 120.0  # unscaled, per attempt

    def now(self) -> float:
        return (time.monotonic() - self.started) / self.scale

    async def send(self, item: dict, rng: random.Random) -> Outcome:
        outcome = Outcome(item["class"], self.now(), item["long"])
        headers = {"content-type": "application/json", "idempotency-key": uuid.uuid4().hex, **item["headers"]}
        for attempt in range(3):
            status: int | str
            retry_after = None
            try:
                async with asyncio.timeout(self.timeout_s * self.scale):
                    async with self.session.post(self.url, json=item["body"], headers=headers) as response:
                        payload = await response.read()
                        status = response.status
                        retry_after = response.headers.get("retry-after")
                        if status == 200:
                            outcome.ok = True
                            outcome.latency_s = self.now() - outcome.sent_at
                            wait = response.headers.get("x-queue-wait-ms")
                            outcome.queue_wait_s = int(wait) / 1000 / self.scale if wait and wait.isdigit() else None
                            try:
                                outcome.completion_tokens = json.loads(payload)["usage"]["completion_tokens"]
                            except (ValueError, KeyError, TypeError):
                                pass
            except (aiohttp.ClientError, TimeoutError) as error:
                status = type(error).__name__
            outcome.attempts.append((self.now(), status))
            if outcome.ok or (isinstance(status, int) and 400 <= status < 500 and status not in (409, 429)):
                break
            if attempt == 2:
                break
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                await asyncio.sleep(float(retry_after))  # the sidecar's clock: already scaled
            else:
                await asyncio.sleep((1.0, 2.0)[attempt] * rng.uniform(0.5, 1.5) * self.scale)
        return outcome


async def drive(url: str, traffic: Traffic, time_scale: float, on_progress) -> list[Outcome]:
    rng = random.Random(traffic.seed)
    started = time.monotonic()
    tasks: list[asyncio.Task] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = Client(url, time_scale, session, started)
        t = 0.0
        last_report = 0.0
        while t < traffic.duration_s:
            t += rng.expovariate(traffic.rate_at(t))
            delay = started + t * time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(client.send(ticket(rng, traffic), random.Random(rng.random()))))
            if t - last_report >= 10:
                last_report = t
                on_progress(traffic.phase_at(t), t, len(tasks))
        return await asyncio.gather(*tasks)


class Sampler:
    """Reads the pool and the sidecar every half second (wall): queue, tier, KV usage."""

    def __init__(self, stack: Stack, time_scale: float, started: float):
        self.stack = stack
        self.scale = time_scale
        self.started = started
        self.series: list[dict] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            point = {"t": (time.monotonic() - self.started) / self.scale}
            kv = []
            for pool in ("primary", "long"):  # what vLLM itself reports (503: crashed, empty)
                for i in range(len(self.stack.ports.pool_ports(pool))):
                    status, text = await asyncio.to_thread(http_get, f"{self.stack.sim_url(i, pool)}/metrics", 1.0)
                    kv.append(metric_sum(parse_samples(text), "vllm:kv_cache_usage_perc") if status == 200 else 0.0)
            point["kv_usage"] = max(kv, default=0.0)
            if self.stack.with_sidecar:
                status, text = await asyncio.to_thread(http_get, self.stack.metrics_url, 1.0)
                if status == 200:
                    samples = parse_samples(text)
                    for key, name in (("queue_depth", "extproc_queue_depth"), ("tier", "extproc_tier"),
                                      ("inflight", "extproc_inflight"), ("latency_limit", "extproc_latency_limit")):
                        point[key] = metric_sum(samples, name, pool="primary")
            self.series.append(point)
            await asyncio.sleep(0.5)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def envoy_alone_template(work: Path, backends: int) -> Path:
    """The production template with the primary cluster's circuit breakers sized to the pool."""
    config = yaml.safe_load(template_path().read_text())
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "vllm_primary":
            threshold = cluster["circuit_breakers"]["thresholds"][0]
            threshold.update(max_requests=backends * MAX_NUM_SEQS, max_pending_requests=backends * MAX_NUM_SEQS,
                             max_connections=backends * MAX_NUM_SEQS * 2)
    path = work / "envoy-alone-template.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def scale_durations(config: dict, time_scale: float) -> dict:
    """The sidecar's own durations scaled like the backends' (waits, retry-after, probe and
    breaker intervals, latency targets), so the whole system runs `time_scale` times faster,
    consistently. Values the file leaves out are scaled from the configuration's defaults."""
    for policy in config["classes"].values():
        policy["max_wait_s"] = policy.get("max_wait_s", ClassPolicy.model_fields["max_wait_s"].default) * time_scale
        if policy.get("latency_target_s"):
            policy["latency_target_s"] = policy["latency_target_s"] * time_scale
    retry_after = {**RetryAfter().model_dump(), **config.get("retry_after_s", {})}
    config["retry_after_s"] = {key: value if key == "jitter" else max(1, round(value * time_scale))  # jitter: a share
                               for key, value in retry_after.items()}
    for key in ("interval_s", "stale_after_s"):
        config["probes"][key] = config["probes"][key] * time_scale
    for pool in config["pools"].values():
        capacity = pool["capacity"]
        capacity.setdefault("aimd", {})["interval_s"] = Aimd().interval_s * time_scale
        capacity["latency_window_s"] = capacity.get("latency_window_s", Capacity().latency_window_s) * time_scale
        breaker = BreakerSettings(**pool.get("breaker", {})).model_dump()
        pool["breaker"] = {level: {key: value * time_scale if key.endswith("_s") else value
                                   for key, value in settings.items()} for level, settings in breaker.items()}
    return config


def long_backends(backends: int) -> int:
    """How many of the sidecar setup's backends are kept for long prompts."""
    return max(1, round(backends / 4)) if backends > 1 else 0


MECHANISMS = ("latency_target", "long_pool", "offload", "engine_priority", "pick_backend")


def sidecar_config(work: Path, ports: StackPorts, time_scale: float, off: frozenset[str] = frozenset()) -> Path:
    config = yaml.safe_load(default_config_text())
    if "latency_target" in off:
        for policy in config["classes"].values():
            policy.pop("latency_target_s", None)
    config.setdefault("queue", {})["engine_priority"] = "engine_priority" not in off
    primary = config["pools"]["primary"]
    primary.pop("fallback", None)
    primary["max_inflight"] = len(ports.primary) * MAX_NUM_SEQS
    primary["capacity"]["backends"] = [f"http://127.0.0.1:{p}" for p in ports.primary]
    primary["capacity"]["max_num_seqs"] = MAX_NUM_SEQS
    primary["capacity"]["pick_backend"] = "pick_backend" not in off
    if ports.long and "long_pool" not in off:
        primary["long_pool"] = "long"
        if "offload" not in off:
            primary["capacity"]["offload_request_tokens"] = OFFLOAD_REQUEST_TOKENS
        config["pools"]["long"] = {
            "cluster": "vllm_long", "max_inflight": len(ports.long) * MAX_NUM_SEQS,
            "capacity": {"backends": [f"http://127.0.0.1:{p}" for p in ports.long], "max_num_seqs": MAX_NUM_SEQS,
                         "pick_backend": "pick_backend" not in off},
        }
    config["pools"]["fallback"]["capacity"]["backends"] = [f"http://127.0.0.1:{p}" for p in ports.fallback]
    config["probes"]["nvml"] = "off"
    config["shadow"]["share"] = 0.0
    path = work / "extproc.yaml"
    path.write_text(yaml.safe_dump(scale_durations(config, time_scale)))
    return path


def run_setup(setup: str, backends: int, traffic: Traffic, time_scale: float, work: Path, progress,
              off: frozenset[str] = frozenset()) -> dict:
    """One run of the traffic through one setup; `off` names sidecar mechanisms left out."""
    work.mkdir(parents=True, exist_ok=True)
    with_sidecar = setup == "sidecar"
    kept_for_long = long_backends(backends) if with_sidecar and "long_pool" not in off else 0
    ports = StackPorts.random(primary=backends - kept_for_long, long=kept_for_long)
    # the same engines in both setups; only the sidecar writes a priority for them to read
    sim_args = ("--time-scale", str(time_scale), "--on-kv-exhausted", "crash", "--max-num-seqs", str(MAX_NUM_SEQS),
                "--kv-tokens", str(KV_TOKENS), "--recovery-s", "90", "--scheduling-policy", "priority")
    stack = Stack(work, ports, sidecar_config(work, ports, time_scale, off) if with_sidecar else None,
                  primary=SimSpec("deepseek-sim", sim_args), fallback=SimSpec("deepseek-sim-small", sim_args),
                  with_sidecar=with_sidecar)
    if not with_sidecar:
        stack.envoy_template = envoy_alone_template(work, backends)
    stack.start()
    try:
        async def go() -> tuple[list[Outcome], list[dict]]:
            sampler = Sampler(stack, time_scale, time.monotonic())
            sampler.start()
            try:
                outcomes = await drive(stack.url, traffic, time_scale,
                                       lambda phase, t, n: progress(f"{setup} N={backends}: {phase}, "
                                                                    f"t={t:.0f}s of {traffic.duration_s:.0f}s, {n} requests"))
            finally:
                sampler.stop()
            return outcomes, sampler.series

        outcomes, series = asyncio.run(go())
        crashes = sum(json.loads(http_get(f"{stack.sim_url(i, pool)}/sim/stats")[1])["crashes"]
                      for pool in ("primary", "long") for i in range(len(ports.pool_ports(pool))))
    finally:
        stack.stop()
    return summarize(outcomes, series, crashes, traffic)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(outcomes: list[Outcome], series: list[dict], crashes: int, traffic: Traffic) -> dict:
    classes = {}
    for name in CLASSES:
        mine = [o for o in outcomes if o.class_name == name]
        latencies = [o.latency_s for o in mine if o.ok]
        with_failures = [o.latency_s if o.ok else math.inf for o in mine]  # a failed request missed any SLO
        waits = [o.queue_wait_s for o in mine if o.ok and o.queue_wait_s is not None]
        classes[name] = {
            "requests": len(mine),
            "availability": round(sum(o.ok for o in mine) / len(mine), 4) if mine else None,
            "p50_s": _round(_percentile(latencies, 50)), "p95_s": _round(_percentile(latencies, 95)),
            "p99_s": _round(_percentile(latencies, 99)),
            "p99_with_failures_s": _round(_percentile(with_failures, 99)),  # None: the p99 request failed
            "queue_wait_p50_s": _round(_percentile(waits, 50)), "queue_wait_p99_s": _round(_percentile(waits, 99)),
        }
    for phase in ("steady", "burst", "recovery"):  # the latency-bound class, by when it was sent
        mine = [o for o in outcomes if o.class_name == SLO_CLASS and traffic.phase_at(o.sent_at) == phase]
        latencies = [o.latency_s for o in mine if o.ok]
        classes[SLO_CLASS][f"{phase}_p50_s"] = _round(_percentile(latencies, 50))
        classes[SLO_CLASS][f"{phase}_p99_s"] = _round(_percentile([o.latency_s if o.ok else math.inf for o in mine], 99))
    ok = [o for o in outcomes if o.ok]
    attempts = [a for o in outcomes for a in o.attempts]
    refused = [a for a in attempts if a[1] in (429, 503, 409)]
    buckets: dict[int, list[int]] = {}
    for o in outcomes:
        buckets.setdefault(int(o.sent_at // 5) * 5, []).append(int(o.ok))
    retries_by_second: dict[int, int] = {}
    for o in outcomes:
        for when, _ in o.attempts[1:]:
            retries_by_second[int(when // 5) * 5] = retries_by_second.get(int(when // 5) * 5, 0) + 1
    p99 = classes[SLO_CLASS]["p99_with_failures_s"]
    return {
        "requests": len(outcomes),
        "classes": classes,
        "oom_crashes": crashes,
        "availability": round(len(ok) / len(outcomes), 4) if outcomes else None,
        "attempts": len(attempts),
        "refused_attempts_share": round(len(refused) / len(attempts), 4) if attempts else None,
        "attempt_endings": dict(Counter(str(a[1]) for a in attempts).most_common()),
        "failed_share": round(1 - len(ok) / len(outcomes), 4) if outcomes else None,
        "goodput_tokens_per_s": round(sum(o.completion_tokens for o in ok) / traffic.duration_s, 1),
        "meets_slo": p99 is not None and p99 < SLO_P99_S and bool(classes[SLO_CLASS]["requests"]),
        "availability_over_time": {t: round(sum(v) / len(v), 4) for t, v in sorted(buckets.items())},
        "retries_over_time": dict(sorted(retries_by_second.items())),
        "latencies_s": {name: sorted(o.latency_s for o in outcomes if o.ok and o.class_name == name)
                        for name in CLASSES},
        "series": series,
    }


def _round(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else round(value, 3)


def smallest_meeting_slo(setup: str, start: int, max_backends: int, traffic: Traffic, time_scale: float,
                         work: Path, progress, known: dict[int, dict],
                         min_backends: int = 1) -> tuple[int | None, dict[int, bool]]:
    """The smallest N keeping the SLO, assuming more backends never hurt: from `start`, down
    (to `min_backends`) while it holds, or up to `max_backends` until it does."""
    tried: dict[int, bool] = {}

    def meets(n: int) -> bool:
        result = known.get(n) or run_setup(setup, n, traffic, time_scale, work / f"{setup}-{n}", progress)
        known[n] = result
        tried[n] = result["meets_slo"]
        progress(f"{setup} N={n}: loan p99 (failures counted) {result['classes'][SLO_CLASS]['p99_with_failures_s']} s, "
                 f"{'meets' if result['meets_slo'] else 'misses'} the SLO")
        return tried[n]

    if meets(start):
        n = start
        while n > min_backends and meets(n - 1):
            n -= 1
        return n, tried
    for n in range(start + 1, max_backends + 1):
        if meets(n):
            return n, tried
    return None, tried


def step_load(backends: int, time_scale: float, work: Path, progress, steps: list[float], step_s: float) -> list[dict]:
    """The seed's phase-one test: raise the rate step by step until the system breaks."""
    levels = []
    for setup in ("envoy_only", "sidecar"):
        for i, rps in enumerate(steps):
            traffic = Traffic(steady_rps=rps, burst_rps=rps, steady_s=step_s, burst_s=0, recovery_s=0, seed=100 + i)
            result = run_setup(setup, backends, traffic, time_scale, work / f"steps-{setup}-{rps:g}", progress)
            level = {"setup": setup, "rps": rps, "availability": result["availability"],
                     "loan_p99_s": result["classes"][SLO_CLASS]["p99_with_failures_s"], "oom_crashes": result["oom_crashes"]}
            levels.append(level)
            progress(f"step {setup} {rps:g} req/s: {level}")
            if result["availability"] < 0.99 or result["oom_crashes"]:
                break  # broken: the next steps only break it more
    return levels


def strip(result: dict) -> dict:
    """A setup's figures for scenario.json (the raw series go to the plots, not the JSON)."""
    return {k: v for k, v in result.items() if k not in ("latencies_s", "series")}


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="extproc-scenario-"))
    traffic = Traffic() if args.size == 1 else Traffic().scaled(args.size)
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"[{time.monotonic() - started:6.0f}s] {message}", flush=True)

    progress(f"traffic: {traffic}; time scale {args.time_scale}; logs in {work}")
    main = {setup: run_setup(setup, args.backends, traffic, args.time_scale, work / f"{setup}-{args.backends}", progress)
            for setup in ("envoy_only", "sidecar")}
    for setup, result in main.items():
        progress(f"{setup} N={args.backends}: availability {result['availability']}, crashes {result['oom_crashes']}, "
                 f"loan p99 {result['classes'][SLO_CLASS]['p99_s']} s")
    minimum: dict[str, int | None] = {}
    tried: dict[str, dict[int, bool]] = {}
    if args.search:
        known = {"envoy_only": {args.backends: main["envoy_only"]}, "sidecar": {args.backends: main["sidecar"]}}
        minimum["sidecar"], tried["sidecar"] = smallest_meeting_slo(
            "sidecar", args.backends, args.max_backends, traffic, args.time_scale, work, progress, known["sidecar"],
            args.min_backends)
        minimum["envoy_only"], tried["envoy_only"] = smallest_meeting_slo(
            "envoy_only", minimum["sidecar"] or args.max_backends, args.max_backends, traffic, args.time_scale, work,
            progress, known["envoy_only"], args.min_backends)
    ablation = []
    if args.ablation:
        variants = [frozenset([m]) for m in MECHANISMS] + [frozenset(MECHANISMS)]
        for off in variants:
            name = "without " + " and ".join(sorted(off))
            result = run_setup("sidecar", args.backends, traffic, args.time_scale,
                               work / f"ablation-{'-'.join(sorted(off))}", progress, off)
            ablation.append({"variant": name, "off": sorted(off), **ablation_row(result)})
            progress(f"{name}: {ablation[-1]}")
        ablation.insert(0, {"variant": "all on", "off": [], **ablation_row(main["sidecar"])})
        ablation.append({"variant": "Envoy alone", "off": None, **ablation_row(main["envoy_only"])})
    levels = step_load(args.backends, args.time_scale, work, progress, args.step_rps, args.step_seconds) \
        if args.steps else []
    summary = {
        "setups": {setup: strip(result) for setup, result in main.items()},
        "backends": args.backends,
        "min_backends_for_slo": minimum,
        "backends_tried": {k: {str(n): ok for n, ok in v.items()} for k, v in tried.items()},
        "max_backends_tried": args.max_backends if args.search else None,
        "slo": f"{SLO_CLASS} p99 under {SLO_P99_S:g} s, failed requests counted as missing it",
        "step_load": levels,
        "ablation": ablation,
        "traffic": traffic.__dict__,
        "time_scale": args.time_scale,
        "pool": f"simulated vLLM, crash mode, {MAX_NUM_SEQS} sequences and {KV_TOKENS} KV tokens per backend, "
                "90 s recovery",
        "command": " ".join(["extproc", "bench", "scenario", *sys.argv[3:]]),
        "machine": describe_machine(),
        "seconds": round(time.monotonic() - started),
    }
    (out / "scenario.json").write_text(json.dumps(summary, indent=2) + "\n")
    from . import plots  # matplotlib: installed with the test and bench tools, not the server

    plots.scenario_plots(out, main)
    return summary


def ablation_row(result: dict) -> dict:
    loan = result["classes"][SLO_CLASS]
    return {"loan_p99_s": loan["p99_with_failures_s"], "loan_availability": loan["availability"],
            "complaint_availability": result["classes"]["complaint"]["availability"],
            "archive_availability": result["classes"]["archive_query"]["availability"],
            "availability": result["availability"], "oom_crashes": result["oom_crashes"],
            "goodput_tokens_per_s": result["goodput_tokens_per_s"]}


def _fmt(value, unit: str = "", missing: str = "—") -> str:
    return missing if value is None else f"{value:g}{unit}"


def results_section(summary: dict) -> list[str]:
    setups = summary["setups"]
    lines = [
        "## What it buys under a burst",
        "",
        f"`{summary['command']}` — {summary['traffic']['branches']} branches; steady "
        f"{summary['traffic']['steady_rps']:g} req/s for {summary['traffic']['steady_s']:g} s, a burst of "
        f"{summary['traffic']['burst_rps']:g} req/s for {summary['traffic']['burst_s']:g} s, then "
        f"{summary['traffic']['recovery_s']:g} s at the steady rate (unscaled seconds; run at time scale "
        f"{summary['time_scale']:g}). Pool: {summary['pool']}, {summary['backends']} backends. Clients retry up to "
        "three attempts. Latencies in the backends' unscaled seconds; availability counts each request once, its "
        "retries included.",
        "",
        "| | Envoy alone | Envoy + sidecar |",
        "|---|---|---|",
    ]
    a, b = setups["envoy_only"], setups["sidecar"]
    rows = [("simulated OOM crashes", "oom_crashes", ""), ("availability", "availability", ""),
            ("failed requests (after retries)", "failed_share", ""), ("refused attempts", "refused_attempts_share", ""),
            ("goodput (completion tokens/s)", "goodput_tokens_per_s", "")]
    for title, key, unit in rows:
        lines.append(f"| {title} | {_fmt(a[key], unit)} | {_fmt(b[key], unit)} |")
    la, lb = a["classes"][SLO_CLASS], b["classes"][SLO_CLASS]
    if "burst_p99_s" in lb:
        lines.append(f"| **{SLO_CLASS}: p99 of those sent during the burst (failures counted)** | "
                     f"{_fmt(la['burst_p99_s'], ' s', 'failed')} | **{_fmt(lb['burst_p99_s'], ' s', 'failed')}** |")
    for name in CLASSES:
        ca, cb = a["classes"][name], b["classes"][name]
        lines.append(f"| {name}: p50 / p95 / p99 of answered | {_fmt(ca['p50_s'])} / {_fmt(ca['p95_s'])} / "
                     f"{_fmt(ca['p99_s'])} s | {_fmt(cb['p50_s'])} / {_fmt(cb['p95_s'])} / {_fmt(cb['p99_s'])} s |")
        lines.append(f"| {name}: availability, p99 counting failures | {_fmt(ca['availability'])}, "
                     f"{_fmt(ca['p99_with_failures_s'], ' s', 'failed')} | {_fmt(cb['availability'])}, "
                     f"{_fmt(cb['p99_with_failures_s'], ' s', 'failed')} |")
        lines.append(f"| {name}: queue wait p50 / p99 | — | {_fmt(cb['queue_wait_p50_s'])} / "
                     f"{_fmt(cb['queue_wait_p99_s'])} s |")
    minimum = summary["min_backends_for_slo"]
    if minimum:
        def shown(setup: str) -> str:
            n = minimum.get(setup)
            return str(n) if n is not None else f"more than {summary['max_backends_tried']}"

        lines += ["", f"Smallest pool keeping the SLO ({summary['slo']}): Envoy alone **{shown('envoy_only')}** "
                  f"backends, Envoy + sidecar **{shown('sidecar')}** (tried: {summary['backends_tried']})."]
    if summary["step_load"]:
        lines += ["", "Step load (the seed's phase-one test: the rate raised until the system breaks):", "",
                  "| setup | req/s | availability | loan p99 (failures counted) | crashes |", "|---|---|---|---|---|"]
        for level in summary["step_load"]:
            lines.append(f"| {level['setup']} | {level['rps']:g} | {_fmt(level['availability'])} | "
                         f"{_fmt(level['loan_p99_s'])} | {level['oom_crashes']} |")
    if summary.get("ablation"):
        lines += ["", f"Each mechanism of the sidecar left out in turn (the same traffic, {summary['backends']} "
                  "backends; one run each, so a difference within the run-to-run spread of \"The burst again\" "
                  "is noise):", "",
                  "| variant | loan p99 (failures counted) | loan availability | complaint / archive availability "
                  "| availability | crashes | goodput (tokens/s) |", "|---|---|---|---|---|---|---|"]
        for row in summary["ablation"]:
            lines.append(f"| {row['variant']} | {_fmt(row['loan_p99_s'], ' s', 'failed')} | "
                         f"{_fmt(row['loan_availability'])} | {_fmt(row['complaint_availability'])} / "
                         f"{_fmt(row['archive_availability'])} | {_fmt(row['availability'])} | {row['oom_crashes']} | "
                         f"{_fmt(row['goodput_tokens_per_s'])} |")
    lines += ["", "Plots: `results/latency_cdf.png`, `results/queue_kv_over_time.png`, "
              "`results/availability_over_time.png`.", "", f"Machine: {summary['machine']}; the run took "
              f"{summary['seconds']} s.", ""]
    return lines


def main(args) -> int:
    summary = run(args)
    from .report import write_results

    path = write_results(Path(args.out))
    print("\n".join(results_section(summary)))
    print(f"written: {Path(args.out) / 'scenario.json'}, {path}")
    return 0


def add_parser(bench) -> None:
    p = bench.add_parser("scenario", help="the seed's burst through Envoy alone and through the sidecar")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--backends", type=int, default=4, help="simulated vLLM servers in the pool")
    p.add_argument("--time-scale", type=float, default=0.5, help="multiply every simulated duration")
    p.add_argument("--size", type=float, default=1.0, help="shorten every phase by this factor (smoke runs)")
    p.add_argument("--search", action="store_true", help="also find the smallest pool keeping loan p99 under 2 s")
    p.add_argument("--max-backends", type=int, default=8)
    p.add_argument("--min-backends", type=int, default=1)
    p.add_argument("--steps", action="store_true", help="also run the step load")
    p.add_argument("--ablation", action="store_true",
                   help="also run the sidecar with each mechanism left out in turn: " + ", ".join(MECHANISMS))
    p.add_argument("--step-rps", type=lambda s: [float(x) for x in s.split(",")], default=[10, 20, 30, 40, 60, 80])
    p.add_argument("--step-seconds", type=float, default=20.0)
    p.set_defaults(func=main)
