"""The answer that carries a decision, as protobuf wire bytes, put together per request.

The servicer writes its answers to gRPC as bytes (its handler is registered without a response
serializer, envoy/servicer.py): an answer the same for every request is serialized once. The one
that carries a decision (an admission, the pass-through of a bodyless request) differs from one
request to the next only in its dynamic metadata, and there mostly in the request's own id, wait
and cost. So it is the shared answer's bytes, serialized once, followed by its
`dynamic_metadata` field (`ProcessingResponse` field 8, a `Struct`), whose fields are encoded
here by the protobuf wire rules: those a classification, pool and outcome share once, the
request's own each time. A reader takes a message's fields in any order, so the bytes parse to
the message the protobuf API builds from the same record (tests/unit/test_wire.py holds them to it,
field for field, and Envoy reads them through real gRPC in the end-to-end tests).
"""

from __future__ import annotations

import struct

_DOUBLE = struct.Struct("<d").pack

# The decision record's fields in the metadata, under the names the access log reads
# (docs/logs.md): those a classification, pool and outcome share, and the request's own.
SHARED_FIELDS = (("tenant", "tenant"), ("branch", "branch"), ("class", "class"), ("priority", "priority"),
                 ("pool", "pool"), ("outcome", "outcome"))
OWN_FIELDS = (("request_id", "request_id"), ("wait_ms", "queue_wait_ms"), ("cost_tokens", "cost_tokens"))


def varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + varint(len(payload)) + payload


def value(v: str | float | int) -> bytes:
    """A `google.protobuf.Value`: a string, or a number (a double)."""
    if isinstance(v, str):
        return _delimited(b"\x1a", v.encode())  # string_value = 3
    return b"\x11" + _DOUBLE(v)  # number_value = 2 (fixed64)


def entry(key: str, encoded_value: bytes) -> bytes:
    """One entry of a `Struct`'s `fields` map (field 1: key 1, value 2)."""
    return _delimited(b"\x0a", _delimited(b"\x0a", key.encode()) + _delimited(b"\x12", encoded_value))


def fields(record: dict, names: tuple[tuple[str, str], ...]) -> bytes:
    """The entries of `record`'s fields `names` ((record key, metadata name)); a None is left out."""
    return b"".join(entry(name, value(record[key])) for key, name in names if record[key] is not None)


def namespace(name: str, entries: bytes) -> bytes:
    """A metadata namespace: an entry whose value is a `Struct` of `entries` (struct_value = 5)."""
    return entry(name, _delimited(b"\x2a", entries))


def dynamic_metadata(namespaces: bytes) -> bytes:
    """`ProcessingResponse.dynamic_metadata` (field 8), a `Struct` of `namespaces`."""
    return _delimited(b"\x42", namespaces)


# The request's own fields, their constant parts encoded once: a number's entry is fixed but
# for its 8 bytes.
_WAIT = entry("queue_wait_ms", value(0.0))[:-8]
_COST = entry("cost_tokens", value(0.0))[:-8]


def _request_id(request_id: str) -> bytes:
    encoded = request_id.encode()
    n = len(encoded)
    if n >= 0x70:  # a length past one byte somewhere: the general way
        return entry("request_id", value(request_id))
    # entry: key "request_id" (12 bytes), value: string_value of n bytes (n + 2)
    return b"\x0a" + bytes((n + 16,)) + b"\x0a\x0arequest_id\x12" + bytes((n + 2,)) + b"\x1a" + bytes((n,)) + encoded


class DecisionAnswers:
    """Answers that carry a decision: `answer(shared, record)` is the shared answer's bytes with
    the decision `record` as dynamic metadata in `metadata_namespace` (and the backends Envoy
    is told to try, in `lb_namespace`, when there are some)."""

    def __init__(self, metadata_namespace: str, lb_namespace: str, endpoint_key: str, size: int = 4096):
        self.metadata_namespace = metadata_namespace
        self.lb_namespace = lb_namespace
        self.endpoint_key = endpoint_key
        self.size = size
        self._shared: dict[tuple, bytes] = {}  # the shared fields' values -> their entries
        # the namespace's entry up to its value's length: key, then the value's tag
        self._namespace_key = _delimited(b"\x0a", metadata_namespace.encode()) + b"\x12"

    def answer(self, shared: bytes, record: dict | None, endpoints: str | None = None) -> bytes:
        if record is None:
            if endpoints is None:
                return shared
            return shared + dynamic_metadata(namespace(self.lb_namespace, entry(self.endpoint_key, value(endpoints))))
        key = (record["tenant"], record["branch"], record["class"], record["priority"], record["pool"],
               record["outcome"])
        entries = self._shared.get(key)
        if entries is None:
            if len(self._shared) >= self.size:
                self._shared.clear()
            entries = self._shared[key] = fields(record, SHARED_FIELDS)
        request_id, wait, cost = record["request_id"], record["wait_ms"], record["cost_tokens"]
        if request_id is not None:
            entries += _request_id(request_id)
        if wait is not None:
            entries += _WAIT + _DOUBLE(wait)
        if cost is not None:
            entries += _COST + _DOUBLE(cost)
        struct_value = b"\x2a" + varint(len(entries)) + entries
        body = self._namespace_key + varint(len(struct_value)) + struct_value
        metadata = b"\x0a" + varint(len(body)) + body
        if endpoints is not None:
            metadata += namespace(self.lb_namespace, entry(self.endpoint_key, value(endpoints)))
        return shared + b"\x42" + varint(len(metadata)) + metadata
