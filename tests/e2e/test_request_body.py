"""Request bodies: what the parser refuses (strings that are not Unicode, numbers Python cannot
read or a float cannot hold, bodies nested too deep), how their fields are read (a null is
absent), what they cost (the prompt the path's API reads, its tools and tool calls, `max_tokens`
or the default the sidecar writes in, `n` / `best_of`, batches and token-id prompts), how that
bound is written (spliced into the body as it came), and what the requests the sidecar sends
itself (failover, shadow) carry: the same body changes and the client's Authorization. The core
is driven directly; the gate over the local stores, its relay pointed at a real simulated engine
that requires an API key; the servicer over real gRPC."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pydantic_core
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from extproc.core import openai_request
from extproc.core.capacity import check_context, request_cost
from extproc.core.openai_request import (LEGACY_DEFAULT_MAX_TOKENS, MAX_SAMPLES, Api, CompletionRequest,
                                         parse_completion_request, rewritten)
from extproc.core.events import ShadowAnswered, ShadowCopied, ShadowTokens
from extproc.core.outcomes import Outcome, Rejection
from extproc.core.tokens import estimate_prompts, estimate_text_tokens
from extproc.lifecycle.relay import HttpRelay
from extproc.server import SidecarServer
from extproc_testbed.sim import SimServer
from extproc_testbed.sim_engine import SimParams
from extproc_testbed.stack import metric_sum, parse_samples

from ..conftest import OFFICER_KEY
from ..helpers import async_wait_until, chat
from ..unit.test_gate import Rig
from .test_servicer import Exchange, body_msg, headers_msg, serving

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
    (b'{"messages": [], "x": "\\uDbFf"}', "(x)"),  # hex in either case
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


def test_only_a_body_with_a_surrogate_escape_is_walked_for_a_lone_one(monkeypatch):
    """Escapes are common (Go's encoder writes <, >, & as \\u003c..., Python's every character
    past ASCII): a body whose escapes are none of a surrogate is not walked."""
    walked = []
    monkeypatch.setattr(openai_request, "_check_unicode", walked.append)
    parse(b'{"messages": [{"role": "user", "content": "\\u003cb\\u003e caf\\u00e9 \\u00FF \\u0d80"}]}')
    assert walked == []
    for escape in (b"\\ud83d\\ude00", b"\\uDBFF\\uDFFF", b"\\uD8a0\\udc00"):
        parse(b'{"messages": [], "x": "' + escape + b'"}')
    assert len(walked) == 3


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


@pytest.mark.parametrize("number, named", [
    (b"1e999", "1e999"),
    (b"-1e999999", "-1e999999"),
    (b"1.8e308", "1.8e308"),
    (b"1" * 400 + b".5", "1" * 37 + "..."),
])
def test_a_number_past_a_floats_range_is_refused_naming_it(number, named):
    """Read as infinity, it could only be re-encoded as `Infinity`, which is not JSON: the
    sidecar refuses it on input, and strict engines do."""
    assert refusal(b'{"messages": [], "temperature": ' + number + b', "max_tokens": 4}') == \
        f"Request body holds a number too large for a float: {named}."
    assert parse(b'{"messages": [], "temperature": 1.7e308, "x": 1e-999}').body["x"] == 0.0  # (underflow is a number)


def test_a_rewritten_body_is_json_or_nothing():
    request = CompletionRequest({"messages": [], "temperature": math.inf}, None, False, 4)  # made by hand
    with pytest.raises(ValueError):
        rewritten(request, model="n")


def test_a_max_tokens_too_large_for_any_context_is_a_context_error_not_a_crash():
    request = parse({"messages": [], "max_tokens": 10 ** 4000})
    with pytest.raises(Rejection) as error:
        check_context(10, request.max_tokens, 512, 16384, 0.2)
    assert error.value.outcome is Outcome.REJECTED_CONTEXT_LENGTH


# -- nesting -----------------------------------------------------------------------------------

def nested(depth: int, field: str = "x") -> bytes:
    """A body whose arrays nest `depth` levels deep under `field`."""
    return b'{"messages": [], "max_tokens": 4, "' + field.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"


def deepest_parsed(field: str = "x") -> CompletionRequest:
    """The most deeply nested body the parser reads, here."""
    depth = sys.getrecursionlimit()
    while True:
        try:
            return parse(nested(depth, field))
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


def estimate_deeper(request: CompletionRequest, frames: int) -> tuple[int, int, int]:
    return estimate_deeper(request, frames - 1) if frames else estimate_prompts(request.body, Api.CHAT)


def test_tools_too_deep_to_write_where_they_are_costed_are_a_400():
    """The tools are costed as the JSON text the template writes: written a few calls deeper than
    they were parsed, they may meet Python's recursion limit there too."""
    request = deepest_parsed("tools")
    with pytest.raises(Rejection) as error:
        estimate_deeper(request, 50)
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
    assert estimate_prompts({"prompt": prompt}, Api.COMPLETIONS) == prompts


def test_a_chat_is_one_prompt():
    tokens = 4 + estimate_text_tokens("a" * 40)
    assert estimate_prompts({"messages": [{"role": "user", "content": "a" * 40}]}, Api.CHAT) == (tokens, 1, tokens)


def test_each_api_reads_its_own_prompt_and_ignores_the_others_as_the_engine_does():
    decoy = {"messages": [], "prompt": [[7] * 12000]}  # a completion with a chat's empty messages
    assert estimate_prompts(decoy, Api.COMPLETIONS) == (12000, 1, 12000)
    chat_body = {"messages": [{"role": "user", "content": "a" * 40}], "prompt": [[7] * 12000]}
    assert estimate_prompts(chat_body, Api.CHAT) == (14, 1, 14)
    assert estimate_prompts(decoy, Api.OTHER) == estimate_prompts(chat_body, Api.OTHER) == (12000, 1, 12000)


def test_a_chats_tools_and_tool_calls_are_counted_as_the_template_writes_them():
    """The chat template writes the tools' definitions and the calls' arguments into the prompt."""
    messages = [{"role": "user", "content": "hi"}]
    plain = estimate_prompts({"messages": messages}, Api.CHAT)[0]
    tools = [{"type": "function", "function": {"name": "lookup", "description": "d" * 8000,
                                               "parameters": {"type": "object", "properties": {}}}}]
    assert estimate_prompts({"messages": messages, "tools": tools}, Api.CHAT)[0] >= plain + 8000 // 4
    calls = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": "x" * 8000})}}]
    answered = [*messages, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert estimate_prompts({"messages": answered}, Api.CHAT)[0] >= plain + 8000 // 4


def test_a_content_part_that_is_not_text_counts_at_least_a_small_picture():
    parts = [{"type": "text", "text": "a" * 40}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
             {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]
    tokens = estimate_prompts({"messages": [{"role": "user", "content": parts}]}, Api.CHAT)[0]
    assert tokens >= 4 + 10 + 2 * 576  # a picture is 576 tokens on LLaVA-1.5, more on most models


def test_the_cost_counts_every_prompt_and_sequence():
    assert request_cost(500, 64, 512) == 564
    assert request_cost(500, None, 512) == 1012
    assert request_cost(500, 64, 512, samples=4) == 4 * 564  # n = 4: four sequences, each may hold it all
    assert request_cost(5, 10, 512, prompts=2) == 25  # two prompts of 5 tokens together, 10 tokens each
    assert request_cost(5, None, 16, prompts=2, samples=3) == 3 * (5 + 2 * 16)


# -- the bound written in: spliced into the body as it came ------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8)
# Any fields but those the parser checks, a null bound or two among them, in any order.
body_fields = st.dictionaries(
    st.text(max_size=8).filter(lambda key: key not in {"model", "stream", "messages", "n", "best_of", "max_tokens",
                                                       "max_completion_tokens"}),
    json_values, max_size=5)
null_bounds = st.lists(st.sampled_from(["max_tokens", "max_completion_tokens"]), unique=True).map(
    lambda keys: dict.fromkeys(keys))
layouts = st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}])


@given(st.builds(lambda fields, nulls: list({**fields, **nulls}.items()), body_fields, null_bounds).flatmap(st.permutations),
       layouts, st.sampled_from(["", " ", "\n", " \r\n\t"]), st.integers(1, 100000))
def test_a_spliced_bound_reads_as_the_re_encoded_body_does(fields, layout, trailing, bound):
    """Read by Python's json (FastAPI's, which vLLM's endpoints use) and by pydantic-core, the
    body with the bound spliced in is the re-encoded body: a key given twice reads as its last."""
    raw = (json.dumps(dict(fields), **layout) + trailing).encode()
    request = parse(raw)
    spliced = rewritten(request, max_tokens=bound)
    assert spliced.startswith(raw[:len(raw.rstrip()) - 1])  # the body as it came, up to its closing brace
    re_encoded = rewritten(dataclasses.replace(request, raw=None), max_tokens=bound)
    assert json.loads(spliced) == json.loads(re_encoded) == {**dict(fields), "max_tokens": bound}
    assert pydantic_core.from_json(spliced) == json.loads(re_encoded)


def test_a_body_the_bound_cannot_be_spliced_into_is_re_encoded():
    """Only a plain UTF-8 object is spliced; any other change than the bound re-encodes the body."""
    utf16 = json.dumps({"messages": [], "x": "é"}).encode("utf-16-le")
    for raw in (utf16, b' {"messages": []}', b'\xef\xbb\xbf{"messages": []}'):
        request = parse(raw)
        assert request.raw is None and json.loads(rewritten(request, max_tokens=9))["max_tokens"] == 9
    request = parse(b'{"messages": [], "max_tokens": null}')
    assert rewritten(request, max_tokens=9, model="n") == b'{"messages": [], "max_tokens": 9, "model": "n"}'
    assert rewritten(parse(b"{ }"), max_tokens=9) == b'{ "max_tokens":9}'


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


async def admit(rig: Rig, body: bytes, path: str = CHAT, **headers: str):
    """An admitted request: its exchange and what Envoy is told."""
    exchange = rig.gate.open({"x-ticket-type": "complaint", ":path": path, **headers})
    assert await rig.gate.enqueue(exchange, body) is None
    return exchange, rig.gate.admission(exchange)


async def test_a_null_beside_max_tokens_does_not_hide_it_from_the_context_check():
    rig = Rig()
    prompt = "word " * 6000  # 7,500 tokens: with 12,000 to generate, over the usable context (13,107)
    for extra in ({}, {"max_completion_tokens": None}):
        exchange = rig.gate.open({"x-ticket-type": "complaint", ":path": CHAT})
        with pytest.raises(Rejection) as error:
            await rig.gate.enqueue(exchange, chat(prompt, max_tokens=12000, **extra))
        assert error.value.outcome is Outcome.REJECTED_CONTEXT_LENGTH
        await rig.gate.close(exchange)


async def test_a_request_without_a_bound_is_costed_at_the_default_which_is_written_into_its_body():
    rig = Rig()
    default = rig.config.requests.default_max_tokens
    exchange, admission = await admit(rig, chat("a" * 40))
    assert exchange.cost == 14 + default
    sent = json.loads(admission.body)
    assert sent["max_tokens"] == default and sent["messages"] == [{"role": "user", "content": "a" * 40}]
    await rig.gate.close(exchange)
    exchange, admission = await admit(rig, chat("a" * 40, max_tokens=None, max_completion_tokens=None))
    assert json.loads(admission.body)["max_tokens"] == default
    await rig.gate.close(exchange)


async def test_a_bound_alone_is_spliced_into_the_body_as_it_came():
    rig = Rig()
    body = chat("a" * 40)
    exchange, admission = await admit(rig, body)
    assert admission.body == body[:-1] + b',"max_tokens":%d}' % rig.config.requests.default_max_tokens
    await rig.gate.close(exchange)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/tokenize", "/v1/responses"])
async def test_the_bound_is_written_only_into_a_chat_or_a_completion(path):
    rig = Rig()
    exchange, admission = await admit(rig, json.dumps({"model": "deepseek-sim", "input": "a" * 40}).encode(), path)
    assert admission.body is None  # sent as it came
    await rig.gate.close(exchange)
    exchange, admission = await admit(rig, json.dumps({"model": "deepseek-sim", "prompt": "a", "max_tokens": None}).encode(),
                                      LEGACY)
    assert json.loads(admission.body)["max_tokens"] == rig.config.requests.default_max_tokens  # as before
    await rig.gate.close(exchange)


async def test_a_decoy_beside_the_prompt_the_engine_reads_hides_none_of_it():
    """On /v1/completions the engine runs `prompt` and ignores `messages`: an empty one beside a
    long prompt once cost 16 tokens and passed the context check. A chat's tools count too."""
    rig = Rig()
    decoy = {"model": "deepseek-sim", "messages": [], "prompt": [[7] * 12000]}
    exchange, _ = await admit(rig, json.dumps(decoy).encode(), LEGACY)
    assert exchange.cost == 12000 + LEGACY_DEFAULT_MAX_TOKENS
    await rig.gate.close(exchange)
    tools = [{"type": "function", "function": {"name": "lookup", "description": "d" * 53000}}]  # 13,250 tokens
    for path, body in ((LEGACY, {**decoy, "prompt": [[7] * 13100]}),
                       (CHAT, {"model": "deepseek-sim", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                               "max_tokens": 16})):
        exchange = rig.gate.open({"x-ticket-type": "complaint", ":path": path})
        with pytest.raises(Rejection) as error:
            await rig.gate.enqueue(exchange, json.dumps(body).encode())
        assert error.value.outcome is Outcome.REJECTED_CONTEXT_LENGTH
        await rig.gate.close(exchange)


async def test_a_request_that_carries_its_bound_is_sent_as_it_came():
    rig = Rig()
    for body in (chat("a" * 40, max_tokens=64), chat("a" * 40, max_completion_tokens=64, max_tokens=None)):
        exchange, admission = await admit(rig, body)
        assert exchange.cost == 14 + 64 and admission.body is None
        await rig.gate.close(exchange)
    exchange, admission = await admit(rig, json.dumps({"model": "deepseek-sim", "prompt": "a" * 40}).encode(), LEGACY)
    assert exchange.cost == 10 + LEGACY_DEFAULT_MAX_TOKENS and admission.body is None  # the engine stops at 16
    await rig.gate.close(exchange)


async def test_every_sequence_and_every_prompt_of_a_batch_is_costed():
    rig = Rig()
    exchange, _ = await admit(rig, chat("a" * 40, max_tokens=64, n=4))
    assert exchange.cost == 4 * (14 + 64)
    await rig.gate.close(exchange)
    body = json.dumps({"model": "deepseek-sim", "prompt": [[1] * 300, [2] * 200], "max_tokens": 100, "best_of": 2})
    exchange, _ = await admit(rig, body.encode(), LEGACY)
    assert exchange.cost == 2 * (500 + 2 * 100)
    await rig.gate.close(exchange)


async def test_a_failover_carries_the_clients_authorization_and_the_body_changes(engine):
    """A primary attempt fails; the fallback's engine requires the API key the client sent: the
    failover answers 200, and its engine ran to the max_tokens the sidecar costed."""
    server, url = engine
    rig = Rig(HttpRelay(url, 10))
    try:
        exchange, admission = await admit(rig, chat("a" * 40), authorization=f"Bearer {OFFICER_KEY}")
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
        await rig.relay.close()


async def test_a_shadow_copy_carries_the_clients_authorization_and_the_body_changes(engine):
    server, url = engine
    rig = Rig(HttpRelay(url, 10), shadow={"share": 1.0})
    try:
        exchange, _ = await admit(rig, chat("a" * 40), authorization=f"Bearer {OFFICER_KEY}")
        await async_wait_until(lambda: len(rig.told(ShadowAnswered, side="shadow")) == 1)
        assert rig.told(ShadowAnswered, side="shadow") == [ShadowAnswered("shadow", "2xx")]
        assert rig.told(ShadowTokens, side="shadow") == [ShadowTokens("shadow", 512)]
        await rig.gate.close(exchange)
    finally:
        await rig.relay.close()


async def test_a_copy_that_cannot_be_built_leaves_the_request_and_the_shadows_share_alone(engine):
    """The copy is counted only once built: a body that cannot be re-encoded (here one made by
    hand, as parsing now refuses it) makes no copy, its request is admitted undisturbed, and
    the next request is copied as before. The share here is one copy at a time. (The copy is
    made as the request is admitted: this one is admitted with no share, its body made by hand,
    then given to the copier as an admission would be.)"""
    server, url = engine
    rig = Rig(HttpRelay(url, 10), shadow={"share": 1.0})
    try:
        await rig.control.set_shadow_share(0.0)
        exchange = rig.gate.open({"x-ticket-type": "complaint", ":path": CHAT, "authorization": f"Bearer {OFFICER_KEY}"})
        assert await rig.gate.enqueue(exchange, chat(max_tokens=8)) is None
        body = {**exchange.request.body, "messages": [{"role": "user", "content": "\ud800"}]}
        exchange.request = CompletionRequest(body, "deepseek-sim", False, 8)
        await rig.control.set_shadow_share(1.0)
        rig.gate.shadow.admitted(exchange)
        assert rig.gate.admission(exchange).body is None  # admitted, sent as it came
        assert not exchange.shadowed
        await rig.gate.close(exchange)
        for copies in (1, 2):
            exchange, _ = await admit(rig, chat(max_tokens=8), authorization=f"Bearer {OFFICER_KEY}")
            assert exchange.shadowed
            await async_wait_until(lambda: len(rig.told(ShadowAnswered, side="shadow")) == copies)
            await rig.gate.close(exchange)
        assert [event.result for event in rig.heard.of(ShadowCopied)] == ["sent", "sent"]  # no other result
    finally:
        await rig.relay.close()


# -- through the servicer: the client sees a 400 ------------------------------------------------

@pytest.fixture
async def sidecar(engine):
    """A real sidecar over gRPC whose relay reaches the engine: every admitted request copied."""
    server, url = engine
    async with serving(relay={"url": url}, shadow={"share": 1.0}) as running:
        yield running


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
    (b'{"model": "deepseek-sim", "messages": [], "temperature": 1e999}', "number too large for a float: 1e999"),
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


@pytest.mark.parametrize("spelling", ["/v1/chat/%63ompletions", "/v1//chat/completions", "/v1/x/../chat/completions",
                                      "/v1/chat/completions/?stream=false", "/v1/%63hat/completions?x=1"])
async def test_a_path_the_engine_reads_as_a_chat_is_costed_and_bounded_as_one(spelling):
    """The engine's HTTP server decodes escapes, merges slashes and resolves dot segments: a chat
    sent under another spelling of its path is still a chat there, run to the end of the context
    without a bound. It is costed as one, and the default bound is written into its body."""
    rig = Rig()
    body = chat("a" * 40, max_tokens=None)
    exchange, admission = await admit(rig, body, spelling)
    assert exchange.request.api is Api.CHAT and exchange.request.needs_bound
    assert json.loads(admission.body)["max_tokens"] == rig.config.requests.default_max_tokens
    await rig.gate.close(exchange)
