"""`extproc sim`: a simulated vLLM server, so everything can be run and measured without GPUs.

It speaks the parts of vLLM's OpenAI-compatible API the sidecar fronts, exports vLLM's own
metric names, and fails the way the real engine fails. This is the HTTP server; the engine it
serves (vLLM v1's scheduling, the timing model, the KV cache, OOM crashes) is in sim_engine.py.

Metrics, with vLLM's names and labels (vllm/v1/metrics/loggers.py; tests/e2e/test_sim_shape.py
holds them to a real server's): KV usage, running and waiting requests (also by reason), the
cache config, `vllm:num_preemptions_total`, `vllm:admission_rejections_total`, and the
histograms `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`,
`vllm:request_prefill_time_seconds` and `vllm:request_decode_time_seconds`, with vLLM's
buckets, in the engine's unscaled seconds.

With `--api-key` (vLLM's flag), every route under /v1 answers 401 `{"error": "Unauthorized"}`
unless the request carries `Authorization: Bearer <one of the keys>`, as vLLM's
AuthenticationMiddleware does; /health, /metrics and the simulator's own /sim routes stay open.

Errors come in vLLM's shape (`code` is the HTTP status): a prompt longer than the context 400
(`param: input_tokens`), a prompt that fits with a `max_tokens` that does not 200 with the
answer cut short, a non-integer `priority` or `max_tokens` 400 (`param: body.priority`), a full
line (`--max-num-queued-reqs`) 503 without retry-after.

A non-streamed answer says where its time went (`timing_headers`: `x-sim-engine`,
`x-sim-engine-queue-ms`, `x-sim-prefill-ms`, `x-sim-decode-ms`, `x-sim-beside-prefill-ms`,
`x-sim-beside-long-prefill-ms`), the simulator's own debug view: vLLM exposes nothing like it
per request.

Fault injection (`POST /sim/faults`): `error_rate` (500s), `added_latency_s`, `paused` (the
engine loop stops, as if the process were stopped), `crash` (an OOM crash now). A request
carrying `x-sim-fault: MODEL` is answered 500 by the server of that model (tests choose exactly
which requests fail; other servers ignore it, so a copy sent elsewhere succeeds).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import random
import time
from dataclasses import asdict
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from extproc.core.tokens import estimate_prompt_tokens
from .sim_engine import EngineBusy, EngineCrashed, EngineDown, Sequence, SimEngine, SimParams

BUSY = "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
# What vLLM's --api-key guards whatever routes are registered (its MIN_GUARDED_PREFIXES).
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def _error(status: int, message: str, error_type: str, param: str | None = None) -> web.Response:
    """An error in vLLM's shape: the OpenAI fields, with the HTTP status as `code`."""
    body = {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _bad_integer(field: str, value: Any) -> web.Response:
    """vLLM's request validation (pydantic) refusing a field that must be an integer."""
    kind = "int_from_float" if isinstance(value, float) else "int_type"
    message = f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.{field}', 'msg': 'Input should be a valid " \
              f"integer', 'input': {value!r}}}"
    return _error(400, message, "Bad Request", f"body.{field}")


def timing_headers(request: web.Request, seq: Sequence) -> dict[str, str]:
    """The simulator's own debug view of where a finished request's time went (vLLM has nothing
    like it per request): which engine served it (its address), and in the engine's unscaled
    milliseconds its wait in the engine's line, its prefill, its decode, and the part of its
    steps shared with another request's prefill (`beside-prefill`) and with a long one's."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    headers = {f"x-sim-{name.removesuffix('_s').replace('_', '-')}-ms": str(round(seconds * 1000))
               for name, seconds in seq.timings().items()}
    if sockname:
        headers["x-sim-engine"] = f"{sockname[0]}:{sockname[1]}"
    return headers


class SimServer:
    def __init__(self, params: SimParams):
        self.params = params
        self.registry = CollectorRegistry()
        self.engine = SimEngine(params, self.registry)
        self.registry.register(self.engine)  # a collector: SimEngine.collect
        self._ids = itertools.count(1)
        self.requests = 0  # completion requests received, whatever became of them
        self._key_hashes = [hashlib.sha256(key.encode()).digest() for key in params.api_keys]
        middlewares = [self._require_api_key] if params.api_keys else []
        self.app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
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

    @web.middleware
    async def _require_api_key(self, request: web.Request, handler) -> web.StreamResponse:
        """vLLM's check: a bearer token (the scheme in any case) whose SHA-256 is one of the
        keys'; CORS preflights pass."""
        if request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(digest, key) for key in self._key_hashes):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

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
                "max_step_tokens_seen": e.max_step_tokens_seen,
                "preemptions": e.preemptions,
                "kv_used": e.kv_used,
                "crashes": e.crashes,
                "on_kv_exhausted": e.p.on_kv_exhausted,
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
            return _error(404, f"The model `{model}` does not exist. Valid aliases: {self.params.model}.",
                          "NotFoundError", "model")
        for field in ("max_tokens", "max_completion_tokens", "priority"):
            value = body.get(field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                return _bad_integer(field, value)
        prompt_tokens = estimate_prompt_tokens(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.params.default_output_tokens
        if max_tokens < 1:
            return _error(400, f"max_tokens must be at least 1, got {max_tokens}. (parameter=max_tokens, "
                          f"value={max_tokens})", "BadRequestError", "max_tokens")
        # vLLM's rule: a prompt longer than the context is refused; one that fits runs, and its
        # answer is cut short at the context's end when max_tokens does not fit beside it
        max_model_len = self.engine.max_model_len
        if prompt_tokens >= max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains at "
                f"least {max_model_len + 1} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={max_model_len + 1})",
                "BadRequestError", "input_tokens",
            )
        max_tokens = min(max_tokens, max_model_len - prompt_tokens)
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
            seq = self.engine.submit(prompt_tokens, max_tokens, info, streamed=body.get("stream") is True,
                                     priority=body.get("priority") or 0)
        except EngineDown:
            return _error(503, "The engine is restarting.", "ServiceUnavailableError")
        except EngineBusy:
            return _error(503, BUSY, "Service Unavailable")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-sim-{next(self._ids)}"
        try:
            if body.get("stream") is True:
                return await self._stream(request, body, seq, request_id, chat, prompt_tokens)
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
            },
            headers=timing_headers(request, seq),
        )

    async def _stream(self, request, body, seq, request_id, chat, prompt_tokens) -> web.StreamResponse:
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
        if (body.get("stream_options") or {}).get("include_usage") is True:  # vLLM: one more chunk, no choices
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": seq.generated,
                     "total_tokens": prompt_tokens + seq.generated}
            chunk = {"id": request_id, "object": chunk["object"], "created": created, "model": self.params.model,
                     "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def run_sim(params: SimParams, host: str, port: int) -> None:
    server = SimServer(params)
    # A client that goes away cancels its handler, streamed or not: vLLM's routes abort the request
    # then (`with_cancellation`, vllm/entrypoints/serve/utils/api_utils.py); aiohttp keeps running
    # it by default.
    runner = web.AppRunner(server.app, access_log=None, handler_cancellation=True)
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
