"""The ext_proc protocol adapter, driven over a real gRPC channel (no Envoy), and body fuzzing."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.config import parse_config
from extproc.core.openai_request import parse_completion_request
from extproc.core.outcomes import Rejection
from extproc.envoy.servicer import ExtProcServicer
from extproc.server import SidecarServer
from extproc_testbed.stack import metric_sum, parse_samples
from extproc_testbed.stream_context import StreamContext

from ..conftest import e2e_config
from ..helpers import async_wait_until, webhook_receiver


def headers_msg(end_of_stream: bool = False, **headers: str) -> pb.ProcessingRequest:
    pairs = {":method": "POST", ":path": "/v1/chat/completions", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
            end_of_stream=end_of_stream,
        )
    )


def body_msg(body: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def response_headers_msg(status: int) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())]))
    )


def chat_body(model: str = "deepseek-sim") -> bytes:
    """A chat that bounds its answer (one without `max_tokens` has the default written in)."""
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}).encode()


def set_headers(mutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


class Exchange:
    """One ext_proc stream, fed message by message like Envoy does."""

    def __init__(self, stub):
        self._outbox: asyncio.Queue = asyncio.Queue()
        self.call = stub.Process(self._requests())

    async def _requests(self):
        while (message := await self._outbox.get()) is not None:
            yield message

    async def send(self, message) -> None:
        await self._outbox.put(message)

    async def receive(self) -> pb.ProcessingResponse:
        return await asyncio.wait_for(self.call.read(), 10)

    async def finish(self) -> None:
        await self._outbox.put(None)  # Envoy closes its side when the HTTP exchange is over
        assert await asyncio.wait_for(self.call.read(), 10) == grpc.aio.EOF


@contextlib.asynccontextmanager
async def serving(**overrides):
    """A real sidecar on loopback (e2e_config with `overrides`) and a stub of its ext_proc service."""
    config = parse_config(e2e_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0}, admin={"port": 0},
                                     **overrides))
    server = SidecarServer(config)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    try:
        yield server, pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await server.stop()


@pytest.fixture
async def sidecar():
    async with serving() as running:
        yield running


async def inflight(server: SidecarServer) -> int:
    return sum([(await server.store.snapshot(pool)).inflight for pool in server.config.pools])


async def test_bodyless_request_passes_with_our_headers_stripped(sidecar):
    server, stub = sidecar
    ex = Exchange(stub)
    await ex.send(headers_msg(end_of_stream=True, x_llm_pool="vllm_fallback"))
    response = await ex.receive()
    assert set(response.request_headers.response.header_mutation.remove_headers) == {"x-llm-pool", "x-llm-priority", "x-llm-class"}
    assert response.request_headers.response.clear_route_cache  # the route was picked from the client's copy
    await ex.finish()
    assert (await inflight(server)) == 0


async def test_admission_sets_the_pool_and_waiters_get_a_hold_first(sidecar):
    server, stub = sidecar
    first = Exchange(stub)
    await first.send(headers_msg(x_ticket_type="complaint"))
    await first.receive()
    await first.send(body_msg(chat_body()))
    admitted = (await first.receive()).request_body.response
    assert set_headers(admitted.header_mutation) == {"x-llm-pool": "vllm_primary", "x-llm-priority": "1", "x-llm-class": "complaint"}
    assert admitted.clear_route_cache
    assert (await inflight(server)) == 1

    second = Exchange(stub)
    await second.send(headers_msg(x_ticket_type="loan_approval"))
    await second.receive()
    await second.send(body_msg(chat_body()))
    hold = await second.receive()
    assert hold.WhichOneof("response") is None and hold.override_message_timeout.seconds == 62  # 60 s wait + margin
    gauges = parse_samples(server.metrics.render().decode())  # the pools' gauges, written as the metrics are read
    assert metric_sum(gauges, "extproc_inflight", pool="primary") == 1
    assert metric_sum(gauges, "extproc_queue_depth", pool="primary", **{"class": "loan_approval"}) == 1

    await first.send(response_headers_msg(200))
    response = await first.receive()
    assert "x-queue-wait-ms" in set_headers(response.response_headers.response.header_mutation)
    await first.finish()  # the exchange is over: its slot goes to the waiter
    admitted = (await second.receive()).request_body.response
    assert set_headers(admitted.header_mutation)["x-llm-class"] == "loan_approval"
    await second.finish()
    assert (await inflight(server)) == 0


async def test_degraded_request_gets_the_fallback_model_and_length(sidecar):
    server, stub = sidecar
    holders = []
    blocker = Exchange(stub)
    await blocker.send(headers_msg(x_ticket_type="complaint"))
    await blocker.receive()
    await blocker.send(body_msg(chat_body()))
    await blocker.receive()
    for _ in range(5):  # queue depth 5 > orange (4)
        ex = Exchange(stub)
        await ex.send(headers_msg(x_ticket_type="complaint"))
        await ex.receive()
        await ex.send(body_msg(chat_body()))
        await ex.receive()  # the hold
        holders.append(ex)
    archive = Exchange(stub)
    await archive.send(headers_msg(x_ticket_type="archive_query"))
    await archive.receive()
    await archive.send(body_msg(chat_body()))
    response = (await archive.receive()).request_body.response
    headers = set_headers(response.header_mutation)
    assert headers["x-llm-pool"] == "vllm_fallback"
    assert json.loads(response.body_mutation.body)["model"] == "deepseek-sim-small"
    assert headers["content-length"] == str(len(response.body_mutation.body))
    for ex in [archive, blocker, *holders]:
        ex.call.cancel()
    await asyncio.sleep(0.2)
    assert (await inflight(server)) == 0 and (await server.store.snapshot("primary")).depth == 0


@pytest.mark.parametrize(
    "body, status",
    [(b"{", 400), (b'"text"', 400), (b"\xff\xfe", 400), (json.dumps({"messages": "hi"}).encode(), 400),
     (json.dumps({"stream": "yes"}).encode(), 400), (b"[" * 60000, 400), (b" " * 70000, 413)],
)
async def test_bad_bodies_get_immediate_json_errors(sidecar, body, status):
    server, stub = sidecar
    ex = Exchange(stub)
    await ex.send(headers_msg())
    await ex.receive()
    await ex.send(body_msg(body))
    immediate = (await ex.receive()).immediate_response
    assert immediate.status.code == status
    assert json.loads(immediate.body)["error"]["message"]
    assert (await inflight(server)) == 0


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["model", "messages", "stream", "max_tokens", "prompt", "x"]), children, max_size=5),
    max_leaves=20,
).map(lambda value: json.dumps(value).encode())))
def test_any_body_parses_or_is_rejected_cleanly(raw):
    try:
        parsed = parse_completion_request(raw, 65536)
    except Rejection as rejection:
        assert rejection.outcome.value.startswith("rejected_")
    else:
        assert isinstance(parsed.body, dict)


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=60).map(lambda tail: "{" + tail),
    st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=4).map(json.dumps).flatmap(
        lambda text: st.sampled_from(["", " ", "\n\t ", "\x0b", "x", "{}", "\u3000"]).map(lambda tail: text + tail)),
))
def test_a_body_is_read_as_json_reads_it(text):
    """A body that starts with "{" skips json's encoding detection: the same value or the same
    error (message and position) as json.loads."""
    from extproc.core.openai_request import _object

    try:
        expected = ("value", json.loads(text))
    except json.JSONDecodeError as error:
        expected = ("error", error.msg, error.pos)
    try:
        got = ("value", _object(text))
    except json.JSONDecodeError as error:
        got = ("error", error.msg, error.pos)
    assert got == expected


async def open_exchange(stub, body: bytes, **headers) -> tuple[Exchange, pb.ProcessingResponse]:
    ex = Exchange(stub)
    await ex.send(headers_msg(**headers))
    await ex.receive()
    await ex.send(body_msg(body))
    return ex, await ex.receive()


async def test_yellow_posts_a_scale_out_signal_and_engine_priority_is_written():
    async with webhook_receiver() as (url, received):
        config = parse_config(e2e_config(
            listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0}, admin={"port": 0},
            queue={"scale_out_webhook": url, "engine_priority": True},
        ))
        server = SidecarServer(config)
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        stub = pb_grpc.ExternalProcessorStub(channel)
        try:
            blocker, admitted = await open_exchange(stub, chat_body(), x_ticket_type="loan_approval", x_urgent_level="0")
            # vLLM's --scheduling-policy priority reads "priority" from the body: lower first
            assert json.loads(admitted.request_body.response.body_mutation.body)["priority"] == 0
            queued = [await open_exchange(stub, chat_body(), x_ticket_type="complaint") for _ in range(3)]
            await async_wait_until(lambda: received)  # depth 3 > yellow (2): one POST, off the request path
            assert received[0]["event"] == "scale_out"
            assert received[0]["pool"] == "primary" and received[0]["tier"] == "yellow"
            assert received[0]["queue_depth"] == 3
            for ex, _ in [(blocker, None), *queued]:
                ex.call.cancel()
        finally:
            await channel.close()
            await server.stop()


async def test_a_stream_cancelled_while_its_hold_is_written_leaves_nothing_in_line(sidecar):
    """When Envoy resets a stream, gRPC cancels the task running its handler at the await it is
    in: here, the write of the hold. The ticket the request put in line must leave the line
    then, or it is admitted later into a slot nobody releases."""
    server, stub = sidecar
    holder = Exchange(stub)  # takes the pool's only slot
    await holder.send(headers_msg(x_ticket_type="complaint"))
    await holder.receive()
    await holder.send(body_msg(chat_body()))
    await holder.receive()

    class HoldNeverWritten(StreamContext):
        def __init__(self, messages):
            super().__init__(messages)
            self.writing_hold = asyncio.Event()

        async def write(self, message):
            if pb.ProcessingResponse.FromString(message).HasField("override_message_timeout"):
                self.writing_hold.set()
                await asyncio.Event().wait()  # the write of the hold never completes
            await super().write(message)

    context = HoldNeverWritten([headers_msg(x_ticket_type="complaint"), body_msg(chat_body())])
    stream = asyncio.create_task(ExtProcServicer(server.gate).Process(None, context))
    await asyncio.wait_for(context.writing_hold.wait(), 10)
    assert server.store.depth("primary") == 1  # the ticket is in line
    stream.cancel()  # Envoy reset the stream
    with pytest.raises(asyncio.CancelledError):
        await stream

    assert server.store.depth("primary") == 0
    await holder.finish()  # the slot comes free: nobody is in line to take it
    assert (await inflight(server)) == 0


@pytest.mark.parametrize("again", ["request_headers", "request_body", "response_headers", "no_phase"])
async def test_a_stream_out_of_order_is_answered_500_and_keeps_nothing(sidecar, again):
    """Envoy never sends a second request on one stream, a body twice, response headers twice or
    a message with no phase. A stream that does is answered 500 and closed; the slot its request
    took comes back once, nothing else is taken, and no upstream outcome is counted twice."""
    server, stub = sidecar
    streamed = json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    ex, admitted = await open_exchange(stub, streamed.encode(), x_ticket_type="complaint")
    assert admitted.WhichOneof("response") == "request_body" and (await inflight(server)) == 1
    if again == "response_headers":
        await ex.send(response_headers_msg(200))
        await ex.receive()
    message = {"request_headers": headers_msg(x_ticket_type="complaint"), "request_body": body_msg(chat_body()),
               "response_headers": response_headers_msg(503), "no_phase": pb.ProcessingRequest()}[again]
    await ex.send(message)
    answer = await ex.receive()
    assert answer.immediate_response.status.code == 500
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "internal_error"
    assert await asyncio.wait_for(ex.call.read(), 10) == grpc.aio.EOF  # the server closed the stream
    await async_wait_until(lambda: slot_counts(server)[1] == 1)
    assert slot_counts(server) == (1, 1) and (await inflight(server)) == 0
    samples = parse_samples(server.metrics.render().decode())
    upstream_outcomes = metric_sum(samples, "extproc_upstream_outcomes_total")
    assert upstream_outcomes == (1 if again == "response_headers" else 0)  # the 200, once; never the 503


def slot_counts(server: SidecarServer) -> tuple[float, float]:
    samples = parse_samples(server.metrics.render().decode())
    return metric_sum(samples, "extproc_slots_admitted_total"), metric_sum(samples, "extproc_slots_released_total")


async def test_the_benchmarks_pass_through_answers_as_the_sidecar_answers_an_admitted_request(sidecar):
    """`extproc bench overhead`'s floor_answers (testbed/passthrough.py) stands for what the
    sidecar's answers cost Envoy: it must send what the sidecar sends, field for field."""
    from extproc_testbed.passthrough import answers_like_sidecar

    server, stub = sidecar
    ex = Exchange(stub)
    await ex.send(headers_msg(x_ticket_type="complaint"))
    answers = {"request_headers": await ex.receive()}
    await ex.send(body_msg(chat_body()))
    answers["request_body"] = await ex.receive()
    await ex.send(response_headers_msg(200))
    answers["response_headers"] = await ex.receive()
    assert await asyncio.wait_for(ex.call.read(), 10) == grpc.aio.EOF  # let go after the response headers, as it is
    like = answers_like_sidecar()
    for phase, answer in answers.items():
        copy = pb.ProcessingResponse()
        copy.CopyFrom(like[phase])
        if answer.HasField("dynamic_metadata"):  # the same fields; their values are the request's own
            fields = answer.dynamic_metadata.fields["extproc"].struct_value.fields
            assert set(fields) == set(copy.dynamic_metadata.fields["extproc"].struct_value.fields)
            copy.dynamic_metadata.CopyFrom(answer.dynamic_metadata)
        if phase == "response_headers":  # the same headers; the waits are the request's own
            mine, theirs = answer.response_headers.response.header_mutation, copy.response_headers.response.header_mutation
            assert set(set_headers(mine)) == set(set_headers(theirs))
            theirs.CopyFrom(mine)
        assert answer == copy, phase


@pytest.mark.parametrize("ending", ["response_headers", "refused"])
async def test_a_stream_the_servicer_leaves_early_reads_nothing_more(sidecar, ending):
    """After the response headers of a finished response (or a refusal) the handler returns
    while Envoy's side is still open: it reads no further message, and what it held is
    released."""
    server, _ = sidecar
    body = chat_body() if ending == "response_headers" else b"{not json"
    context = StreamContext([headers_msg(x_ticket_type="complaint"), body_msg(body), response_headers_msg(200),
                             response_headers_msg(200)])  # the last is never read: the handler has let go
    await ExtProcServicer(server.gate).Process(None, context)
    phases = [a.WhichOneof("response") for a in context.answers]
    if ending == "response_headers":
        assert phases == ["request_headers", "request_body", "response_headers"] and context.reads == 3
    else:
        assert phases == ["request_headers", "immediate_response"] and context.reads == 2
    assert (await inflight(server)) == 0
