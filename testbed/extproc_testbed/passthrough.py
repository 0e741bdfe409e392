"""The floor any Python ext_proc pays: a bare grpc.aio processor that answers every message
with an empty response and decides nothing (`python -m extproc_testbed.passthrough --port P`).

It speaks the same processing mode as the sidecar (request headers, buffered body, response
headers, response trailers), so Envoy sends it the same messages: measured beside the sidecar,
the difference is the sidecar's own work.

The floor reads and answers through gRPC's async-iterator API (the handler an async generator
over the request iterator), as gRPC's examples write a bidirectional stream.

With `--answer-like-sidecar` it answers as the sidecar answers an admitted, non-streamed
request, decided once for all: the pool, priority and class headers with the route cleared, the
decision as dynamic metadata, the wait headers on the response, and the stream let go after the
response headers; and it reads and answers as the sidecar does, through gRPC's reader-writer
API. What that costs beside the bare floor is what the sidecar's answers and its way of using
gRPC cost Envoy and gRPC; what the sidecar costs over it is its decisions.
"""

from __future__ import annotations

import argparse

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc.aio import EOF
from grpc_health.v1._async import HealthServicer

from extproc import event_loop

_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_ANSWERS = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def answers_like_sidecar() -> dict[str, pb.ProcessingResponse]:
    """The sidecar's answers to an admitted, non-streamed complaint, as envoy/servicer.py builds
    them (built here from the protocol alone; tests/e2e/test_servicer.py holds them to the sidecar's)."""
    from envoy.config.core.v3 import base_pb2

    from extproc.core.headers import CLASS, POOL, PREDICTED_WAIT_MS, PRIORITY, QUEUE_WAIT_MS

    def set_headers(*pairs: tuple[str, str]) -> pb.HeaderMutation:
        return pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD) for k, v in pairs])

    admitted = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=set_headers((POOL, "vllm_primary"), (PRIORITY, "1"), (CLASS, "complaint")),
        clear_route_cache=True)))
    decision = admitted.dynamic_metadata.fields["extproc"].struct_value.fields
    for key, value in (("request_id", "0123456789ab-1"), ("tenant", "anonymous"), ("branch", "unknown"),
                       ("class", "complaint"), ("pool", "primary"), ("outcome", "admitted")):
        decision[key].string_value = value
    for key, number in (("priority", 1.0), ("queue_wait_ms", 0), ("cost_tokens", 11)):
        decision[key].number_value = number
    response = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
        header_mutation=set_headers((QUEUE_WAIT_MS, "0"), (PREDICTED_WAIT_MS, "0")))))
    return {**_ANSWERS, "request_body": admitted, "response_headers": response}


class PassThrough(pb_grpc.ExternalProcessorServicer):
    """The floor: every message answered empty, through the async-iterator API."""

    async def Process(self, request_iterator, context):
        async for message in request_iterator:
            yield _ANSWERS[message.WhichOneof("request")]


class AnswersLikeSidecar(pb_grpc.ExternalProcessorServicer):
    """The sidecar's answers to an admitted request, through the reader-writer API and as wire
    bytes, as the sidecar reads and writes (envoy/servicer.py), letting go after the response
    headers. Registered by `add_to_server` (gRPC sends the bytes as they are)."""

    def __init__(self) -> None:
        self.answers = {phase: answer.SerializeToString() for phase, answer in answers_like_sidecar().items()}

    def add_to_server(self, server: grpc.aio.Server) -> None:
        handlers = {"Process": grpc.stream_stream_rpc_method_handler(
            self.Process, request_deserializer=pb.ProcessingRequest.FromString, response_serializer=None)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        server.add_registered_method_handlers(_SERVICE, handlers)

    async def Process(self, request_iterator, context) -> None:
        read, write = context.read, context.write
        while (message := await read()) is not EOF:
            phase = message.WhichOneof("request")
            await write(self.answers[phase])
            if phase == "response_headers":
                return


async def serve(host: str, port: int, like_sidecar: bool = False) -> None:
    server = grpc.aio.server()
    if like_sidecar:
        AnswersLikeSidecar().add_to_server(server)
    else:
        pb_grpc.add_ExternalProcessorServicer_to_server(PassThrough(), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for service in ("", _SERVICE):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"pass-through ext_proc on {host}:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--answer-like-sidecar", action="store_true",
                        help="answer as the sidecar answers an admitted request, without deciding anything")
    args = parser.parse_args()
    try:
        event_loop.run(serve(args.host, args.port, args.answer_like_sidecar))  # the loop the sidecar runs on, for a fair floor
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
