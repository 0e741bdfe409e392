"""Routing by model, end to end: two pools behind one real Envoy, each serving one model on
simulated engines of its own (each engine answers 404 for any other model). Each model's
requests land on its own engines only; a model nobody serves gets the sidecar's 404, a tenant
limited to one model the sidecar's 403 for the other, both before any queue; `GET /v1/models`
lists what the caller may use, answered by the sidecar without reaching an engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from extproc_testbed.stack import LOOPBACK, http_get

from ..conftest import CLERK_KEY, OFFICER_KEY, e2e_config, start_stack
from ..helpers import chat, metric

# The stack's two engine groups: Envoy's vllm_primary cluster runs two `extproc sim --model
# deepseek-sim`, vllm_fallback one `--model deepseek-sim-small`.
BIG, SMALL = "deepseek-sim", "deepseek-sim-small"
ENGINES = {BIG: "primary", SMALL: "fallback"}  # the stack's name for each model's engines


def models_config() -> dict:
    raw = e2e_config()
    raw["pools"] = {
        "loans": {"cluster": "vllm_primary", "max_inflight": 4, "served_models": [BIG]},
        "archive": {"cluster": "vllm_fallback", "max_inflight": 4, "served_models": [SMALL]},
    }
    raw["default_pool"] = "loans"
    assert raw["tenants"][1]["name"] == "clerk"
    raw["tenants"][1]["models"] = [SMALL]  # the clerk may use the small model alone
    return raw


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("models"), models_config(), primaries=2)
    yield stack
    stack.stop()


def ask(stack, method: str, path: str, body: bytes | None = None, key: str | None = None) -> tuple[int, dict, dict]:
    headers = {"content-type": "application/json"} if body is not None else {}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{stack.url}{path}", body, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            status, got, text = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        status, got, text = error.code, dict(error.headers), error.read()
    return status, {k.lower(): v for k, v in got.items()}, json.loads(text)


def engine_requests(stack, model: str) -> int:
    """The completions the engines of `model`'s pool were sent (each engine's own count)."""
    pool = ENGINES[model]
    return sum(json.loads(http_get(f"{stack.sim_url(i, pool)}/sim/stats")[1])["requests"]
               for i in range(len(stack.ports.pool_ports(pool))))


def upstream_requests(stack) -> int:
    """Every request Envoy sent to a model cluster (its own stats)."""
    _, text = http_get(f"http://{LOOPBACK}:{stack.ports.envoy_admin}/stats?filter=upstream_rq_total")
    return sum(int(line.split(":")[1]) for line in text.splitlines()
               if line.startswith(("cluster.vllm_primary.", "cluster.vllm_fallback.")))


def outcomes(stack, outcome: str) -> float:
    return metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome=outcome)


def test_each_models_requests_land_only_on_its_own_engines(two_models):
    before = {model: engine_requests(two_models, model) for model in ENGINES}
    for model in (BIG, SMALL, BIG, SMALL, SMALL, BIG, BIG):
        status, headers, body = ask(two_models, "POST", "/v1/chat/completions", chat(model=model, max_tokens=4))
        assert status == 200, body
        assert body["model"] == model and "x-llm-fallback" not in headers
    assert {model: engine_requests(two_models, model) - before[model] for model in ENGINES} == {BIG: 4, SMALL: 3}


def test_a_model_nobody_serves_gets_the_sidecars_404_before_any_queue(two_models):
    engines, refused = upstream_requests(two_models), outcomes(two_models, "rejected_model_not_found")
    status, headers, body = ask(two_models, "POST", "/v1/chat/completions", chat(model="gpt-4o"), key=OFFICER_KEY)
    assert status == 404
    assert body == {"error": {"message": "The model `gpt-4o` does not exist or you do not have access to it.",
                              "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert headers["x-extproc-outcome"] == "rejected_model_not_found"
    assert outcomes(two_models, "rejected_model_not_found") == refused + 1
    assert upstream_requests(two_models) == engines  # no engine was asked


def test_a_tenant_limited_to_one_model_gets_403_for_the_other(two_models):
    engines = upstream_requests(two_models)
    status, headers, body = ask(two_models, "POST", "/v1/chat/completions", chat(model=BIG), key=CLERK_KEY)
    assert status == 403
    assert body == {"error": {"message": f"Tenant `clerk` does not have access to model `{BIG}`.",
                              "type": "invalid_request_error", "param": "model", "code": "model_not_allowed"}}
    assert headers["x-extproc-outcome"] == "rejected_model_not_allowed"
    assert upstream_requests(two_models) == engines
    status, _, body = ask(two_models, "POST", "/v1/chat/completions", chat(model=SMALL, max_tokens=4), key=CLERK_KEY)
    assert status == 200 and body["model"] == SMALL
    # the officer may use both
    assert ask(two_models, "POST", "/v1/chat/completions", chat(model=BIG, max_tokens=4), key=OFFICER_KEY)[0] == 200


def test_v1_models_lists_what_the_caller_may_use_without_reaching_an_engine(two_models):
    engines, listed = upstream_requests(two_models), outcomes(two_models, "models_listed")
    status, headers, body = ask(two_models, "GET", "/v1/models", key=OFFICER_KEY)
    assert status == 200 and headers["x-extproc-outcome"] == "models_listed"
    assert body["object"] == "list"
    # (in the configuration file's order: start_stack writes the pools sorted by name)
    assert sorted((m["id"], m["object"], m["owned_by"]) for m in body["data"]) == [
        (BIG, "model", "vllm"), (SMALL, "model", "vllm")]
    assert all(isinstance(m["created"], int) for m in body["data"])
    status, _, body = ask(two_models, "GET", "/v1/models", key=CLERK_KEY)
    assert status == 200 and [m["id"] for m in body["data"]] == [SMALL]
    status, _, body = ask(two_models, "GET", "/v1/models")  # a caller without a key: anonymous's rights (all)
    assert sorted(m["id"] for m in body["data"]) == [BIG, SMALL]
    # one model, as the OpenAI client's models.retrieve asks for it
    status, _, body = ask(two_models, "GET", f"/v1/models/{SMALL}", key=CLERK_KEY)
    assert (status, body["id"], body["owned_by"]) == (200, SMALL, "vllm")
    # a model the caller may not use is one it does not see: 404, as for a model nobody serves
    for model in (BIG, "gpt-4o"):
        status, _, body = ask(two_models, "GET", f"/v1/models/{model}", key=CLERK_KEY)
        assert (status, body["error"]["code"]) == (404, "model_not_found")
    # however the path is spelt, and with a body, the list is the sidecar's: no engine lists its own
    for path in ("/v1/%6dodels", "//v1/models", "/v1/./models", "/v1/chat/../models"):
        status, _, body = ask(two_models, "GET", path, key=CLERK_KEY)
        assert (status, [m["id"] for m in body["data"]]) == (200, [SMALL]), path
    status, _, body = ask(two_models, "GET", "/v1/models", json.dumps({"model": SMALL}).encode(), key=CLERK_KEY)
    assert (status, [m["id"] for m in body["data"]]) == (200, [SMALL])
    assert upstream_requests(two_models) == engines
    assert outcomes(two_models, "models_listed") == listed + 9
