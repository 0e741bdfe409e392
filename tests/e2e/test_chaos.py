"""I1 under real faults at once: clients that give up at random points, a backend answering
500s, one crashing mid-generation, another killed outright. Every slot taken (admissions,
failover attempts on the fallback pool) is released exactly once and both pools end idle."""

from __future__ import annotations

import asyncio
import json
import random
import signal

import aiohttp
import pytest
import yaml

from extproc.core.breaker import UPSTREAM_RESULTS
from extproc_testbed.chaos import run_drill
from extproc_testbed.stack import SimSpec, Stack, StackPorts, http_get

from ..conftest import TIME_SCALE, e2e_config
from ..helpers import async_wait_until, chat, metric
from .test_e2e import depth, inflight, post_json

REQUESTS = 48


def chaos_config() -> dict:
    config = e2e_config()
    config["pools"]["primary"]["max_inflight"] = 3
    config["pools"]["primary"]["tiers"] = {"yellow": 10, "orange": 60, "red": 70, "hard_max": 80}
    return config


async def one_client(session: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    """One request with a random shape and fate; returns how it ended, as the client saw it."""
    stream = rng.random() < 0.5
    body = chat(user=f"chaos-{rng.random():.6f}", stream=stream, max_tokens=rng.randint(50, 1500))
    give_up_after = rng.uniform(0.0, 1.5) if rng.random() < 0.4 else None
    headers = {"content-type": "application/json", "x-ticket-type": rng.choice(["loan_approval", "complaint"])}
    if rng.random() < 0.5:  # a named request: the attempt ledger is part of every ending too
        headers["idempotency-key"] = f"chaos-{rng.random():.9f}"

    answered = False  # response headers reached the client

    async def exchange() -> str:
        nonlocal answered
        async with session.post(url, data=body, headers=headers) as response:
            answered = True
            async for _ in response.content.iter_any():
                pass
            return str(response.status)

    try:
        async with asyncio.timeout(give_up_after):
            return await exchange()
    except TimeoutError:  # the connection closes: while queued, admitted, or mid-stream
        return "gave up mid-response" if answered else "gave up"
    except aiohttp.ClientError as error:
        return type(error).__name__  # an upstream reset mid-stream


@pytest.mark.parametrize("pick_backend", [False, True], ids=["envoy_places", "sidecar_places"])
async def test_random_disconnects_and_backend_faults_leak_no_slot(tmp_path, pick_backend):
    config = chaos_config()
    ports = StackPorts.random(primary=3)
    if pick_backend:  # the sidecar reads the backends and names one for each request
        config["pools"]["primary"]["capacity"] = {"backends": [f"http://127.0.0.1:{p}" for p in ports.primary],
                                                  "pick_backend": True}
    config_path = tmp_path / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(config))
    sim_args = ("--time-scale", TIME_SCALE, "--recovery-s", "5")  # a crash keeps a backend down 1 s
    stack = Stack(tmp_path, ports, config_path, primary=SimSpec("deepseek-sim", sim_args),
                  fallback=SimSpec("deepseek-sim-small", sim_args)).start()
    rng = random.Random(20261129)
    try:
        post_json(f"{stack.sim_url(0)}/sim/faults", {"error_rate": 0.3})
        async with aiohttp.ClientSession() as session:
            clients = []
            for _ in range(REQUESTS):
                clients.append(asyncio.create_task(one_client(session, f"{stack.url}/v1/chat/completions", rng)))
                await asyncio.sleep(rng.uniform(0, 0.05))
                if len(clients) == REQUESTS // 3:
                    post_json(f"{stack.sim_url(1)}/sim/faults", {"crash": True})  # in-flight requests fail
                if len(clients) == 3 * REQUESTS // 4:
                    stack.sims[2].signal(signal.SIGKILL)  # a backend dies outright
            endings = await asyncio.gather(*clients)
        assert stack.sidecar.alive() and stack.envoy.alive()
        assert "200" in endings and "gave up" in endings
        await async_wait_until(lambda: all(inflight(stack, p) == 0 and depth(stack, p) == 0
                                           for p in ("primary", "fallback")), timeout=30, what="the pools to go idle")
        m = stack.metrics_url  # every exchange has ended: what follows is final
        # What the breakers counted, by kind. The faults answer 5xx (backend 0's injected 500s,
        # backend 1's 503s while it recovers from its crash); the crash and the SIGKILL drop
        # connections (a reset, a refused connection: Envoy tries once more on another host, so
        # those may not all show; with every host ejected, Envoy's own no_healthy_upstream).
        # Nothing else: no timeout, overflow or 429, and never a client that left.
        caused = {"http_5xx", "reset", "connect_failure", "no_healthy_upstream"}
        counted = {kind: metric(m, "extproc_upstream_outcomes_total", pool="primary", result=kind)
                   for kind in (*UPSTREAM_RESULTS, "failure")}
        assert counted["http_5xx"] > 0, counted  # the faults reached the sidecar (which failed requests over)
        assert {kind for kind, n in counted.items() if n and kind != "success"} <= caused, counted
        # Only backends 0 and 1 answer 5xx, each at most once per request that reached it and
        # never started (a request the engine started ran to its end, or was cut by the crash).
        answered_5xx = 0
        for i in (0, 1):
            stats = json.loads(http_get(f"{stack.sim_url(i)}/sim/stats")[1])
            answered_5xx += stats["requests"] - len(stats["started"])
        assert counted["http_5xx"] <= answered_5xx, (counted, answered_5xx)
        # The fallback is healthy: every failover attempt there succeeded, whoever left meanwhile.
        on_fallback = {kind: metric(m, "extproc_upstream_outcomes_total", pool="fallback", result=kind)
                       for kind in (*UPSTREAM_RESULTS, "failure") if kind != "success"}
        assert not any(on_fallback.values()), on_fallback
        taken = metric(stack.metrics_url, "extproc_slots_admitted_total")
        released = metric(stack.metrics_url, "extproc_slots_released_total")
        assert taken > 0 and released == taken  # each slot released once
        assert metric(stack.metrics_url, "extproc_inflight_tokens") == 0
        # The clients that gave up are counted apart, as cancellations: at most one each, and
        # only those that left before their response (one that left mid-stream had it).
        cancelled = {phase: metric(m, "extproc_client_cancelled_total", phase=phase)
                     for phase in ("arriving", "queued", "before_response")}
        assert 0 < sum(cancelled.values()) <= endings.count("gave up"), (cancelled, endings.count("gave up"))
        if pick_backend:
            state = json.loads(http_get(f"{stack.metrics_url.rsplit('/', 1)[0]}/queue/state")[1])
            assert any(d.get("backend") for d in state["decisions"])  # it did place requests...
            assert next(p for p in state["pools"] if p["name"] == "primary")["placed"] == {}  # ...and forgot each
    finally:
        stack.stop()


def test_the_chaos_drill_answers_every_request_that_can_be_answered(tmp_path):
    """Three primary backends failing three ways, a healthy fallback: every request whose client
    stayed and whose stream had not started when its backend failed is answered 200."""
    summary = run_drill(requests=60, rate=20, seed=3, workdir=tmp_path)
    assert summary["counted"] >= 40, summary
    assert summary["answered_200"] >= 0.99 * summary["counted"], summary
    assert summary["by_fallback"] > 0
