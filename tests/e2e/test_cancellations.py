"""Clients that leave are not upstream failures (invariant I12), through real Envoy.

A wave of clients gives up at every point of a request's life: while waiting in the sidecar's
line, after admission while the engine has not answered yet, and in the middle of a stream.
None of it may move a breaker, page a person, or refuse the requests that come next; each
give-up before the response is counted as a cancellation, by pool, class and phase; and in
the same run a backend that really fails still trips the breaker.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import aiohttp

from extproc_testbed.stack import Stack, metric_sum

from ..conftest import e2e_config, start_stack
from ..helpers import async_wait_until, chat, metric, scrape, webhook_receiver
from .test_e2e import post_json

CLIENTS = 200


def sensitive_breaker() -> dict:
    """Levels that trip on a few dozen failures: a wave of counted give-ups would trip all three."""
    return {"instant": {"min_requests": 10, "threshold": 0.3, "open_s": 30},
            "sustained": {"window_s": 60, "min_requests": 20, "threshold": 0.2, "recover_below": 0.1, "hold_s": 30},
            "deep": {"window_s": 300, "min_requests": 20, "threshold": 0.15}}


def breaker_levels(stack: Stack) -> dict[str, float]:
    return {level: metric(stack.metrics_url, "extproc_breaker_state", pool="primary", level=level)
            for level in ("instant", "sustained", "deep")}


async def give_up_after(session: aiohttp.ClientSession, stack: Stack, seconds: float, stream: bool) -> str:
    """One client that leaves after `seconds`: where it was when it left."""
    seen = "nothing"

    async def exchange() -> None:
        nonlocal seen
        body = chat(max_tokens=400, stream=stream)
        async with session.post(f"{stack.url}/v1/chat/completions", data=body,
                                headers={"content-type": "application/json", "x-ticket-type": "complaint"}) as answer:
            seen = f"status {answer.status}"
            await answer.read()
            seen = f"answered {answer.status}"

    try:
        await asyncio.wait_for(exchange(), seconds)
    except asyncio.TimeoutError:
        pass
    return seen


async def test_a_wave_of_clients_leaving_moves_no_breaker_and_a_real_failure_still_does(tmp_path):
    async with webhook_receiver() as (hook, received):
        config = e2e_config(alerts={"webhook": hook})
        config["pools"]["primary"].update(max_inflight=8, breaker=sensitive_breaker(),
                                          tiers={"yellow": 300, "orange": 400, "red": 500, "hard_max": 1000})
        config["pools"]["fallback"]["breaker"] = sensitive_breaker()
        stack = start_stack(tmp_path, config, primaries=2)
        try:
            for i in range(2):  # every engine answers, but only after 0.4 s: admitted requests wait for it
                post_json(f"{stack.sim_url(i)}/sim/faults", {"added_latency_s": 0.4})
            rng = random.Random(15)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                ends = await asyncio.gather(*(
                    give_up_after(session, stack, rng.uniform(0.05, 1.5), stream=i % 2 == 0) for i in range(CLIENTS)))
            before_response = sum(1 for end in ends if end == "nothing")
            assert before_response >= CLIENTS // 2, Counter(ends)  # most left before any response: queued or admitted
            await async_wait_until(
                lambda: metric(stack.metrics_url, "extproc_inflight", pool="primary") == 0
                and metric(stack.metrics_url, "extproc_queue_depth", pool="primary") == 0, 30, "the pool to go idle")

            samples = scrape(stack.metrics_url)
            failures = sum(v for (name, labels), v in samples.items()
                           if name == "extproc_upstream_outcomes_total" and dict(labels)["result"] != "success")
            assert failures == 0
            assert breaker_levels(stack) == {"instant": 0, "sustained": 0, "deep": 0}
            assert sum(v for (name, _), v in samples.items() if name == "extproc_breaker_transitions_total") == 0
            assert [r for r in received if r.get("event") == "breaker_deep"] == []
            cancelled = {phase: metric_sum(samples, "extproc_client_cancelled_total", pool="primary", phase=phase)
                         for phase in ("queued", "before_response")}
            # Each counted cancellation is a client that left before its response: never more.
            assert 0 < sum(cancelled.values()) <= before_response
            assert cancelled.get("queued", 0) > 0 and cancelled.get("before_response", 0) > 0, cancelled

            async with aiohttp.ClientSession() as session:  # the next clients are served as usual
                for i in range(2):
                    post_json(f"{stack.sim_url(i)}/sim/faults", {"added_latency_s": 0.0})
                for _ in range(20):
                    async with session.post(f"{stack.url}/v1/chat/completions", data=chat(max_tokens=4),
                                            headers={"content-type": "application/json"}) as answer:
                        assert answer.status == 200 and answer.headers.get("x-llm-fallback") is None

                # In the same run, engines that really fail still trip the breaker, and each of their
                # failures is counted: every attempt admitted to the primary pool from here on fails.
                admitted_before = metric(stack.metrics_url, "extproc_slots_admitted_total", pool="primary")
                for i in range(2):
                    post_json(f"{stack.sim_url(i)}/sim/faults", {"error_rate": 1.0})

                async def one() -> None:
                    async with session.post(f"{stack.url}/v1/chat/completions", data=chat(max_tokens=4),
                                            headers={"content-type": "application/json"}) as answer:
                        await answer.read()

                # Twelve at once, so that the instant level's 1 s window can hold its 10 requests
                # however slowly this machine answers them one by one. Which level trips first is a
                # race: the sustained one (20 requests in 60 s, 20 % failing) may, counting the
                # successes just before, and reroute the rest to the fallback. Either is the breaker
                # tripping on real failures.
                def opened() -> float:  # counted, not the levels read at one moment (they half-open again)
                    samples = scrape(stack.metrics_url)
                    return sum(metric_sum(samples, "extproc_breaker_transitions_total", pool="primary", to=to)
                               for to in ("open", "rerouting"))

                for _ in range(5):
                    await asyncio.gather(*(one() for _ in range(12)))
                    if opened() >= 1:
                        break
            assert opened() >= 1
            samples = scrape(stack.metrics_url)
            attempts = metric_sum(samples, "extproc_slots_admitted_total", pool="primary") - admitted_before
            failures = metric_sum(samples, "extproc_upstream_outcomes_total", pool="primary") - metric_sum(
                samples, "extproc_upstream_outcomes_total", pool="primary", result="success")
            assert failures == attempts > 0
        finally:
            stack.stop()

