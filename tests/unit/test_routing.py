"""Where a request goes (pure): breaker reroutes, paired models, probes, retries, canary, shadow."""

from __future__ import annotations

from extproc.core.breaker import Permit, ProbeKind
from extproc.core.config import parse_config
from extproc.core.outcomes import Outcome
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
