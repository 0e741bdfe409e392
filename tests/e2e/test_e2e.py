"""End to end: real HTTP through real Envoy to the sidecar and the simulated vLLM pool."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import openai
import pytest
from multidict import CIMultiDict

from extproc_testbed.stack import http_get

from ..conftest import CLERK_KEY, OFFICER_KEY
from ..helpers import async_wait_until, chat, metric, wait_until


def post_json(url: str, payload: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(payload).encode(), {"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def pause_sims(stack, paused: bool, pools: tuple[str, ...] = ("primary", "fallback")) -> None:
    for pool in pools:
        ports = stack.ports.primary if pool == "primary" else stack.ports.fallback
        for i in range(len(ports)):
            post_json(f"{stack.sim_url(i, pool)}/sim/faults", {"paused": paused})


def sim_stats(stack, pool: str = "primary") -> dict:
    return json.loads(http_get(f"{stack.sim_url(0, pool)}/sim/stats")[1])


def inflight(stack, pool: str = "primary") -> float:
    return metric(stack.metrics_url, "extproc_inflight", pool=pool)


def depth(stack, pool: str = "primary") -> float:
    return metric(stack.metrics_url, "extproc_queue_depth", pool=pool)


@pytest.fixture(autouse=True)
def leave_idle(stack):
    yield
    pause_sims(stack, False)
    wait_until(lambda: inflight(stack) == 0 and depth(stack) == 0, 30, "the pool to go idle")
    wait_until(lambda: inflight(stack, "fallback") == 0 and depth(stack, "fallback") == 0, 30, "fallback idle")


async def send(session: aiohttp.ClientSession, stack, body: bytes, **headers: str) -> tuple[int, CIMultiDict, dict]:
    hdrs = {"content-type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}}
    async with session.post(f"{stack.url}/v1/chat/completions", data=body, headers=hdrs) as response:
        text = await response.text()
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            payload = {"raw": text}
        return response.status, CIMultiDict(response.headers), payload


async def occupy_slot(session, stack, user: str = "blocker") -> asyncio.Task:
    """Pause the primary sim and put one request on the pool's only slot."""
    pause_sims(stack, True, ("primary",))
    task = asyncio.create_task(send(session, stack, chat(user=user), x_ticket_type="complaint"))
    await async_wait_until(lambda: inflight(stack) == 1, what="the blocker to be admitted")
    return task


async def enqueue(session, stack, body: bytes, **headers: str) -> asyncio.Task:
    """Send a request and return once the sidecar holds it in line."""
    before = depth(stack) + depth(stack, "fallback")
    task = asyncio.create_task(send(session, stack, body, **headers))
    await async_wait_until(lambda: depth(stack) + depth(stack, "fallback") > before, what="the request to queue")
    return task


def admitted(stack, class_name: str) -> float:
    return metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="admitted", **{"class": class_name})


def test_openai_client_completion_through_envoy(stack):
    admitted_before = admitted(stack, "loan_approval")
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=OFFICER_KEY, max_retries=0)
    completion = client.chat.completions.create(
        model="deepseek-sim",
        messages=[{"role": "user", "content": "Approve loan #42?"}],
        max_tokens=8,
        extra_headers={"x-ticket-type": "loan_approval", "x-urgent-level": "1"},
    )
    assert completion.choices[0].message.content.split() == ["ok"] * 8
    assert completion.usage.completion_tokens == 8
    started = sim_stats(stack)["started"][-1]
    assert started["class"] == "loan_approval"
    assert float(started["priority"]) == pytest.approx(-0.1)
    assert admitted(stack, "loan_approval") == admitted_before + 1  # this request, counted once


def test_openai_client_streamed_completion_releases_at_end(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)
    released_before = metric(stack.metrics_url, "extproc_slots_released_total", pool="primary")
    # 200 tokens, about a second of decoding: the stream is still running when the client,
    # however busy the machine, reads its first piece (20 could all be sent before that).
    stream = client.chat.completions.create(
        model="deepseek-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=200, stream=True
    )
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if len(pieces) == 1:
                assert inflight(stack) == 1  # the slot is held while tokens stream
    assert "".join(pieces).split() == ["ok"] * 200
    wait_until(lambda: inflight(stack) == 0, what="release after the stream")
    assert metric(stack.metrics_url, "extproc_slots_released_total", pool="primary") == released_before + 1


def test_models_listing_passes_without_queueing_and_client_cannot_pick_the_pool(stack):
    passed_before = metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="passed_through")
    admitted_before = metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="admitted")
    request = urllib.request.Request(f"{stack.url}/v1/models", headers={"x-llm-pool": "vllm_fallback"})
    with urllib.request.urlopen(request, timeout=5) as response:
        status, body = response.status, response.read()
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == "deepseek-sim"  # the primary pool, not the one asked for
    assert metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="passed_through") == passed_before + 1
    # passed, not admitted: it took no slot
    assert metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="admitted") == admitted_before


async def test_queued_requests_are_served_in_priority_order(stack):
    lowered_before = metric(stack.metrics_url, "extproc_claims_lowered_total", claim="urgent_level")
    async with aiohttp.ClientSession() as session:
        blocker = await occupy_slot(session, stack)
        bearer = lambda key: f"Bearer {key}"  # noqa: E731
        arrivals = [
            ("archive-1", {"x_ticket_type": "archive_query"}),
            ("complaint-1", {"x_ticket_type": "complaint"}),
            # an anonymous caller claiming urgency: lowered to no boost, stays behind complaint-1
            ("complaint-spoofed-urgent", {"x_ticket_type": "complaint", "x_urgent_level": "3"}),
            ("loan-1", {"x_ticket_type": "loan_approval"}),
            # an officer may claim urgency: ahead of the other complaints, never ahead of a loan
            ("complaint-urgent", {"x_ticket_type": "complaint", "x_urgent_level": "3", "authorization": bearer(OFFICER_KEY)}),
            ("loan-2", {"x_ticket_type": "loan_approval"}),
        ]
        tasks = [await enqueue(session, stack, chat(user=user), **headers) for user, headers in arrivals]
        pause_sims(stack, False)
        results = await asyncio.gather(blocker, *tasks)
    assert [status for status, _, _ in results] == [200] * 7
    served = [s["user"] for s in sim_stats(stack)["started"][-7:]]
    assert served == ["blocker", "loan-1", "loan-2", "complaint-urgent", "complaint-1", "complaint-spoofed-urgent", "archive-1"]
    # every queued request reports its wait
    assert all(int(headers["x-queue-wait-ms"]) >= 0 for _, headers, _ in results)
    # the spoofed claim, and only it, was cut
    assert metric(stack.metrics_url, "extproc_claims_lowered_total", claim="urgent_level") == lowered_before + 1


async def test_orange_degrades_red_sheds_unprotected_and_queues_protected(stack):
    async with aiohttp.ClientSession() as session:
        blocker = await occupy_slot(session, stack)
        queued = [await enqueue(session, stack, chat(user=f"c{i}"), x_ticket_type="complaint") for i in range(5)]
        # depth 5 > orange (4): a degradable archive query goes to the fallback pool, model rewritten
        status, headers, body = await send(session, stack, chat(user="archive-degraded"), x_ticket_type="archive_query")
        assert status == 200 and body["model"] == "deepseek-sim-small"
        assert metric(stack.metrics_url, "extproc_tier", pool="primary") == 2
        queued += [await enqueue(session, stack, chat(user=f"c{i}"), x_ticket_type="complaint") for i in range(5, 7)]
        # depth 7 > red (6): an unprotected class is shed at once, with retry-after and a JSON error
        status, headers, body = await send(session, stack, chat(), x_ticket_type="complaint")
        assert status == 429
        assert int(headers["retry-after"]) > 0
        assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "rate_limit_error"
        assert metric(stack.metrics_url, "extproc_tier", pool="primary") == 3
        # a protected class still queues
        queued.append(await enqueue(session, stack, chat(user="loan"), x_ticket_type="loan_approval"))
        pause_sims(stack, False)
        results = await asyncio.gather(blocker, *queued)
    assert [status for status, _, _ in results] == [200] * 9


async def test_expired_wait_gets_503_with_retry_after(stack):
    async with aiohttp.ClientSession() as session:
        blocker = await occupy_slot(session, stack)
        status, headers, body = await send(session, stack, chat(), x_ticket_type="quick_check")
        pause_sims(stack, False)
        await blocker
    assert status == 503
    assert int(headers["retry-after"]) > 0
    assert body["error"]["code"] == "queue_wait_expired"
    assert int(headers["x-queue-wait-ms"]) > 0  # it waited (how long is the event loop's timer: not asserted)
    assert depth(stack) == 0


async def test_bad_input_gets_clear_errors(stack):
    async with aiohttp.ClientSession() as session:
        status, _, body = await send(session, stack, b'{"model": "deepseek-sim", "messages": [')
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        assert "not valid JSON" in body["error"]["message"]
        status, _, body = await send(session, stack, b"[1, 2]")
        assert status == 400
        status, _, body = await send(session, stack, chat(max_tokens="many"))
        assert status == 400 and "max_tokens" in body["error"]["message"]
        status, _, body = await send(session, stack, chat(), x_urgent_level="urgent!")
        assert status == 400 and "x-urgent-level" in body["error"]["message"]
        status, _, body = await send(session, stack, chat("x" * 70000))
        assert status == 413 and body["error"]["code"] == "request_too_large"
    assert inflight(stack) == 0


def test_clerk_cannot_claim_a_loan_ticket(stack):
    lowered_before = metric(stack.metrics_url, "extproc_claims_lowered_total", claim="ticket_type")
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=CLERK_KEY, max_retries=0)
    client.chat.completions.create(
        model="deepseek-sim", messages=[{"role": "user", "content": "x"}], max_tokens=2,
        extra_headers={"x-ticket-type": "loan_approval", "x-vip-level": "2"},
    )
    started = sim_stats(stack)["started"][-1]
    assert started["class"] == "complaint"  # the nearest class the clerk may claim
    assert float(started["priority"]) == pytest.approx(1.0)
    assert metric(stack.metrics_url, "extproc_claims_lowered_total", claim="ticket_type") == lowered_before + 1


async def test_client_gone_while_queued_leaves_nothing_behind(stack):
    gone_before = metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="cancelled_client_gone")
    queued_before = metric(stack.metrics_url, "extproc_client_cancelled_total", phase="queued")
    async with aiohttp.ClientSession() as session:
        blocker = await occupy_slot(session, stack)
        waiting = await enqueue(session, stack, chat(user="gone-while-queued"), x_ticket_type="complaint")
        waiting.cancel()  # closes the client's connection
        await async_wait_until(lambda: depth(stack) == 0, what="the ticket to leave the line")
        pause_sims(stack, False)
        status, _, _ = await blocker
    assert status == 200
    await async_wait_until(lambda: inflight(stack) == 0, what="in-flight back to 0")
    assert "gone-while-queued" not in [s["user"] for s in sim_stats(stack)["started"]]
    # the one client that left, counted once, as a cancellation while queued
    assert metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="cancelled_client_gone") == gone_before + 1
    assert metric(stack.metrics_url, "extproc_client_cancelled_total", phase="queued") == queued_before + 1


async def test_client_gone_mid_stream_releases_the_slot(stack):
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{stack.url}/v1/chat/completions",
            data=chat(stream=True, max_tokens=5000, user="gone-mid-stream"),
            headers={"content-type": "application/json"},
        )
        assert response.status == 200
        first = await response.content.readline()
        assert first.startswith(b"data: ")
        assert inflight(stack) == 1
        response.close()  # drop the connection mid-stream
    await async_wait_until(lambda: inflight(stack) == 0, what="in-flight back to 0")
    await async_wait_until(lambda: sim_stats(stack)["running"] == 0, what="the backend to abort the request")
