"""DNS messages (RFC 1035), pure: a query for one name's A or AAAA records, and what its
response says. For asking a given nameserver (`discovery.nameserver`, control/discovery.py);
without one the system's resolver answers.

A response is read defensively: anything that does not parse, answers another question, or
points outside the message raises BadResponse, never another error, so a broken or hostile
answer is a failed resolution and nothing more; one that is no response to the query at all
(another id) raises NotTheAnswer, which a reader over UDP passes over to wait for the answer.
Only the records of the name asked, or of a name its CNAME records lead to, are taken.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

A, AAAA, _CNAME = 1, 28, 5
_MAX_CNAMES = 16  # the links of a CNAME chain in one answer followed
_CLASS_IN = 1
_OPT = 41  # EDNS(0): the UDP payload this side reads (RFC 6891)
UDP_PAYLOAD = 1232  # no IP fragments on any path (DNS Flag Day 2020); larger: TC, then TCP
NOERROR, NXDOMAIN = 0, 3
_HEADER = struct.Struct(">HHHHHH")
_RR = struct.Struct(">HHIH")


class BadResponse(ValueError):
    """A response that cannot be read, or is not the answer to the query."""


class NotTheAnswer(BadResponse):
    """A message that is no response to the query (another id, or a query)."""


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
    larger UDP answer than 512 bytes (a Service with many pods; more: over TCP)."""
    header = _HEADER.pack(query_id, 0x0100, 1, 0, 0, 1)  # RD; one question, one additional (OPT)
    question = encode_name(name) + struct.pack(">HH", qtype, _CLASS_IN)
    opt = b"\0" + _RR.pack(_OPT, UDP_PAYLOAD, 0, 0)
    return header + question + opt


def _read_name(data: bytes, at: int) -> tuple[tuple[bytes, ...], int]:
    """The name at `at`, its labels in lower case, and the offset just past it. A pointer must
    point before the labels read so far (as a compressing server's do), so no name loops."""
    labels: list[bytes] = []
    end, start, size = None, at, 1
    while True:
        if at >= len(data):
            raise BadResponse("a name runs past the end of the message")
        length = data[at]
        if length & 0xC0 == 0xC0:  # a pointer: the rest of the name is elsewhere
            if at + 2 > len(data):
                raise BadResponse("a name pointer runs past the end of the message")
            target = (length & 0x3F) << 8 | data[at + 1]
            if target >= start:
                raise BadResponse("a name pointer that does not point back")
            end = at + 2 if end is None else end
            at = start = target
            continue
        if length & 0xC0:
            raise BadResponse(f"unknown label type {length:#x}")
        if length == 0:
            return tuple(labels), at + 1 if end is None else end
        size += 1 + length
        if at + 1 + length > len(data):
            raise BadResponse("a name runs past the end of the message")
        if size > 255:
            raise BadResponse("a name of more than 255 bytes")
        labels.append(data[at + 1:at + 1 + length].lower())
        at += 1 + length


def decode_response(data: bytes, query_id: int, qtype: int, name: str) -> Answer:
    """What the response `data` to the query `query_id` for `name`'s `qtype` records says: the
    records of `name`, or of the names its CNAME records in the answer lead to."""
    if len(data) < _HEADER.size:
        raise BadResponse(f"{len(data)} bytes: shorter than a DNS header")
    ident, flags, questions, answers, _, _ = _HEADER.unpack_from(data)
    if ident != query_id or not flags & 0x8000:
        raise NotTheAnswer("not the response to this query")
    if (flags >> 11) & 0xF != 0:
        raise BadResponse(f"opcode {(flags >> 11) & 0xF}, not a standard query's")
    rcode, truncated = flags & 0xF, bool(flags & 0x0200)
    if truncated or (rcode not in (NOERROR, NXDOMAIN) and not questions):
        return Answer(rcode, (), truncated)  # a truncated message may be cut anywhere: asked again over TCP
    if questions != 1:
        raise BadResponse(f"{questions} questions in the response to one")
    asked, at = _read_name(data, _HEADER.size)
    if at + 4 > len(data):
        raise BadResponse("the message ends inside a question")
    if (asked, struct.unpack_from(">HH", data, at)) != (_read_name(encode_name(name), 0)[0], (qtype, _CLASS_IN)):
        raise BadResponse("the answer to another question")
    at += 4
    records: list[tuple[tuple[bytes, ...], int, int, int]] = []  # (owner, type, offset of its data, length)
    cnames: dict[tuple[bytes, ...], list[int]] = {}  # owner -> the offsets of its CNAME records' data
    for _ in range(answers):
        owner, at = _read_name(data, at)
        if at + _RR.size > len(data):
            raise BadResponse("a record runs past the end of the message")
        rtype, rclass, _, length = _RR.unpack_from(data, at)
        at += _RR.size
        if at + length > len(data):
            raise BadResponse("a record's data runs past the end of the message")
        if rclass == _CLASS_IN and rtype in (qtype, _CNAME):
            records.append((owner, rtype, at, length))
            if rtype == _CNAME:
                cnames.setdefault(owner, []).append(at)
        at += length
    names, chain = {asked}, {asked}
    for _ in range(_MAX_CNAMES):  # the names the CNAME chain from the question leads to
        chain = {_read_name(data, offset)[0] for owner in chain for offset in cnames.get(owner, ())} - names
        names |= chain
    found: list[str] = []
    size = 4 if qtype == A else 16
    for owner, rtype, at, length in records:
        if rtype == qtype and owner in names:
            if length != size:
                raise BadResponse(f"a type {qtype} record of {length} bytes")
            found.append(str(ipaddress.ip_address(data[at:at + length])))
    if not found and any(rtype == qtype for _, rtype, _, _ in records):
        raise BadResponse(f"type {qtype} records for another name than {name!r}")
    return Answer(rcode, tuple(found), truncated)
