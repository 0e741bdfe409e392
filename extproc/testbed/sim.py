"""`extproc sim`: a simulated vLLM server, so everything can be run and measured without GPUs.

It speaks the parts of vLLM's OpenAI-compatible API the sidecar fronts, exports vLLM's own
metric names, and fails the way the real engine fails:

Timing model. One engine loop runs steps like vLLM's scheduler. Each step first prefills the
sequences scheduled in it (`prefill_s_per_token` per prompt token), then decodes one token for
every running sequence; a decode step takes `decode_s_per_token * (1 + decode_contention *
(running - 1))`. All durations are multiplied by `time_scale`. With the defaults a 500-token
ticket with 64 output tokens takes about 0.41 s alone, a 16k-token one about 3.3 s (8x).

KV cache. `kv_tokens` of capacity (`num_gpu_blocks * block_size`); a running sequence holds
its prompt plus what it generated. `on_kv_exhausted=queue` schedules a sequence only when its
prompt plus `max_tokens` fit (vLLM-like: requests wait, latency grows). `crash` schedules up to
`max_num_seqs` regardless, like an engine whose memory settings are too optimistic: when the
cache overflows every in-flight request fails (connections reset), `/health` and `/metrics`
answer 503, new requests get 503, and the engine is back after `recovery_s` (scaled).

Fault injection (`POST /sim/faults`): `error_rate` (500s), `added_latency_s`, `paused` (the
engine loop stops, as if the process were stopped), `crash` (an OOM crash now). A request
carrying `x-sim-fault: MODEL` is answered 500 by the server of that model (tests choose exactly
which requests fail; other servers ignore it, so a copy sent elsewhere succeeds).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..tokens import estimate_prompt_tokens

log = logging.getLogger("extproc.sim")


@dataclass
class SimParams:
    model: str = "deepseek-sim"
    kv_tokens: int = 65536
    block_size: int = 16
    max_num_seqs: int = 32
    max_model_len: int = 32768
    prefill_s_per_token: float = 0.00018
    decode_s_per_token: float = 0.005
    decode_contention: float = 0.04
    default_output_tokens: int = 64
    on_kv_exhausted: Literal["queue", "crash"] = "queue"
    recovery_s: float = 90.0
    time_scale: float = 1.0


@dataclass
class Faults:
    error_rate: float = 0.0
    added_latency_s: float = 0.0
    paused: bool = False


def step_seconds(p: SimParams, prefill_tokens: int, running: int) -> float:
    """Duration of one engine step: prefill of newly scheduled prompts, then one decode."""
    decode = p.decode_s_per_token * (1 + p.decode_contention * max(0, running - 1))
    return (prefill_tokens * p.prefill_s_per_token + decode) * p.time_scale


def solo_latency_s(p: SimParams, prompt_tokens: int, output_tokens: int) -> float:
    """End-to-end time of a request running alone on the engine."""
    return step_seconds(p, prompt_tokens, 1) + (output_tokens - 1) * step_seconds(p, 0, 1)


class EngineCrashed(Exception):
    """The engine died (KV cache overflow) while this request was in flight."""


class EngineDown(Exception):
    """The engine is recovering from a crash."""


@dataclass(eq=False)
class Sequence:
    prompt_tokens: int
    output_tokens: int
    info: dict[str, Any]
    streamed: bool = True  # a non-streamed one hears only of its end (one wake-up, not one per token)
    generated: int = 0
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def kv_held(self) -> int:
        return self.prompt_tokens + self.generated


class SimEngine:
    def __init__(self, params: SimParams):
        self.p = params
        self.faults = Faults()
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.kv_used = 0
        self.crashes = 0
        self.down_until: float | None = None
        self.started: deque[dict[str, Any]] = deque(maxlen=10000)
        self.completed = 0
        self.max_running_seen = 0
        self._work = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def healthy(self) -> bool:
        """Whether the engine is up (a finished recovery is noticed here)."""
        if self.down_until is not None and time.monotonic() >= self.down_until:
            self.down_until = None
            log.warning("engine recovered")
        return self.down_until is None

    def set_paused(self, paused: bool) -> None:
        self.faults.paused = paused
        (self._unpaused.clear if paused else self._unpaused.set)()

    def submit(self, prompt_tokens: int, output_tokens: int, info: dict[str, Any], streamed: bool = True) -> Sequence:
        if not self.healthy():
            raise EngineDown()
        seq = Sequence(prompt_tokens, output_tokens, info, streamed)
        self.waiting.append(seq)
        self._work.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The client went away: free what the sequence holds (vLLM aborts the request)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.kv_used -= self._kv_charge(seq)
        self._work.set()

    def _kv_charge(self, seq: Sequence) -> int:
        if self.p.on_kv_exhausted == "queue":
            return seq.prompt_tokens + seq.output_tokens  # reserved up front
        return seq.kv_held

    def crash(self) -> None:
        self.crashes += 1
        self.down_until = time.monotonic() + self.p.recovery_s * self.p.time_scale
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

    def _schedule(self) -> int:
        """Move waiting sequences into the running batch; return prompt tokens to prefill."""
        prefill = 0
        while self.waiting and len(self.running) < self.p.max_num_seqs:
            seq = self.waiting[0]
            need = seq.prompt_tokens + (seq.output_tokens if self.p.on_kv_exhausted == "queue" else 0)
            if self.p.on_kv_exhausted == "queue" and self.kv_used + need > self.p.kv_tokens:
                break
            self.waiting.popleft()
            self.running.append(seq)
            self.kv_used += need
            prefill += seq.prompt_tokens
            self.started.append({**seq.info, "prompt_tokens": seq.prompt_tokens, "t": time.monotonic()})
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        return prefill

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
            prefill = self._schedule()
            if p.on_kv_exhausted == "crash" and self.kv_used > p.kv_tokens:
                self.crash()
                continue
            if not self.running:  # nothing fits yet (queue mode): wait for a change
                self._work.clear()
                await self._work.wait()
                continue
            # Steps follow a schedule rather than sleeping each step's length after the work of
            # the last: the loop's own overhead and a busy CPU would otherwise stretch every
            # step, and the engine would run slower than its timing model says.
            due = max(due, time.monotonic() - step_seconds(p, 0, 1)) + step_seconds(p, prefill, len(self.running))
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            await self._unpaused.wait()
            if self.down_until is not None:
                continue  # crashed by fault injection during the step
            finished = []
            for seq in self.running:
                seq.generated += 1
                if p.on_kv_exhausted == "crash":
                    self.kv_used += 1
                if seq.streamed:
                    seq.tokens.put_nowait(seq.generated)
                if seq.generated >= seq.output_tokens:
                    finished.append(seq)
            if p.on_kv_exhausted == "crash" and self.kv_used > p.kv_tokens:
                self.crash()
                continue
            for seq in finished:
                self.running.remove(seq)
                self.kv_used -= self._kv_charge(seq)
                seq.tokens.put_nowait(None)
                self.completed += 1

    def collect(self) -> list:
        labels = {"model_name": self.p.model}
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=list(labels))
        usage.add_metric(list(labels.values()), min(1.0, self.kv_used / self.p.kv_tokens))
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.", labels=list(labels))
        running.add_metric(list(labels.values()), len(self.running))
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=list(labels))
        waiting.add_metric(list(labels.values()), len(self.waiting))
        cache_labels = {
            "block_size": str(self.p.block_size),
            "num_gpu_blocks": str(self.p.kv_tokens // self.p.block_size),
            "cache_dtype": "auto",
        }
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(cache_labels))
        cache.add_metric(list(cache_labels.values()), 1.0)
        crashes = CounterMetricFamily("vllm_sim:oom_crashes", "Simulated GPU OOM crashes", labels=list(labels))
        crashes.add_metric(list(labels.values()), self.crashes)
        return [usage, running, waiting, cache, crashes]


def _error(status: int, message: str, error_type: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return web.json_response(body, status=status)


class SimServer:
    def __init__(self, params: SimParams):
        self.params = params
        self.engine = SimEngine(params)
        self.registry = CollectorRegistry()
        self.registry.register(self.engine)  # a collector: SimEngine.collect
        self._ids = itertools.count(1)
        self.requests = 0  # completion requests received, whatever became of them
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_post("/v1/chat/completions", self.completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/sim/faults", self.get_faults)
        self.app.router.add_post("/sim/faults", self.set_faults)
        self.app.router.add_get("/sim/stats", self.stats)
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    async def _on_startup(self, app: web.Application) -> None:
        self.engine.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.engine.stop()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.params.model, "object": "model", "created": 0, "owned_by": "vllm"}]}
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.healthy() else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.engine.healthy():  # the real engine's process is gone while it restarts
            return web.Response(status=503, text="engine restarting")
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.engine.faults))

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            spec = await request.json()
            if not isinstance(spec, dict):
                raise ValueError("expected a JSON object")
            faults = self.engine.faults
            if "error_rate" in spec:
                faults.error_rate = min(1.0, max(0.0, float(spec["error_rate"])))
            if "added_latency_s" in spec:
                faults.added_latency_s = max(0.0, float(spec["added_latency_s"]))
            if "paused" in spec:
                self.engine.set_paused(bool(spec["paused"]))
        except (ValueError, TypeError) as error:
            return _error(400, f"bad fault spec: {error}", "invalid_request_error")
        if spec.get("crash"):
            self.engine.crash()
        return web.json_response(asdict(self.engine.faults))

    async def stats(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response(
            {
                "requests": self.requests,
                "started": list(e.started),
                "completed": e.completed,
                "running": len(e.running),
                "waiting": len(e.waiting),
                "max_running_seen": e.max_running_seen,
                "kv_used": e.kv_used,
                "crashes": e.crashes,
                "healthy": e.healthy(),
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        chat = request.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "Request body is not valid JSON.", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "Request body must be a JSON object.", "BadRequestError")
        model = body.get("model")
        if model != self.params.model:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model_not_found")
        prompt_tokens = estimate_prompt_tokens(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.params.default_output_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "max_tokens must be a positive integer.", "BadRequestError")
        if prompt_tokens + max_tokens > self.params.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {self.params.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens.",
                "BadRequestError",
                "context_length_exceeded",
            )
        faults = self.engine.faults
        if faults.added_latency_s:
            await asyncio.sleep(faults.added_latency_s)
        if faults.error_rate and random.random() < faults.error_rate:
            return _error(500, "Injected fault.", "InternalServerError")
        if request.headers.get("x-sim-fault") == self.params.model:
            return _error(500, "Injected fault (x-sim-fault).", "InternalServerError")
        info = {
            "user": body.get("user"),
            "class": request.headers.get("x-llm-class"),
            "priority": request.headers.get("x-llm-priority"),
        }
        try:
            seq = self.engine.submit(prompt_tokens, max_tokens, info, streamed=body.get("stream") is True)
        except EngineDown:
            return _error(503, "The engine is restarting.", "ServiceUnavailableError")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-sim-{next(self._ids)}"
        try:
            if body.get("stream") is True:
                return await self._stream(request, seq, request_id, chat, prompt_tokens)
            return await self._complete(request, seq, request_id, chat, prompt_tokens)
        except EngineCrashed:
            # The real process died: the connection just drops.
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # never reaches the client
        except ConnectionResetError:
            return web.Response(status=499)  # the client went away mid-stream; vLLM aborts the request
        finally:
            self.engine.cancel(seq)

    async def _next_token(self, seq: Sequence) -> int | None:
        item = await seq.tokens.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def _complete(self, request, seq, request_id, chat, prompt_tokens) -> web.Response:
        while await self._next_token(seq) is not None:
            pass
        count = seq.generated
        text = " ".join(["ok"] * count)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return web.json_response(
            {
                "id": request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.params.model,
                "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": count, "total_tokens": prompt_tokens + count},
            }
        )

    async def _stream(self, request, seq, request_id, chat, prompt_tokens) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())
        while True:
            token = await self._next_token(seq)
            finished = token is None
            if chat:
                delta = {} if finished else {"role": "assistant", "content": "ok "} if token == 1 else {"content": "ok "}
                choice = {"index": 0, "delta": delta, "finish_reason": "length" if finished else None}
            else:
                choice = {"index": 0, "text": "" if finished else "ok ", "finish_reason": "length" if finished else None}
            chunk = {
                "id": request_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.params.model,
                "choices": [choice],
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if finished:
                break
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def run_sim(params: SimParams, host: str, port: int) -> None:
    server = SimServer(params)
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(
        f"extproc sim: model {params.model} on http://{host}:{port} "
        f"(kv_tokens={params.kv_tokens}, max_num_seqs={params.max_num_seqs}, "
        f"on_kv_exhausted={params.on_kv_exhausted}, time_scale={params.time_scale})",
        flush=True,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
