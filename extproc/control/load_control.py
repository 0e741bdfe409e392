"""The capacity loop: every `probes.interval_s`, read the probes, adapt each pool's limits. The
probes follow each pool's engines (`engines`: its listed backends, and what its dns:// names
resolve to, control/discovery.py, less those draining), read at every tick; what this replica
still runs on the draining ones (`held`, control/engine_drains.py) is given back to the limits
(core/engine_drain.drained_back)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from ..core.capacity import Aimd, BackendReading, LatencyLimiter, dynamic_batch, long_lane_share, pool_limits
from ..core.config import Config
from ..core.discovery import changes, dns_names
from ..core.engine_drain import drained_back
from ..core.events import FirstByte
from ..ops.metrics import Metrics
from ..stores.queue import QueueStore
from .probes import NvmlProbe, VllmMetricsProbe

log = logging.getLogger("extproc")

_FALLBACK_REQUEST_TOKENS = 1024  # average request size before anything was admitted


class LoadController:
    def __init__(self, config: Config, store: QueueStore, metrics: Metrics, nvml: NvmlProbe | None,
                 clock: Callable[[], float] = time.monotonic,
                 on_readings: Callable[[str, dict[str, BackendReading], dict[str, int]], None] | None = None,
                 picks_followed: Callable[[str], bool | None] | None = None,
                 engines: Callable[[str], tuple[str, ...]] | None = None,
                 held: Callable[[str], tuple[int, int]] | None = None):
        self.config = config
        self.store = store
        self.metrics = metrics
        self.nvml = nvml
        self.clock = clock
        # each pool's engines, as base URLs (None: its listed backends)
        self.engines = engines or (lambda pool: self.config.pools[pool].capacity.backends)
        # (requests, tokens) each pool still runs on engines that take no new request (draining)
        self.held = held or (lambda pool: (0, 0))
        self.backends: dict[str, list[VllmMetricsProbe]] = {name: [] for name in config.pools}
        for name in config.pools:
            self._follow_engines(name)
        self.aimd = {
            name: Aimd(**pool.capacity.aimd.model_dump()) for name, pool in config.pools.items()
        }
        # whether Envoy follows the sidecar's engine picks for a pool (None: not known yet)
        self.picks_followed = picks_followed or (lambda pool: None)
        self.long_rules: dict[str, str | None] = {}  # by pool, as the last tick set it (long_rule)
        self.latency = {name: self.configured(LatencyLimiter(), name) for name in config.pools}
        # each pool's readings by backend URL, as polled (the backend placement takes them)
        # the backends' readings of a pool, and the cost placed on each backend by every replica
        # what the engine picker hears of each pool's engines (pool, readings by URL, placed by URL)
        self.on_readings = on_readings or (lambda pool, readings, placed: None)
        self._targets = {name: c.latency_target_s for name, c in config.classes.items() if c.latency_target_s}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None
        self._ticking = asyncio.Lock()  # a tick asked for (the engines changed) waits for one under way
        self._soon: set[asyncio.Task] = set()  # the tick asked for by an event (tick_soon), until done
        self._stopped = False

    def configured(self, limiter: LatencyLimiter, pool: str) -> LatencyLimiter:
        """`limiter` with this configuration's settings for `pool`."""
        capacity = self.config.pools[pool].capacity
        floor = capacity.latency_floor_share if self._placed_apart(pool) \
            else min(capacity.latency_floor_share, capacity.latency_floor_share_envoy_placed)
        return limiter.configure(capacity.latency_window_s, self.config.probes.interval_s, floor,
                                 capacity.latency_headroom_share)

    @property
    def has_targets(self) -> bool:
        """Some class has a latency target: the latency limiter applies."""
        return bool(self._targets)

    def first_byte(self, event: FirstByte) -> None:
        """A request got its first byte from its pool without a failure, `since_arrival_s` after it
        reached the sidecar (the queue wait included): the latency limiter's measure."""
        target = self._targets.get(event.class_name)
        if target is not None and event.succeeded and event.pool in self.latency:
            self.latency[event.pool].observe(self.clock(), event.since_arrival_s, target)

    def _follow_engines(self, pool: str) -> None:
        """The pool's probes, one per engine it has now: an engine that came gets one (read at
        this tick), one that went takes its probe and its series with it."""
        probes = {probe.base_url: probe for probe in self.backends[pool]}
        urls = self.engines(pool)
        added, dropped = changes(tuple(probes), urls)
        for url in dropped:
            self.metrics.forget_backend(pool, probes.pop(url).url)
        p = self.config.probes
        for url in added:
            probe = probes[url] = VllmMetricsProbe(url, p.timeout_s, p.stale_after_s, self.clock)
            self.metrics.backend_metrics_age.labels(pool, probe.url).set_function(  # read when scraped: exact
                lambda probe=probe: probe.age_s(self.clock()))
        self.backends[pool] = [probes[url] for url in urls]

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        await self.tick()  # limits are known before the first request
        self._task = asyncio.get_running_loop().create_task(self._run())

    def tick_soon(self) -> asyncio.Task | None:
        """A tick now rather than at the next interval: whether Envoy follows a pool's engine picks
        turned (PicksJudged), and what keeps its long prompts apart (`long_alone`, `long_rule`) and
        the latency cap's floor follow the verdict, not a probe interval after it, in which a long
        prompt would be kept apart neither in space nor in time."""
        # one asked for and not done covers another ask (verdicts turn rarely: core/picks.py's
        # hysteresis); a stopped controller (a reload replaced it) ticks no more
        if self._soon or self._stopped:
            return next(iter(self._soon), None)
        task = asyncio.get_running_loop().create_task(self._tick_logged())
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)
        return task

    async def stop(self) -> None:
        self._stopped = True  # (a reload's old controller: no tick asked for after this)
        tasks = [*self._soon, *([self._task] if self._task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.probes.interval_s)
            await self._tick_logged()

    async def _tick_logged(self) -> None:
        try:
            await self.tick()
        except Exception:
            log.exception("capacity loop tick failed; limits unchanged")

    async def _gpu_batch(self, pool_name: str) -> int | None:
        if self.nvml is None or not self.nvml.enabled or pool_name != self.config.default_pool:
            return None
        if not self.config.pools[pool_name].capacity.nvml_dynamic_batch:
            return None
        gpus = self.nvml.read() or []
        for gpu in gpus:
            self.metrics.gpu_memory_used.labels(str(gpu.index)).set(1 - gpu.free_bytes / gpu.total_bytes)
            self.metrics.gpu_sm_utilization.labels(str(gpu.index)).set(gpu.sm_utilization)
            self.metrics.gpu_memory_utilization.labels(str(gpu.index)).set(gpu.memory_utilization)
        snapshot = await self.store.snapshot(pool_name)
        avg_tokens = snapshot.inflight_tokens / snapshot.inflight if snapshot.inflight else _FALLBACK_REQUEST_TOKENS
        avg_bytes = avg_tokens * self.config.probes.kv_bytes_per_token
        cap = self.config.pools[pool_name].capacity.max_num_seqs
        return sum(dynamic_batch(g.free_bytes, avg_bytes, 0.85, cap) for g in gpus)  # [] (unknown) -> 0

    async def tick(self) -> None:
        async with self._ticking:
            await self._tick()

    async def _tick(self) -> None:
        for name in self.config.pools:
            self._follow_engines(name)
        probes = [probe for probes in self.backends.values() for probe in probes]
        if probes:
            assert self._session is not None
            await asyncio.gather(*(probe.poll(self._session) for probe in probes))
        now = self.clock()
        for name, pool in self.config.pools.items():
            readings = [probe.reading(now) for probe in self.backends[name]]
            placed = await self.store.placements(name) if pool.capacity.picks_backend else {}
            self.on_readings(name, {p.base_url: r for p, r in zip(self.backends[name], readings, strict=True)}, placed)
            for probe, reading in zip(self.backends[name], readings, strict=True):
                self.metrics.backend_kv_usage.labels(name, probe.url).set(reading.kv_usage)
                self.metrics.backend_saturated.labels(name, probe.url).set(int(reading.saturated))
                self.metrics.backend_up.labels(name, probe.url).set(int(probe.up))
                if probe.sample is not None and not reading.saturated:
                    self.metrics.backend_requests.labels(name, probe.url, "running").set(probe.sample.running)
                    self.metrics.backend_requests.labels(name, probe.url, "waiting").set(probe.sample.waiting)
            # The engines that answer add room, slots and spread; one whose metrics failed adds no
            # room (pool_limits) and no usage to follow, and one not read well for longer than
            # `stale_after_s` (stopped, crashed) no slot and no spread either. Where none was ever
            # read (its /metrics unreachable), nothing is known: the listed engines count.
            probes = self.backends[name]
            serving = sum(probe.serving(now) for probe in probes)
            if not serving and all(probe.sampled_at is None for probe in probes):
                serving = len(probes)
            answering = [r.kv_usage for r in readings if not r.saturated]
            if not readings:
                factor = 1.0
            elif answering:
                factor = self.aimd[name].update(aimd_usage(answering, pool.capacity.picks_backend), now)
            else:
                factor = self.aimd[name].factor  # nothing to follow: it holds
            snapshot = await self.store.snapshot(name)
            held_requests, held_tokens = self.held(name)  # in the in-flight, on none of these readings' engines
            limits = pool_limits(
                readings,
                static_capacity_per_backend=pool.capacity.kv_tokens_per_backend,
                backends=max(1, serving),
                safety_factor=pool.capacity.safety_factor,
                aimd_factor=factor,
                ledger_tokens=max(0, snapshot.inflight_tokens - held_tokens),
                max_inflight=pool.max_inflight,
                max_num_seqs=pool.capacity.max_num_seqs,
                dynamic_batch=await self._gpu_batch(name),
            )
            limits = drained_back(limits, held_requests, held_tokens, pool.max_inflight)
            if not readings and dns_names(pool.capacity.backends):  # its names stand for no engine now
                limits = replace(limits, budget_tokens=0)  # nothing to hold (a lone request still goes: PoolLine)
            # (the floor follows whether Envoy follows the picks: configured again each tick)
            latency_cap = self.configured(self.latency[name], name).update(
                now, limits.max_inflight, snapshot.unbounded_inflight) if self.has_targets else None
            self.metrics.latency_limit.labels(name).set(-1 if latency_cap is None else latency_cap)
            self.metrics.aimd_factor.labels(name).set(factor)
            self.metrics.token_budget.labels(name).set(-1 if limits.budget_tokens is None else limits.budget_tokens)
            # the sidecar places this pool's requests itself: admit under the spread rule (PoolLine)
            spread = max(1, serving) if pool.capacity.picks_backend else 1
            self.long_rules[name] = self.long_rule(name, len(answering))
            await self.store.set_limits(name, replace(limits, latency_cap=latency_cap, spread=spread,
                                                      long_alone=self._long_alone(name, len(answering)),
                                                      long_quiet_s=pool.capacity.long_quiet_s,
                                                      long_share=long_lane_share(pool.capacity, max(1, serving)),
                                                      engines=max(1, serving)))

    def long_prompts(self, pool: str) -> str | None:
        """What kept the pool's long prompts from its latency-bound requests at the last tick
        (`long_rule`), for the operator; None before the first, or where no class has a target."""
        return self.long_rules.get(pool)

    def long_rule(self, pool: str, answering: int) -> str | None:
        """"placed_apart": the sidecar places long prompts on engines of their own, and Envoy
        follows its picks; "wait_for_quiet": Envoy places the pool's requests by its own policy,
        or is not known yet to follow the picks, so a long prompt waits until no latency-bound
        request and no other long one runs (and one of a class without a target for
        `long_quiet_s` too: `_long_alone`);
        "one_engine": the sidecar places them, but fewer than two engines answer, and one may
        start beside anything (long_lane.long_may_start); "not_kept_apart": `keep_long_apart`
        off. None where no class has a latency target."""
        if not self.has_targets:
            return None
        if not self.config.pools[pool].capacity.keep_long_apart:
            return "not_kept_apart"
        if self._long_alone(pool, answering):
            return "wait_for_quiet"
        return "placed_apart" if answering >= 2 else "one_engine"

    def _long_alone(self, pool: str, answering: int) -> bool:
        """Long prompts wait while latency-bound requests run where nothing is known to keep them
        apart in space: the pool's requests are placed by Envoy's own policy (the sidecar does not
        pick, or Envoy does not follow its picks, or is not known yet to where two engines or more
        answer), so a long prefill may land on a loan's engine. (Until the picks are judged, the
        sidecar also places them apart; a pool of one engine keeps nothing apart either way.)"""
        capacity = self.config.pools[pool].capacity
        return self.has_targets and capacity.keep_long_apart and (
            not self._placed_apart(pool) or capacity.picks_backend and self.picks_followed(pool) is None
            and answering >= 2)

    def _placed_apart(self, pool: str) -> bool:
        """Whether the sidecar places the pool's requests, keeping prompts apart from the
        latency-bound requests, and Envoy follows (or is not known yet not to): else each engine
        gets what Envoy's own policy sends it, an even share of everything."""
        capacity = self.config.pools[pool].capacity
        return capacity.picks_backend and capacity.keep_long_apart and self.picks_followed(pool) is not False


def aimd_usage(usages: list[float], picks_backend: bool) -> float:
    """The KV usage the AIMD factor follows. The hottest engine's, unless the sidecar places
    requests itself: it then fits each on one engine's free room, and packs long prompts on
    purpose (one engine full of them is no sign that the pool is), so the pool's mean does, and
    the other engines stay busy with the work that waits."""
    if not usages:
        return 0.0
    return sum(usages) / len(usages) if picks_backend else max(usages)
