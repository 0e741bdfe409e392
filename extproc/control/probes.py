"""Load probes: vLLM's /metrics of each backend, and NVML for GPUs on this host.

Probes never raise into the server. What they cannot read, they report as saturated: a backend
whose metrics are missing, stale, unparsable, NaN, or slow to answer counts as full, never idle.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ..core.capacity import BackendReading

log = logging.getLogger("extproc.probes")

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # before vLLM renamed it
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class VllmSample:
    kv_usage: float
    running: int
    waiting: int
    kv_capacity_tokens: int | None


def _cache_tokens(labels: dict[str, str]) -> int:
    """One engine's KV capacity in tokens: `kv_cache_size_tokens` where the server says it (newer
    vLLM; exact, also for hybrid models whose blocks only approximate it), else
    `num_gpu_blocks x block_size`; 0 when neither reads as a number."""
    tokens = labels.get("kv_cache_size_tokens", "")
    if tokens.isdigit():
        return int(tokens)
    blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    return int(blocks) * int(size) if blocks.isdigit() and size.isdigit() else 0


def parse_vllm_metrics(text: str) -> VllmSample:
    """Parse vLLM's Prometheus text. Raises ValueError when KV usage is missing or not a number."""
    values: dict[str, list[float]] = {}
    capacity = 0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == CACHE_INFO:
                    capacity += _cache_tokens(sample.labels)
                else:
                    values.setdefault(sample.name, []).append(sample.value)
    except Exception as error:  # the parser raises assorted errors on garbage
        raise ValueError(f"unparsable metrics: {error}") from None
    usage = values.get(KV_USAGE) or values.get(KV_USAGE_OLD)
    if not usage:
        raise ValueError(f"neither {KV_USAGE} nor {KV_USAGE_OLD} is exported")
    if any(math.isnan(u) or math.isinf(u) for u in usage):
        raise ValueError("KV usage is NaN")
    count = lambda name: int(sum(v for v in values.get(name, []) if math.isfinite(v)))  # noqa: E731
    return VllmSample(
        kv_usage=min(1.0, max(0.0, max(usage))),
        running=count(RUNNING),
        waiting=count(WAITING),
        kv_capacity_tokens=capacity or None,
    )


class VllmMetricsProbe:
    """Polls one backend's /metrics; `reading(now)` says what admission may assume."""

    def __init__(self, base_url: str, timeout_s: float, stale_after_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.base_url = base_url  # as the pool lists it (or its discovery found it)
        self.url = base_url.rstrip("/") + "/metrics"
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.sample: VllmSample | None = None
        self.sampled_at: float | None = None
        self.capacity: int | None = None  # last known; capacity does not change while running
        self.failure: str | None = "not polled yet"

    async def poll(self, session: aiohttp.ClientSession) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with session.get(self.url, timeout=timeout) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                text = await response.text()
            sample = parse_vllm_metrics(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, UnicodeDecodeError) as error:
            self._failed(str(error) or type(error).__name__)
            return
        self.sample, self.sampled_at, self.failure = sample, self.clock(), None
        if sample.kv_capacity_tokens:
            self.capacity = sample.kv_capacity_tokens

    def _failed(self, why: str) -> None:
        if self.failure is None:
            log.warning("backend %s reads as saturated: %s", self.url, why)
        self.failure = why

    @property
    def up(self) -> bool:
        """The last scrape succeeded (answered 200 with usable metrics)."""
        return self.failure is None

    def serving(self, now: float) -> bool:
        """Read well within the last `stale_after_s`: an engine that counts in the pool's slots
        (one failed scrape does not take it out; a stopped or crashed engine is out after that)."""
        return self.age_s(now) <= self.stale_after_s

    def age_s(self, now: float) -> float:
        """Seconds since the last good scrape; infinite before the first."""
        return math.inf if self.sampled_at is None else max(0.0, now - self.sampled_at)

    def reading(self, now: float) -> BackendReading:
        stale = self.sampled_at is None or now - self.sampled_at > self.stale_after_s
        if self.failure is not None or stale or self.sample is None:
            return BackendReading(1.0, self.capacity, saturated=True)
        return BackendReading(self.sample.kv_usage, self.capacity, saturated=False)


@dataclass(frozen=True)
class GpuReading:
    index: int
    free_bytes: int
    total_bytes: int
    sm_utilization: float  # 0..1
    memory_utilization: float  # 0..1 (memory bandwidth busy)


class NvmlProbe:
    """GPU memory and utilisation through NVML (`nvidia-ml-py`, imported as pynvml).

    No library, no driver or no GPU: the probe disables itself once, says so, and `read`
    returns None. A read that raises returns [] after the probe is enabled: unknown, which
    the controller treats as no free memory.
    """

    def __init__(self, nvml: Any = None):
        self.enabled = False
        self.reason = ""
        try:
            if nvml is None:
                import pynvml as nvml  # noqa: PLC0415
            nvml.nvmlInit()
            self.count = nvml.nvmlDeviceGetCount()
            if self.count < 1:
                raise RuntimeError("no GPU")
        except Exception as error:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.reason = f"{type(error).__name__}: {error}"
            log.warning("NVML probe disabled (%s); admission uses vLLM metrics and config only", self.reason)
            return
        self.nvml = nvml
        self.enabled = True
        log.info("NVML probe enabled: %d GPU(s)", self.count)

    def read(self) -> list[GpuReading] | None:
        if not self.enabled:
            return None
        nvml = self.nvml
        readings = []
        try:
            for index in range(self.count):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                readings.append(GpuReading(index, int(memory.free), int(memory.total), rates.gpu / 100, rates.memory / 100))
        except Exception as error:
            log.warning("NVML read failed (%s: %s); GPUs read as full", type(error).__name__, error)
            return []
        return readings
