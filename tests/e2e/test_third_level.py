"""The third level end to end: real HTTP through real Envoy to the sidecar and simulated
backends whose faults the tests inject. Breaker levels, rerouting with paired models, failover,
bounded attempts, retries, canary rollback, shadow copies, the admin CLI, shared state."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass

import aiohttp
import yaml

from extproc_testbed.redis_server import RedisServer
from extproc_testbed.stack import SimSpec, Stack, StackPorts, http_get

from ..conftest import TIME_SCALE, e2e_config, start_stack
from ..helpers import async_wait_until, chat, metric, webhook_receiver
from .test_e2e import post_json

FAULT = "x-sim-fault"  # names the model whose server answers this request with 500


def breaker(instant=None, sustained=None, deep=None) -> dict:
    return {"instant": {"min_requests": 1000, **(instant or {})},
            "sustained": {"min_requests": 1000, **(sustained or {})},
            "deep": {"min_requests": 1000, **(deep or {})}}


def level_config(primary_breaker: dict, **overrides) -> dict:
    config = e2e_config(**overrides)
    config["pools"]["primary"].update(max_inflight=4, tiers={"yellow": 30, "orange": 50, "red": 80, "hard_max": 200},
                                      breaker=primary_breaker)
    return config


@dataclass
class Answer:
    status: int
    fallback: bool
    model: str | None
    body: dict


async def ask(session: aiohttp.ClientSession, stack: Stack, fault: str | None = None, branch: str | None = None,
              **headers: str) -> Answer:
    hdrs = {"content-type": "application/json", "x-ticket-type": "complaint", **headers}
    if fault:
        hdrs[FAULT] = fault
    if branch:
        hdrs["x-branch-id"] = branch
    async with session.post(f"{stack.url}/v1/chat/completions", data=chat(max_tokens=4), headers=hdrs) as response:
        text = await response.text()
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = {"raw": text}
        return Answer(response.status, response.headers.get("x-llm-fallback") == "true", body.get("model"), body)


def sim_stats(stack: Stack, pool: str, index: int = 0) -> dict:
    return json.loads(http_get(f"{stack.sim_url(index, pool)}/sim/stats")[1])


def level(stack: Stack, name: str, pool: str = "primary", replica: int = 0) -> float:
    return metric(stack.replica_metrics_url(replica), "extproc_breaker_state", pool=pool, level=name)


def admin(stack: Stack, *args: str, replica: int = 0) -> str:
    address = f"127.0.0.1:{stack.ports.replicas[replica][2]}"
    result = subprocess.run([sys.executable, "-m", "extproc", "admin", "--address", address, *args],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_a_pool_answering_500_is_routed_around_and_traffic_returns_after_the_hold(tmp_path):
    config = level_config(breaker(
        instant={"min_requests": 5, "threshold": 0.3, "open_s": 2, "probes": 2, "max_open_s": 4},
        sustained={"window_s": 4, "buckets": 8, "min_requests": 5, "threshold": 0.2, "recover_below": 0.1,
                   "hold_s": 2, "probe_interval_s": 0.25},
    ))
    stack = start_stack(tmp_path, config, primaries=2)
    try:
        for i in range(2):
            post_json(f"{stack.sim_url(i)}/sim/faults", {"error_rate": 1.0})
        async with aiohttp.ClientSession() as session:
            sent = []
            for _ in range(50):  # 10 a second for 5 s
                sent.append(asyncio.create_task(ask(session, stack)))
                await asyncio.sleep(0.1)
            answers = await asyncio.gather(*sent)
            by_fallback = [a for a in answers if a.status == 200 and a.fallback and a.model == "deepseek-sim-small"]
            assert len(by_fallback) >= 0.95 * len(answers), [(a.status, a.fallback, a.model) for a in answers]
            assert level(stack, "instant") == 1 and level(stack, "sustained") == 1

            for i in range(2):
                post_json(f"{stack.sim_url(i)}/sim/faults", {"error_rate": 0.0})
            for _ in range(300):  # traffic keeps coming; probes find the pool healthy again
                assert (await ask(session, stack)).status == 200
                if level(stack, "instant") == 0 and level(stack, "sustained") == 0:
                    break
                await asyncio.sleep(0.1)
            after = [await ask(session, stack) for _ in range(5)]
            assert all((a.status, a.fallback, a.model) == (200, False, "deepseek-sim") for a in after)
        # it came back through the hold, not around it: rerouted once, cleared once
        sustained = {to: metric(stack.metrics_url, "extproc_breaker_transitions_total", pool="primary",
                                level="sustained", to=to) for to in ("rerouting", "cleared")}
        assert sustained == {"rerouting": 1, "cleared": 1}
    finally:
        stack.stop()


async def test_rising_error_rates_move_the_pool_through_the_levels_and_page_once(tmp_path):
    async with webhook_receiver() as (url, received):
        config = level_config(
            breaker(instant={"min_requests": 3, "threshold": 0.75, "open_s": 30},
                    sustained={"window_s": 60, "min_requests": 12, "threshold": 0.2, "recover_below": 0.05,
                               "hold_s": 60, "probe_interval_s": 0.1},
                    deep={"min_requests": 12, "threshold": 0.15}),
            alerts={"webhook": url},
        )
        stack = start_stack(tmp_path, config, primaries=1)
        try:
            async with aiohttp.ClientSession() as session:
                answers = []
                for i in range(1, 13):  # 1 in 6 fails: 16.7 %, past the deep level's 15 % only
                    answers.append(await ask(session, stack, fault="deepseek-sim" if i % 6 == 0 else None))
                await async_wait_until(lambda: level(stack, "deep") == 1, 5, "the deep level")
                assert level(stack, "sustained") == 0 and level(stack, "instant") == 0

                for i in range(30):  # 1 in 2 fails: past the sustained level's 20 %
                    answers.append(await ask(session, stack, fault="deepseek-sim" if i % 2 else None))
                    if level(stack, "sustained") == 1:
                        break
                assert level(stack, "sustained") == 1 and level(stack, "instant") == 0

                for _ in range(60):  # every request fails: the probes open the instant level
                    answers.append(await ask(session, stack, fault="deepseek-sim"))
                    if level(stack, "instant") == 1:
                        break
                    await asyncio.sleep(0.1)  # the 1 s window moves past the successes before
                assert level(stack, "instant") == 1
                assert all(a.status == 200 for a in answers)  # failed attempts were answered by the fallback

                # One page, for the deep level, however many breaker ticks went by since it latched
                # (the sustained and instant levels moved since): counted once, and delivered once.
                assert metric(stack.metrics_url, "extproc_breaker_pages_total", pool="primary") == 1
                await async_wait_until(lambda: any(r.get("event") == "breaker_deep" for r in received), 10,
                                       "the page to be delivered")
                pages = [r for r in received if r.get("event") == "breaker_deep"]
                assert len(pages) == 1 and pages[0]["pool"] == "primary"
                assert set(pages[0]["failure_ratios"]) == {"1s", "60s", "300s"} and "since" in pages[0]

                shown = admin(stack, "state")
                assert "instant open" in shown and "rerouting to fallback" in shown and "PAGED" in shown
                after_reset = admin(stack, "breaker", "primary", "reset")
                assert "instant closed" in after_reset and "PAGED" not in after_reset
                assert level(stack, "deep") == 0 and level(stack, "instant") == 0
                # the next request goes to the primary pool again (Envoy may still have its host ejected:
                # then it is answered through the failover, which is fine)
                before = metric(stack.metrics_url, "extproc_slots_admitted_total", pool="primary")
                assert (await ask(session, stack)).status == 200
                assert metric(stack.metrics_url, "extproc_slots_admitted_total", pool="primary") == before + 1
        finally:
            stack.stop()


async def test_failed_attempts_are_bounded_and_a_started_stream_is_never_retried(tmp_path):
    stack = start_stack(tmp_path, level_config(breaker()), primaries=1)  # the breaker never trips here
    try:
        post_json(f"{stack.sim_url(0)}/sim/faults", {"error_rate": 1.0})
        async with aiohttp.ClientSession() as session:
            answers = [await ask(session, stack) for _ in range(4)]  # fewer than Envoy's 5 before it ejects
        assert all(a.status == 200 and a.fallback and a.model == "deepseek-sim-small" for a in answers)
        # one attempt each on the primary (Envoy does not retry a 500), then one on the fallback
        assert sim_stats(stack, "primary")["requests"] == 4
        assert sim_stats(stack, "fallback")["requests"] == 4

        post_json(f"{stack.sim_url(0)}/sim/faults", {"error_rate": 0.0})
        async with aiohttp.ClientSession() as session:
            body = chat(stream=True, max_tokens=2000)
            async with session.post(f"{stack.url}/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as response:
                assert response.status == 200
                assert (await response.content.readline()).startswith(b"data: ")
                post_json(f"{stack.sim_url(0)}/sim/faults", {"crash": True})
                try:
                    await response.read()
                    cut = False
                except aiohttp.ClientPayloadError:
                    cut = True
        assert cut  # the stream had started: it is cut, not retried
        assert sim_stats(stack, "fallback")["requests"] == 4
    finally:
        stack.stop()


async def test_named_requests_are_not_run_twice_and_their_retries_avoid_the_failed_pool(tmp_path):
    stack = start_stack(tmp_path, level_config(breaker(), retries={"max_attempts": 3}), primaries=1)
    try:
        async with aiohttp.ClientSession() as session:
            post_json(f"{stack.sim_url(0)}/sim/faults", {"paused": True})
            first = asyncio.create_task(ask(session, stack, **{"idempotency-key": "ticket-1"}))
            await async_wait_until(lambda: metric(stack.metrics_url, "extproc_inflight", pool="primary") == 1)
            duplicate = await ask(session, stack, **{"idempotency-key": "ticket-1"})
            assert duplicate.status == 409 and duplicate.body["error"]["code"] == "request_in_progress"
            post_json(f"{stack.sim_url(0)}/sim/faults", {"paused": False})
            assert (await first).status == 200

            failed = await ask(session, stack, fault="deepseek-sim", **{"x-request-id": "ticket-2"})
            assert failed.status == 200 and failed.fallback  # failed over
            retry = await ask(session, stack, **{"x-request-id": "ticket-2"})
            assert retry.status == 200 and retry.fallback  # the retry goes where it did not fail
            third = await ask(session, stack, **{"x-request-id": "ticket-2"})
            assert third.status == 200
            too_many = await ask(session, stack, **{"x-request-id": "ticket-2"})
            assert too_many.status == 429 and too_many.body["error"]["code"] == "too_many_attempts"
        assert metric(stack.metrics_url, "extproc_retries_total", verdict="in_progress") == 1
    finally:
        stack.stop()


async def test_a_failing_canary_rolls_its_digits_back_by_itself(tmp_path):
    async with webhook_receiver() as (url, received):
        config = level_config(breaker(), alerts={"webhook": url})
        config["pools"]["canary"] = {
            "cluster": "vllm_canary", "max_inflight": 2, "fallback": "fallback",
            "models": {"deepseek-sim": "deepseek-sim-next"},
            "breaker": breaker(instant={"min_requests": 3, "threshold": 0.5, "open_s": 30}),
        }
        config["canary"] = {"pool": "canary", "digits": ["7"]}
        path = tmp_path / "extproc.yaml"
        path.write_text(yaml.safe_dump(config))
        sim_args = ("--time-scale", TIME_SCALE)
        stack = Stack(tmp_path, StackPorts.random(primary=1, canary=1), path, primary=SimSpec("deepseek-sim", sim_args),
                      fallback=SimSpec("deepseek-sim-small", sim_args),
                      canary=SimSpec("deepseek-sim-next", sim_args)).start()
        try:
            async with aiohttp.ClientSession() as session:
                assert (await ask(session, stack, branch="0417")).model == "deepseek-sim-next"
                assert (await ask(session, stack, branch="0418")).model == "deepseek-sim"
                assert "digits 7" in admin(stack, "state")

                post_json(f"{stack.sim_url(0, 'canary')}/sim/faults", {"error_rate": 1.0})
                answers = []
                for _ in range(20):
                    answers.append(await ask(session, stack, branch="0417"))
                    if metric(stack.metrics_url, "extproc_canary_rolled_back", pool="canary") == 1:
                        break
                assert all(a.status == 200 for a in answers)  # failed over while the canary failed
                after = await ask(session, stack, branch="0417")
                assert (after.status, after.model, after.fallback) == (200, "deepseek-sim", False)
            assert metric(stack.metrics_url, "extproc_canary_batch", pool="canary") == 0
            assert metric(stack.metrics_url, "extproc_canary_rollbacks_total", pool="canary", reason="automatic") == 1
            await async_wait_until(lambda: any(r.get("event") == "canary_rollback" for r in received), 10,
                                   "the rollback alert to be delivered")
            rollbacks = [r for r in received if r.get("event") == "canary_rollback"]
            assert len(rollbacks) == 1 and rollbacks[0]["digits"] == ["7"]
            assert "ROLLED BACK" in admin(stack, "state")
            assert "digits 0" in admin(stack, "canary", "advance")  # an operator starts the rollout again (order 0..9)
        finally:
            stack.stop()


async def test_shadow_copies_run_in_free_room_on_the_fallback_and_are_compared(tmp_path):
    config = level_config(breaker(), shadow={"share": 1.0, "max_share": 0.25})
    stack = start_stack(tmp_path, config, primaries=1)
    try:
        async with aiohttp.ClientSession() as session:
            answers = [await ask(session, stack) for _ in range(6)]
            assert all((a.status, a.fallback, a.model) == (200, False, "deepseek-sim") for a in answers)
            await async_wait_until(
                lambda: metric(stack.metrics_url, "extproc_shadow_responses_total", side="shadow") == 6, 10,
                "the shadow copies to be answered")
            started = sim_stats(stack, "fallback")["started"]
            assert [s["class"] for s in started] == ["shadow"] * 6  # lowest priority, tagged for the engine
            m = stack.metrics_url
            assert metric(m, "extproc_shadow_responses_total", side="primary", status_class="2xx") == 6
            assert metric(m, "extproc_shadow_completion_tokens_total", side="primary") == 24  # 6 x 4 tokens
            assert metric(m, "extproc_shadow_completion_tokens_total", side="shadow") == 24
            assert metric(m, "extproc_shadow_latency_seconds_count", side="shadow") == 6

            post_json(f"{stack.sim_url(0, 'fallback')}/sim/faults", {"paused": True})  # the fallback stalls
            answers = [await ask(session, stack) for _ in range(4)]
            assert all(a.status == 200 and not a.fallback for a in answers)  # real traffic is not held up
            # one copy at a time (max_share: 1 of 4 slots): the first is sent and stalls, the others are dropped
            assert metric(m, "extproc_shadow_copies_total", pool="fallback", result="no_room") == 3
            assert metric(m, "extproc_shadow_copies_total", pool="fallback", result="sent") == 7
            post_json(f"{stack.sim_url(0, 'fallback')}/sim/faults", {"paused": False})

            # The fallback fails every copy: the copies are compared, and its breaker hears nothing of
            # them (a shadow never disturbs anything else: real failovers must still find it closed).
            post_json(f"{stack.sim_url(0, 'fallback')}/sim/faults", {"error_rate": 1.0})
            failed_before = metric(m, "extproc_shadow_responses_total", side="shadow", status_class="5xx")
            for _ in range(4):
                assert (await ask(session, stack)).status == 200
            await async_wait_until(
                lambda: metric(m, "extproc_shadow_responses_total", side="shadow", status_class="5xx") > failed_before,
                10, "a failed shadow copy")
            await async_wait_until(  # every copy sent has ended
                lambda: metric(m, "extproc_shadow_responses_total", side="shadow")
                == metric(m, "extproc_shadow_copies_total", result="sent"), 10, "the copies to end")
            assert metric(m, "extproc_upstream_outcomes_total", pool="fallback") == 0
            assert level(stack, "instant", pool="fallback") == 0
            post_json(f"{stack.sim_url(0, 'fallback')}/sim/faults", {"error_rate": 0.0})

            assert "shadow share 0" in admin(stack, "shadow", "0")  # a runtime setting
            copies = metric(m, "extproc_shadow_copies_total")
            assert (await ask(session, stack)).status == 200
            assert metric(m, "extproc_shadow_copies_total") == copies
    finally:
        stack.stop()


async def test_shadow_copies_are_dropped_when_the_fallback_is_full_and_the_primary_is_unaffected(tmp_path):
    """The fallback's slots all taken by real requests (failovers to a stalled fallback), nobody
    waiting there: a copy finds no free room, is dropped and counted as `no_room`, never waits,
    and the request it copies is answered by the primary as if there were no shadow at all."""
    stack = start_stack(tmp_path, level_config(breaker()), primaries=1)  # shadow share 0 while filling
    m = stack.metrics_url
    try:
        async with aiohttp.ClientSession() as session:
            post_json(f"{stack.sim_url(0, 'fallback')}/sim/faults", {"paused": True})
            # four requests fail on the primary and are failed over: they hold the fallback's 4 slots
            fillers = [asyncio.create_task(ask(session, stack, fault="deepseek-sim")) for _ in range(4)]
            await async_wait_until(lambda: metric(m, "extproc_inflight", pool="fallback") == 4, 15,
                                   "the failovers to fill the fallback")
            assert metric(m, "extproc_queue_depth", pool="fallback") == 0  # full, and nobody waiting there
            assert "shadow share 1" in admin(stack, "shadow", "1")
            admitted_before = metric(m, "extproc_slots_admitted_total", pool="fallback")

            answers = [await ask(session, stack) for _ in range(3)]
            assert all((a.status, a.fallback, a.model) == (200, False, "deepseek-sim") for a in answers)
            assert all(a.body["choices"][0]["message"]["content"].split() == ["ok"] * 4 for a in answers)
            # each copy was dropped at once, counted as finding no room in the fallback
            assert metric(m, "extproc_shadow_copies_total", pool="fallback", result="no_room") == 3
            assert metric(m, "extproc_shadow_copies_total", result="sent") == 0
            assert metric(m, "extproc_shadow_copies_total", result="unavailable") == 0
            # ...without taking a slot or waiting: the fallback is as the fillers left it
            assert metric(m, "extproc_slots_admitted_total", pool="fallback") == admitted_before
            assert metric(m, "extproc_inflight", pool="fallback") == 4
            assert metric(m, "extproc_queue_depth", pool="fallback") == 0
            assert metric(m, "extproc_shadow_responses_total", side="shadow") == 0
            assert metric(m, "extproc_shadow_responses_total", side="primary") == 0  # no copy: nothing compared
            assert not any(s["class"] == "shadow" for s in sim_stats(stack, "fallback")["started"])
            assert all(not f.done() for f in fillers)  # the fallback was full throughout

            post_json(f"{stack.sim_url(0, 'fallback')}/sim/faults", {"paused": False})
            filled = await asyncio.gather(*fillers)
            assert all((a.status, a.fallback, a.model) == (200, True, "deepseek-sim-small") for a in filled)
        await async_wait_until(lambda: all(metric(m, "extproc_inflight", pool=p) == 0 for p in ("primary", "fallback")),
                               15, "the pools to go idle")
        assert metric(m, "extproc_slots_released_total") == metric(m, "extproc_slots_admitted_total")
    finally:
        stack.stop()


async def test_two_replicas_sharing_redis_agree_on_a_breaker(tmp_path):
    redis_server = RedisServer(tmp_path / "redis").start()
    config = level_config(breaker(instant={"min_requests": 6, "threshold": 0.5, "open_s": 60}),
                          redis={"url": redis_server.url})
    path = tmp_path / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    sim_args = ("--time-scale", TIME_SCALE)
    stack = Stack(tmp_path, StackPorts.random(primary=1, replicas=2), path, primary=SimSpec("deepseek-sim", sim_args),
                  fallback=SimSpec("deepseek-sim-small", sim_args)).start()
    try:
        post_json(f"{stack.sim_url(0)}/sim/faults", {"error_rate": 1.0})
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(ask(session, stack) for _ in range(12)))
        assert all(a.status == 200 for a in answers)
        await async_wait_until(lambda: level(stack, "instant", replica=0) == 1 and level(stack, "instant", replica=1) == 1,
                               5, "both replicas to see the breaker open")
        opened = sum(metric(stack.replica_metrics_url(r), "extproc_breaker_transitions_total", pool="primary",
                            level="instant", to="open") for r in (0, 1))
        assert opened == 1  # one replica's change won; the other adopted it
        assert "instant closed" in admin(stack, "breaker", "primary", "reset", replica=1)
        await async_wait_until(lambda: level(stack, "instant", replica=0) == 0, 5, "replica 1 to see the reset")
    finally:
        stack.stop()
        redis_server.kill()
