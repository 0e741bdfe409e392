"""The Envoy ext_proc protocol adapter: messages in, gate calls, messages out. No policy here.

Envoy is configured (envoy/envoy.yaml) to send request headers, the buffered request body,
response headers, and response trailers. The last setting matters: it keeps this stream open
until the HTTP exchange is over, so the slot is released when generation ends, not at the
first byte. While a request waits in line, the server first sends a standalone
`override_message_timeout` so Envoy's short per-message timeout does not fire, then the answer.
The answer that carries the decision (admission, refusal, pass-through) also carries it as
dynamic metadata in the `extproc` namespace, for Envoy's access log (docs/logs.md).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf.duration_pb2 import Duration

from ..core.headers import OWN_HEADERS, QUEUE_WAIT_MS, REQUEST_HEADERS_READ
from ..core.outcomes import HttpReply, Outcome, Rejection, reply_for
from ..lifecycle.exchange import Exchange
from ..lifecycle.gate import AdmissionGate
from ..lifecycle.placement import ENDPOINT_KEY, LB_METADATA_NAMESPACE

log = logging.getLogger("extproc")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"

# Envoy accepts dynamic metadata only in the namespaces the filter lists
# (metadata_options.receiving_namespaces.untyped in envoy/envoy.yaml); the access log reads
# them as %DYNAMIC_METADATA(extproc:KEY)%.
METADATA_NAMESPACE = "extproc"
# (decision record key, metadata key)
_METADATA_FIELDS = (
    ("request_id", "request_id"), ("tenant", "tenant"), ("branch", "branch"), ("class", "class"),
    ("priority", "priority"), ("pool", "pool"), ("outcome", "outcome"), ("wait_ms", "queue_wait_ms"),
    ("cost_tokens", "cost_tokens"),
)

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
        fields = response.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        for key, name in _METADATA_FIELDS:
            value = record[key]
            if value is None:
                continue
            if isinstance(value, str):
                fields[name].string_value = value
            else:
                fields[name].number_value = value
    return response


def _with_decision(shared: pb.ProcessingResponse, record: dict | None) -> pb.ProcessingResponse:
    """A copy of a shared answer, with the decision record as dynamic metadata."""
    if record is None:
        return shared
    return _set_decision(_copy(shared), record)


def _immediate(rejection: Rejection, exchange: Exchange | None, record: dict | None = None) -> pb.ProcessingResponse:
    reply = reply_for(rejection)
    headers = list(reply.headers)
    if exchange is not None and exchange.pool is not None:
        headers.append((QUEUE_WAIT_MS, str(round(exchange.queue_wait_s * 1000))))
    response = _reply(HttpReply(reply.status, tuple(headers), reply.body), f"extproc_{rejection.outcome.value}")
    return _set_decision(response, record)


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


def _attribute(message: pb.ProcessingRequest, name: str) -> str:
    """An attribute Envoy sent with this message (`response_attributes` in envoy.yaml)."""
    for struct in message.attributes.values():
        value = struct.fields.get(name)
        if value is not None:
            return value.string_value
    return ""


# For a shadowed, non-streamed request: Envoy sends the whole response body, to count its tokens.
_READ_BODY = processing_mode_pb2.ProcessingMode(
    response_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED,
    response_trailer_mode=processing_mode_pb2.ProcessingMode.SEND,
)


_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())

# Envoy picked a route when the headers arrived, from whatever x-llm-pool the client sent:
# removing the header is not enough, the cached route must be cleared too.
_STRIP_OWN_HEADERS = pb.ProcessingResponse(
    request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(remove_headers=sorted(OWN_HEADERS)), clear_route_cache=True
        )
    )
)


class OutOfOrder(Exception):
    """A message Envoy never sends at this point of a stream (configured as envoy/envoy.yaml
    configures it): a second request's headers, a body before headers or twice, a message with
    no phase. The stream is answered 500 and closed; nothing it held is kept."""


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    def __init__(self, gate: AdmissionGate):
        self.gate = gate

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange: Exchange | None = None
        gate = self.gate
        body_expected = responded = False
        messages = aiter(request_iterator)
        try:
            async for message in messages:
                phase = message.WhichOneof("request")
                try:
                    if phase == "request_headers":
                        if exchange is not None:
                            raise OutOfOrder("request headers twice")
                        body_expected = not message.request_headers.end_of_stream
                        headers = header_map(message.request_headers, REQUEST_HEADERS_READ)
                        exchange = gate.open(headers)
                        answer = _CONTINUE_HEADERS if OWN_HEADERS.isdisjoint(headers) else _STRIP_OWN_HEADERS
                        if message.request_headers.end_of_stream:
                            gate.pass_through(exchange)
                            answer = _with_decision(answer, exchange.decision)
                        yield answer
                    elif phase == "request_body":
                        if not body_expected:
                            raise OutOfOrder("a request body before the headers, twice, or after headers that ended the request")
                        body_expected = False
                        waiter = await gate.enqueue(exchange, message.request_body.body)
                        if waiter is not None:  # in line: Envoy must wait longer for the answer
                            yield pb.ProcessingResponse(override_message_timeout=Duration(seconds=gate.hold_seconds(exchange)))
                            await gate.wait(exchange, waiter)
                        yield _admitted(gate.admission(exchange), exchange.decision)
                    elif phase == "response_headers":
                        if exchange is None:
                            yield _headers_response(())
                            continue
                        if responded:
                            raise OutOfOrder("response headers twice")
                        # Before the body, too: Envoy's own local reply (a 413 for a body over its
                        # buffer) passes this filter; the request was never admitted.
                        responded, body_expected = True, False
                        plan = gate.response_started(exchange, _status(message.response_headers),
                                                     _attribute(message, "response.code_details"),
                                                     _attribute(message, "upstream.address"))
                        if plan.fail_over:
                            yield pb.ProcessingResponse(
                                override_message_timeout=Duration(seconds=gate.failover_hold_seconds(exchange)))
                            reply = await gate.fail_over(exchange)
                            if reply is not None:
                                answer = _reply(reply, "extproc_failover")
                                # Merged into the admission's metadata: the pool that answered.
                                answer.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[
                                    "pool"].string_value = exchange.pool or ""
                                yield answer
                                return
                        if plan.read_body:
                            response = _build_headers_response(plan.set_headers)
                            response.mode_override.CopyFrom(_READ_BODY)
                        else:
                            response = _headers_response(plan.set_headers)
                        yield response
                        if plan.finished:  # the backend is done with it: let go of the stream, release now
                            return
                    elif phase == "response_trailers":
                        yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
                    elif phase == "request_trailers":
                        if body_expected:
                            # Headers, then trailers, no DATA (HTTP/2 allows it): Envoy sends no
                            # body in BUFFERED mode, so the request is decided here, on an empty
                            # body (refused 400), before Envoy could route it without a decision.
                            body_expected = False
                            await gate.enqueue(exchange, b"")
                        yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                    elif phase == "response_body":
                        if exchange is not None and exchange.shadowed and message.response_body.end_of_stream:
                            gate.response_body(exchange, message.response_body.body)
                        yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                    else:
                        raise OutOfOrder("a message with no phase")
                except Rejection as rejection:
                    yield _immediate(rejection, exchange, gate.refused(exchange, rejection))
                    return
        except OutOfOrder as error:
            log.warning("ext_proc stream out of order (%s): answered 500 and closed", error)
            rejection = Rejection(Outcome.INTERNAL_ERROR, "Internal gateway error.")
            yield _immediate(rejection, exchange, gate.refused(exchange, rejection))
        except Exception:
            log.exception("ext_proc stream failed")
            rejection = Rejection(Outcome.INTERNAL_ERROR, "Internal gateway error.")
            yield _immediate(rejection, exchange, gate.refused(exchange, rejection))
        finally:
            await _let_go(messages)  # (does not suspend: gRPC's reader ends at its yield)
            if exchange is not None:
                await gate.close(exchange)


async def _let_go(messages) -> None:
    """Close gRPC's reader of a stream the handler leaves before Envoy ends it (a finished
    response, a refusal). Left to the garbage collector, an unclosed async generator is closed
    through the event loop: a wake of its selector, as if from another thread, and a task, per
    request (about 3 % of the path's instructions, bench/servicer_path.py --instructions)."""
    close = getattr(messages, "aclose", None)
    if close is not None:
        try:
            await close()
        except RuntimeError:  # still running: a read cancelled under it ends it anyway
            pass


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


def _admitted(admission, record: dict | None = None) -> pb.ProcessingResponse:
    """The answer to the request body of an admitted request: its pool and priority headers,
    the route recomputed from them, the body when it was rewritten, the decision as metadata,
    and the backends to try when the sidecar picks them (Envoy's override_host reads them)."""
    if admission.body is None:  # the common case: a few pools, classes and scores
        response = _ADMITTED.get_or_build(admission.set_headers, lambda: _build_admitted(admission))
        if admission.endpoints is None:
            return _with_decision(response, record)
        response = _copy(response)
    else:
        response = _build_admitted(admission)
    if admission.endpoints is not None:
        lb = response.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields
        lb[ENDPOINT_KEY].string_value = admission.endpoints
    return _set_decision(response, record)


def _copy(shared: pb.ProcessingResponse) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    response.CopyFrom(shared)
    return response


def _build_admitted(admission) -> pb.ProcessingResponse:
    mutation = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=_set_headers(admission.set_headers)),
        clear_route_cache=True,
    )
    if admission.body is not None:
        mutation.body_mutation.body = admission.body
        mutation.header_mutation.set_headers.extend(_set_headers([("content-length", str(len(admission.body)))]))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=mutation))


def _headers_response(set_headers: tuple[tuple[str, str], ...]) -> pb.ProcessingResponse:
    """The answer to response headers (never change what this returns: it may be shared)."""
    return _RESPONSE_HEADERS.get_or_build(set_headers, lambda: _build_headers_response(set_headers))


def _build_headers_response(set_headers) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_set_headers(set_headers)))
        )
    )
