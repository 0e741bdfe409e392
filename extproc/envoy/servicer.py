"""The Envoy ext_proc protocol adapter: messages in, gate calls, messages out. No policy here.

Envoy is configured (envoy/envoy.yaml) to send request headers, the buffered request body,
response headers, and response trailers. The last setting matters: it keeps this stream open
until the HTTP exchange is over, so the slot is released when generation ends, not at the
first byte. While a request waits in line, the server first sends a standalone
`override_message_timeout` so Envoy's short per-message timeout does not fire, then the answer.
The answer that carries the decision (admission, refusal, pass-through, a model list) also
carries it as dynamic metadata in the `extproc` namespace, for Envoy's access log (docs/logs.md).

Answers go to gRPC as wire bytes (`method_handlers` registers the handler without a response
serializer): the ones every request gets are serialized once, the one that carries a decision
is put together from pieces encoded once (envoy/wire.py), and the few built for the occasion
(a refusal, a hold, a failover) are serialized as they are built. A read or a write that fails
because the stream ended under it (gRPC's `grpc.aio.BaseError`: nothing of the sidecar's own
raises one) ends the handler quietly.

An admitted long prompt may yield its engine before its response comes (lifecycle/yielding.py):
a task of its own waits for that signal while the stream waits for Envoy's next message, and
answers in Envoy's place (an ImmediateResponse while its request is upstream: Envoy replies to the
client and resets the upstream request; tests/e2e/test_yielding.py). The two never write at once:
after the admission Envoy's next message is the response's headers, which find the exchange
either answered (the yield then writes nothing) or yielded (the stream then writes nothing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf.duration_pb2 import Duration
from grpc.aio import EOF

from ..core.headers import OWN_HEADERS, QUEUE_WAIT_MS, REQUEST_HEADERS_READ
from ..core.outcomes import HttpReply, Rejection, internal_error, reply_for
from ..core.request_life import Phase
from ..lifecycle.exchange import Exchange
from ..lifecycle.gate import AdmissionGate
from ..lifecycle.placement import ENDPOINT_KEY, LB_METADATA_NAMESPACE
from .wire import OWN_FIELDS, SHARED_FIELDS, DecisionAnswers

log = logging.getLogger("extproc")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
FILTER_NAME = "envoy.filters.http.ext_proc"  # envoy/envoy.yaml's name for the filter: its attributes' key

# Envoy accepts dynamic metadata only in the namespaces the filter lists
# (metadata_options.receiving_namespaces.untyped in envoy/envoy.yaml); the access log reads
# them as %DYNAMIC_METADATA(extproc:KEY)%.
METADATA_NAMESPACE = "extproc"
# (decision record key, metadata key)
_METADATA_FIELDS = OWN_FIELDS + SHARED_FIELDS

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: pb.HttpHeaders, wanted: frozenset[str] | None = None) -> dict[str, str]:
    """Envoy's header list as a dict (Envoy sends lower-case names; repeated names are joined
    by ','), keeping only the `wanted` names when given: the others are never decoded."""
    result: dict[str, str] = {}
    for header in headers.headers.headers:
        name = header.key
        if wanted is not None and name not in wanted:
            continue
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        result[name] = f"{result[name]},{value}" if name in result else value
    return result


def _status(headers: pb.HttpHeaders) -> int:
    for header in headers.headers.headers:
        if header.key == ":status":
            value = header.raw_value or header.value.encode()
            return int(value) if value.isdigit() else 0
    return 0


def _set_headers(pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> list[base_pb2.HeaderValueOption]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE
        )
        for name, value in pairs
    ]


def _set_decision(response: pb.ProcessingResponse, record: dict | None) -> pb.ProcessingResponse:
    """Put a decision record in the response's dynamic metadata (a value that is None is left out)."""
    if record is not None:
        metadata = response.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        for key, name in _METADATA_FIELDS:
            value = record[key]
            if value is None:
                continue
            if isinstance(value, str):
                metadata[name].string_value = value
            else:
                metadata[name].number_value = value
    return response


_DECISIONS = DecisionAnswers(METADATA_NAMESPACE, LB_METADATA_NAMESPACE, ENDPOINT_KEY)


def _with_decision(shared: bytes, record: dict | None) -> bytes:
    """A shared answer (its bytes) with the decision record as dynamic metadata."""
    return _DECISIONS.answer(shared, record)


def _immediate(rejection: Rejection, exchange: Exchange | None, record: dict | None = None) -> bytes:
    reply = reply_for(rejection)
    headers = list(reply.headers)
    if exchange is not None and exchange.pool is not None:
        headers.append((QUEUE_WAIT_MS, str(round(exchange.queue_wait_s * 1000))))
    response = _reply(HttpReply(reply.status, tuple(headers), reply.body), f"extproc_{rejection.outcome.value}")
    return _set_decision(response, record).SerializeToString()


def _reply(reply: HttpReply, details: str) -> pb.ProcessingResponse:
    """Answer the client ourselves ("extproc_..." details keep Envoy's local-reply mappers off it)."""
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=pb.HeaderMutation(set_headers=_set_headers(reply.headers)),
            body=reply.body,
            details=details,
        )
    )


_NO_ATTRIBUTES = ("", "")


def _response_attributes(message: pb.ProcessingRequest) -> tuple[str, str]:
    """(response.code_details, upstream.address) as Envoy sent them with the response headers
    (`response_attributes` in envoy.yaml; "" for one it did not send)."""
    details = upstream = ""
    attributes = message.attributes
    named = attributes.get(FILTER_NAME)  # the filter's name in envoy.yaml; another's: looked for
    for struct in (named,) if named is not None else attributes.values():
        fields = struct.fields
        value = fields.get("response.code_details")
        if value is not None:
            details = value.string_value
        value = fields.get("upstream.address")
        if value is not None:
            upstream = value.string_value
    return details, upstream


# For a shadowed, non-streamed request: Envoy sends the whole response body, to count its tokens.
_READ_BODY = processing_mode_pb2.ProcessingMode(
    response_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED,
    response_trailer_mode=processing_mode_pb2.ProcessingMode.SEND,
)


_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()

# Envoy picked a route when the headers arrived, from whatever x-llm-pool the client sent:
# removing the header is not enough, the cached route must be cleared too.
_STRIP_OWN_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(remove_headers=sorted(OWN_HEADERS)), clear_route_cache=True
        )
    )
).SerializeToString()


class OutOfOrder(Exception):
    """A message Envoy never sends at this point of a stream (configured as envoy/envoy.yaml
    configures it): a second request's headers, a body before headers or twice, a message with
    no phase. The stream is answered 500 and closed; nothing it held is kept."""


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """One exchange per stream, through gRPC's reader-writer API: `context.read()` for the next
    message, `context.write()` for each answer. (Its async-iterator API wraps both in async
    generators, one per stream each way, and drives them a message at a time: some 4 % of a
    bare processor's CPU per request, measured under load.)"""

    def __init__(self, gate: AdmissionGate, admit_client: Callable[[grpc.aio.ServicerContext], bool] | None = None):
        self.gate = gate
        # The stream's client checked before anything it sends is read (ops/allowed_clients.py):
        # None, any client that reached the port.
        self.admit_client = admit_client

    async def Process(self, request_iterator, context) -> None:
        if self.admit_client is not None and not self.admit_client(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "the client's certificate names none of listen.tls.allowed_client_names")
        exchange: Exchange | None = None
        giving_way: asyncio.Task | None = None  # an admitted long prompt, waiting to yield its engine
        gate = self.gate
        body_expected = responded = False
        read, answer = context.read, context.write  # (answers are wire bytes: see method_handlers)
        try:
            try:
                while (message := await read()) is not EOF:
                    phase = message.WhichOneof("request")
                    try:
                        if phase == "request_headers":
                            if exchange is not None:
                                raise OutOfOrder("request headers twice")
                            body_expected = not message.request_headers.end_of_stream
                            headers = header_map(message.request_headers, REQUEST_HEADERS_READ)
                            exchange = gate.open(headers)
                            shared = _CONTINUE_HEADERS if OWN_HEADERS.isdisjoint(headers) else _STRIP_OWN_HEADERS
                            if message.request_headers.end_of_stream or gate.answers_itself(exchange):
                                listed = gate.pass_through(exchange)
                                if listed is not None:  # GET /v1/models, answered from the configuration
                                    await answer(_set_decision(_reply(listed, "extproc_models_listed"),
                                                               exchange.decision).SerializeToString())
                                    return
                                shared = _with_decision(shared, exchange.decision)
                            await answer(shared)
                        elif phase == "request_body":
                            if not body_expected:
                                raise OutOfOrder("a request body before the headers, twice, or after headers that "
                                                 "ended the request")
                            body_expected = False
                            waiter = await gate.enqueue(exchange, message.request_body.body)
                            if waiter is not None:  # in line: Envoy must wait longer for the answer
                                await answer(pb.ProcessingResponse(override_message_timeout=Duration(
                                    seconds=gate.hold_seconds(exchange))).SerializeToString())
                                await gate.wait(exchange, waiter)
                            await answer(_admitted(gate.admission(exchange), exchange.decision))
                            if (signal := gate.yields.watch(exchange)) is not None:
                                giving_way = asyncio.get_running_loop().create_task(
                                    _give_way(gate, exchange, signal, answer))
                        elif phase == "response_headers":
                            if exchange is None:
                                await answer(_headers_response(()))
                                continue
                            if responded:
                                raise OutOfOrder("response headers twice")
                            if exchange.phase is Phase.YIELDED:  # the yield's answer is on its way: it answers these
                                responded = True
                                continue
                            # Before the body, too: Envoy's own local reply (a 413 for a body over its
                            # buffer) passes this filter; the request was never admitted.
                            responded, body_expected = True, False
                            status = _status(message.response_headers)
                            details, upstream = _response_attributes(message) \
                                if gate.reads_attributes(exchange, status) else _NO_ATTRIBUTES
                            plan = gate.response_started(exchange, status, details, upstream)
                            if plan.fail_over:
                                await answer(pb.ProcessingResponse(override_message_timeout=Duration(
                                    seconds=gate.failover_hold_seconds(exchange))).SerializeToString())
                                reply = await gate.fail_over(exchange)
                                if reply is not None:
                                    failover = _reply(reply, "extproc_failover")
                                    # Merged into the admission's metadata: the pool that answered.
                                    failover.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[
                                        "pool"].string_value = exchange.pool or ""
                                    await answer(failover.SerializeToString())
                                    return
                            if plan.read_body:
                                read_body = _build_headers_response(plan.set_headers)
                                read_body.mode_override.CopyFrom(_READ_BODY)
                                response = read_body.SerializeToString()
                            else:
                                response = _headers_response(plan.set_headers)
                            await answer(response)
                            if plan.finished:  # the backend is done with it: let go of the stream, release now
                                return
                        elif phase == "response_trailers":
                            await answer(_RESPONSE_TRAILERS)
                        elif phase == "request_trailers":
                            if body_expected:
                                # Headers, then trailers, no DATA (HTTP/2 allows it): Envoy sends no
                                # body in BUFFERED mode, so the request is decided here, on an empty
                                # body (refused 400), before Envoy could route it without a decision.
                                body_expected = False
                                await gate.enqueue(exchange, b"")
                            await answer(_REQUEST_TRAILERS)
                        elif phase == "response_body":
                            if exchange is not None and exchange.shadowed and message.response_body.end_of_stream:
                                gate.response_body(exchange, message.response_body.body)
                            await answer(_RESPONSE_BODY)
                        else:
                            raise OutOfOrder("a message with no phase")
                    except Rejection as rejection:
                        _stop(giving_way)  # (one answer on the stream at a time: the yield writes none now)
                        await answer(_immediate(rejection, exchange, gate.refused(exchange, rejection)))
                        return
            except OutOfOrder as error:
                log.warning("ext_proc stream out of order (%s): answered 500 and closed", error)
                _stop(giving_way)
                rejection = internal_error()
                await answer(_immediate(rejection, exchange, gate.refused(exchange, rejection)))
            except grpc.aio.BaseError:
                raise
            except Exception:
                log.exception("ext_proc stream failed")
                _stop(giving_way)
                rejection = internal_error()
                await answer(_immediate(rejection, exchange, gate.refused(exchange, rejection)))
        except grpc.aio.BaseError:
            pass  # the stream ended under a read or a write: nothing more can be answered; what it held is released below
        finally:
            _stop(giving_way)  # (over, or written: the stream is over)
            if exchange is not None:
                await gate.close(exchange)


async def _give_way(gate: AdmissionGate, exchange: Exchange, signal: asyncio.Event,
                    answer: Callable[[bytes], Awaitable[None]]) -> None:
    """An admitted long prompt yields its engine once `signal` is set (lifecycle/yielding.py): the
    503 that tells it when to come back is sent in Envoy's place, unless its response came first."""
    await signal.wait()
    try:
        rejection = gate.yields.give_way(exchange)
        if rejection is not None:
            await answer(_immediate(rejection, exchange, gate.refused(exchange, rejection)))
    except grpc.aio.BaseError:
        pass  # the stream ended meanwhile: what it held is released where it ends
    except Exception:  # (yielded, and nothing written: the stream skips the response; answer it 500)
        log.exception("a long prompt's yield failed")
        try:
            await answer(_immediate(internal_error(), exchange))
        except grpc.aio.BaseError:
            pass


def _stop(giving_way: asyncio.Task | None) -> None:
    """The yield's task, stopped before the stream answers for itself (or ends)."""
    if giving_way is not None:
        giving_way.cancel()


_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString()
_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString()
_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString()


def method_handlers(servicer: ExtProcServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The ext_proc service's one method, its answers sent as the bytes the servicer writes."""
    return {"Process": grpc.stream_stream_rpc_method_handler(
        servicer.Process, request_deserializer=pb.ProcessingRequest.FromString, response_serializer=None)}


def add_to_server(servicer: ExtProcServicer, server: grpc.aio.Server) -> None:
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class _Answers(dict):
    """Answers that recur (the same headers to set), built once: a bounded cache."""

    def get_or_build(self, key, build):
        answer = self.get(key)
        if answer is None:
            if len(self) >= 4096:
                self.clear()
            answer = self[key] = build()
        return answer


_ADMITTED = _Answers()
_RESPONSE_HEADERS = _Answers()


def _admitted(admission, record: dict | None = None) -> bytes:
    """The answer to the request body of an admitted request: its pool and priority headers,
    the route recomputed from them, the body when it was rewritten, the decision as metadata,
    and the backends to try when the sidecar picks them (Envoy's override_host reads them)."""
    if admission.body is None:  # the common case: a few pools, classes and scores
        shared = _ADMITTED.get_or_build(admission.set_headers, lambda: _build_admitted(admission).SerializeToString())
    else:
        shared = _build_admitted(admission).SerializeToString()
    return _DECISIONS.answer(shared, record, admission.endpoints)


def _build_admitted(admission) -> pb.ProcessingResponse:
    mutation = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=_set_headers(admission.set_headers)),
        clear_route_cache=True,
    )
    if admission.body is not None:
        mutation.body_mutation.body = admission.body
        mutation.header_mutation.set_headers.extend(_set_headers([("content-length", str(len(admission.body)))]))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=mutation))


def _headers_response(set_headers: tuple[tuple[str, str], ...]) -> bytes:
    """The answer to response headers."""
    return _RESPONSE_HEADERS.get_or_build(set_headers, lambda: _build_headers_response(set_headers).SerializeToString())


def _build_headers_response(set_headers) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_set_headers(set_headers)))
        )
    )
