"""DNS messages (RFC 1035), pure: a query for one name's A or AAAA records, and what its
response says. For asking a given nameserver (`discovery.nameserver`, control/discovery.py);
without one the system's resolver answers.

A response is read defensively: anything that does not parse, answers another query, or points
outside the message raises BadResponse, never another error, so a broken or hostile answer is a
failed resolution and nothing more.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

A, AAAA = 1, 28
_CLASS_IN = 1
_OPT = 41  # EDNS(0): the UDP payload this side reads (RFC 6891)
UDP_PAYLOAD = 4096
NOERROR, NXDOMAIN = 0, 3
_HEADER = struct.Struct(">HHHHHH")
_RR = struct.Struct(">HHIH")


class BadResponse(ValueError):
    """A response that cannot be read, or is not the answer to the query."""


@dataclass(frozen=True)
class Answer:
    rcode: int  # NOERROR, NXDOMAIN, or another (a failure)
    addresses: tuple[str, ...]  # the records of the type asked, as text
    truncated: bool  # TC: the whole answer did not fit (ask again over TCP)


def qtype_for(family: str) -> int:
    return AAAA if family == "V6_ONLY" else A


def encode_name(name: str) -> bytes:
    labels = name.rstrip(".").split(".")
    out = bytearray()
    for label in labels:
        raw = label.encode("idna") if not label.isascii() else label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise ValueError(f"not a DNS name: {name!r}")
        out += bytes([len(raw)]) + raw
    if len(out) + 1 > 255:
        raise ValueError(f"DNS name too long: {name!r}")
    return bytes(out) + b"\0"


def encode_query(name: str, qtype: int, query_id: int) -> bytes:
    """A recursive query for `name`'s records of `qtype`, with an EDNS(0) record offering a
    larger UDP answer than 512 bytes (a Service with many pods)."""
    header = _HEADER.pack(query_id, 0x0100, 1, 0, 0, 1)  # RD; one question, one additional (OPT)
    question = encode_name(name) + struct.pack(">HH", qtype, _CLASS_IN)
    opt = b"\0" + _RR.pack(_OPT, UDP_PAYLOAD, 0, 0)
    return header + question + opt


def _skip_name(data: bytes, at: int) -> int:
    """The offset just past the (possibly compressed) name at `at`."""
    while True:
        if at >= len(data):
            raise BadResponse("a name runs past the end of the message")
        length = data[at]
        if length == 0:
            return at + 1
        if length & 0xC0 == 0xC0:  # a pointer ends the name
            if at + 2 > len(data):
                raise BadResponse("a name pointer runs past the end of the message")
            return at + 2
        if length & 0xC0:
            raise BadResponse(f"unknown label type {length:#x}")
        at += 1 + length


def decode_response(data: bytes, query_id: int, qtype: int) -> Answer:
    """What the response `data` to the query `query_id` for `qtype` records says."""
    if len(data) < _HEADER.size:
        raise BadResponse(f"{len(data)} bytes: shorter than a DNS header")
    ident, flags, questions, answers, _, _ = _HEADER.unpack_from(data)
    if ident != query_id or not flags & 0x8000:
        raise BadResponse("not the response to this query")
    if (flags >> 11) & 0xF != 0:
        raise BadResponse(f"opcode {(flags >> 11) & 0xF}, not a standard query's")
    at = _HEADER.size
    for _ in range(questions):
        at = _skip_name(data, at) + 4
    found: list[str] = []
    size = 4 if qtype == A else 16
    for _ in range(answers):
        at = _skip_name(data, at)
        if at + _RR.size > len(data):
            raise BadResponse("a record runs past the end of the message")
        rtype, rclass, _, length = _RR.unpack_from(data, at)
        at += _RR.size
        if at + length > len(data):
            raise BadResponse("a record's data runs past the end of the message")
        if rtype == qtype and rclass == _CLASS_IN:  # CNAMEs on the way are passed over
            if length != size:
                raise BadResponse(f"a type {qtype} record of {length} bytes")
            found.append(str(ipaddress.ip_address(data[at:at + length])))
        at += length
    if at > len(data):
        raise BadResponse("the message ends inside a question")
    return Answer(flags & 0xF, tuple(found), bool(flags & 0x0200))
