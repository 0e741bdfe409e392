"""A relay that sends nothing (extproc.lifecycle.relay.Relay): it answers each request as it is
told to, the way HttpRelay answers when its target answers, refuses the connection, resets it or
stays silent past the relay's timeout, and keeps what it was asked to send.
tests/e2e/test_relay.py holds these answers to HttpRelay's over real sockets;
tests/unit/test_failover_decisions.py drives failover with it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from extproc.lifecycle.relay import RelayAnswer

# How a target may fail to answer, and how HttpRelay (aiohttp) reports each: status None, the
# name of the exception it caught, and whether it was the relay's timeout.
REFUSED = "refused"  # nothing listens: ClientConnectorError
RESET = "reset"  # the connection closes before an answer: ServerDisconnectedError
SILENT = "silent"  # connected, and no answer within the relay's timeout: TimeoutError
FAILURES = {REFUSED: "ClientConnectorError", RESET: "ServerDisconnectedError", SILENT: "TimeoutError"}

# What an engine's JSON answer carries that HttpRelay keeps (content-type and cache-control only).
JSON_HEADERS = (("Content-Type", "application/json; charset=utf-8"),)


def engine_answer(model: str, completion_tokens: int = 4) -> bytes:
    return json.dumps({"object": "chat.completion", "model": model,
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": completion_tokens}}).encode()


def body_for(status: int, request: dict) -> bytes:
    """What the engine answers with `status`: a completion by the model asked for, or an error."""
    if status < 400:
        return engine_answer(request.get("model", ""))
    return json.dumps({"error": {"message": "failed", "code": status}}).encode()


def answer(how: str | int, timeout_s: float, body: bytes = b"") -> RelayAnswer:
    """What HttpRelay returns when its target answers `how` (an HTTP status) or fails that way."""
    if isinstance(how, int):
        return RelayAnswer(how, JSON_HEADERS, body, 0.0)
    return RelayAnswer(None, (), b"", timeout_s if how == SILENT else 0.0, FAILURES[how], timed_out=how == SILENT)


@dataclass(frozen=True)
class Sent:
    path: str
    cluster: str
    body: dict
    headers: dict[str, str]
    authorization: str | None


class StandInRelay:
    """Answers the requests sent to it in turn with `answers` (the last one again once they run
    out): an HTTP status, whose body is a completion by the model the request asked for, or one
    of REFUSED, RESET, SILENT."""

    def __init__(self, *answers: str | int, timeout_s: float = 10.0) -> None:
        assert answers
        self.answers = list(answers)
        self.timeout_s = timeout_s
        self.sent: list[Sent] = []

    async def send(self, path: str, cluster: str, body: bytes, headers: dict[str, str],
                   authorization: str | None = None) -> RelayAnswer:
        request = json.loads(body)
        self.sent.append(Sent(path, cluster, request, dict(headers), authorization))
        await asyncio.sleep(0)  # an answer is never at once: whatever waits for it runs first
        how = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return answer(how, self.timeout_s, body_for(how, request) if isinstance(how, int) else b"")
