"""The answer that carries a decision, put together as wire bytes (extproc/envoy/wire.py), parses
to the message the protobuf API builds from the same record: field for field, whatever the
record's strings hold and however long they are."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.envoy.servicer import METADATA_NAMESPACE, _set_decision
from extproc.envoy.wire import DecisionAnswers, varint
from extproc.lifecycle.placement import ENDPOINT_KEY, LB_METADATA_NAMESPACE

_text = st.text(max_size=300)  # past 127 bytes: lengths of two bytes, and more nested around them
_number = st.one_of(st.integers(0, 10**9), st.floats(allow_nan=False, allow_infinity=False))
_records = st.fixed_dictionaries({
    "request_id": st.one_of(st.none(), _text), "tenant": st.one_of(st.none(), _text),
    "branch": st.one_of(st.none(), _text), "class": _text, "priority": st.one_of(st.none(), _number),
    "pool": st.one_of(st.none(), _text), "outcome": _text, "wait_ms": st.one_of(st.none(), _number),
    "cost_tokens": st.one_of(st.none(), _number),
})
_SHARED = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(clear_route_cache=True)))


def expected(record: dict | None, endpoints: str | None) -> pb.ProcessingResponse:
    message = pb.ProcessingResponse()
    message.CopyFrom(_SHARED)
    _set_decision(message, record)
    if endpoints is not None:
        message.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields[ENDPOINT_KEY].string_value = endpoints
    return message


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.none(), _records), st.one_of(st.none(), _text), st.integers(0, 2))
def test_the_bytes_parse_to_the_message_the_protobuf_api_builds(record, endpoints, earlier):
    answers = DecisionAnswers(METADATA_NAMESPACE, LB_METADATA_NAMESPACE, ENDPOINT_KEY)
    for _ in range(earlier):  # the shared fields come from the cache from the second time on
        answers.answer(_SHARED.SerializeToString(), record, endpoints)
    written = answers.answer(_SHARED.SerializeToString(), record, endpoints)
    assert pb.ProcessingResponse.FromString(written) == expected(record, endpoints)


@given(st.integers(0, 2**63))
def test_a_varint_reads_back(n):
    from google.protobuf.internal.decoder import _DecodeVarint

    encoded = varint(n)
    assert _DecodeVarint(encoded, 0) == (n, len(encoded))
