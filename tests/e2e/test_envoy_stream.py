"""What Envoy sends on the ext_proc stream as an exchange ends, each way it can end.

The sidecar decides who ended an exchange (the client, or the upstream) from these facts alone,
so they are checked here against the real Envoy, with the filter configured as the shipped
template configures it, a recording ext_proc server and a backend that misbehaves on request:

- every upstream failure before the response started (connect failure, reset, route timeout)
  reaches the filter as response headers, Envoy's own 503 or 504, with `response.code_details`
  naming the failure;
- a client that leaves, while its request is held by the processor or after admission before
  the response, gets no response-phase message at all: the stream just ends;
- after the response headers, a stream that completes, a client that leaves mid-stream and an
  upstream reset mid-stream look alike (no trailers, the stream ends);
- whether the gRPC stream ends by a reset or by a half-close says nothing about who ended it;
- the filter sends only the headers the sidecar reads (the template's forward_rules).
"""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from extproc_testbed.envoy_config import INGRESS_LISTENER, EnvoyLayout, render, template_path
from extproc_testbed.stack import ManagedProcess, envoy_binary, free_port, http_get, wait_until

# Each case names its request by a header the template forwards to ext_proc (forward_rules).
CASE_HEADER = "x-request-id"
HOLD_S = 2.0  # how long the recorder holds a request marked "held"


class Recorder(pb_grpc.ExternalProcessorServicer):
    """Admits every request to the cluster its case names, and records what Envoy sent."""

    def __init__(self, cases: dict[str, dict]):
        self.cases = cases
        self.seen: dict[str, list[tuple]] = {}
        self.header_names: dict[str, dict[str, list[str]]] = {}  # case -> phase -> names Envoy sent

    async def Process(self, messages, context):
        events: list[tuple] = []
        case: dict = {}

        def ended(_context) -> None:
            # A reset can land while gRPC writes a reply, outside this generator: it is then
            # never resumed (no CancelledError here), so the end is recorded from the RPC.
            if not events or events[-1][0] != "end":
                events.append(("end", "reset"))

        context.add_done_callback(ended)
        try:
            async for message in messages:
                phase = message.WhichOneof("request")
                if phase == "request_headers":
                    name = _header(message.request_headers, CASE_HEADER)
                    self.seen[name] = events
                    self.header_names[name] = {phase: [h.key for h in message.request_headers.headers.headers]}
                    case = self.cases[name]
                    events.append((phase,))
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif phase == "request_body":
                    events.append((phase,))
                    if case.get("held"):
                        yield pb.ProcessingResponse(override_message_timeout=Duration(seconds=30))
                        await asyncio.sleep(HOLD_S)
                    pool = base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
                        key="x-llm-pool", raw_value=case.get("cluster", "vllm_primary").encode()))
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                        header_mutation=pb.HeaderMutation(set_headers=[pool]), clear_route_cache=True)))
                elif phase == "response_headers":
                    details = next((s.fields["response.code_details"].string_value
                                    for s in message.attributes.values() if "response.code_details" in s.fields), "")
                    events.append((phase, int(_header(message.response_headers, ":status")), details))
                    self.header_names[name][phase] = [h.key for h in message.response_headers.headers.headers]
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                else:
                    events.append((phase,))
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
            events.append(("end", "half-close"))
        except asyncio.CancelledError:
            ended(context)
            raise


def _header(headers: pb.HttpHeaders, name: str) -> str:
    return next((h.raw_value or h.value.encode()).decode() for h in headers.headers.headers if h.key == name)


async def backend(request: web.Request) -> web.StreamResponse:
    """/ok, /slow (headers after 3 s), /stream (3 s of events), /500, /reset_before, /reset_mid, /hang."""
    kind = request.match_info["kind"]
    await request.read()
    if kind == "ok":
        return web.json_response({"ok": True})
    if kind == "slow":
        await asyncio.sleep(3)
        return web.json_response({"ok": True})
    if kind == "500":
        return web.json_response({"error": "boom"}, status=500)
    if kind == "reset_before":
        request.transport.abort()
        return web.Response()
    if kind == "hang":
        await asyncio.sleep(30)
        return web.Response()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for i in range(30 if kind == "stream" else 1):
        await response.write(f"data: {i}\n\n".encode())
        await asyncio.sleep(0.1)
    if kind == "reset_mid":
        request.transport.abort()
    return response


CASES = {
    # name: path, seconds after which the client gives up (None: it waits), recorder options
    "completed": ("/ok", None, {}),
    "stream_completed": ("/stream", None, {}),
    "client_left_while_held": ("/ok", 0.5, {"held": True}),
    "client_left_before_response": ("/slow", 0.5, {}),
    "client_left_mid_stream": ("/stream", 1.0, {}),
    "upstream_500": ("/500", None, {}),
    "upstream_reset_before_response": ("/reset_before", None, {}),
    "upstream_reset_mid_stream": ("/reset_mid", None, {}),
    "route_timeout": ("/hang", None, {}),
    "connect_failure": ("/ok", None, {"cluster": "vllm_fallback"}),
}


@pytest.fixture(scope="module")
def recorder(tmp_path_factory) -> Recorder:
    """The recorder, after every case ran once through real Envoy."""
    return asyncio.run(observe(tmp_path_factory.mktemp("envoy_stream")))


@pytest.fixture(scope="module")
def seen(recorder) -> dict[str, list[tuple]]:
    """What the recorder saw, by case."""
    return recorder.seen


async def observe(work) -> Recorder:
    grpc_port, envoy_port, admin_port, backend_port, closed_port = (free_port() for _ in range(5))
    recorder = Recorder({name: options for name, (_, _, options) in CASES.items()})
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(recorder, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    app = web.Application()
    app.router.add_route("*", "/{kind}", backend)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", backend_port).start()

    layout = EnvoyLayout(listen=("127.0.0.1", envoy_port), admin=("127.0.0.1", admin_port),
                         extproc=[("127.0.0.1", grpc_port)],
                         clusters={"vllm_primary": [("127.0.0.1", backend_port)],
                                   "vllm_fallback": [("127.0.0.1", closed_port)]})  # nothing listens there
    config = render(yaml.safe_load(template_path().read_text("utf-8")), layout)
    listeners = config["static_resources"]["listeners"]
    config["static_resources"]["listeners"] = [li for li in listeners if li["name"] == INGRESS_LISTENER]
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for route in manager["route_config"]["virtual_hosts"][0]["routes"]:
        route["route"]["timeout"] = "4s"  # the template's 300 s, shortened for the timeout case
    (work / "envoy.yaml").write_text(yaml.safe_dump(config), "utf-8")
    envoy = ManagedProcess("envoy", [envoy_binary(), "-c", str(work / "envoy.yaml"), "--concurrency", "1",
                                     "--use-dynamic-base-id", "--log-level", "warn"], work / "envoy.log")
    envoy.start()
    healthy = f"extproc::127.0.0.1:{grpc_port}::health_flags::healthy"
    await asyncio.to_thread(wait_until, lambda: healthy in http_get(f"http://127.0.0.1:{admin_port}/clusters")[1],
                            30, "Envoy to see the recorder healthy", envoy)
    try:
        async with aiohttp.ClientSession() as session:
            async def one(name: str, path: str, give_up: float | None) -> None:
                async def exchange() -> None:
                    async with session.post(f"http://127.0.0.1:{envoy_port}{path}", data=b"{}",
                                            headers={CASE_HEADER: name, "content-type": "application/json"}) as answer:
                        await answer.read()
                try:
                    await asyncio.wait_for(exchange(), give_up)
                except (asyncio.TimeoutError, aiohttp.ClientError):
                    pass

            await asyncio.gather(*(one(name, path, give_up) for name, (path, give_up, _) in CASES.items()))
            for _ in range(100):  # until every stream has ended
                if len(recorder.seen) == len(CASES) and all(e[-1][0] == "end" for e in recorder.seen.values()):
                    break
                await asyncio.sleep(0.1)
        return recorder
    finally:
        envoy.stop()
        await server.stop(0)
        await runner.cleanup()


def response_phases(events: list[tuple]) -> list[tuple]:
    """What Envoy sent after the request phases, the stream's end aside."""
    return [e for e in events if e[0] not in ("request_headers", "request_body", "end")]


def test_every_case_ran_to_the_end_of_its_stream(seen):
    assert set(seen) == set(CASES)
    for name, events in seen.items():
        assert events[0] == ("request_headers",) and events[-1][0] == "end", (name, events)


@pytest.mark.parametrize("name", ["client_left_while_held", "client_left_before_response"])
def test_a_client_that_leaves_before_its_response_gets_no_response_phase(seen, name):
    assert response_phases(seen[name]) == []


@pytest.mark.parametrize("name, status, details", [
    ("upstream_reset_before_response", 503, "upstream_reset_before_response_started{connection_termination}"),
    ("connect_failure", 503, "upstream_reset_before_response_started{remote_connection_failure"),
    ("route_timeout", 504, "response_timeout"),
    ("upstream_500", 500, "via_upstream"),
])
def test_an_upstream_failure_before_the_response_arrives_as_response_headers(seen, name, status, details):
    (phase, got_status, got_details), *_ = response_phases(seen[name])
    assert phase == "response_headers" and got_status == status and got_details.startswith(details)


@pytest.mark.parametrize("name", ["stream_completed", "client_left_mid_stream", "upstream_reset_mid_stream"])
def test_after_the_response_headers_a_completed_stream_and_a_cut_one_look_alike(seen, name):
    assert response_phases(seen[name]) == [("response_headers", 200, "via_upstream")]


def test_envoy_sends_the_sidecar_only_the_headers_it_reads(recorder):
    """The client's content-type, Envoy's :authority and :scheme, the backend's content-type and
    date: none of them reach the processor; what the sidecar reads does (:method too: GET
    /v1/models may be the sidecar's to answer)."""
    names = recorder.header_names["stream_completed"]
    assert sorted(names["request_headers"]) == sorted([":method", ":path", "content-length", CASE_HEADER])
    assert names["response_headers"] == [":status"]
