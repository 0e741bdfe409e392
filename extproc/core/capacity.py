"""Capacity math, pure: what a request costs, how much a pool may hold, and how the limit adapts.

Theory of operation
-------------------
A request costs its prompt tokens (estimated, see tokens.py) plus the tokens it may generate
(`max_tokens`, or a configured default, which the sidecar then writes into the body so the
engine stops there), for each prompt of a batch and each sequence sampled (`n`, `best_of`): the
most KV cache it can ever hold. A pool's token budget is

    budget = KV capacity of its backends x safety_factor (0.85) x AIMD factor (0.1 .. 1)

and a request is admitted while `inflight cost + its cost <= budget` and the in-flight count stays
under `min(max_inflight, backends x max_num_seqs, NVML dynamic batch)`. The KV capacity comes
from each backend's `vllm:cache_config_info` (num_gpu_blocks x block_size), or from config.

Two signals are blended. The sidecar's own ledger of admitted cost moves the instant a request is
admitted; vLLM's `vllm:kv_cache_usage_perc` moves seconds later but also sees load the sidecar
did not admit. The ledger is checked against `budget - max(0, telemetry_used - ledger)`: whichever
says more of the cache is in use wins. A backend whose metrics are missing, stale, unparsable or
NaN reads as full (usage 1.0), never idle.

The AIMD factor: above `high` KV usage it is multiplied by `decrease`, below `low` it grows by
`increase_step`, once per `interval_s` at most, between `min_factor` and 1. Between the marks it
holds still, so the loop neither oscillates nor starves.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .admission import PoolLimits
from .outcomes import context_length_exceeded


def request_cost(prompt_tokens: int, max_tokens: int | None, default_max_tokens: int, prompts: int = 1,
                 samples: int = 1) -> int:
    """The most KV cache a request can hold: its `prompts` (`prompt_tokens` together), each
    with the tokens it may generate (`max_tokens`, or the default the sidecar writes into a body
    that sets none), once for each sequence sampled (`n`, `best_of`). The prompt is counted
    again for every sequence: the engine shares it between them only through prefix caching,
    which may be off, and never its last, partly filled block."""
    return samples * (prompt_tokens + prompts * (max_tokens if max_tokens is not None else default_max_tokens))


def usable_context(max_model_len: int, reserve: float) -> int:
    return int(max_model_len * (1 - reserve))


def check_context(prompt_tokens: int, max_tokens: int | None, default_max_tokens: int,
                  max_model_len: int, reserve: float) -> None:
    """Reject at once what could never run; raises a 400 `context_length_exceeded`.
    `prompt_tokens`: the longest prompt's (each of a batch runs in a context of its own)."""
    limit = usable_context(max_model_len, reserve)
    cost = request_cost(prompt_tokens, max_tokens, default_max_tokens)
    if cost > limit:
        raise context_length_exceeded(limit, cost, prompt_tokens)


@dataclass(frozen=True)
class BackendReading:
    """One backend's telemetry as the admission math sees it."""

    kv_usage: float  # 0..1; 1.0 when saturated or unknown
    kv_capacity_tokens: int | None  # None when never known
    saturated: bool  # missing, stale, unparsable or NaN metrics


def pool_limits(
    readings: Iterable[BackendReading],
    *,
    static_capacity_per_backend: int | None,
    backends: int,
    safety_factor: float,
    aimd_factor: float,
    ledger_tokens: int,
    max_inflight: int,
    max_num_seqs: int,
    dynamic_batch: int | None = None,
) -> PoolLimits:
    """The count limit and the token budget (None: no capacity known, the count limit only)
    that the engines' readings allow; the load control adds the latency cap and the placement
    rules (control/load_control.py)."""
    readings = list(readings)
    capacity = 0
    telemetry_used = 0.0
    known = False
    for reading in readings:
        cap = reading.kv_capacity_tokens or static_capacity_per_backend
        if cap is None:
            continue
        known = True
        if reading.saturated:
            # down, or its metrics stale: no room there, and none taken from the others (counted
            # full to its whole cache, each such engine cut the live ones' budget by its cache
            # beyond the safety factor). Where none answers, the budget is 0.
            continue
        capacity += cap
        telemetry_used += reading.kv_usage * cap
    if not readings and static_capacity_per_backend is not None:
        known, capacity = True, static_capacity_per_backend * backends
    count = min(max_inflight, max(1, backends) * max_num_seqs)
    if dynamic_batch is not None:
        count = min(count, max(1, dynamic_batch))
    if not known:
        return PoolLimits(count)
    budget = capacity * safety_factor * aimd_factor
    effective = budget - max(0.0, telemetry_used - ledger_tokens)
    return PoolLimits(count, max(0, int(effective)))


@dataclass(frozen=True)
class BackendLoad:
    """One backend as the sidecar's placement sees it."""

    endpoint: str  # IP:PORT, as Envoy's override_host takes it
    capacity_tokens: int | None  # its KV cache (None: never known)
    used_tokens: float  # what this replica placed there, plus what others did as of the last poll
    running: int  # requests this replica placed there that still run
    saturated: bool  # metrics missing, stale or unparsable: may be down
    long_running: int = 0  # of those, long ones (their prompts' prefill fills whole engine steps)
    bound_running: int = 0  # of those, latency-bound ones (their class has a latency target)
    bound_lately: bool = False  # a latency-bound request started there within the pool's `bound_lately_s`

    @property
    def serving(self) -> bool:
        """Whether it serves latency-bound requests: runs one, or started one lately (an engine
        whose loans just finished is where the next ones go; a long prompt or a surge of the
        other classes' prompts taken there in between would meet them)."""
        return self.bound_running > 0 or self.bound_lately


@dataclass(frozen=True)
class Placing:
    """What placement knows of the request it places."""

    cost: int  # KV tokens it may hold
    long: bool = False  # a long prompt: its prefill takes whole engine steps, for seconds
    bound: bool = False  # its class has a latency target


def backend_order(loads: Iterable[BackendLoad], request: Placing, max_num_seqs: int,
                  keep_long_apart: bool = True, lane: str | None = None,
                  spent: frozenset[str] = frozenset()) -> list[str]:
    """The backends in the order a request should try them: those whose metrics answer first;
    then those where it fits in the KV cache; then, to keep prefill away from the latency-bound
    requests (each chunk of a prompt lengthens every step of every request on its engine: a
    loan beside a 12k-token prefill waits seconds), a latency-bound request prefers engines
    running no long prompt, and a long prompt engines already running long ones, then those
    serving no latency-bound request (`BackendLoad.serving`), then those running the fewest; a
    request of neither kind prefers an engine with a free sequence slot (a full one makes it
    wait in vLLM's own line, holding no cache), then one not `spent` (serving latency-bound
    requests, its turn on the spill pace has not come: core/spill.py), then one serving none,
    then the one running the fewest latency-bound requests; last, the least loaded (most free KV
    tokens). A latency-bound request avoids `lane` too, the engine long prompts take
    (core/long_lane.py). Placing each request on the least loaded backend it fits is
    what makes PoolLine's `spread` rule safe: average load + cost <= per-backend budget implies
    least load + cost <= it; the long lane (PoolLine's long share, one backend's part) lets the
    long prompts share one engine."""
    def key(load: BackendLoad) -> tuple:
        free = (load.capacity_tokens or 0) - load.used_tokens
        fits = load.capacity_tokens is None or request.cost <= free
        full = load.running >= max_num_seqs
        if not keep_long_apart:
            order = (full, 0, 0, 0)
        elif request.long:
            order = (load.long_running == 0, load.serving, load.bound_running, full)
        elif request.bound:
            order = (load.long_running, load.endpoint == lane, full, 0)
        else:
            order = (full, load.endpoint in spent, load.serving, load.bound_running)
        return load.saturated, not fits, order, -free

    return [load.endpoint for load in sorted(loads, key=key)]


def dynamic_batch(free_bytes: int, avg_request_bytes: float, safety_factor: float = 0.85, cap: int = 32) -> int:
    """The seed's formula: int(free_mem x 0.85 / avg_request_mem), capped (32)."""
    if avg_request_bytes <= 0:
        return cap
    return max(0, min(cap, int(free_bytes * safety_factor / avg_request_bytes)))


@dataclass
class Aimd:
    """Additive-increase, multiplicative-decrease factor on a pool's token budget."""

    high: float = 0.85
    low: float = 0.6
    decrease: float = 0.7
    increase_step: float = 0.05
    min_factor: float = 0.1
    interval_s: float = 1.0
    factor: float = 1.0
    _last_change: float = -math.inf

    def update(self, kv_usage: float, now: float) -> float:
        if now - self._last_change < self.interval_s:
            return self.factor
        if kv_usage > self.high:
            new = max(self.min_factor, self.factor * self.decrease)
        elif kv_usage < self.low:
            new = min(1.0, self.factor + self.increase_step)
        else:
            return self.factor
        if new != self.factor:
            self.factor = new
            self._last_change = now
        return self.factor


def latency_pressure(samples: deque[tuple[float, float]], now: float, window_s: float, min_samples: int,
                     quantile: float) -> float | None:
    """The `quantile` of the (when, latency / target) `samples` of the last `window_s` (older ones
    are dropped), None under `min_samples`: how far the latency-bound classes are from their
    target, as the latency cap and the prefill pace read it."""
    while samples and samples[0][0] < now - window_s:
        samples.popleft()
    if len(samples) < min_samples:
        return None
    ratios = sorted(ratio for _, ratio in samples)
    return ratios[min(len(ratios) - 1, int(quantile * len(ratios)))]


class LatencyLimiter:
    """Keeps a pool's latency-bound classes inside their target when the engines saturate.

    KV capacity says how much the engines can *hold*; it says nothing of how fast they answer
    once full: every request in a batch shares each step, and each newly admitted prompt's
    prefill chunks lengthen the steps of every running one. So the requests of classes *without*
    a latency target run only while fewer than a cap of them are in flight (the latency-bound
    ones may use the rest of the pool: the headroom is theirs), and the cap follows how long the
    latency-bound requests take from reaching the sidecar to their first byte (their whole
    answer, when not streamed; queue wait included: the target is end to end) relative to their
    class's `latency_target_s`:

    - every `interval_s`, over the last `window_s` of samples (at least `min_samples`, so one
      slow request is not a trend), the `quantile` (0.9) of (latency / target) is the pressure.
      Not the SLO's 0.99: the slowest percent are the requests that met a long prefill on their
      engine, a few tenths of a second that no cap removes; the 90th percentile follows the cap
      and leaves that margin under the target;
    - above `high` (0.6), the cap is cut in proportion to the overshoot (x high / pressure:
      latency grows about linearly with concurrency), by at least `decrease` (x0.9) and at most
      `max_cut` (halved) per interval;
    - below `low` (0.4) it grows by an eighth of the pool's count limit (at least one), and is
      lifted once it reaches that limit; after a whole window without samples it grows the same
      way, and at every interval while no latency-bound request answers at all (nobody to
      protect);
    - it grows only while it binds (the classes it holds back use it all, within half a step:
      `in_use`); while they use less, it follows what they use, a step above (never below the
      floor): room left unused is no evidence the engines could take it, and a cap lifted in a
      light spell would let a burst fill every slot at once, the latency-bound requests paying
      until the cap caught up. A burst therefore grows it a step an interval, as far as the
      latency allows;
    - in between it holds: the band between the marks keeps it from oscillating;
    - after each change the samples taken under the old limit are dropped and the next decision
      waits for `min_samples` new ones (a window full of the old limit's latencies would
      otherwise push it on past the point where the latency is already back in the band);
    - it never goes above the pool's count limit less `headroom_share` of it (0 here: none; the
      shipped configuration's `latency_headroom_share` is 0.25, a quarter of the slots that only
      the latency-bound classes may take, so that one that arrives when the engines are full of
      the others still finds a slot at once);
    - it never goes below `floor_share` of the pool's count limit, and it counts only the
      classes it holds back: however slow the latency-bound requests, the cap itself never
      shuts those classes out of a free slot (a latency that does not come from load, a long
      prompt alone, cannot shut the pool down). The floor bounds the cap; it reserves no
      slot: the latency-bound classes may take every slot, and the line serves them first, so
      while they alone keep the pool full the others wait, until their `max_wait_s` runs out,
      unless aging (`queue.promote_after_s`, off by default) bounds the wait
      (tests/unit/test_latency_limiter.py).

    Pure: samples and time come in, a limit comes out (None: no cap)."""

    def __init__(self, quantile: float = 0.9, high: float = 0.6, low: float = 0.4, decrease: float = 0.9,
                 max_cut: float = 0.5, floor_share: float = 0.25, headroom_share: float = 0.0, window_s: float = 10.0,
                 interval_s: float = 1.0, min_samples: int = 10):
        self.quantile = quantile
        self.high = high
        self.low = low
        self.decrease = decrease
        self.max_cut = max_cut
        self.floor_share = floor_share
        self.headroom_share = headroom_share
        self.window_s = window_s
        self.interval_s = interval_s
        self.min_samples = min_samples
        self.limit: int | None = None
        self._samples: deque[tuple[float, float]] = deque()  # (when, latency / target)
        self._last = -math.inf
        self._changed_at = -math.inf
        self._observed_at = -math.inf  # the last latency-bound request's sample

    def configure(self, window_s: float, interval_s: float, floor_share: float, headroom_share: float) -> LatencyLimiter:
        """Take new settings (at start, and on a reload), keeping the cap and the samples."""
        self.window_s, self.interval_s = window_s, interval_s
        self.floor_share, self.headroom_share = floor_share, headroom_share
        return self

    def observe(self, now: float, latency_s: float, target_s: float) -> None:
        self._samples.append((now, latency_s / target_s))
        self._observed_at = now

    def pressure(self, now: float) -> float | None:
        """The quantile of latency over target in the window (None: too few samples)."""
        return latency_pressure(self._samples, now, self.window_s, self.min_samples, self.quantile)

    def floor(self, ceiling: int) -> int:
        return max(1, math.ceil(self.floor_share * ceiling))

    def top(self, ceiling: int) -> int:
        """The most the classes without a target may ever hold: the pool less the headroom."""
        return max(self.floor(ceiling), ceiling - math.ceil(self.headroom_share * ceiling))

    def update(self, now: float, ceiling: int, in_use: int | None = None) -> int | None:
        """The concurrency limit for the next interval, at most `ceiling` (None: no limit).
        `in_use`: how many requests of the classes it holds back run now (None: not told, as
        if the cap bound them)."""
        if now - self._last < self.interval_s:
            return self.applied(ceiling)
        self._last = now
        pressure = self.pressure(now)
        top = self.top(ceiling)
        step = max(1, ceiling // 8)
        # (a floor raised since the limit was set, by a reload or by Envoy's placement turning: it binds now)
        current = top if self.limit is None else min(max(self.limit, self.floor(ceiling)), top)
        before = self.limit
        binding = in_use is None or in_use >= current - step // 2
        if pressure is not None and pressure > self.high:
            # the further over the mark, the deeper the cut (latency grows about linearly with
            # the concurrency), at least x decrease, at most halved in one step
            cut = max(self.max_cut, min(self.decrease, self.high / pressure))
            self.limit = min(top, max(self.floor(ceiling), int(current * cut)))
        elif not binding:
            # Unused room is no evidence the engines could take it: the cap follows what runs,
            # a step above, so a burst grows from there as the latency allows (a cap lifted
            # while the load was light would let a burst fill every slot at once, and the
            # latency-bound requests would pay for it until the cap caught up).
            self.limit = max(self.floor(ceiling), min(current, in_use + step))
            return self.applied(ceiling)  # (no request's latency changed: the samples stand)
        elif self.limit is not None and (
                (pressure is not None and pressure < self.low)
                or (pressure is None and now - self._changed_at >= self.window_s)  # a window without news
                or (in_use is not None and now - self._observed_at >= self.window_s)):  # nobody to protect
            grown = current + step
            self.limit = None if grown >= top and in_use is None else min(top, grown)
        if self.limit != before:
            # what was seen under the old limit says nothing of the new one: judge it afresh
            self._samples.clear()
            self._changed_at = now
        return self.applied(ceiling)

    def applied(self, ceiling: int) -> int | None:
        """The limit in force under the pool's count limit `ceiling` (which may have shrunk
        since the limit was set), as the last update left it."""
        top = self.top(ceiling)
        if self.limit is None or self.limit >= top:
            return None if top >= ceiling else top
        return max(self.limit, self.floor(ceiling))


@dataclass(frozen=True)
class VllmArg:
    flag: str
    value: str
    reason: str


def recommend_vllm_args(gpus: int, gpu_memory_gib: float | None, max_context: int = 16384,
                        reserve: float = 0.2) -> list[VllmArg]:
    """vLLM flags following the seed's hard limits, each with its reason."""
    if gpus < 1:
        raise ValueError("at least one GPU")
    seqs = min(4 * gpus, 32)
    args = [
        VllmArg("--max-num-seqs", str(seqs), f"min(4 x {gpus} GPUs, 32): bounds the batch so KV demand stays predictable"),
        VllmArg("--max-model-len", str(max_context),
                f"the longest ticket the service accepts; the sidecar admits at most {usable_context(max_context, reserve)} "
                f"tokens per request ({reserve:.0%} reserve)"),
        VllmArg("--gpu-memory-utilization", "0.85",
                "leave 15% of GPU memory as a safety margin against fragmentation and activation spikes"),
        VllmArg("--scheduling-policy", "priority", "let the engine favour what the gateway favours (x-llm-priority)"),
    ]
    if gpus > 1:
        args.append(VllmArg("--tensor-parallel-size", str(gpus), f"shard the model over the {gpus} GPUs of the host"))
    if gpu_memory_gib is not None and gpu_memory_gib < 40:
        args.append(VllmArg("--enable-chunked-prefill", "", "small GPUs: interleave long prefills with decodes"))
    return args


def long_lane_share(capacity, engines: int | None = None) -> float:
    """The share of a pool's token budget long requests may hold together: `long_share`, and
    never more than one backend's part. Envoy places requests by count, not by tokens, so every
    long request in flight could land on the same engine; that engine must hold them all. (One
    long request alone may take up to one backend's part, `PoolLimits.engines`: PoolLine.)
    `engines`: the engines whose room the budget counts (those that answer); when not told, the
    backends listed."""
    backends = len(capacity.backends) if engines is None else engines
    return min(capacity.long_share, 1 / backends) if backends else capacity.long_share
