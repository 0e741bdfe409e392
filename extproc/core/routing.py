"""Where a request goes, pure: its home pool (the pool that serves its model, or the canary pool
for the branches in the canary), and when the home pool cannot take it, the fallback pool. No I/O.

Theory of operation
-------------------
1. **Home.** The pool that serves the request's `model` (`served_models`; the default pool
   where no pool lists its models: core/catalog.py refused a model nobody serves before this);
   a branch whose id ends in one of the canary digits goes to the canary pool instead, when the
   canary is that pool's (`canary.of`), as long as the canary pool's breaker lets requests
   through. A long request goes to the home pool's `long_pool`, when it has one.
2. **Reroute.** The home pool's breaker (see breaker.py) may say no (instant level open, or an
   operator forced it open), or let the request through only as a probe (half-open, or one
   probe per interval while rerouting). A probe that cannot be granted, a breaker that says no,
   or a retry whose previous attempt failed in the home pool, sends the request to the home
   pool's fallback, if that pool's own breaker lets it through; otherwise the client gets 503.
3. **Degrade.** A degradable class goes to the fallback pool from the home pool's orange tier.
4. **Paired models.** A request reaching a pool other than the one that serves its model has its
   `model` rewritten through that pool's `models` map; a model missing from the map (or, without
   a map, from a pool that lists `served_models`) is never sent there (503 when there is nowhere
   else to go, no degrade when there is).
5. **Shed.** When the line ahead of it (its class and the classes served before it) is past
   the chosen pool's red tier, a request of an unprotected class gets 429 (with an appointment:
   core/appointments.py), except one coming back to keep its place; past the hard maximum, any
   class. Requests of classes served after it do not count: they never delay it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .admission import Tier, tier_for
from .breaker import Permit, ProbeKind
from .config import Config
from .outcomes import Outcome


@dataclass(frozen=True, slots=True)
class Route:
    """Where a classified request should wait, or why it must not."""

    pool: str
    home: str
    reason: str | None = None  # why not home: "breaker", "probe_denied", "retry", "degraded"
    model: str | None = None  # write this `model` into the body (None: unchanged)
    probe: ProbeKind | None = None  # the caller must obtain this probe permit for `pool`
    refusal: Outcome | None = None

    @property
    def rerouted(self) -> bool:
        """Served by a fallback pool rather than its home (the response says so)."""
        return self.pool != self.home


@dataclass(frozen=True)
class RoutingView:
    """What routing reads of the moment: queue depths, breaker permits, canary digits."""

    depth: Callable[[str], int]
    permit: Callable[[str], tuple[Permit, ProbeKind | None]]
    canary_digits: Callable[[], frozenset[str]] = frozenset
    # (pool, class) -> the requests in line served before or with one of that class (None: all of them)
    ahead: Callable[[str, str], int] | None = None

    def depth_ahead(self, pool: str, class_name: str) -> int:
        return self.depth(pool) if self.ahead is None else self.ahead(pool, class_name)


def paired_model(config: Config, pool: str, model: str | None, own: str | None = None) -> tuple[bool, str | None]:
    """(may go, model to write) for a request of `model` that reaches `pool` (`own`: the pool
    that serves the model, when the caller knows it already)."""
    if pool == (own or config.pool_serving(model)):
        return True, None
    target = config.pools[pool]
    models = target.models
    if models is None:  # the pools serve the same models, unless this one says which it serves
        return target.served_models is None, None
    if model is None or model not in models:
        return False, None
    return True, None if models[model] == model else models[model]


def home_pool(config: Config, branch_id: str, view: RoutingView, cost: int = 0, latency_bound: bool = False,
              probe_denied: frozenset[str] = frozenset(), own: str | None = None) -> str:
    """The canary pool for its branches, when it is the canary of the request's `own` pool (the
    one that serves its model; None: the default pool), while its breaker lets requests through,
    as probes too: a canary that half-opened after a rollback closes again only if it gets them;
    `own` otherwise. A long request (costing
    more than the pool's `long_request_tokens`) goes to the pool's `long_pool` when it has one,
    so short requests never share an engine step with a long prompt's prefill. A request of a
    class without a latency target goes there above `offload_request_tokens`: its prefill
    would lengthen the steps of the latency-bound requests, which stay home up to the first
    threshold (on the long pool, behind medium prompts, they would miss their target)."""
    own = own or config.default_pool
    canary = config.canary.pool
    if (canary is not None and own == config.canary_of and branch_id[-1:] in view.canary_digits()
            and canary not in probe_denied and view.permit(canary)[0] is not Permit.NO):
        home = canary
    else:
        home = own
    pool = config.pools[home]
    if pool.long_pool is not None:
        offload = pool.capacity.offload_request_tokens
        threshold = pool.capacity.long_request_tokens if latency_bound or offload is None else offload
        if cost > threshold:
            return pool.long_pool
    return home


def route(
    class_name: str,
    branch_id: str,
    model: str | None,
    config: Config,
    view: RoutingView,
    avoid: str | None = None,
    probe_denied: frozenset[str] = frozenset(),
    cost: int = 0,
    returning: bool = False,
) -> Route:
    """`returning`: the request comes back (after an appointment): the red tier lets it in. The
    gate checked its `model` first (core/catalog.py: a model no pool serves is refused 404)."""
    policy = config.classes[class_name]
    let_in = policy.protected or returning  # the red tier lets it in
    own = config.pool_serving(model) or config.default_pool
    home = home_pool(config, branch_id, view, cost, policy.latency_target_s is not None, probe_denied, own)
    fallback = config.pools[home].fallback
    may_home, home_rewrite = paired_model(config, home, model, own)
    if not may_home:  # the canary (or long) pool has no pair for this model: its own pool serves it
        home, fallback = own, config.pools[own].fallback
        home_rewrite = None
    permit, probe = view.permit(home)
    if home == avoid:  # the previous attempt failed here: the fallback, if it can serve
        retry = _to_fallback("retry", home, fallback, model, class_name, let_in, config, view)
        if retry.refusal is None:
            return retry
    if permit is Permit.NO:
        return _to_fallback("breaker", home, fallback, model, class_name, let_in, config, view)
    if permit is Permit.PROBE:
        if home in probe_denied:
            return _to_fallback("probe_denied", home, fallback, model, class_name, let_in, config, view)
        return _shed_check(Route(home, home, None, home_rewrite, probe), class_name, let_in, config, view)
    if (
        policy.degradable
        and fallback is not None
        and tier_for(view.depth(home), config.pools[home].tiers) >= Tier.ORANGE
        and view.permit(fallback)[0] is Permit.YES
        and paired_model(config, fallback, model)[0]
    ):
        return _to_fallback("degraded", home, fallback, model, class_name, let_in, config, view)
    chosen = _HOME.get((home, home_rewrite))
    if chosen is None:  # (a Route is frozen: the plain ones are shared)
        chosen = _HOME[(home, home_rewrite)] = Route(home, home, None, home_rewrite)
    return _shed_check(chosen, class_name, let_in, config, view)


_HOME: dict[tuple[str, str | None], Route] = {}  # (pool, model written) -> the plain route home


def _to_fallback(reason: str, home: str, fallback: str | None, model: str | None, class_name: str, let_in: bool,
                 config: Config, view: RoutingView) -> Route:
    if fallback is None:
        return Route(home, home, reason, refusal=Outcome.REJECTED_UNAVAILABLE)
    permit, _ = view.permit(fallback)
    if permit is not Permit.YES:
        return Route(fallback, home, reason, refusal=Outcome.REJECTED_UNAVAILABLE)
    may, rewrite = paired_model(config, fallback, model)
    if not may:
        return Route(fallback, home, reason, refusal=Outcome.REJECTED_NO_PAIRED_MODEL)
    return _shed_check(Route(fallback, home, reason, rewrite), class_name, let_in, config, view)


def _shed_check(chosen: Route, class_name: str, let_in: bool, config: Config, view: RoutingView) -> Route:
    """Past the hard maximum, any request is refused; in the red tier, one the red tier does not
    let in (`let_in`: a protected class, or a request that comes back with an appointment).
    Either way the line ahead of it counts only the classes served before or with it, so the
    waiting of a lower class never refuses a higher one."""
    tiers = config.pools[chosen.pool].tiers
    depth = view.depth_ahead(chosen.pool, class_name)
    if depth >= tiers.hard_max:
        return Route(chosen.pool, chosen.home, chosen.reason, chosen.model, refusal=Outcome.SHED_QUEUE_FULL)
    if not let_in and tier_for(depth, tiers) is Tier.RED:
        return Route(chosen.pool, chosen.home, chosen.reason, chosen.model, refusal=Outcome.SHED_OVERLOADED)
    return chosen


def failover_route(home: str, model: str | None, config: Config, view: RoutingView) -> Route | None:
    """Where a failed attempt in `home` (one that failed before its response started) may be
    tried once more: its fallback pool, when that pool takes requests and pairs the model."""
    fallback = config.pools[home].fallback
    if fallback is None or view.permit(fallback)[0] is not Permit.YES:
        return None
    may, rewrite = paired_model(config, fallback, model)
    if not may:
        return None
    depth = view.depth(fallback)
    if depth >= config.pools[fallback].tiers.hard_max:
        return None
    return Route(fallback, home, "failover", rewrite)


def shadow_route(model: str | None, config: Config, view: RoutingView) -> Route | None:
    """Where a shadow copy of a request served by the default pool goes, if anywhere now."""
    target = config.shadow.pool or config.pools[config.default_pool].fallback
    if target is None or view.permit(target)[0] is not Permit.YES:
        return None
    if view.permit(config.default_pool)[0] is not Permit.YES:
        return None  # the target may have to carry the default pool's traffic
    may, rewrite = paired_model(config, target, model)
    if not may or view.depth(target) > 0:
        return None  # never ahead of, nor beside, anyone waiting
    return Route(target, config.default_pool, "shadow", rewrite)
