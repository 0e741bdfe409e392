"""Requests the sidecar sends itself, through Envoy's relay listener: a failover attempt (a
request whose first attempt failed before its response started) and a shadow copy.

Both are admitted by the sidecar before they are sent (they hold a slot of the pool they go
to), so the relay listener has no ext_proc filter; it routes by `x-llm-pool` like the main
listener and must only listen on loopback. They carry the client's `Authorization`, as the
main path does (an engine started with `--api-key` refuses a request without it). The whole
answer is read (a streamed one too), so it can be returned to the client in one piece or
compared.

`Relay` is what the gate, failover.py and shadow.py need of it: one `send` that never raises for
a target it could not reach. `HttpRelay` is the one the server runs (aiohttp, through Envoy's
relay listener); the unit tests give the gate a stand-in that answers as told (tests/relays.py,
held to HttpRelay's failures in tests/e2e/test_relay.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from ..core.headers import POOL

_KEPT_HEADERS = ("content-type", "cache-control")


@dataclass(frozen=True)
class RelayAnswer:
    status: int | None  # None: no answer (connection refused, reset, timeout)
    headers: tuple[tuple[str, str], ...]
    body: bytes
    seconds: float
    error: str = ""
    timed_out: bool = False  # no answer within the relay's timeout (status None)

    def completion_tokens(self) -> int | None:
        return completion_tokens(self.body)


def completion_tokens(body: bytes) -> int | None:
    """`usage.completion_tokens` of an OpenAI-style JSON answer (None if it has none)."""
    try:
        usage = json.loads(body).get("usage") or {}
    except (ValueError, AttributeError):
        return None
    tokens = usage.get("completion_tokens")
    return tokens if isinstance(tokens, int) and tokens >= 0 else None


class Relay(Protocol):
    """What failover and shadow copies send through."""

    async def send(self, path: str, cluster: str, body: bytes, headers: dict[str, str],
                   authorization: str | None = None) -> RelayAnswer:
        """POST `body` to `cluster`'s `path`, with the pool header and `authorization` (the
        client's, as it came). A target that is not reached (refused, reset, no answer within
        the relay's timeout, a header that cannot be written) is an answer with `status` None,
        `error` naming why and `timed_out` set for a timeout: never an exception."""
        ...


class HttpRelay:
    """The relay the server runs: one aiohttp session to Envoy's relay listener at `url`."""

    def __init__(self, url: str, timeout_s: float):
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def send(self, path: str, cluster: str, body: bytes, headers: dict[str, str],
                   authorization: str | None = None) -> RelayAnswer:
        """POST `body` to `cluster`; `authorization`: the client's header, passed on as it came."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        started = time.monotonic()
        send_headers = {**headers, POOL: cluster, "content-type": "application/json"}
        if authorization is not None:
            send_headers["authorization"] = authorization
        try:
            async with self._session.post(f"{self.url}{path}", data=body, headers=send_headers) as response:
                payload = await response.read()
                kept = tuple((k, v) for k, v in response.headers.items() if k.lower() in _KEPT_HEADERS)
                return RelayAnswer(response.status, kept, payload, time.monotonic() - started)
        # (ValueError: a header aiohttp refuses to write, a control character in the client's Authorization)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            return RelayAnswer(None, (), b"", time.monotonic() - started, type(error).__name__,
                               timed_out=isinstance(error, asyncio.TimeoutError))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
