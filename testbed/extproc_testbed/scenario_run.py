"""One run of the burst scenario's traffic through one setup on a fresh stack, sampled while it runs
and summed up per class (latency percentiles, availability, crashes, goodput, attempts, where the
slow loans' time went); the searches built on runs (the smallest pool keeping the SLO, the step
load) and the rows the summary keeps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections import Counter
from pathlib import Path

from .scenario_setups import (
    KV_TOKENS,
    MAX_NUM_SEQS,
    Cell,
    envoy_alone_template,
    envoy_template,
    long_backends,
    shipped_config,
    sidecar_config,
)
from .stack import SimSpec, Stack, StackPorts, http_get, metric_sum, parse_samples
from .traffic import CLASSES, SLO_CLASS, Outcome, Traffic, drive


def _get(url: str) -> tuple[int, str]:
    """A page, or (0, "") where it did not answer within a second (a real engine's API server on
    a busy 2-core machine): a point without it, never the end of the sampling."""
    try:
        return http_get(url, 1.0)
    except OSError:
        return 0, ""


class Sampler:
    """Reads the pool and the sidecar every half second (wall): queue, tier, KV usage (the
    busiest engine's) and the engines' own lines (running and waiting, summed), the latency
    cap, whether the sidecar sees Envoy ignoring its engine picks."""

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
            point["engine_running"] = point["engine_waiting"] = 0.0
            for pool in ("primary", "long"):  # what vLLM itself reports (503: crashed, empty)
                for i in range(len(self.stack.ports.pool_ports(pool))):
                    status, text = await asyncio.to_thread(_get, f"{self.stack.sim_url(i, pool)}/metrics")
                    engine = parse_samples(text) if status == 200 else {}
                    kv.append(metric_sum(engine, "vllm:kv_cache_usage_perc"))
                    point["engine_running"] += metric_sum(engine, "vllm:num_requests_running")
                    point["engine_waiting"] += metric_sum(engine, "vllm:num_requests_waiting")
            point["kv_usage"] = max(kv, default=0.0)
            if self.stack.with_sidecar:
                status, text = await asyncio.to_thread(_get, self.stack.metrics_url)
                if status == 200:
                    samples = parse_samples(text)
                    for key, name in (("queue_depth", "extproc_queue_depth"), ("tier", "extproc_tier"),
                                      ("inflight", "extproc_inflight"), ("latency_limit", "extproc_latency_limit"),
                                      ("released", "extproc_slots_released_total"),
                                      ("picks_ignored", "extproc_engine_picks_ignored")):
                        point[key] = metric_sum(samples, name, pool="primary")
                    for result in ("given", "past_deadline"):  # appointments, counted since the start
                        point[f"appointments_{result}"] = metric_sum(samples, "extproc_appointments_total",
                                                                     pool="primary", result=result)
            self.series.append(point)
            await asyncio.sleep(0.5)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def run_setup(setup: str, backends: int, traffic: Traffic, time_scale: float, work: Path, progress,
              off: frozenset[str] = frozenset(), shipped: bool = False, cell: Cell | None = None,
              kv_exhausted: str = "crash", keep_outcomes: bool = False) -> dict:
    """One run of the traffic through one setup; `off` names sidecar mechanisms left out;
    `shipped`: the sidecar on its shipped defaults (no long pool, nothing tuned); `cell`: a cell
    of the matrix (its engines, its Envoy, its clients; the sidecar on the shipped defaults with
    the pool sized at the engines' slots); `kv_exhausted`: what an engine does when its KV cache
    overflows, `crash` (dies, back 90 s later) or `queue` (preempts and recomputes, as vLLM);
    `keep_outcomes`: every request's outcome under `outcomes` too (`pooled`; `strip` drops them)."""
    work.mkdir(parents=True, exist_ok=True)
    with_sidecar = setup == "sidecar"
    seqs, kv_tokens = (cell.max_num_seqs, cell.kv_tokens) if cell else (MAX_NUM_SEQS, KV_TOKENS)
    plain = cell is not None and cell.envoy == "plain"
    kept_for_long = long_backends(backends) \
        if with_sidecar and "long_pool" not in off and not shipped and cell is None else 0
    ports = StackPorts.random(primary=backends - kept_for_long, long=kept_for_long)
    # the same engines in both setups; only the sidecar writes a priority for them to read
    sim_args = ("--time-scale", str(time_scale), "--on-kv-exhausted", kv_exhausted, "--max-num-seqs", str(seqs),
                "--kv-tokens", str(kv_tokens), "--recovery-s", "90", "--scheduling-policy", "priority",
                "--long-prefill-token-threshold", str(cell.long_prefill_token_threshold if cell else 0))
    if not with_sidecar:
        config = None
    elif cell is not None:
        config = shipped_config(work, ports, time_scale, seqs)
    elif shipped:
        config = shipped_config(work, ports, time_scale)
    else:
        config = sidecar_config(work, ports, time_scale, off)
    stack = Stack(work, ports, config,
                  primary=SimSpec("deepseek-sim", sim_args), fallback=SimSpec("deepseek-sim-small", sim_args),
                  with_sidecar=with_sidecar)
    stack.envoy_template = envoy_template(work, plain) if with_sidecar \
        else envoy_alone_template(work, backends, seqs, plain)
    stack.start()
    try:
        outcomes, series = drive_sampled(stack, traffic, time_scale, progress, f"{setup} N={backends}",
                                         cell.impatient if cell else frozenset())
        stats = [json.loads(http_get(f"{stack.sim_url(i, pool)}/sim/stats")[1])
                 for pool in ("primary", "long") for i in range(len(ports.pool_ports(pool)))]
    finally:
        stack.stop()
    return {**summarize(outcomes, series, sum(s["crashes"] for s in stats), traffic),
            # what the engines themselves said: their mode when the KV cache overflows, their preemptions
            "engines_on_kv_exhausted": sorted({s.get("on_kv_exhausted", "unknown") for s in stats}),
            "engine_preemptions": sum(s.get("preemptions", 0) for s in stats), "seed": traffic.seed,
            **({"outcomes": outcomes} if keep_outcomes else {})}


def pooled(runs: list[dict], traffic: Traffic) -> dict:
    """Runs of one setup on the same traffic drawn from different seeds (`run_setup` with
    `keep_outcomes`), as one: the figures of all their requests together (one run's 119 loans
    allow a single miss under 99 %, so one run cannot tell a change from its seed's luck), each
    run's headline figures under `by_seed`, and the first run's series for the plots. Counts
    (requests, attempts, crashes, preemptions) are the runs' sums; shares are of all the requests;
    rates (goodput, retries over time) are per second of one run."""
    # each run's engines are its own (new ports each time): named with the run's seed
    outcomes = [dataclasses.replace(o, engine=None if o.engine is None else f"seed {run['seed']} {o.engine}")
                for run in runs for o in run["outcomes"]]
    whole = summarize(outcomes, [p for run in runs for p in run["series"]], sum(r["oom_crashes"] for r in runs),
                      traffic, runs=len(runs))
    return {**whole, "series": runs[0]["series"],
            "engines_on_kv_exhausted": sorted({mode for r in runs for mode in r["engines_on_kv_exhausted"]}),
            "engine_preemptions": sum(r["engine_preemptions"] for r in runs),
            "by_seed": [{"seed": r["seed"], "loans_in_time": r["classes"][SLO_CLASS]["in_time"],
                         "loan_burst_p99_s": r["classes"][SLO_CLASS]["burst_p99_s"],
                         "availability": r["availability"], "goodput_in_time_rps": r["goodput_in_time_rps"],
                         "crashes": r["oom_crashes"]} for r in runs]}


def drive_sampled(stack: Stack, traffic: Traffic, time_scale: float, progress, label: str,
                  impatient: frozenset[str] = frozenset(), prepare=None) -> tuple[list[Outcome], list[dict]]:
    """The traffic through a started stack, sampled while it runs: every request's outcome, and
    the samples (`Sampler`)."""
    async def go() -> tuple[list[Outcome], list[dict]]:
        sampler = Sampler(stack, time_scale, time.monotonic())
        sampler.start()
        try:
            def report(phase: str, t: float, n: int) -> None:
                progress(f"{label}: {phase}, t={t:.0f}s of {traffic.duration_s:.0f}s, {n} requests")

            outcomes = await drive(stack.url, traffic, time_scale, report, impatient, prepare)
        finally:
            sampler.stop()
        return outcomes, sampler.series

    return asyncio.run(go())


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(outcomes: list[Outcome], series: list[dict], crashes: int, traffic: Traffic, runs: int = 1) -> dict:
    """The figures of `outcomes` (of `runs` runs of `traffic`: rates are per second of one run)."""
    seconds = traffic.duration_s * runs
    classes = {}
    for name in CLASSES:
        mine = [o for o in outcomes if o.class_name == name]
        latencies = [o.latency_s for o in mine if o.ok]
        with_failures = [o.latency_s if o.ok else math.inf for o in mine]  # a failed request missed any SLO
        waits = [o.queue_wait_s for o in mine if o.ok and o.queue_wait_s is not None]
        classes[name] = {
            "requests": len(mine),
            "availability": round(sum(o.ok for o in mine) / len(mine), 4) if mine else None,
            "deadline_s": round(traffic.deadlines_s[name], 3),
            "in_time": round(sum(o.in_time for o in mine) / len(mine), 4) if mine else None,
            # how the requests that failed ended: their attempts' statuses, in order
            "failed_endings": dict(Counter(">".join(str(status) for _, status in o.attempts)
                                           for o in mine if not o.ok).most_common(6)),
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
    in_time = [o for o in outcomes if o.in_time]
    forecasts = [o.forecast_wait_s - o.queue_wait_s for o in ok
                 if o.forecast_wait_s is not None and o.queue_wait_s is not None]
    attainment: dict[int, list[int]] = {}
    by_class: dict[str, dict[int, list[int]]] = {name: {} for name in CLASSES}
    for o in outcomes:
        attainment.setdefault(int(o.sent_at // 5) * 5, []).append(int(o.in_time))
        by_class[o.class_name].setdefault(int(o.sent_at // 5) * 5, []).append(int(o.in_time))
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
        "attempts_per_request": round(len(attempts) / len(outcomes), 2) if outcomes else None,
        "refused_attempts_share": round(len(refused) / len(attempts), 4) if attempts else None,
        "attempt_endings": dict(Counter(str(a[1]) for a in attempts).most_common()),
        "failed_share": round(1 - len(ok) / len(outcomes), 4) if outcomes else None,
        "goodput_tokens_per_s": round(sum(o.completion_tokens for o in ok) / seconds, 1),
        "in_time": round(len(in_time) / len(outcomes), 4) if outcomes else None,
        "goodput_in_time_tokens_per_s": round(sum(o.completion_tokens for o in in_time) / seconds, 1),
        "goodput_in_time_rps": round(len(in_time) / seconds, 2),  # answered in time, per second
        "slow_loans": slow_loans(outcomes, traffic),
        # whether the sidecar ever read Envoy as ignoring its engine picks (None: no sidecar)
        "engine_picks_ignored": max((p["picks_ignored"] for p in series if "picks_ignored" in p), default=None),
        "in_time_over_time": {t: round(sum(v) / len(v), 4) for t, v in sorted(attainment.items())},
        "in_time_over_time_by_class": {name: {t: round(sum(v) / len(v), 4) for t, v in sorted(buckets_.items())}
                                       for name, buckets_ in by_class.items()},
        # forecast minus the wait it turned out to be (unscaled seconds), for requests that waited
        "forecast_error_s": {"p50": _round(_percentile(forecasts, 50)),
                             "p05": _round(_percentile(forecasts, 5)), "p95": _round(_percentile(forecasts, 95)),
                             "mean_abs": _round(sum(abs(e) for e in forecasts) / len(forecasts)) if forecasts else None},
        "meets_slo": p99 is not None and p99 < traffic.slo_p99_s and bool(classes[SLO_CLASS]["requests"]),
        "availability_over_time": {t: round(sum(v) / len(v), 4) for t, v in sorted(buckets.items())},
        "retries_over_time": {t: round(n / runs, 2) if runs > 1 else n for t, n in sorted(retries_by_second.items())},
        "latencies_s": {name: sorted(o.latency_s for o in outcomes if o.ok and o.class_name == name)
                        for name in CLASSES},
        # each loan: when it was sent and its latency (None: it failed), for the plots
        "loans_over_time": sorted((o.sent_at, o.latency_s if o.ok else None)
                                  for o in outcomes if o.class_name == SLO_CLASS),
        "series": series,
    }


SLOW_PARTS = ("earlier_attempts_s", "line_s", "engine_queue_s", "prefill_s", "decode_s", "elsewhere_s")


def time_spent(o: Outcome) -> dict[str, float | None]:
    """Where an answered request's time went (unscaled seconds): its attempts before the one
    answered (and the pauses between them), the sidecar's line, the engine's line, its prefill,
    its decode, and the rest (Envoy, the sidecar's decisions, the network); `beside_prefill_s`
    and `beside_long_prefill_s`, the part of its engine steps shared with another request's
    prefill, and with a long one's. None where the answer did not say (no simulated engine)."""
    earlier = (o.answered_attempt_at or o.sent_at) - o.sent_at
    line = o.queue_wait_s or 0.0  # Envoy alone has no line
    engine = (o.engine_queue_s, o.prefill_s, o.decode_s)
    elsewhere = None if None in engine or o.latency_s is None \
        else o.latency_s - earlier - line - sum(engine)  # type: ignore[arg-type]
    return {"earlier_attempts_s": earlier, "line_s": line, "engine_queue_s": o.engine_queue_s,
            "prefill_s": o.prefill_s, "decode_s": o.decode_s, "elsewhere_s": elsewhere,
            "beside_prefill_s": o.beside_prefill_s, "beside_long_prefill_s": o.beside_long_prefill_s}


def slow_loans(outcomes: list[Outcome], traffic: Traffic, listed: int = 100) -> dict:
    """The loans answered after the latency SLO (2 s, times the traffic's `latency_scale`), and
    where their time went: counts, the median of each part (and of the time beside others'
    prefill), how many shared engine steps with another request's long prefill, by engine and by
    phase; the slowest `listed` one by one. Loans that failed are counted apart."""
    loans = [o for o in outcomes if o.class_name == SLO_CLASS]
    slow = sorted((o for o in loans if o.ok and o.latency_s is not None and o.latency_s > traffic.slo_p99_s),
                  key=lambda o: -(o.latency_s or 0))
    spent = [time_spent(o) for o in slow]
    medians = {}
    for part in (*SLOW_PARTS, "beside_prefill_s", "beside_long_prefill_s"):
        values = [s[part] for s in spent if s[part] is not None]
        medians[part] = _round(_percentile(values, 50))
    return {
        "loans": len(loans),
        "slow": len(slow),
        "failed": sum(not o.ok for o in loans),
        "medians_s": medians,
        "beside_long_prefill": sum((s["beside_long_prefill_s"] or 0) > 0 for s in spent),
        "by_engine": dict(Counter(o.engine or "unknown" for o in slow).most_common()),
        "by_phase": dict(Counter(traffic.phase_at(o.sent_at) for o in slow)),
        "slowest": [{"sent_at_s": round(o.sent_at, 2), "latency_s": round(o.latency_s or 0, 3), "engine": o.engine,
                     "attempts": len(o.attempts), **{k: _round(v) for k, v in s.items()}}
                    for o, s in zip(slow[:listed], spent[:listed], strict=True)],
    }


def _round(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else round(value, 3)


def smallest_meeting_slo(setup: str, start: int, max_backends: int, traffic: Traffic, time_scale: float,
                         work: Path, progress, known: dict[int, dict],
                         min_backends: int = 1, kv_exhausted: str = "crash") -> tuple[int | None, dict[int, bool]]:
    """The smallest N keeping the SLO, assuming more backends never hurt: from `start`, down
    (to `min_backends`) while it holds, or up to `max_backends` until it does."""
    tried: dict[int, bool] = {}

    def meets(n: int) -> bool:
        result = known.get(n) or run_setup(setup, n, traffic, time_scale, work / f"{setup}-{n}", progress,
                                           kv_exhausted=kv_exhausted)
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


def step_load(backends: int, time_scale: float, work: Path, progress, steps: list[float], step_s: float,
              kv_exhausted: str = "crash") -> list[dict]:
    """The seed's phase-one test: raise the rate step by step until the system breaks."""
    levels = []
    for setup in ("envoy_only", "sidecar"):
        for i, rps in enumerate(steps):
            traffic = Traffic(steady_rps=rps, burst_rps=rps, steady_s=step_s, burst_s=0, recovery_s=0, seed=100 + i)
            result = run_setup(setup, backends, traffic, time_scale, work / f"steps-{setup}-{rps:g}", progress,
                               kv_exhausted=kv_exhausted)
            level = {"setup": setup, "rps": rps, "availability": result["availability"],
                     "loan_p99_s": result["classes"][SLO_CLASS]["p99_with_failures_s"],
                     "oom_crashes": result["oom_crashes"], "slow_loans": result["slow_loans"]}
            levels.append(level)
            progress(f"step {setup} {rps:g} req/s: {level}")
            if result["availability"] < 0.99 or result["oom_crashes"]:
                break  # broken: the next steps only break it more
    return levels


def strip(result: dict) -> dict:
    """A setup's figures for scenario.json (the raw series go to the plots, not the JSON)."""
    return {k: v for k, v in result.items() if k not in ("latencies_s", "loans_over_time", "series", "outcomes")}


def ablation_row(result: dict) -> dict:
    loan = result["classes"][SLO_CLASS]
    return {"loan_p99_s": loan["p99_with_failures_s"], "loan_burst_p99_s": loan["burst_p99_s"],
            "loan_availability": loan["availability"],
            "complaint_availability": result["classes"]["complaint"]["availability"],
            "archive_availability": result["classes"]["archive_query"]["availability"],
            "availability": result["availability"], "in_time": result["in_time"],
            "in_time_by_class": {name: result["classes"][name]["in_time"] for name in CLASSES},
            "oom_crashes": result["oom_crashes"],
            "goodput_tokens_per_s": result["goodput_tokens_per_s"],
            "goodput_in_time_tokens_per_s": result["goodput_in_time_tokens_per_s"]}
