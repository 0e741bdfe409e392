"""The floor any Python ext_proc pays: a bare grpc.aio processor that answers every message
with an empty response and decides nothing (`python -m extproc.testbed.passthrough --port P`).

It speaks the same processing mode as the sidecar (request headers, buffered body, response
headers, response trailers), so Envoy sends it the same messages: measured beside the sidecar,
the difference is the sidecar's own work.
"""

from __future__ import annotations

import argparse

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from .. import event_loop

_ANSWERS = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


class PassThrough(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator, context):
        async for message in request_iterator:
            yield _ANSWERS[message.WhichOneof("request")]


async def serve(host: str, port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(PassThrough(), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"pass-through ext_proc on {host}:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        event_loop.run(serve(args.host, args.port))  # the loop the sidecar runs on, for a fair floor
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
