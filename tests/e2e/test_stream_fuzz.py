"""The ext_proc stream fuzzed directly (invariant I14): Hypothesis writes sequences of
`ProcessingRequest` messages that no well-behaved Envoy would send (out of order, phases twice,
empty and huge header maps, bytes that are not UTF-8, statuses that are not numbers, messages
with no phase at all) and ends each stream at any point, by closing it or cancelling it. They go
over a real gRPC channel to a real sidecar (no Envoy), several streams at once so that some wait
in line. After each example:

- the server still answers, and every stream ended within its bound: an answer or a clean close;
- no slot leaked or was released twice: nothing in flight or in line, slots given back exactly
  as many as were taken;
- the breakers counted no failure that no upstream reported: each failure counted is a failing
  status some stream's response headers carried.

Envoy's own ext_proc fuzzer (test/extensions/filters/http/ext_proc/ in Envoy's source) is the
model: arbitrary message streams against the real filter.

The bodies include the shapes that once broke the sidecar or its cost: strings holding a lone
surrogate (escaped, or as raw bytes), numbers Python cannot read, a float cannot hold or JSON
does not know, a null beside a value (`max_tokens` beside `max_completion_tokens`), token-id
prompts flat and nested, `n` and `best_of`, and decoys: a chat's empty `messages` beside a
completion's `prompt`, a `prompt` beside a chat's messages with tool calls and tools. The sidecar's relay reaches a real simulated engine and every admitted
request is copied there, so failovers and shadow copies are built from those bodies too; every
answer is well-formed (an error is an OpenAI-style JSON body; a rewritten body is JSON and its
content-length is its length), and no shadow copy stays counted once the streams are over.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from aiohttp import web
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from extproc.core.config import parse_config
from extproc.core.outcomes import _SHAPES
from extproc.server import SidecarServer
from extproc_testbed.sim import SimServer
from extproc_testbed.sim_engine import SimParams
from extproc_testbed.stack import metric_sum, parse_samples

from ..conftest import e2e_config

STREAM_BOUND_S = 8.0  # the longest wait in line here is 1 s; a held stream is answered well within this

class HugeHeaders(list):
    """Hundreds of headers (printed short when Hypothesis shows a failing example)."""

    def __init__(self, n: int):
        super().__init__((f"x-h-{i}", b"v" * 50) for i in range(n))

    def __repr__(self) -> str:
        return f"HugeHeaders({len(self)})"


HEADER_NAMES = [":path", ":method", ":status", "content-length", "authorization", "x-ticket-type", "x-urgent-level",
                "x-vip-level", "x-bulk", "x-branch-id", "x-llm-pool", "X-LLM-Pool", "x-llm-priority", "idempotency-key",
                "x-request-id", "x-stainless-retry-count", "content-type", ""]
header_values = st.one_of(
    st.sampled_from([b"complaint", b"loan_approval", b"quick_check", b"3", b"-1", b"99999999999", b"true", b"",
                     b"vllm_fallback", b"/v1/chat/completions", b"Bearer sk-test-officer", b"100"]),
    st.binary(max_size=24),  # not UTF-8, control bytes, anything
)
header_maps = st.one_of(
    st.lists(st.tuples(st.sampled_from(HEADER_NAMES) | st.text(max_size=12), header_values), max_size=8),
    st.builds(HugeHeaders, st.integers(150, 400)),
)


def chat(content: str, **extra) -> bytes:
    return json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": content}], **extra}).encode()


def json_text(value) -> bytes:
    return json.dumps(value).encode()  # (ensure_ascii: a lone surrogate is written as its escape, "\ud800")


def raw_object(fields: dict[str, bytes]) -> bytes:
    """A JSON object from its fields' texts, which may be what json.dumps would never write."""
    return b"{" + b", ".join(json_text(name) + b": " + text for name, text in fields.items()) + b"}"


# Strings: any text, lone surrogates (escaped: json.dumps writes them so), a surrogate pair, and
# a surrogate's own bytes, which are not UTF-8.
strings = st.one_of(
    st.text(max_size=20).map(json_text),
    st.sampled_from([rb'"\ud800"', rb'"a\udfffb"', rb'"\ud83d"', rb'"\ud83d\ude00"', rb'"\uDC00"']),
    st.just(b'"\xed\xa0\x80"'),  # a surrogate's UTF-8 bytes
)
# Numbers: ordinary ones, past what Python converts or a float holds, what JSON does not know.
numbers = st.one_of(
    st.integers(-3, 20000).map(json_text),
    st.sampled_from([b"null", b"1" * 5000, b"-" + b"7" * 4301, b"1e999999", b"-1e999999", b"NaN", b"Infinity",
                     b"-Infinity", b"1.5", b"true", b'"12"', b"0", b"129"]),
)
token_ids = st.lists(st.integers(0, 50000), max_size=12).map(json_text)
prompts = st.one_of(
    strings,
    token_ids,  # one prompt of token ids
    st.lists(st.lists(st.integers(0, 50000), max_size=8), min_size=1, max_size=4).map(json_text),  # a batch of them
    st.lists(strings, min_size=1, max_size=3).map(lambda texts: b"[" + b", ".join(texts) + b"]"),  # a batch of texts
)
# Each field at most once, but any of them beside any other: max_tokens null beside
# max_completion_tokens and the other way round, n beside best_of.
counts = st.dictionaries(st.sampled_from(["max_tokens", "max_completion_tokens", "n", "best_of", "stream", "seed",
                                          "temperature"]), numbers, max_size=4)

def chat_with_tools(content: bytes, prompt: bytes, fields: dict[str, bytes]) -> bytes:
    """A chat whose assistant called a tool, with the tools' definitions and a `prompt` beside them."""
    call = b'{"type": "function", "function": {"name": "f", "arguments": ' + content + b"}}"
    messages = b'[{"role": "user", "content": ' + content + b'}, {"role": "assistant", "tool_calls": [' + call + b"]}]"
    tools = b'[{"type": "function", "function": {"name": "f", "description": ' + content + b"}}]"
    return raw_object({"model": b'"deepseek-sim"', "messages": messages, "tools": tools, "prompt": prompt, **fields})


shaped_bodies = st.one_of(
    st.builds(lambda content, fields: raw_object({"model": b'"deepseek-sim"', "messages": b'[{"role": "user", '
                                                  b'"content": ' + content + b"}]", **fields}), strings, counts),
    st.builds(lambda prompt, fields: raw_object({"model": b'"deepseek-sim"', "prompt": prompt, **fields}), prompts,
              counts),
    # Decoys: a field of the other API beside the prompt the engine reads.
    st.builds(lambda prompt, fields: raw_object({"model": b'"deepseek-sim"', "messages": b"[]", "prompt": prompt,
                                                 **fields}), prompts, counts),
    st.builds(chat_with_tools, strings, prompts, counts),
    st.just(json_text({"model": "deepseek-sim", "messages": [], "prompt": [[7] * 13100]})),  # past the context as a completion
)


def nested(depth: int) -> bytes:
    return b'{"messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}"


bodies = st.one_of(
    st.builds(lambda c, n: chat(c, max_tokens=n), st.text(max_size=40), st.integers(1, 64)),
    st.binary(max_size=64),
    st.just(b""),
    st.just(b"{" * 20000),
    st.just(b"x" * 70000),  # over limits.max_body_bytes
    st.just(chat("hi", stream=True)),
    shaped_bodies,
    st.sampled_from([nested(255), nested(300), nested(900)]),
)


valid_chats = st.builds(lambda n, stream: chat("hello", max_tokens=n, stream=stream), st.integers(1, 64), st.booleans())


def headers_message(pairs, end_of_stream: bool, response: bool) -> pb.ProcessingRequest:
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs]),
        end_of_stream=end_of_stream)
    return pb.ProcessingRequest(response_headers=headers) if response else pb.ProcessingRequest(request_headers=headers)


def response_headers(status: bytes | None, details: str | None) -> pb.ProcessingRequest:
    message = headers_message([(":status", status)] if status is not None else [], False, response=True)
    if details is not None:
        attributes = Struct()
        attributes.update({"response.code_details": details})
        message.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
    return message


messages = st.one_of(
    st.builds(lambda h, eos: headers_message(h, eos, response=False), header_maps, st.booleans()),
    st.builds(lambda b, eos: pb.ProcessingRequest(request_body=pb.HttpBody(body=b, end_of_stream=eos)), bodies,
              st.booleans()),
    st.builds(lambda s, d: response_headers(s, d),
              st.sampled_from([b"200", b"404", b"429", b"500", b"503", b"", b"abc", None]),
              st.sampled_from([None, "via_upstream", "upstream_reset_before_response_started{connection_termination}",
                               "response_timeout", "junk"])),
    st.just(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())),
    st.just(pb.ProcessingRequest(response_trailers=pb.HttpTrailers())),
    st.builds(lambda b, eos: pb.ProcessingRequest(response_body=pb.HttpBody(body=b, end_of_stream=eos)),
              st.binary(max_size=32), st.booleans()),
    st.just(pb.ProcessingRequest()),  # no phase at all
)


def usual_start(class_name: str, body: bytes, path: bytes) -> list[pb.ProcessingRequest]:
    """What Envoy sends first for a completion: most generated streams begin like this, so
    that they get past the headers and into line."""
    pairs = [(":method", b"POST"), (":path", path), ("x-ticket-type", class_name.encode()),
             ("authorization", b"Bearer sk-test-officer")]
    return [headers_message(pairs, False, response=False),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


streams = st.builds(
    lambda start, rest, end, cut: (start + rest, end, cut),
    st.one_of(st.just([]), st.builds(usual_start, st.sampled_from(["complaint", "loan_approval", "quick_check"]),
                                     st.one_of(valid_chats, valid_chats, bodies, shaped_bodies),
                                     st.sampled_from([b"/v1/chat/completions", b"/v1/completions"]))),
    st.lists(messages, max_size=6),
    st.sampled_from(["close", "cancel"]),
    st.integers(0, 100),
)


def failing(message: pb.ProcessingRequest) -> bool:
    if message.WhichOneof("request") != "response_headers":
        return False
    for header in message.response_headers.headers.headers:
        if header.key == ":status" and header.raw_value.isdigit():
            status = int(header.raw_value)
            return status >= 500 or status == 429
    return False  # no status, or not a number: counted as no failure


async def start_engine() -> tuple[web.AppRunner, str]:
    """A simulated engine serving the fallback's model, fast: where the relay sends failovers
    and shadow copies (it ignores the relay's pool header)."""
    runner = web.AppRunner(SimServer(SimParams(model="deepseek-sim-small", time_scale=0.001)).app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.fixture(scope="module")
def sidecar():
    """A real sidecar on loopback (its own event loop in a thread of this test's making)."""
    loop = asyncio.new_event_loop()
    engine, engine_url = loop.run_until_complete(start_engine())
    config = e2e_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0}, admin={"port": 0},
                        relay={"url": engine_url, "timeout_s": 2}, shadow={"share": 1.0})
    for policy in config["classes"].values():
        policy["max_wait_s"] = 1
    config["pools"]["primary"]["max_inflight"] = 2
    server = SidecarServer(parse_config(config))
    errors = ErrorRecords()
    logging.getLogger("extproc").addHandler(errors)
    loop.run_until_complete(server.start())
    yield loop, server, errors
    loop.run_until_complete(server.stop())
    loop.run_until_complete(engine.cleanup())
    loop.close()
    logging.getLogger("extproc").removeHandler(errors)


class ErrorRecords(logging.Handler):
    """The sidecar's error lines: an exception the server did not expect is logged here. A
    breaker's transition is logged at error level too, by design: it is the answer to failing
    statuses the streams sent, whose count is checked apart, so it is not recorded here."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name != "extproc.breaker":
            self.records.append(record)


async def run_stream(stub, messages_: list[pb.ProcessingRequest], end: str, cut: int) -> None:
    """Send the messages as Envoy does: one at a time, each after the answer to the one before
    (a held request's `override_message_timeout` is not an answer). Then end the stream: close
    this side ("close"), or reset it `cut` hundredths of a second in, wherever it is by then (in
    line, or mid-exchange: "cancel"), as Envoy does when its client leaves."""
    loop = asyncio.get_running_loop()
    cancel_at = loop.time() + 0.01 * cut if end == "cancel" else None

    def left() -> float:
        return STREAM_BOUND_S if cancel_at is None else max(0.0, cancel_at - loop.time())

    call = stub.Process()
    server_ended = False
    for message in messages_:
        if call.done() or left() == 0:
            break
        try:
            await call.write(message)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            # The server had ended the stream after its last answer (it does once the response
            # needs nothing more); grpc's client then reads the refused write as its own error.
            return
        try:
            answer = await asyncio.wait_for(next_answer(call), left())
        except asyncio.TimeoutError:
            assert cancel_at is not None, "no answer within the bound"
            # The cut came before the answer: the client leaves here (grpc ends the whole call
            # when a read is cancelled, as the timeout just did: its status is CANCELLED).
            call.cancel()
            return
        if answer is None or answer.WhichOneof("response") == "immediate_response":
            server_ended = True  # it answered the client itself: Envoy sends nothing more
            break
    if cancel_at is not None and not call.done() and not server_ended:
        await asyncio.sleep(left())
        call.cancel()
        return
    if server_ended:
        while await asyncio.wait_for(call.read(), STREAM_BOUND_S) is not grpc.aio.EOF:
            pass
    elif not call.done():
        await asyncio.sleep(0.005 * cut)  # the exchange goes on a while: others wait in line
        await call.done_writing()  # Envoy closes its side
        while await asyncio.wait_for(call.read(), STREAM_BOUND_S) is not grpc.aio.EOF:
            pass
    # Ended within the bound, and by the server cleanly (a stream it ended early included).
    assert await asyncio.wait_for(call.code(), STREAM_BOUND_S) is grpc.StatusCode.OK


STATUSES = {shape.status for shape in _SHAPES.values()}  # what core/outcomes.py's table answers


def outcome_headers(immediate: pb.ImmediateResponse) -> list[tuple[str, str]]:
    return [(h.header.key, h.header.raw_value.decode()) for h in immediate.headers.set_headers]


def well_formed(answer: pb.ProcessingResponse) -> str:
    """What the answer is, for the statistics, after checking that Envoy and its client could
    read it: an error as an OpenAI-style JSON body; a body rewritten as JSON, with its length."""
    kind = answer.WhichOneof("response")
    if kind == "immediate_response":
        immediate = answer.immediate_response
        if immediate.details == "extproc_failover":  # the fallback's own answer, passed on as it came
            return f"{kind} {immediate.status.code} from the fallback"
        error = json.loads(immediate.body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
        assert immediate.status.code in STATUSES, immediate.status.code
        assert immediate.details == f"extproc_{dict(outcome_headers(immediate))['x-extproc-outcome']}"
        return f"{kind} {immediate.status.code} {error['code']}"
    if kind == "request_body" and answer.request_body.response.HasField("body_mutation"):
        response = answer.request_body.response
        body = response.body_mutation.body
        json.loads(body)
        lengths = [h.header.raw_value for h in response.header_mutation.set_headers if h.header.key == "content-length"]
        assert lengths == [str(len(body)).encode()], lengths
        return f"{kind} rewritten"
    return kind


async def next_answer(call) -> pb.ProcessingResponse | None:
    while (answer := await call.read()) is not grpc.aio.EOF:
        if answer.WhichOneof("response") is not None:
            event(f"answered with {well_formed(answer)}")
            return answer
        event("held in line")
    return None


def counters(server: SidecarServer) -> dict[str, float]:
    samples = parse_samples(server.metrics.render().decode())
    failures = metric_sum(samples, "extproc_upstream_outcomes_total") - metric_sum(
        samples, "extproc_upstream_outcomes_total", result="success")
    return {"admitted": metric_sum(samples, "extproc_slots_admitted_total"),
            "released": metric_sum(samples, "extproc_slots_released_total"), "failures": failures}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(st.lists(streams, min_size=1, max_size=6))
def test_any_stream_ends_cleanly_leaks_nothing_and_counts_only_upstream_failures(sidecar, examples):
    loop, server, errors = sidecar

    async def go() -> None:
        before = counters(server)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        try:
            stub = pb_grpc.ExternalProcessorStub(channel)
            await asyncio.gather(*(run_stream(stub, msgs, end, cut) for msgs, end, cut in examples))
            shadow = server.gate.shadow
            for _ in range(300):  # every stream's close runs on the server, every copy ends: back to idle
                snapshots = [await server.store.snapshot(pool) for pool in server.config.pools]
                if all(s.inflight == 0 and s.depth == 0 for s in snapshots) and not any(shadow._running.values()):
                    break
                await asyncio.sleep(0.01)
            assert all(s.inflight == 0 and s.depth == 0 and s.inflight_tokens == 0 for s in snapshots), snapshots
            assert not any(shadow._running.values()), shadow._running  # no copy counted for good
            after = counters(server)
            assert after["admitted"] - before["admitted"] == after["released"] - before["released"]
            sent_failures = sum(failing(m) for msgs, _, _ in examples for m in msgs)
            assert after["failures"] - before["failures"] <= sent_failures
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING  # the server is still there
            assert not errors.records, [r.getMessage() for r in errors.records]  # nothing it did not expect
        finally:
            await channel.close()
            for pool in server.config.pools:  # the next example starts from closed breakers
                await server.control.reset(pool)

    loop.run_until_complete(asyncio.wait_for(go(), 60))  # a hang fails the example, it does not stall the suite
