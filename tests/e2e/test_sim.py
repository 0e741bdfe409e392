"""The simulated vLLM server, hit directly: API shape, metrics, timing model, faults, and the
KV-cache crash the sidecar exists to prevent."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
import pytest

from extproc_testbed.sim_engine import SimParams, solo_latency_s
from extproc_testbed.stack import LOOPBACK, ManagedProcess, free_port, http_get, metric_sum, wait_until

from ..helpers import async_wait_until, chat, metric, scrape, sim_crashes


def start_sim(tmp_path, *args: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    proc = ManagedProcess(
        "sim", [sys.executable, "-m", "extproc", "sim", "--port", str(port), *args], tmp_path / f"sim-{port}.log"
    )
    proc.start()
    url = f"http://{LOOPBACK}:{port}"
    wait_until(lambda: http_get(f"{url}/health")[0] == 200, 20, "the sim", proc)
    return proc, url


@pytest.fixture
def sim(tmp_path):
    procs = []

    def launch(*args: str) -> str:
        proc, url = start_sim(tmp_path, *args)
        procs.append(proc)
        return url

    yield launch
    for proc in procs:
        proc.stop()


def test_timing_model_lands_on_the_seed_figures():
    params = SimParams()
    short, long = solo_latency_s(params, 500, 64), solo_latency_s(params, 16000, 64)
    assert short < 0.6  # a 500-token ticket well under a second
    assert 7 <= long / short <= 9  # a 16k-token ticket about 8 times longer
    assert long == pytest.approx(3.2, abs=0.3)  # the seed's 3.2 s


async def test_metrics_use_vllm_names(sim):
    url = sim("--kv-tokens", "8192", "--block-size", "16")
    samples = scrape(f"{url}/metrics")
    names = {name for name, _ in samples}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:cache_config_info", "vllm_sim:oom_crashes_total"):
        assert name in names
    info = next(dict(labels) for name, labels in samples if name == "vllm:cache_config_info")
    assert int(info["num_gpu_blocks"]) * int(info["block_size"]) == 8192


async def test_completions_streaming_and_errors(sim):
    url = sim("--time-scale", "0.1")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={"model": "deepseek-sim", "prompt": "hi", "max_tokens": 3}) as r:
            body = await r.json()
            assert r.status == 200 and body["choices"][0]["text"] == "ok ok ok"
            assert body["usage"]["completion_tokens"] == 3
        async with session.post(f"{url}/v1/chat/completions", data=chat(stream=True, max_tokens=2)) as r:
            events = [line for line in (await r.text()).splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) == 4  # 2 tokens, a finish chunk, [DONE]
        async with session.post(f"{url}/v1/chat/completions", data=chat(model="other")) as r:
            assert r.status == 404 and (await r.json())["error"]["param"] == "model"
        async with session.post(f"{url}/v1/chat/completions", data=chat("x" * 200_000, max_tokens=10)) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "input_tokens"
        async with session.post(f"{url}/sim/faults", json={"error_rate": 1.0}) as r:
            assert r.status == 200
        async with session.post(f"{url}/v1/chat/completions", data=chat(max_tokens=1)) as r:
            assert r.status == 500
        async with session.post(f"{url}/sim/faults", json={"error_rate": "lots"}) as r:
            assert r.status == 400


async def _burst(url: str, prompts: list[int], max_tokens: int) -> list[int | str]:
    async def one(session, tokens):
        try:
            async with session.post(f"{url}/v1/chat/completions", data=chat("x" * (4 * tokens), max_tokens=max_tokens)) as r:
                await r.read()
                return r.status
        except aiohttp.ClientError as error:
            return type(error).__name__

    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, t) for t in prompts))


async def test_kv_overflow_in_crash_mode_fails_everything_and_recovers(sim):
    url = sim("--on-kv-exhausted", "crash", "--kv-tokens", "4096", "--recovery-s", "3", "--time-scale", "0.5")
    results = await _burst(url, [1000] * 8, max_tokens=32)  # 8k tokens of prompts into a 4k cache
    assert all(r != 200 for r in results), results  # every in-flight request failed
    assert sim_crashes(url) == 1
    assert http_get(f"{url}/health")[0] == 503
    assert http_get(f"{url}/metrics")[0] == 503  # like vLLM's process: gone while it restarts
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", data=chat(max_tokens=1)) as r:
            assert r.status == 503  # still recovering
    await async_wait_until(lambda: http_get(f"{url}/health")[0] == 200, 30, "recovery")
    assert await _burst(url, [100], max_tokens=4) == [200]
    assert metric(f"{url}/metrics", "vllm:kv_cache_usage_perc") == 0
    assert metric(f"{url}/metrics", "vllm_sim:oom_crashes_total") == 1


async def test_kv_overflow_in_queue_mode_preempts_and_recomputes_instead(sim):
    url = sim("--on-kv-exhausted", "queue", "--kv-tokens", "4096", "--block-size", "16", "--time-scale", "0.2")
    results = await _burst(url, [1000] * 8, max_tokens=32)
    assert results == [200] * 8
    assert metric(f"{url}/metrics", "vllm_sim:oom_crashes_total") == 0
    stats = json.loads((await asyncio.to_thread(http_get, f"{url}/sim/stats"))[1])
    # three 1036-token prompts and part of a fourth fill 4096 tokens; the first decode that
    # needs a block preempts the last to join (vLLM v1, fcfs), which is recomputed later
    assert stats["max_running_seen"] == 4
    assert stats["preemptions"] >= 1
    assert metric(f"{url}/metrics", "vllm:num_preemptions_total") == stats["preemptions"]
    assert stats["kv_used"] == 0 and stats["max_step_tokens_seen"] <= 2048
    async with aiohttp.ClientSession() as session:  # more than the whole cache can never run: refused
        async with session.post(f"{url}/v1/chat/completions", data=chat("x" * 17000, max_tokens=200)) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "input_tokens"  # vLLM's shape
            assert "4096 tokens" in body["error"]["message"]


async def test_priority_is_read_from_the_body(sim):
    fcfs = sim("--time-scale", "0.1")
    priority = sim("--time-scale", "0.1", "--scheduling-policy", "priority")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{fcfs}/v1/chat/completions", data=chat(max_tokens=1, priority=5)) as r:
            assert r.status == 200  # vLLM v1 carries it under fcfs, and ignores it
        async with session.post(f"{priority}/v1/chat/completions", data=chat(max_tokens=1, priority=5)) as r:
            assert r.status == 200
        async with session.post(f"{priority}/v1/chat/completions", data=chat(max_tokens=1, priority="high")) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "body.priority"


async def test_latency_histograms_count_what_ran(sim):
    url = sim("--time-scale", "0.1")
    assert await _burst(url, [100, 200, 300], max_tokens=5) == [200] * 3
    samples = scrape(f"{url}/metrics")

    def count(name: str) -> float:
        return sum(v for (n, labels), v in samples.items() if n == name and ("model_name", "deepseek-sim") in labels)

    assert count("vllm:time_to_first_token_seconds_count") == 3
    assert count("vllm:e2e_request_latency_seconds_count") == 3
    assert count("vllm:request_queue_time_seconds_count") == 3
    assert count("vllm:inter_token_latency_seconds_count") == 3 * 4  # every token after the first
    assert count("vllm:num_preemptions_total") == 0
    # in the engine's unscaled seconds: a 5-token answer takes at least 5 steps of 5 ms
    assert count("vllm:e2e_request_latency_seconds_sum") >= 3 * 5 * 0.005


async def test_forced_crash_resets_streams_in_flight(sim):
    url = sim("--recovery-s", "1", "--time-scale", "1")
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{url}/v1/chat/completions", data=chat(stream=True, max_tokens=2000))
        assert (await response.content.readline()).startswith(b"data: ")
        async with session.post(f"{url}/sim/faults", json={"crash": True}) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    assert sim_crashes(url) == 1


async def test_context_length_follows_vllm_refused_over_the_limit_cut_short_when_only_max_tokens_does_not_fit(sim):
    url = sim("--time-scale", "0.05", "--max-model-len", "1000", "--kv-tokens", "4096")
    async with aiohttp.ClientSession() as session:
        # about 900 tokens of prompt (the sim's estimate, 4 characters a token) and 500 to answer
        async with session.post(f"{url}/v1/completions",
                                json={"model": "deepseek-sim", "prompt": "abcd" * 900, "max_tokens": 500}) as r:
            body = await r.json()
            assert r.status == 200 and body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 1000 - 900  # cut at the context's end
        async with session.post(f"{url}/v1/completions",
                                json={"model": "deepseek-sim", "prompt": "abcd" * 1001, "max_tokens": 1}) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and (error["type"], error["param"], error["code"]) == ("BadRequestError",
                                                                                       "input_tokens", 400)
            assert "maximum context length is 1000 tokens" in error["message"]


async def test_a_full_engine_line_answers_503_without_retry_after_and_counts_the_rejection(sim):
    url = sim("--time-scale", "0.1", "--max-num-queued-reqs", "2")
    async with aiohttp.ClientSession() as session:
        async def ask():
            async with session.post(f"{url}/v1/chat/completions", data=chat(max_tokens=4)) as r:
                return r.status, r.headers.get("retry-after"), await r.json()

        async with session.post(f"{url}/sim/faults", json={"paused": True}) as r:  # nothing leaves the line
            assert r.status == 200
        waiting = [asyncio.create_task(ask()) for _ in range(2)]
        await async_wait_until(lambda: metric(f"{url}/metrics", "vllm:num_requests_waiting") == 2, what="a full line")
        refused = await asyncio.gather(*[ask() for _ in range(4)])
        async with session.post(f"{url}/sim/faults", json={"paused": False}) as r:
            assert r.status == 200
        assert [a[0] for a in await asyncio.gather(*waiting)] == [200, 200]
    assert all(status == 503 and retry is None and body["error"]["message"].startswith("The engine is currently busy")
               for status, retry, body in refused)
    assert metric(f"{url}/metrics", "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 4


async def test_prefill_and_decode_histograms_and_waiting_by_reason(sim):
    url = sim("--time-scale", "0.1")
    assert await _burst(url, [100, 200], max_tokens=5) == [200] * 2
    samples = scrape(f"{url}/metrics")
    assert metric_sum(samples, "vllm:request_prefill_time_seconds_count") == 2
    assert metric_sum(samples, "vllm:request_decode_time_seconds_count") == 2
    assert metric_sum(samples, "vllm:request_decode_time_seconds_sum") > 0  # four tokens after the first
    assert metric_sum(samples, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    info = next(dict(labels) for name, labels in samples if name == "vllm:cache_config_info")
    assert (info["block_size"], info["kv_cache_size_tokens"]) == ("128", "65536")


def test_each_request_knows_where_its_engine_time_went():
    """With a stepped clock: a short request that arrives behind a long prompt waits in the
    engine's line while the long prefill fills whole steps, shares one step with its last chunk
    (time beside a long prefill), then decodes; the long prompt's own prefill is not counted
    beside itself. Times are the engine's unscaled seconds."""
    from extproc_testbed.sim_engine import SimEngine, step_seconds

    class Clock:
        t = 50.0

        def __call__(self) -> float:
            return self.t

    params = SimParams(time_scale=0.5, max_num_seqs=2)
    clock = Clock()
    engine = SimEngine(params, clock=clock)
    long = engine.submit(6000, 1, {})
    short = engine.submit(100, 2, {})
    steps = []
    while engine.running or engine.waiting:
        step = engine.schedule()
        steps.append({seq: n for seq, n in step.work})
        clock.t += engine.step_duration(step)
        engine.finish(step)
    # chunks of 2048, 2048, then the long's last 1904 beside the short's whole prompt, then its decode
    assert steps == [{long: 2048}, {long: 2048}, {long: 1904, short: 100}, {short: 1}]

    def unscaled(prefill_tokens: int, sequences: int) -> float:
        return step_seconds(params, prefill_tokens, sequences) / params.time_scale

    shared = unscaled(2004, 2)
    assert short.timings() == pytest.approx({"engine_queue_s": 2 * unscaled(2048, 1), "prefill_s": shared,
                                             "decode_s": unscaled(0, 1), "beside_prefill_s": shared,
                                             "beside_long_prefill_s": shared})
    # the long one's last chunk shared its step with the short one's prompt, a short prefill
    assert long.timings()["beside_prefill_s"] == pytest.approx(shared)
    assert long.timings()["beside_long_prefill_s"] == 0
    assert long.timings()["prefill_s"] == pytest.approx(2 * unscaled(2048, 1) + shared)


async def test_an_answer_says_which_engine_served_it_and_where_its_time_went(sim):
    url = sim("--time-scale", "0.5")
    port = url.rsplit(":", 1)[1]
    async with aiohttp.ClientSession() as session:
        alone = await session.post(f"{url}/v1/chat/completions", data=chat(max_tokens=4))
        assert alone.status == 200
        timing = {k: alone.headers[f"x-sim-{k}-ms"] for k in ("engine-queue", "prefill", "decode",
                                                                "beside-prefill", "beside-long-prefill")}
        assert alone.headers["x-sim-engine"] == f"127.0.0.1:{port}"
        assert all(v.isdigit() for v in timing.values())
        assert timing["beside-prefill"] == timing["beside-long-prefill"] == "0"
        assert int(timing["decode"]) > 0

        long = asyncio.create_task(session.post(f"{url}/v1/chat/completions", data=chat("x" * 4 * 12000, max_tokens=1)))
        await async_wait_until(lambda: json.loads(http_get(f"{url}/sim/stats")[1])["running"] == 1, 10)
        beside = await session.post(f"{url}/v1/chat/completions", data=chat(max_tokens=2))
        assert int(beside.headers["x-sim-beside-long-prefill-ms"]) > 0
        assert (await long).status == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_goes_away_aborts_its_request_as_vllm_does(sim, stream):
    """vLLM aborts a request whose client disconnected, streamed or not (`with_cancellation`): its
    engine lets it go at once, and counts it `abort`, not `length`. (A long answer: at time scale 1
    it would run for about 20 s.)"""
    url = sim("--time-scale", "1")
    samples = lambda: scrape(f"{url}/metrics")  # noqa: E731
    finished = lambda reason: metric_sum(samples(), "vllm:request_success_total", finished_reason=reason)  # noqa: E731
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(f"{url}/v1/chat/completions",
                                                   data=chat(stream=stream, max_tokens=2000)))
        await async_wait_until(lambda: metric_sum(samples(), "vllm:num_requests_running") == 1, 10, "it running")
        request.cancel()  # the connection closes under it
        if stream and request.done() and not request.cancelled():
            request.result().close()
    await async_wait_until(lambda: finished("abort") == 1, 10, "the engine aborting it")
    assert metric_sum(samples(), "vllm:num_requests_running") == 0 and finished("length") == 0
