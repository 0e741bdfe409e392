"""A stream as the servicer sees it through gRPC's reader-writer API, without gRPC: for driving
`ExtProcServicer.Process` in-process (bench/servicer_path.py, tests/e2e/test_servicer.py)."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc.aio import EOF


class StreamContext:
    """`read()` gives the messages one by one, then `grpc.aio.EOF`; `write()` keeps each answer
    as written (`written`: the wire bytes gRPC would send), `answers` reads them as Envoy does.
    `reads` counts the reads, the one that found EOF included."""

    def __init__(self, messages: Iterable[pb.ProcessingRequest] | AsyncIterable[pb.ProcessingRequest]):
        self._async = hasattr(messages, "__aiter__")
        self._messages = aiter(messages) if self._async else iter(messages)  # type: ignore[arg-type]
        self.written: list[bytes | pb.ProcessingResponse] = []
        self.reads = 0

    async def read(self) -> pb.ProcessingRequest:
        self.reads += 1
        if self._async:
            return await anext(self._messages, EOF)  # type: ignore[arg-type]
        return next(self._messages, EOF)  # type: ignore[arg-type]

    async def write(self, message: bytes | pb.ProcessingResponse) -> None:
        self.written.append(message)

    @property
    def answers(self) -> list[pb.ProcessingResponse]:
        return [pb.ProcessingResponse.FromString(m) if isinstance(m, bytes) else m for m in self.written]
