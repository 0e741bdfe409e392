"""HttpRelay, the relay the server runs, over real loopback sockets, held to the stand-in the
unit tests drive failover with (tests/relays.py): for a target that answers, refuses the
connection, resets it or stays silent past the relay's timeout, both give the same answer (the
seconds it took aside), and what HttpRelay puts on the wire is what the stand-in records."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from aiohttp import web

from extproc.lifecycle.relay import HttpRelay
from extproc_testbed.stack import free_port

from ..conftest import OFFICER_KEY
from ..helpers import chat, serving
from ..relays import REFUSED, RESET, SILENT, StandInRelay, body_for

TIMEOUT_S = 0.3
PATH = "/v1/chat/completions"
SENT_HEADERS = {"x-llm-priority": "0", "x-llm-class": "loan_approval"}


async def engine(status: int, received: list[tuple[web.Request, bytes]]) -> web.Application:
    """An engine answering every request `status`, with headers the relay must not pass on."""
    async def answer(request: web.Request) -> web.Response:
        received.append((request, await request.read()))
        return web.Response(status=status, body=body_for(status, json.loads(await request.read())),
                            headers={"Content-Type": "application/json; charset=utf-8", "x-engine": "dropped"})

    app = web.Application()
    app.router.add_post(PATH, answer)
    return app


async def listener(how: str) -> asyncio.Server:
    """A loopback server that takes the connection and resets it, or never answers."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        if how == RESET:
            writer.transport.abort()
        else:
            await reader.read()  # until the relay gives up and closes the connection
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def both_send(url: str, how: str | int):
    stand_in, real = StandInRelay(how, timeout_s=TIMEOUT_S), HttpRelay(url, TIMEOUT_S)
    args = (PATH, "vllm_fallback", chat(model="deepseek-sim-small"), SENT_HEADERS, f"Bearer {OFFICER_KEY}")
    try:
        return await stand_in.send(*args), await real.send(*args), stand_in
    finally:
        await real.close()


def unclocked(answer):
    return dataclasses.replace(answer, seconds=0.0)


@pytest.mark.parametrize("status", [200, 503, 429])
async def test_an_answer_comes_back_as_the_stand_in_gives_it_and_the_request_as_it_records_it(status):
    received = []
    async with serving(await engine(status, received)) as port:
        expected, got, stand_in = await both_send(f"http://127.0.0.1:{port}/", status)
    assert unclocked(got) == unclocked(expected)
    assert got.status == status and ("x-engine", "dropped") not in got.headers
    ((request, body),) = received
    (sent,) = stand_in.sent
    assert request.path == sent.path and json.loads(body) == sent.body
    assert request.headers["x-llm-pool"] == sent.cluster
    assert request.headers["authorization"] == sent.authorization
    assert {k: request.headers[k] for k in sent.headers} == sent.headers


async def test_a_refused_connection_is_answered_as_the_stand_in_answers_it():
    expected, got, _ = await both_send(f"http://127.0.0.1:{free_port()}", REFUSED)
    assert unclocked(got) == unclocked(expected)
    assert got.status is None and not got.timed_out


@pytest.mark.parametrize("how", [RESET, SILENT])
async def test_a_reset_or_a_silence_is_answered_as_the_stand_in_answers_it(how):
    server = await listener(how)
    try:
        expected, got, _ = await both_send(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", how)
    finally:
        server.close()
        await server.wait_closed()
    assert unclocked(got) == unclocked(expected)
    assert got.status is None and got.timed_out is (how == SILENT)
