"""Where a request goes (pure): breaker reroutes, paired models, probes, retries, canary, shadow; and by
model, where pools list the models they serve (core/catalog.py: 404, 403, GET /v1/models)."""

from __future__ import annotations

import hashlib
import json

import pytest

from extproc.core.breaker import Permit, ProbeKind
from extproc.core.catalog import check_model, listing
from extproc.core.config import ConfigError, parse_config
from extproc.core.outcomes import Outcome, Rejection, reply_for
from extproc.core.priority import Callers
from extproc.core.routing import RoutingView, failover_route, route, shadow_route

from ..conftest import e2e_config


def config_with_canary():
    raw = e2e_config()
    raw["pools"]["canary"] = {"cluster": "vllm_canary", "max_inflight": 2, "fallback": "fallback",
                              "models": {"deepseek-sim": "deepseek-sim-next"}}
    raw["canary"] = {"pool": "canary", "digits": ["7"]}
    return parse_config(raw)


CONFIG = config_with_canary()


def view(permits: dict[str, Permit | tuple[Permit, ProbeKind]] | None = None, depths: dict[str, int] | None = None,
         digits: str = "") -> RoutingView:
    permits, depths = permits or {}, depths or {}

    def permit(pool: str):
        p = permits.get(pool, Permit.YES)
        return p if isinstance(p, tuple) else (p, None)

    return RoutingView(lambda pool: depths.get(pool, 0), permit, lambda: frozenset(digits))


def go(v: RoutingView, model: str | None = "deepseek-sim", branch: str = "0001", cls: str = "complaint", **kw):
    return route(cls, branch, model, CONFIG, v, **kw)


def test_an_open_breaker_sends_the_request_to_the_fallback_with_the_paired_model():
    r = go(view({"primary": Permit.NO}))
    assert (r.pool, r.home, r.reason, r.model, r.refusal) == ("fallback", "primary", "breaker", "deepseek-sim-small", None)
    assert r.rerouted


def test_no_healthy_fallback_means_503_and_an_unpaired_model_is_never_sent():
    assert go(view({"primary": Permit.NO, "fallback": Permit.NO})).refusal is Outcome.REJECTED_UNAVAILABLE
    unpaired = go(view({"primary": Permit.NO}), model="some-other-model")
    assert unpaired.refusal is Outcome.REJECTED_NO_PAIRED_MODEL
    assert go(view({"primary": Permit.NO}), model=None).refusal is Outcome.REJECTED_NO_PAIRED_MODEL


def test_probes_go_to_the_pool_when_granted_and_to_the_fallback_when_not():
    half_open = view({"primary": (Permit.PROBE, ProbeKind.HALF_OPEN)})
    probe = go(half_open)
    assert (probe.pool, probe.probe) == ("primary", ProbeKind.HALF_OPEN)
    denied = go(half_open, probe_denied=frozenset({"primary"}))
    assert (denied.pool, denied.reason) == ("fallback", "probe_denied")


def test_a_retry_avoids_the_pool_that_failed_it_when_the_fallback_can_serve():
    r = go(view(), avoid="primary")
    assert (r.pool, r.reason) == ("fallback", "retry")
    assert go(view({"fallback": Permit.NO}), avoid="primary").pool == "primary"  # nowhere better


def test_orange_degrades_only_when_the_model_pairs():
    orange = view(depths={"primary": 5})
    assert go(orange, cls="archive_query").pool == "fallback"
    assert go(orange, cls="archive_query", model="unpaired").pool == "primary"


def test_the_canary_takes_its_digits_while_its_breaker_lets_it():
    r = go(view(digits="7"), branch="0417")
    assert (r.pool, r.home, r.model, r.rerouted) == ("canary", "canary", "deepseek-sim-next", False)
    assert go(view(digits="7"), branch="0418").pool == "primary"
    assert go(view({"canary": Permit.NO}, digits="7"), branch="0417").pool == "primary"
    unpaired = go(view(digits="7"), branch="0417", model="other")  # the canary pairs no such model
    assert unpaired.pool == "primary" and unpaired.model is None


def test_failover_and_shadow_targets():
    v = view()
    target = failover_route("primary", "deepseek-sim", CONFIG, v)
    assert (target.pool, target.model, target.reason) == ("fallback", "deepseek-sim-small", "failover")
    assert failover_route("primary", "unpaired", CONFIG, v) is None
    assert failover_route("primary", "deepseek-sim", CONFIG, view({"fallback": Permit.NO})) is None
    assert failover_route("fallback", "deepseek-sim", CONFIG, v) is None  # no fallback of its own
    assert shadow_route("deepseek-sim", CONFIG, v).pool == "fallback"
    assert shadow_route("deepseek-sim", CONFIG, view(depths={"fallback": 1})) is None  # someone waits there
    assert shadow_route("deepseek-sim", CONFIG, view({"primary": Permit.NO})) is None  # it may need the room


def test_long_prompts_go_to_engines_of_their_own():
    raw = e2e_config()
    raw["pools"]["primary"]["long_pool"] = "long"
    raw["pools"]["long"] = {"cluster": "vllm_long", "max_inflight": 2}
    config = parse_config(raw)
    long_limit = config.pools["primary"].capacity.long_request_tokens
    assert route("complaint", "0001", "deepseek-sim", config, view(), cost=long_limit + 1).pool == "long"
    short = route("complaint", "0001", "deepseek-sim", config, view(), cost=long_limit)
    assert (short.pool, short.rerouted) == ("primary", False)


def test_medium_prompts_of_classes_without_a_target_are_offloaded_and_latency_bound_ones_stay_home():
    raw = e2e_config()
    raw["classes"]["loan_approval"]["latency_target_s"] = 2
    raw["pools"]["primary"]["long_pool"] = "long"
    raw["pools"]["primary"].setdefault("capacity", {})["offload_request_tokens"] = 1000
    raw["pools"]["long"] = {"cluster": "vllm_long", "max_inflight": 2}
    config = parse_config(raw)
    long_limit = config.pools["primary"].capacity.long_request_tokens
    assert route("complaint", "0001", "deepseek-sim", config, view(), cost=1001).pool == "long"
    assert route("complaint", "0001", "deepseek-sim", config, view(), cost=1000).pool == "primary"
    assert route("loan_approval", "0001", "deepseek-sim", config, view(), cost=4000).pool == "primary"
    assert route("loan_approval", "0001", "deepseek-sim", config, view(), cost=long_limit + 1).pool == "long"


def test_the_long_lane_is_never_larger_than_one_backend():
    from extproc.core.capacity import long_lane_share
    from extproc.core.pool_config import Capacity

    assert long_lane_share(Capacity(long_share=0.5)) == 0.5  # no backends listed: as configured
    assert long_lane_share(Capacity(long_share=0.5, backends=("http://a", "http://b"))) == 0.5
    assert long_lane_share(Capacity(long_share=0.5, backends=tuple(f"http://{i}" for i in range(4)))) == 0.25


def test_a_half_open_canary_gets_its_probes_so_it_can_close_again():
    half_open = view({"canary": (Permit.PROBE, ProbeKind.HALF_OPEN)}, digits="7")
    probe = go(half_open, branch="0417")
    assert (probe.pool, probe.probe, probe.model) == ("canary", ProbeKind.HALF_OPEN, "deepseek-sim-next")
    # a probe it cannot be granted: the default pool serves the canary's branch meanwhile
    denied = go(half_open, branch="0417", probe_denied=frozenset({"canary"}))
    assert (denied.pool, denied.refusal, denied.rerouted) == ("primary", None, False)
    # other branches are not the canary's
    assert go(half_open, branch="0412").pool == "primary"


# -- routing by model: each pool lists the models it serves ------------------------------------

def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def by_model_raw() -> dict:
    """Two model pools: `big` serves llama-70b (its fallback `small` pairs it, its long prompts
    go to `big_long`), `small` serves llama-8b and an embedding model (its canary pairs llama-8b
    with the next version); `clerk` may use llama-8b alone."""
    raw = e2e_config()
    raw["pools"] = {
        "big": {"cluster": "vllm_big", "max_inflight": 2, "served_models": ["llama-70b"], "fallback": "small",
                "long_pool": "big_long", "tiers": {"yellow": 2, "orange": 4, "red": 6, "hard_max": 10}},
        "small": {"cluster": "vllm_small", "max_inflight": 4, "served_models": ["llama-8b", "org/embed v2"],
                  "models": {"llama-70b": "llama-8b"}, "tiers": {"yellow": 2, "orange": 4, "red": 6, "hard_max": 10}},
        "big_long": {"cluster": "vllm_big_long", "max_inflight": 1},
        "canary": {"cluster": "vllm_canary", "max_inflight": 1, "models": {"llama-8b": "llama-8b-next"}},
    }
    raw["default_pool"] = "big"
    raw["canary"] = {"pool": "canary", "of": "small", "digits": ["7"]}
    raw["tenants"] = [
        {"name": "officer", "api_key_sha256": [_sha("sk-officer")]},
        {"name": "clerk", "api_key_sha256": [_sha("sk-clerk")], "models": ["llama-8b"]},
    ]
    return raw


BY_MODEL = parse_config(by_model_raw())
ANYONE, OFFICER, CLERK = (Callers(BY_MODEL).identify(key) for key in (None, "Bearer sk-officer", "Bearer sk-clerk"))


def to(model: str | None, v: RoutingView | None = None, branch: str = "0001", cls: str = "complaint", **kw):
    return route(cls, branch, model, BY_MODEL, v or view(), **kw)


def test_each_model_goes_to_the_pool_that_serves_it():
    for model, pool in (("llama-70b", "big"), ("llama-8b", "small"), ("org/embed v2", "small")):
        r = to(model)
        assert (r.pool, r.home, r.model, r.refusal, r.rerouted) == (pool, pool, None, None, False)
    assert BY_MODEL.model_pools == {"llama-70b": "big", "llama-8b": "small", "org/embed v2": "small"}


def test_the_fallback_of_a_models_pool_is_that_pools_own():
    rerouted = to("llama-70b", view({"big": Permit.NO}))
    assert (rerouted.pool, rerouted.home, rerouted.model, rerouted.reason) == ("small", "big", "llama-8b", "breaker")
    # small has no fallback: never big's, nor the default pool's
    assert to("llama-8b", view({"small": Permit.NO})).refusal is Outcome.REJECTED_UNAVAILABLE
    orange = to("llama-70b", view(depths={"big": 5}), cls="archive_query")
    assert (orange.pool, orange.reason, orange.model) == ("small", "degraded", "llama-8b")
    assert to("llama-8b", view(depths={"small": 5}), cls="archive_query").pool == "small"
    target = failover_route("big", "llama-70b", BY_MODEL, view())
    assert (target.pool, target.model) == ("small", "llama-8b")
    assert failover_route("small", "llama-8b", BY_MODEL, view()) is None


def test_the_canary_and_the_long_pool_of_a_models_pool_are_that_pools_own():
    canary = to("llama-8b", view(digits="7"), branch="0417")
    assert (canary.pool, canary.home, canary.model) == ("canary", "canary", "llama-8b-next")
    # the canary is small's: big's requests of the canary's branches stay in big
    assert to("llama-70b", view(digits="7"), branch="0417").pool == "big"
    # the canary pairs no embedding model: small serves it
    assert to("org/embed v2", view(digits="7"), branch="0417").pool == "small"
    long_limit = BY_MODEL.pools["big"].capacity.long_request_tokens
    assert to("llama-70b", cost=long_limit + 1).pool == "big_long"
    assert to("llama-8b", cost=long_limit + 1).pool == "small"  # small keeps no long pool


def test_a_pool_that_lists_its_models_takes_from_another_pool_only_what_its_map_pairs():
    raw = by_model_raw()
    del raw["pools"]["small"]["models"]
    config = parse_config(raw)
    assert route("complaint", "0001", "llama-70b", config, view({"big": Permit.NO})).refusal \
        is Outcome.REJECTED_NO_PAIRED_MODEL
    assert route("archive_query", "0001", "llama-70b", config, view(depths={"big": 5})).pool == "big"  # no degrade
    assert failover_route("big", "llama-70b", config, view()) is None


def test_a_model_nobody_serves_is_404_one_the_caller_may_not_use_403_before_any_route():
    assert check_model(BY_MODEL, ANYONE, "llama-70b") == "big"
    assert check_model(BY_MODEL, CLERK, "llama-8b") == "small"
    with pytest.raises(Rejection) as missing:
        check_model(BY_MODEL, OFFICER, "gpt-4o")
    assert (missing.value.outcome, missing.value.param) == (Outcome.REJECTED_MODEL_NOT_FOUND, "model")
    assert missing.value.message == "The model `gpt-4o` does not exist or you do not have access to it."
    with pytest.raises(Rejection) as denied:
        check_model(BY_MODEL, CLERK, "llama-70b")
    assert (denied.value.outcome, denied.value.param) == (Outcome.REJECTED_MODEL_NOT_ALLOWED, "model")
    assert "clerk" in denied.value.message
    with pytest.raises(Rejection) as unnamed:
        check_model(BY_MODEL, OFFICER, None)
    assert (unnamed.value.outcome, unnamed.value.param) == (Outcome.REJECTED_BAD_REQUEST, "model")


def test_get_v1_models_lists_what_the_caller_may_use_from_the_configuration():
    def listed(caller, path="/v1/models", method="GET"):
        reply = listing(BY_MODEL, caller, method, path, 1_700_000_000)
        return None if reply is None else (reply.status, dict(reply.headers), json.loads(reply.body))

    status, headers, body = listed(ANYONE)
    assert status == 200 and headers["content-type"] == "application/json"
    assert headers["x-extproc-outcome"] == "models_listed"
    # (owned_by as vLLM says it: which pool serves a model is the operator's business)
    assert body == {"object": "list", "data": [
        {"id": "llama-70b", "object": "model", "created": 1_700_000_000, "owned_by": "vllm"},
        {"id": "llama-8b", "object": "model", "created": 1_700_000_000, "owned_by": "vllm"},
        {"id": "org/embed v2", "object": "model", "created": 1_700_000_000, "owned_by": "vllm"}]}
    assert [m["id"] for m in listed(CLERK)[2]["data"]] == ["llama-8b"]
    assert listed(CLERK, "/v1/models/?limit=5")[2] == listed(CLERK)[2]
    # every spelling the engine's server reads as /v1/models is answered here, never passed on
    for spelling in ("/v1/%6dodels", "//v1/models", "/v1/./models", "/v1/chat/../models", "/v1//models/"):
        assert listed(CLERK, spelling)[2] == listed(CLERK)[2], spelling
    assert listed(CLERK, method="HEAD")[2] == listed(CLERK)[2]
    # one model: retrieved; 404 for one the caller may not use, as for one nobody serves (a list
    # that hides a model does not confirm it exists)
    assert listed(ANYONE, "/v1/models/org%2Fembed%20v2")[2]["id"] == "org/embed v2"
    assert listed(ANYONE, "/v1/models/org/embed%20v2")[2]["id"] == "org/embed v2"
    refusals = []
    for path in ("/v1/models/llama-70b", "/v1/models/gpt-4o", "/v1/%6dodels/llama-70b"):
        with pytest.raises(Rejection) as refused:
            listed(CLERK, path)
        refusals.append((refused.value.outcome, reply_for(refused.value).status))
    assert refusals == [(Outcome.REJECTED_MODEL_NOT_FOUND, 404)] * 3
    # anything else passes through: another method, another path, a method Envoy did not send
    assert listed(ANYONE, method="POST") is None and listed(ANYONE, method=None) is None
    assert listed(ANYONE, "/health") is None and listed(ANYONE, "/v1/modelsx") is None
    assert listed(ANYONE, "/v1/models/../chat/completions") is None


def test_without_model_lists_every_model_goes_to_the_default_pool_and_v1_models_passes_through():
    assert CONFIG.model_pools == {} and CONFIG.pool_serving("anything") == "primary"
    anyone = Callers(CONFIG).identify(None)
    for model in ("deepseek-sim", "anything", None):
        assert check_model(CONFIG, anyone, model) == "primary"
        assert go(view(), model=model).pool == "primary"
    assert listing(CONFIG, anyone, "GET", "/v1/models", 0) is None


@pytest.mark.parametrize(("change", "says"), [
    (lambda raw: raw["pools"]["big"].update(served_models=["llama-70b", "llama-8b"]),
     "model 'llama-8b' is in the served_models of two pools, big and small"),
    (lambda raw: raw["pools"]["big"].update(served_models=["llama-70b", "llama-70b"]),
     "served_models lists a model twice"),
    (lambda raw: raw["pools"]["big"].update(served_models=[]), "served_models"),
    (lambda raw: raw["pools"]["big"].pop("served_models"), "default_pool 'big' lists no served_models"),
    (lambda raw: raw["canary"].update(of="big_long"), "canary.of 'big_long' lists no served_models"),
    (lambda raw: raw["canary"].update(of="canary"), "canary.pool must not be the pool it is the canary of"),
    (lambda raw: raw["canary"].update(of="nowhere"), "canary.of 'nowhere' is not one of pools"),
    (lambda raw: raw["tenants"][1].update(models=["llama-9b"]), "tenants.1.models: 'llama-9b' is in no pool's"),
    (lambda raw: raw.update(anonymous={"ticket_types": "*", "models": ["nope"]}), "anonymous.models: 'nope'"),
])
def test_a_model_list_that_cannot_route_is_refused_naming_the_key(change, says):
    raw = by_model_raw()
    change(raw)
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert says in str(error.value)


def test_a_tenants_model_list_needs_pools_that_list_theirs():
    raw = e2e_config()
    raw["tenants"][1]["models"] = ["deepseek-sim"]
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert "tenants.1.models: a list of models needs pools that list their served_models" in str(error.value)


def test_a_canary_of_another_pool_than_the_default_needs_pools_that_list_their_models():
    """Without served_models every request goes to the default pool: a canary of another pool
    would take none, while its rollbacks would still name that pool."""
    raw = e2e_config(canary={"pool": "fallback", "of": "primary", "digits": ["7"]})
    assert parse_config(raw).canary_of == "primary"  # the default pool: as without `of`
    raw["pools"]["spare"] = {"cluster": "vllm_spare", "max_inflight": 1}
    raw["canary"]["of"] = "spare"
    with pytest.raises(ConfigError, match="canary.of names another pool than the default"):
        parse_config(raw)
