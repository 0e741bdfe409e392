"""Engines started with `--api-key`, as vLLM's: the simulator refuses what vLLM refuses, and the
requests the sidecar sends itself through Envoy's relay listener (a failover attempt, a shadow
copy) carry the client's Authorization, so an engine that requires a key answers them too. Real
Envoy, real sidecar, simulated engines, the `openai` client."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
import yaml
from aiohttp import web

from extproc_testbed.sim import SimServer
from extproc_testbed.sim_engine import SimParams
from extproc_testbed.stack import SimSpec, Stack, StackPorts

from ..conftest import OFFICER_KEY, TIME_SCALE, e2e_config
from ..helpers import async_wait_until, chat, metric

FAULT = "x-sim-fault"  # names the model whose server answers this request with 500


async def test_the_sim_guards_the_api_as_vllm_does_and_leaves_health_and_metrics_open():
    server = SimServer(SimParams(time_scale=0.001, api_keys=("sk-one", "sk-two")))
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    body = chat(max_tokens=2)
    try:
        async with aiohttp.ClientSession() as session:
            async def ask(method: str, path: str, authorization: str | None = None) -> tuple[int, str]:
                headers = {"authorization": authorization} if authorization is not None else {}
                async with session.request(method, f"{url}{path}", data=body if method == "POST" else None,
                                           headers=headers) as response:
                    return response.status, await response.text()

            for authorization in (None, "Bearer sk-three", "Basic sk-one", "sk-one", "Bearer  sk-one"):
                status, text = await ask("POST", "/v1/chat/completions", authorization)
                assert (status, json.loads(text)) == (401, {"error": "Unauthorized"}), authorization
            assert (await ask("GET", "/v1/models"))[0] == 401
            assert server.requests == 0  # refused before the engine saw anything
            for authorization in ("Bearer sk-one", "bearer sk-two"):  # the scheme in any case
                assert (await ask("POST", "/v1/chat/completions", authorization))[0] == 200
            assert (await ask("GET", "/v1/models", "Bearer sk-two"))[0] == 200
            for path in ("/health", "/metrics", "/sim/stats"):
                assert (await ask("GET", path))[0] == 200, path
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory):
    """Both pools' engines require OFFICER_KEY; every admitted request is copied to the fallback."""
    tmp = tmp_path_factory.mktemp("keyed")
    path = tmp / "extproc.yaml"
    config = e2e_config(shadow={"share": 1.0})
    path.write_text(yaml.safe_dump(config))
    args = ("--time-scale", TIME_SCALE, "--api-key", OFFICER_KEY)
    stack = Stack(tmp, StackPorts.random(), path, primary=SimSpec("deepseek-sim", args),
                  fallback=SimSpec("deepseek-sim-small", args)).start()
    yield stack
    stack.stop()


def client(stack: Stack, key: str = OFFICER_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0)


def test_a_failover_to_an_engine_that_requires_a_key_is_answered(keyed_stack):
    answered = metric(keyed_stack.metrics_url, "extproc_failovers_total", result="answered")
    raw = client(keyed_stack).chat.completions.with_raw_response.create(
        model="deepseek-sim", messages=[{"role": "user", "content": "Approve loan #42?"}], max_tokens=4,
        extra_headers={"x-ticket-type": "complaint", FAULT: "deepseek-sim"})  # the primary answers 500
    assert raw.http_response.status_code == 200
    assert raw.headers["x-llm-fallback"] == "true"
    completion = raw.parse()
    assert completion.model == "deepseek-sim-small" and completion.usage.completion_tokens == 4
    assert metric(keyed_stack.metrics_url, "extproc_failovers_total", result="answered") == answered + 1


async def test_a_shadow_copy_to_an_engine_that_requires_a_key_is_answered(keyed_stack):
    m = keyed_stack.metrics_url
    copies = metric(m, "extproc_shadow_responses_total", side="shadow")
    answered = metric(m, "extproc_shadow_responses_total", side="shadow", status_class="2xx")
    completion = client(keyed_stack).chat.completions.create(
        model="deepseek-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_headers={"x-ticket-type": "complaint"})
    assert completion.model == "deepseek-sim"
    await async_wait_until(lambda: metric(m, "extproc_shadow_responses_total", side="shadow") == copies + 1, 10)
    assert metric(m, "extproc_shadow_responses_total", side="shadow", status_class="2xx") == answered + 1


def test_a_client_without_the_key_is_refused_by_the_engine_not_the_sidecar(keyed_stack):
    with pytest.raises(openai.AuthenticationError) as error:
        client(keyed_stack, "sk-not-the-key").chat.completions.create(
            model="deepseek-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_headers={"x-ticket-type": "complaint"})
    assert error.value.response.json() == {"error": "Unauthorized"}  # vLLM's words, not the sidecar's
