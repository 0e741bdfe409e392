"""Request bodies: what the parser refuses (strings that are not Unicode, numbers Python cannot
read, bodies nested too deep), how their fields are read (a null is absent), what they cost
(`max_tokens` or the default the sidecar writes in, `n` / `best_of`, batches and token-id
prompts), and what the requests the sidecar sends itself (failover, shadow) carry: the same
body changes and the client's Authorization. The core is driven directly; the gate over the
local stores, its relay pointed at a real simulated engine that requires an API key; the
servicer over real gRPC."""

from __future__ import annotations

import json
import math
import random
import sys

import grpc
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.control.plane import ControlPlane
from extproc.core.capacity import check_context, request_cost
from extproc.core.config import parse_config
from extproc.core.openai_request import (LEGACY_DEFAULT_MAX_TOKENS, MAX_SAMPLES, CompletionRequest,
                                         parse_completion_request, rewritten)
from extproc.core.outcomes import Outcome, Rejection
from extproc.core.tokens import estimate_prompts, estimate_text_tokens
from extproc.lifecycle.gate import AdmissionGate
from extproc.lifecycle.relay import Relay
from extproc.ops.metrics import Metrics
from extproc.server import SidecarServer
from extproc.stores.control import LocalControlStore
from extproc.stores.local_queue import LocalQueueStore
from extproc.testbed.sim import SimServer
from extproc.testbed.sim_engine import SimParams
from extproc.testbed.stack import metric_sum, parse_samples

from .conftest import OFFICER_KEY, e2e_config
from .helpers import async_wait_until, chat
from .test_gate import SteppedClock
from .test_servicer import Exchange, body_msg, headers_msg

LIMIT = 1 << 20
CHAT = "/v1/chat/completions"
LEGACY = "/v1/completions"


def parse(body: dict | bytes, path: str = CHAT) -> CompletionRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_completion_request(raw, LIMIT, path)


def refusal(body: dict | bytes, path: str = CHAT) -> str:
    with pytest.raises(Rejection) as error:
        parse(body, path)
    assert error.value.outcome is Outcome.REJECTED_BAD_REQUEST
    return error.value.message


# -- strings that are not Unicode --------------------------------------------------------------

@pytest.mark.parametrize("raw, where", [
    (b'{"model": "m", "messages": [{"role": "user", "content": "a \\ud800 b"}]}', "(messages[0].content)"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\uDFFF"}]}', "(messages[0].content)"),
    (b'{"model": "\\udc00x", "messages": []}', "(model)"),
    (b'{"messages": [], "metadata": {"k\\ud800": 1}}', "(metadata.k\\ud800)"),
    (b'{"messages": [], "tools": [{"x": ["ok", "\\ud83d"]}]}', "(tools[0].x[1])"),
])
def test_a_lone_surrogate_is_refused_naming_where_it_is(raw, where):
    message = refusal(raw)
    assert message.startswith("Request body is not valid Unicode: a string holds a lone surrogate.")
    assert message.endswith(where)
    message.encode()  # the answer itself is valid UTF-8


def test_the_bytes_of_a_surrogate_are_not_utf8():
    assert refusal('{"messages": [{"content": "\ud800"}]}'.encode("utf-8", "surrogatepass")) == \
        "Request body is not valid UTF-8."
    assert refusal('{"x": "\ud800"}'.encode("utf-16-le", "surrogatepass")) == "Request body is not valid UTF-16-LE."


def test_a_surrogate_pair_is_a_character_and_the_body_is_rewritten_whole():
    request = parse(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00 ok"}], "max_tokens": 4}')
    assert request.body["messages"][0]["content"] == "\U0001F600 ok"
    assert json.loads(rewritten(request, model="n"))["messages"][0]["content"] == "\U0001F600 ok"


# -- numbers -----------------------------------------------------------------------------------

def test_an_integer_of_more_digits_than_python_reads_is_refused():
    digits = sys.get_int_max_str_digits() + 700  # 5000
    assert refusal(b'{"messages": [], "seed": ' + b"7" * digits + b"}") == "Request body holds a number too long to read."
    assert refusal(b'{"messages": [], "max_tokens": ' + b"9" * digits + b"}") == \
        "Request body holds a number too long to read."


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_not_json(literal):
    assert refusal(b'{"messages": [], "temperature": ' + literal + b"}") == \
        f"Request body is not valid JSON: {literal.decode()} is not a JSON value."


def test_a_number_past_the_float_range_reads_as_infinity_as_json_and_vllm_read_it():
    request = parse(b'{"messages": [], "temperature": 1e999999, "max_tokens": 4}')
    assert request.body["temperature"] == math.inf
    assert json.loads(rewritten(request, model="n"))["temperature"] == math.inf  # re-encoded: the engine reads the same


def test_a_max_tokens_too_large_for_any_context_is_a_context_error_not_a_crash():
    request = parse({"messages": [], "max_tokens": 10 ** 4000})
    with pytest.raises(Rejection) as error:
        check_context(10, request.max_tokens, 512, 16384, 0.2)
    assert error.value.outcome is Outcome.REJECTED_CONTEXT_LENGTH


# -- nesting -----------------------------------------------------------------------------------

def nested(depth: int) -> bytes:
    """A body whose arrays nest `depth` levels deep under it."""
    return b'{"messages": [], "max_tokens": 4, "x": ' + b"[" * depth + b"]" * depth + b"}"


def deepest_parsed() -> CompletionRequest:
    """The most deeply nested body the parser reads, here."""
    depth = sys.getrecursionlimit()
    while True:
        try:
            return parse(nested(depth))
        except Rejection as rejection:
            assert rejection.message == "Request body nests too deeply."
            depth -= 1


def rewrite_deeper(request: CompletionRequest, frames: int) -> bytes:
    return rewrite_deeper(request, frames - 1) if frames else rewritten(request, model="n")


def test_a_body_too_deep_to_rewrite_where_it_is_rewritten_is_a_400():
    """Re-encoding recurses once a level, like parsing: a body parsed a few calls nearer the
    top of the stack than it is re-encoded may meet Python's recursion limit there."""
    request = deepest_parsed()
    with pytest.raises(Rejection) as error:
        rewrite_deeper(request, 50)
    assert (error.value.outcome, error.value.message) == (Outcome.REJECTED_BAD_REQUEST, "Request body nests too deeply.")


def test_a_body_with_many_parts_and_escapes_is_checked_whole():
    """Past the parts looked at one by one, the body is encoded whole: a lone surrogate after
    many parts is found, and a wide body without one passes."""
    parts = [f"\\u00e9{i}" for i in range(3000)]
    wide = '{"messages": [], "max_tokens": 4, "x": [' + ", ".join(f'"{p}"' for p in parts) + "]}"
    assert len(parse(wide.encode()).body["x"]) == 3000
    assert refusal(wide.replace('"\\u00e92999"', '"\\ud800"').encode()).endswith("(x[2999])")


# -- fields: a null is absent ------------------------------------------------------------------

@pytest.mark.parametrize("body, max_tokens", [
    ({"max_completion_tokens": None, "max_tokens": 12000}, 12000),
    ({"max_tokens": None, "max_completion_tokens": 500}, 500),
    ({"max_tokens": 5000, "max_completion_tokens": 10}, 10),  # vLLM: max_completion_tokens wins
    ({"max_tokens": None, "max_completion_tokens": None}, None),
    ({}, None),
])
def test_a_null_reads_as_absent_and_max_completion_tokens_wins_in_a_chat(body, max_tokens):
    assert parse({"messages": [], **body}).max_tokens == max_tokens


def test_a_null_n_or_stream_reads_as_absent():
    request = parse({"messages": [], "n": None, "best_of": None, "stream": None, "max_tokens": 4})
    assert (request.samples, request.stream) == (1, False)


@pytest.mark.parametrize("body, max_tokens", [
    ({}, LEGACY_DEFAULT_MAX_TOKENS),  # vLLM's /v1/completions default: no bound to write in
    ({"max_tokens": None}, None),  # an explicit null runs to the end of the context there
    ({"max_tokens": 5000, "max_completion_tokens": 10}, 5000),  # a field /v1/completions does not know
    ({"max_completion_tokens": 10}, LEGACY_DEFAULT_MAX_TOKENS),
])
def test_legacy_completions_read_max_tokens_as_vllm_does(body, max_tokens):
    assert parse({"prompt": "hi", **body}, LEGACY).max_tokens == max_tokens
    assert parse({"prompt": "hi", **body}, LEGACY + "?x=1").max_tokens == max_tokens


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n", "best_of"])
@pytest.mark.parametrize("value", [0, -1, "2", True, 1.5])
def test_a_count_must_be_a_positive_integer_and_the_refusal_names_it(field, value):
    assert refusal({"messages": [], field: value}) == f"'{field}' must be a positive integer. ({field})"


def test_n_and_best_of_are_the_sequences_sampled_and_bounded():
    assert parse({"messages": [], "n": 3}).samples == 3
    assert parse({"messages": [], "n": 2, "best_of": 5}).samples == 5
    assert parse({"messages": [], "best_of": 4}).samples == 4
    assert refusal({"messages": [], "n": 3, "best_of": 2}) == "'best_of' (2) must be at least 'n' (3). (best_of)"
    assert refusal({"messages": [], "n": MAX_SAMPLES + 1}) == f"'n' may be at most {MAX_SAMPLES}. (n)"
    assert refusal({"messages": [], "best_of": MAX_SAMPLES + 1}) == f"'best_of' may be at most {MAX_SAMPLES}. (best_of)"
    assert parse({"messages": [], "n": MAX_SAMPLES}).samples == MAX_SAMPLES


# -- prompts and cost --------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, prompts", [
    ([1, 2, 3], (3, 1, 3)),  # token ids: a token each
    ([[1, 2, 3], [4, 5]], (5, 2, 3)),  # a batch of token-id prompts
    (["a" * 40, "b" * 8], (12, 2, 10)),  # a batch of texts
    ("a" * 40, (10, 1, 10)),
    ([], (0, 1, 0)),
])
def test_a_completions_prompts_are_counted_each_as_the_engine_runs_them(prompt, prompts):
    assert estimate_prompts({"prompt": prompt}) == prompts


def test_a_chat_is_one_prompt():
    tokens = 4 + estimate_text_tokens("a" * 40)
    assert estimate_prompts({"messages": [{"role": "user", "content": "a" * 40}], "prompt": [1, 2]}) == \
        (tokens, 1, tokens)


def test_the_cost_counts_every_prompt_and_sequence():
    assert request_cost(500, 64, 512) == 564
    assert request_cost(500, None, 512) == 1012
    assert request_cost(500, 64, 512, samples=4) == 4 * 564  # n = 4: four sequences, each may hold it all
    assert request_cost(5, 10, 512, prompts=2) == 25  # two prompts of 5 tokens together, 10 tokens each
    assert request_cost(5, None, 16, prompts=2, samples=3) == 3 * (5 + 2 * 16)


# -- through the gate: the cost admitted, the body sent ----------------------------------------

@pytest.fixture
async def engine():
    """A real simulated engine serving the fallback's model that requires OFFICER_KEY, as vLLM
    with --api-key: what the gate's relay sends to (it ignores the relay's x-llm-pool header)."""
    server = SimServer(SimParams(model="deepseek-sim-small", time_scale=0.001, api_keys=(OFFICER_KEY,)))
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield server, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


class Gate:
    """The gate over the local stores (as tests/test_gate.py's rig), with a relay when given one."""

    def __init__(self, relay_url: str | None = None, **overrides) -> None:
        self.config = parse_config(e2e_config(**overrides))
        self.clock = SteppedClock()
        self.metrics = Metrics()
        self.metrics.declare(self.config.classes, self.config.pools)
        self.store = LocalQueueStore({name: pool.max_inflight for name, pool in self.config.pools.items()},
                                     on_change=lambda pool, snapshot: self.gate.pool_changed(pool, snapshot),
                                     clock=self.clock)
        self.control = ControlPlane(self.config, LocalControlStore(self.config.retries, clock=self.clock), self.metrics)
        self.relay = Relay(relay_url, 10) if relay_url else None
        self.gate = AdmissionGate(self.config, self.store, self.metrics, self.control, relay=self.relay,
                                  clock=self.clock, rng=random.Random(7))

    def counted(self, name: str, **labels: str) -> float:
        return metric_sum(parse_samples(self.metrics.render().decode()), name, **labels)

    async def admit(self, body: bytes, path: str = CHAT, **headers: str):
        exchange = self.gate.open({"x-ticket-type": "complaint", ":path": path, **headers})
        assert await self.gate.enqueue(exchange, body) is None
        return exchange, self.gate.admission(exchange)

    async def close(self) -> None:
        if self.relay is not None:
            await self.relay.close()


async def test_a_null_beside_max_tokens_does_not_hide_it_from_the_context_check():
    rig = Gate()
    prompt = "word " * 6000  # 7,500 tokens: with 12,000 to generate, over the usable context (13,107)
    for extra in ({}, {"max_completion_tokens": None}):
        exchange = rig.gate.open({"x-ticket-type": "complaint", ":path": CHAT})
        with pytest.raises(Rejection) as error:
            await rig.gate.enqueue(exchange, chat(prompt, max_tokens=12000, **extra))
        assert error.value.outcome is Outcome.REJECTED_CONTEXT_LENGTH
        await rig.gate.close(exchange)


async def test_a_request_without_a_bound_is_costed_at_the_default_which_is_written_into_its_body():
    rig = Gate()
    default = rig.config.requests.default_max_tokens
    exchange, admission = await rig.admit(chat("a" * 40))
    assert exchange.cost == 14 + default
    sent = json.loads(admission.body)
    assert sent["max_tokens"] == default and sent["messages"] == [{"role": "user", "content": "a" * 40}]
    await rig.gate.close(exchange)
    exchange, admission = await rig.admit(chat("a" * 40, max_tokens=None, max_completion_tokens=None))
    assert json.loads(admission.body)["max_tokens"] == default
    await rig.gate.close(exchange)


async def test_a_request_that_carries_its_bound_is_sent_as_it_came():
    rig = Gate()
    for body in (chat("a" * 40, max_tokens=64), chat("a" * 40, max_completion_tokens=64, max_tokens=None)):
        exchange, admission = await rig.admit(body)
        assert exchange.cost == 14 + 64 and admission.body is None
        await rig.gate.close(exchange)
    exchange, admission = await rig.admit(json.dumps({"model": "deepseek-sim", "prompt": "a" * 40}).encode(), LEGACY)
    assert exchange.cost == 10 + LEGACY_DEFAULT_MAX_TOKENS and admission.body is None  # the engine stops at 16
    await rig.gate.close(exchange)


async def test_every_sequence_and_every_prompt_of_a_batch_is_costed():
    rig = Gate()
    exchange, _ = await rig.admit(chat("a" * 40, max_tokens=64, n=4))
    assert exchange.cost == 4 * (14 + 64)
    await rig.gate.close(exchange)
    body = json.dumps({"model": "deepseek-sim", "prompt": [[1] * 300, [2] * 200], "max_tokens": 100, "best_of": 2})
    exchange, _ = await rig.admit(body.encode(), LEGACY)
    assert exchange.cost == 2 * (500 + 2 * 100)
    await rig.gate.close(exchange)


async def test_a_failover_carries_the_clients_authorization_and_the_body_changes(engine):
    """A primary attempt fails; the fallback's engine requires the API key the client sent: the
    failover answers 200, and its engine ran to the max_tokens the sidecar costed."""
    server, url = engine
    rig = Gate(url)
    try:
        exchange, admission = await rig.admit(chat("a" * 40), authorization=f"Bearer {OFFICER_KEY}")
        default = rig.config.requests.default_max_tokens
        assert json.loads(admission.body)["max_tokens"] == default
        plan = rig.gate.response_started(exchange, 500, "via_upstream")
        assert plan.fail_over
        reply = await rig.gate.fail_over(exchange)
        assert reply is not None and reply.status == 200, reply
        answer = json.loads(reply.body)
        assert answer["model"] == "deepseek-sim-small"
        assert answer["usage"]["completion_tokens"] == default  # not the engine's own default (64)
        assert "Bearer" not in repr(exchange) and OFFICER_KEY not in json.dumps(exchange.decision)
        await rig.gate.close(exchange)
    finally:
        await rig.close()


async def test_a_shadow_copy_carries_the_clients_authorization_and_the_body_changes(engine):
    server, url = engine
    rig = Gate(url, shadow={"share": 1.0})
    try:
        exchange, _ = await rig.admit(chat("a" * 40), authorization=f"Bearer {OFFICER_KEY}")
        await async_wait_until(lambda: rig.counted("extproc_shadow_responses_total", side="shadow") == 1)
        assert rig.counted("extproc_shadow_responses_total", side="shadow", status_class="2xx") == 1
        assert rig.counted("extproc_shadow_completion_tokens_total", side="shadow") == 512
        await rig.gate.close(exchange)
    finally:
        await rig.close()


async def test_a_copy_that_cannot_be_built_leaves_the_request_and_the_shadows_share_alone(engine):
    """The copy is counted only once built: a body that cannot be re-encoded (here one made by
    hand, as parsing now refuses it) makes no copy, its request is admitted undisturbed, and
    the next request is copied as before. The share here is one copy at a time."""
    server, url = engine
    rig = Gate(url, shadow={"share": 1.0})
    try:
        exchange = rig.gate.open({"x-ticket-type": "complaint", ":path": CHAT, "authorization": f"Bearer {OFFICER_KEY}"})
        assert await rig.gate.enqueue(exchange, chat(max_tokens=8)) is None
        body = {**exchange.request.body, "messages": [{"role": "user", "content": "\ud800"}]}
        exchange.request = CompletionRequest(body, "deepseek-sim", False, 8)
        assert rig.gate.admission(exchange).body is None  # admitted, sent as it came
        assert not exchange.shadowed
        await rig.gate.close(exchange)
        for copies in (1, 2):
            exchange, _ = await rig.admit(chat(max_tokens=8), authorization=f"Bearer {OFFICER_KEY}")
            assert exchange.shadowed
            await async_wait_until(lambda: rig.counted("extproc_shadow_responses_total", side="shadow") == copies)
            await rig.gate.close(exchange)
        assert rig.counted("extproc_shadow_copies_total", result="sent") == 2
        assert rig.counted("extproc_shadow_copies_total", result="no_room") == 0
    finally:
        await rig.close()


# -- through the servicer: the client sees a 400 ------------------------------------------------

@pytest.fixture
async def sidecar(engine):
    """A real sidecar over gRPC whose relay reaches the engine: every admitted request copied."""
    server, url = engine
    config = parse_config(e2e_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0},
                                     admin={"port": 0}, relay={"url": url}, shadow={"share": 1.0}))
    sidecar = SidecarServer(config)
    await sidecar.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")
    yield sidecar, pb_grpc.ExternalProcessorStub(channel)
    await channel.close()
    await sidecar.stop()


async def answer_to(stub, body: bytes):
    ex = Exchange(stub)
    await ex.send(headers_msg(x_ticket_type="complaint", authorization=f"Bearer {OFFICER_KEY}"))
    await ex.receive()
    await ex.send(body_msg(body))
    return ex, await ex.receive()


def counted(sidecar: SidecarServer, name: str, **labels: str) -> float:
    return metric_sum(parse_samples(sidecar.metrics.render().decode()), name, **labels)


@pytest.mark.parametrize("body, message", [
    (b'{"model": "deepseek-sim", "messages": [{"role": "user", "content": "x\\ud800"}]}', "lone surrogate"),
    (b'{"model": "deepseek-sim", "messages": [], "seed": ' + b"1" * 5000 + b"}", "number too long"),
    (b'{"model": "deepseek-sim", "messages": [], "temperature": NaN}', "NaN is not a JSON value"),
    (b'{"model": "deepseek-sim", "messages": [], "n": 0}', "'n' must be a positive integer"),
])
async def test_a_body_the_engine_could_not_read_gets_an_openai_style_400(sidecar, body, message):
    server, stub = sidecar
    _, response = await answer_to(stub, body)
    immediate = response.immediate_response
    assert immediate.status.code == 400
    error = json.loads(immediate.body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request" and message in error["message"]
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert headers["content-type"] == "application/json" and headers["x-extproc-outcome"] == "rejected_bad_request"
    assert (await server.store.snapshot("primary")).inflight == 0


async def test_lone_surrogates_never_stop_the_shadow_copies(sidecar):
    """Requests holding "\\ud800" used to be admitted and to fail while their copy was built,
    each keeping a count of the shadow's share: after one, no copy was ever sent again."""
    server, stub = sidecar
    for _ in range(5):
        ex, response = await answer_to(stub, chat("x\ud800", max_tokens=4))  # json.dumps writes "x\\ud800"
        assert response.immediate_response.status.code == 400
    for i in range(3):
        ex, response = await answer_to(stub, chat("hello", max_tokens=4))
        assert response.request_body.response.header_mutation.set_headers  # admitted
        await async_wait_until(lambda: counted(server, "extproc_shadow_responses_total", side="shadow") == i + 1)
        await ex.finish()
    assert counted(server, "extproc_shadow_copies_total", result="sent") == 3
    assert counted(server, "extproc_shadow_responses_total", side="shadow", status_class="2xx") == 3


async def test_a_bound_the_sidecar_writes_reaches_envoy_with_its_length(sidecar):
    server, stub = sidecar
    ex, response = await answer_to(stub, chat("hello"))
    mutation = response.request_body.response
    body = mutation.body_mutation.body
    assert json.loads(body)["max_tokens"] == server.config.requests.default_max_tokens
    headers = {h.header.key: h.header.raw_value.decode() for h in mutation.header_mutation.set_headers}
    assert headers["content-length"] == str(len(body))
    await ex.finish()
