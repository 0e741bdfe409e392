"""The simulated vLLM engine behind `extproc sim` (sim.py serves it over HTTP): its scheduler, its
timing model and its KV cache, without GPUs.

Scheduling, as vLLM v1's `Scheduler.schedule` (vllm/v1/core/sched/scheduler.py) does it. Each
step has a budget of `max_num_batched_tokens` (2048: vLLM's default for its API server on GPUs
under 70 GiB and on A100s, `EngineArgs.get_batch_defaults`). Running sequences come first: a
decode takes one token, a prompt still being prefilled takes what is left of it up to the rest
of the budget (chunked prefill, on by default in v1), and no more than
`long_prefill_token_threshold` when one is set and the engine holds more than that one request
(vLLM's `--long-prefill-token-threshold`, off by default; its adaptive variant is not modelled):
a long prompt's chunks then leave room in each step for the requests behind it. Then, when
nothing was preempted in the step, waiting sequences join while there is budget and a free slot
(`max_num_seqs`).
`scheduling_policy=fcfs` (the default) keeps arrival order; `priority` orders the line by the
request body's `priority`, then arrival (lower first, `Request.__lt__`).

Timing model. A step takes `prefill_s_per_token` per prompt token in it plus one forward pass,
`decode_s_per_token * (1 + decode_contention * (sequences - 1))`; all durations are multiplied
by `time_scale`. With the defaults a 500-token ticket with 64 output tokens takes about 0.41 s
alone, a 16k-token one about 3.2 s (8x), the seed's figures.

KV cache. `kv_tokens` of capacity (`num_gpu_blocks * block_size`), allocated in blocks as
tokens are computed, not reserved for the whole answer (`KVCacheManager.allocate_slots`).
`on_kv_exhausted=queue` is vLLM: a waiting request joins only when its whole prompt fits
(`scheduler_reserve_full_isl`); a running one that needs a block when none is free preempts
another (fcfs: the last to join; priority: the largest (priority, arrival), maybe itself),
which frees its blocks and goes back to the front of the line to recompute its prompt and
what it generated (`Scheduler._preempt_request`). A waiting request never preempts a running
one, whatever its priority (as in vLLM). `crash` checks nothing, like an engine whose memory
settings are too optimistic: when the cache overflows every in-flight request fails
(connections reset), `/health` and `/metrics` answer 503, new requests get 503, and the engine
is back after `recovery_s` (scaled).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .sim_metrics import EngineHistograms

log = logging.getLogger("extproc.sim")


@dataclass
class SimParams:
    model: str = "deepseek-sim"
    kv_tokens: int = 65536
    block_size: int = 128  # vLLM's on the CPU, where the simulator is held to it (16 on CUDA GPUs)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    # vLLM's --long-prefill-token-threshold: a prompt's chunk in one step is at most this many
    # tokens, unless it is the engine's only request (0: no cap, vLLM's default)
    long_prefill_token_threshold: int = 0
    max_model_len: int = 32768
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    prefill_s_per_token: float = 0.00018
    decode_s_per_token: float = 0.005
    decode_contention: float = 0.04
    default_output_tokens: int = 64
    on_kv_exhausted: Literal["queue", "crash"] = "queue"
    recovery_s: float = 90.0
    time_scale: float = 1.0
    max_num_queued_reqs: int | None = None  # vLLM's --max-num-queued-reqs: a full line answers 503
    api_keys: tuple[str, ...] = ()  # vLLM's --api-key: the API's routes answer 401 without one of them


@dataclass
class Faults:
    error_rate: float = 0.0
    added_latency_s: float = 0.0
    paused: bool = False


def step_seconds(p: SimParams, prefill_tokens: int, sequences: int) -> float:
    """Duration of one engine step: the prefill chunks in it, and one forward pass over the
    `sequences` that take part (decodes, and prompts whose last chunk samples a first token)."""
    decode = p.decode_s_per_token * (1 + p.decode_contention * max(0, sequences - 1))
    return (prefill_tokens * p.prefill_s_per_token + decode) * p.time_scale


def solo_latency_s(p: SimParams, prompt_tokens: int, output_tokens: int) -> float:
    """End-to-end time of a request running alone on the engine (prefill in chunks of
    `max_num_batched_tokens`, then one step per further token)."""
    chunks = max(1, math.ceil(prompt_tokens / p.max_num_batched_tokens))
    return chunks * step_seconds(p, 0, 1) + prompt_tokens * p.prefill_s_per_token * p.time_scale \
        + (output_tokens - 1) * step_seconds(p, 0, 1)


class EngineCrashed(Exception):
    """The engine died (KV cache overflow) while this request was in flight."""


class EngineDown(Exception):
    """The engine is recovering from a crash."""


class EngineBusy(Exception):
    """The waiting line holds `max_num_queued_reqs` already (vLLM answers 503)."""


@dataclass(eq=False)
class Sequence:
    prompt_tokens: int
    output_tokens: int
    info: dict[str, Any]
    streamed: bool = True  # a non-streamed one hears only of its end (one wake-up, not one per token)
    priority: int = 0  # lower first (the request body's `priority`, vLLM's priority policy)
    arrived: float = 0.0  # engine clock (unscaled seconds)
    number: int = 0  # arrival order, the tie-break
    generated: int = 0
    computed: int = 0  # tokens whose KV is computed (and held)
    kv_held: int = 0  # tokens of KV allocated, in whole blocks
    last_token_at: float | None = None
    scheduled_at: float | None = None  # engine clock of its first scheduling: its prefill starts
    first_token_at: float | None = None
    finished_at: float | None = None
    beside_prefill_s: float = 0.0  # engine time of its steps that also prefilled another request's prompt...
    beside_long_prefill_s: float = 0.0  # ...and of those where that prompt was a long one
    preemptions: int = 0
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def prefill_left(self) -> int:
        """Tokens to compute before the next token can be sampled: the prompt (in chunks), after
        a preemption also what was generated (vLLM recomputes it), while decoding the one token
        sampled last."""
        return max(0, self.prompt_tokens + self.generated - self.computed)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_tokens or self.prefill_left > 1

    def timings(self) -> dict[str, float]:
        """Where a finished request's time went on the engine, in unscaled seconds: waiting in the
        engine's line (arrival to first scheduling), its prefill (to the first token), its decode
        (to the last), and the part of its steps shared with another request's prefill (of any
        prompt, and of a long one)."""
        arrived = self.arrived
        scheduled = self.scheduled_at if self.scheduled_at is not None else arrived
        first = self.first_token_at if self.first_token_at is not None else scheduled
        finished = self.finished_at if self.finished_at is not None else first
        return {"engine_queue_s": scheduled - arrived, "prefill_s": first - scheduled, "decode_s": finished - first,
                "beside_prefill_s": self.beside_prefill_s, "beside_long_prefill_s": self.beside_long_prefill_s}

    @property
    def order(self) -> tuple[int, float, int]:
        return (self.priority, self.arrived, self.number)

    def __lt__(self, other: Sequence) -> bool:  # the priority policy's heap
        return self.order < other.order


@dataclass
class Step:
    """What one engine step runs: tokens per sequence, and what it preempted."""

    work: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for seq, n in self.work if seq.prefilling)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.work)


class SimEngine:
    """vLLM v1's scheduler, on a timing model.

    Each step has a budget of `max_num_batched_tokens`. Running sequences come first, in order:
    a decode takes one token, a prompt still being prefilled takes the rest of it up to what is
    left of the budget (chunked prefill). Then, if nothing was preempted, waiting sequences join
    while there is budget, a free sequence slot and (queue mode) KV blocks for their chunk.
    KV blocks are allocated as tokens are computed (not reserved for the whole answer); a
    running sequence that needs a block when none is free preempts another: under `fcfs` the
    last one to join, under `priority` the one with the largest (priority, arrival), which may
    be itself. A preempted sequence frees its blocks and goes back to the front of the line, to
    recompute its prompt and what it generated. In `crash` mode nothing is checked: memory
    settings that are too optimistic, and the engine dies when its KV cache overflows.
    """

    def __init__(self, params: SimParams, registry: CollectorRegistry | None = None,
                 clock=time.monotonic):
        self.p = params
        self.clock = clock
        self.faults = Faults()
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []  # fcfs: in order; priority: a heap on Sequence.order
        self.kv_used = 0
        self.crashes = 0
        self.preemptions = 0
        self.down_until: float | None = None
        self.started: deque[dict[str, Any]] = deque(maxlen=10000)
        self.completed = 0
        self.max_running_seen = 0
        self.max_step_tokens_seen = 0
        self.histograms = EngineHistograms(registry or CollectorRegistry(), params.model)
        # vLLM refuses to start when a whole max_model_len sequence cannot fit in its KV cache;
        # in queue mode the simulator serves the context that fits (crash mode checks nothing)
        self.max_model_len = params.max_model_len if params.on_kv_exhausted == "crash" \
            else min(params.max_model_len, params.kv_tokens)
        self._numbers = itertools.count()
        self._work = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._task: asyncio.Task | None = None

    def now(self) -> float:
        """The engine's clock in unscaled seconds (what its histograms count)."""
        return self.clock() / self.p.time_scale

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def healthy(self) -> bool:
        """Whether the engine is up (a finished recovery is noticed here)."""
        if self.down_until is not None and self.clock() >= self.down_until:
            self.down_until = None
            log.warning("engine recovered")
        return self.down_until is None

    def set_paused(self, paused: bool) -> None:
        self.faults.paused = paused
        (self._unpaused.clear if paused else self._unpaused.set)()

    def submit(self, prompt_tokens: int, output_tokens: int, info: dict[str, Any], streamed: bool = True,
               priority: int = 0) -> Sequence:
        if not self.healthy():
            raise EngineDown()
        if self.p.max_num_queued_reqs is not None and len(self.waiting) >= self.p.max_num_queued_reqs:
            self.histograms.rejected_requests.inc()
            raise EngineBusy()
        seq = Sequence(prompt_tokens, output_tokens, info, streamed, priority, self.now(), next(self._numbers))
        self._enqueue(seq)
        self._work.set()
        return seq

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        if self.p.scheduling_policy == "priority":
            heapq.heappush(self.waiting, seq)
        elif front:
            self.waiting.insert(0, seq)
        else:
            self.waiting.append(seq)

    def _waiting_pop(self) -> Sequence:
        if self.p.scheduling_policy == "priority":
            return heapq.heappop(self.waiting)
        return self.waiting.pop(0)

    def cancel(self, seq: Sequence) -> None:
        """The client went away, or the request ended: free what the sequence holds."""
        if seq in self.running:
            self.running.remove(seq)
            self._free(seq)
            self.histograms.finished_abort.inc()
        else:
            kept = [w for w in self.waiting if w is not seq]
            if len(kept) != len(self.waiting):
                self.waiting[:] = kept
                self.histograms.finished_abort.inc()
                if self.p.scheduling_policy == "priority":
                    heapq.heapify(self.waiting)
        self._work.set()

    def _free(self, seq: Sequence) -> None:
        self.kv_used -= seq.kv_held
        seq.kv_held = 0

    def _blocks_for(self, tokens: int) -> int:
        b = self.p.block_size
        return -(-tokens // b) * b

    def _allocate(self, seq: Sequence, new_tokens: int, room_for: int = 0) -> bool:
        """KV blocks for the sequence's computed tokens plus `new_tokens`; False when they do
        not fit (queue mode), or when fewer than `room_for` tokens' blocks are free for it (a
        waiting request needs room for its whole prompt: vLLM's `scheduler_reserve_full_isl`).
        Crash mode allocates regardless."""
        need = self._blocks_for(seq.computed + new_tokens) - seq.kv_held
        if self.p.on_kv_exhausted == "queue":
            free = self.p.kv_tokens - self.kv_used
            if need > free or self._blocks_for(room_for) - seq.kv_held > free:
                return False
        if need > 0:
            seq.kv_held += need
            self.kv_used += need
        return True

    def _preempt(self, seq: Sequence, step: Step) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.histograms.preemptions.inc()
        step.preempted.append(seq)
        self._enqueue(seq, front=True)

    def _victim(self) -> Sequence:
        if self.p.scheduling_policy == "priority":
            return max(self.running, key=lambda s: s.order)
        return self.running[-1]

    def crash(self) -> None:
        self.crashes += 1
        self.down_until = self.clock() + self.p.recovery_s * self.p.time_scale
        log.error(
            "simulated GPU OOM: KV cache %d/%d tokens; %d requests fail; down for %.1fs",
            self.kv_used, self.p.kv_tokens, len(self.running) + len(self.waiting),
            self.p.recovery_s * self.p.time_scale,
        )
        for seq in [*self.running, *self.waiting]:
            seq.tokens.put_nowait(EngineCrashed())
        self.running.clear()
        self.waiting.clear()
        self.kv_used = 0

    def schedule(self) -> Step:
        """Choose the work of the next step (vLLM v1's `Scheduler.schedule`)."""
        step = Step()
        budget = self.p.max_num_batched_tokens
        chunk_cap = self._chunk_cap()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.prefill_left, chunk_cap, budget)
            while not self._allocate(seq, n):
                victim = self._victim()
                if self.running.index(victim) < i:  # already in this step: its tokens go back
                    i -= 1
                    budget += next(m for s, m in step.work if s is victim)
                    step.work = [(s, m) for s, m in step.work if s is not victim]
                self._preempt(victim, step)
                if victim is seq:
                    break
            else:
                step.work.append((seq, n))
                budget -= n
                i += 1
                continue
            if self.p.scheduling_policy == "fcfs":
                break  # vLLM v1: the running phase ends when the request preempted itself
        if not step.preempted:
            now = self.now()
            while self.waiting and budget > 0 and len(self.running) < self.p.max_num_seqs:
                seq = self.waiting[0]  # the first in line (a heap's first under priority)
                n = min(seq.prefill_left, chunk_cap, budget)
                if not self._allocate(seq, n, room_for=min(seq.prompt_tokens + seq.generated, self.max_model_len)):
                    break  # the line waits for blocks (vLLM does not preempt for a waiting request)
                self._waiting_pop()
                self.running.append(seq)
                step.work.append((seq, n))
                budget -= n
                if seq.preemptions == 0:  # its first scheduling (a preempted one comes back later)
                    seq.scheduled_at = now
                    self.histograms.queue.observe(now - seq.arrived)
                    self.started.append({**seq.info, "prompt_tokens": seq.prompt_tokens, "t": self.clock()})
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        self.max_step_tokens_seen = max(self.max_step_tokens_seen, step.tokens)
        return step

    def _chunk_cap(self) -> int | float:
        """The most tokens of one prompt in the next step: `long_prefill_token_threshold`, not
        applied to an engine's only request (there is nobody for it to starve; vLLM 0.32's
        `Scheduler.schedule`). Decodes (one token) are below any cap."""
        cap = self.p.long_prefill_token_threshold
        return cap if cap > 0 and len(self.running) + len(self.waiting) > 1 else math.inf

    def finish(self, step: Step) -> None:
        """The step's forward pass is done: computed tokens, sampled tokens, finished requests."""
        now = self.now()
        prefills = {seq for seq, _ in step.work if seq.prefilling}
        # a long prompt: one whose prefill fills whole steps (longer than a step's token budget)
        long_prefills = {seq for seq in prefills if seq.prompt_tokens > self.p.max_num_batched_tokens}
        seconds = self.step_duration(step) / self.p.time_scale
        for seq, n in step.work:
            if seq not in self.running:
                continue  # cancelled during the step
            if prefills - {seq}:
                seq.beside_prefill_s += seconds
            if long_prefills - {seq}:
                seq.beside_long_prefill_s += seconds
            seq.computed += n
            if seq.prefill_left > 0:
                continue  # a chunk of a prompt: no token yet
            seq.generated += 1
            self.histograms.generation_tokens.inc()
            if seq.last_token_at is None:
                self.histograms.prompt_tokens.inc(seq.prompt_tokens)
                seq.first_token_at = now
                self.histograms.ttft.observe(now - seq.arrived)
                self.histograms.prefill.observe(now - (seq.scheduled_at if seq.scheduled_at is not None else now))
            else:
                self.histograms.itl.observe(now - seq.last_token_at)
            seq.last_token_at = now
            if seq.streamed:
                seq.tokens.put_nowait(seq.generated)
            if seq.generated >= seq.output_tokens:
                seq.finished_at = now
                self.running.remove(seq)
                self._free(seq)
                seq.tokens.put_nowait(None)
                self.completed += 1
                self.histograms.finished_length.inc()
                self.histograms.e2e.observe(now - seq.arrived)
                self.histograms.decode.observe(now - (seq.first_token_at or now))

    def step_duration(self, step: Step) -> float:
        return step_seconds(self.p, step.prefill_tokens, len(step.work))

    async def _loop(self) -> None:
        p = self.p
        due = time.monotonic()  # when the current step ends, on the engine's own schedule
        while True:
            await self._unpaused.wait()
            if not self.running and not self.waiting:
                self._work.clear()
                await self._work.wait()
                due = time.monotonic()
                continue
            step = self.schedule()
            if p.on_kv_exhausted == "crash" and self.kv_used > p.kv_tokens:
                self.crash()
                continue
            if not step.work:  # nothing fits yet (queue mode): wait for a change
                self._work.clear()
                await self._work.wait()
                continue
            # Steps follow a schedule rather than sleeping each step's length after the work of
            # the last: the loop's own overhead and a busy CPU would otherwise stretch every
            # step, and the engine would run slower than its timing model says.
            due = max(due, time.monotonic() - step_seconds(p, 0, 1)) + self.step_duration(step)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            await self._unpaused.wait()
            if self.down_until is not None:
                continue  # crashed by fault injection during the step
            self.finish(step)

    def collect(self) -> list:
        """The engine's gauges, labelled as a real server labels them (model_name, engine)."""
        labels = {"engine": "0", "model_name": self.p.model}

        def gauge(name: str, doc: str, value: float, **extra: str) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=[*labels, *extra])
            family.add_metric([*labels.values(), *extra.values()], value)
            return family

        usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                      min(1.0, self.kv_used / self.p.kv_tokens))
        running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(self.running))
        waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(self.waiting))
        # "deferred" is vLLM's for requests waiting on something else than room (remote KV, a
        # grammar): never here
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                      "Number of requests waiting, by the reason they wait.", labels=[*labels, "reason"])
        by_reason.add_metric([*labels.values(), "capacity"], len(self.waiting))
        by_reason.add_metric([*labels.values(), "deferred"], 0)
        config = {"engine": "0", **self.cache_config()}  # labelled by engine, not by model (as vLLM does)
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(config))
        cache.add_metric(list(config.values()), 1.0)
        crashes = CounterMetricFamily("vllm_sim:oom_crashes", "Simulated GPU OOM crashes", labels=["model_name"])
        crashes.add_metric([self.p.model], self.crashes)
        return [usage, running, waiting, by_reason, cache, crashes]

    def cache_config(self) -> dict[str, str]:
        """vLLM's `cache_config_info` labels, those the simulator has a value for."""
        blocks = self.p.kv_tokens // self.p.block_size
        return {
            "block_size": str(self.p.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "False",  # the simulator caches no prefix (real vLLM: True by default)
            "kv_cache_max_concurrency": str(blocks * self.p.block_size / self.max_model_len),
            "kv_cache_size_tokens": str(blocks * self.p.block_size),
            "num_gpu_blocks": str(blocks),
            "num_gpu_blocks_override": "None",
        }
