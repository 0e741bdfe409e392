"""One read model of the sidecar's state, for the operator API and the live queue page alike.

`read_state` gathers it from `StateSources` (callables into the running parts: the composition
root, server.py, wires them), so neither reader depends on the server; each renders the same
frozen dataclasses in its own format (protobuf: admin_service.py; JSON: queue_page.py).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.admission import QUIET_ARRIVALS, tier_for
from ..core.canary import CanaryState
from ..core.config import Config
from ..core.engine_drain import DrainView
from ..core.events import ClientLeft, RequestDecided
from ..stores.queue import PoolSnapshot


@dataclass(frozen=True)
class WindowView:
    requests: int
    failures: int
    failure_ratio: float | None  # None while the window is empty
    tripped: bool


@dataclass(frozen=True)
class BreakerView:
    instant: str  # closed, open, half_open
    open_for_s: float
    rerouting: bool
    paged: bool
    paged_for_s: float
    forced: str | None  # None, "open" or "closed"
    windows: dict[str, WindowView]  # by window ("1s", "60s", "300s")


@dataclass(frozen=True)
class PoolView:
    name: str
    cluster: str
    fallback: str | None
    tier: str
    tiers: dict[str, int]
    waiting: int
    waiting_by_class: dict[str, int]
    waiting_by_branch: dict[str, dict[str, int]]
    inflight: int
    max_inflight: int  # as the load probes set it now
    max_inflight_configured: int
    latency_cap: int | None  # on the classes without a latency target (None: no cap now)
    inflight_unbounded: int
    placed: dict[str, dict[str, int]]  # backend -> requests and tokens this replica placed there, still running
    inflight_tokens: int
    token_budget: int | None
    cancelled: dict[str, int]  # clients that left before their response, by where they were
    breaker: BreakerView
    capacity: dict[str, Any] | None = None  # the capacity model's estimate (None: none yet)
    # Whether Envoy sends placed requests where the sidecar placed them: "followed", "ignored",
    # "unknown" (too few answered yet); None when the sidecar does not pick this pool's backends
    engine_picks: str | None = None
    engine_picks_followed_share: float | None = None  # of the last placed requests that answered
    # engines that get no new request (drained by an operator, or gone from the pool), what each runs
    draining_engines: tuple[DrainView, ...] = ()
    # what keeps long prompts from latency-bound requests (LoadController.long_rule): "placed_apart",
    # "wait_for_quiet" (with the quiet spell `long_quiet_s`), "one_engine", "not_kept_apart"; None:
    # no latency target. `long_prompts_said`: the same in words (long_prompts_said)
    long_prompts: str | None = None
    long_quiet_s: float = 0.0
    long_prompts_said: str | None = None


@dataclass(frozen=True)
class ClassView:
    name: str
    protected: bool
    degradable: bool
    latency_target_s: float | None


@dataclass(frozen=True)
class CanaryView:
    pool: str | None
    digits: tuple[str, ...]
    batch: int
    batches: int
    order: str
    rolled_back: bool
    rollback_reason: str | None


@dataclass(frozen=True)
class SidecarState:
    generated_at: float
    replica: str
    shared: bool
    draining: bool
    config_version: str
    classes: tuple[ClassView, ...]
    pools: tuple[PoolView, ...]  # the default pool first, the others as configured
    canary: CanaryView
    shadow_share: float
    shadow_share_by_operator: bool  # set at run time (`extproc admin shadow`), not the file's
    decisions: tuple[dict[str, Any], ...] | None  # the newest first (None: no history kept)


class RecentDecisions:
    """What the queue page shows of the request path, from its events (core/events.py): the
    newest decision records, and the clients that left before their response since start, by
    pool and where they were."""

    def __init__(self, keep: int = 200):
        self.records: deque[Mapping[str, Any]] = deque(maxlen=keep)  # newest last
        self._cancelled: dict[str, Counter[str]] = {}

    def subscriptions(self) -> list[tuple[type, Callable[[Any], None]]]:
        return [(RequestDecided, self.decided), (ClientLeft, self.client_left)]

    def decided(self, event: RequestDecided) -> None:
        self.records.append(event.record)

    def client_left(self, event: ClientLeft) -> None:
        self._cancelled.setdefault(event.pool, Counter())[event.phase] += 1

    def cancelled_in(self, pool: str) -> dict[str, int]:
        return dict(self._cancelled.get(pool, {}))


@dataclass(frozen=True)
class StateSources:
    """Where each part of the state is read."""

    config: Callable[[], Config]
    config_version: Callable[[], str]
    replica: str
    shared: bool  # the queue and the breakers are shared by replicas (Redis)
    draining: Callable[[], bool]
    snapshot: Callable[[str], Awaitable[PoolSnapshot]]
    waiting_by_branch: Callable[[str], Awaitable[dict[str, dict[str, int]]]]
    breaker: Callable[[str], Mapping[str, Any]]  # the control plane's snapshot of a pool's breaker
    canary: Callable[[], CanaryState]
    shadow_share: Callable[[], float]  # in force
    shadow_share_by_operator: Callable[[], bool]
    latency_cap: Callable[[str, int], int | None]  # pool, its max_inflight now
    placed: Callable[[str], Mapping[str, tuple[int, int]]]  # backend -> (requests, tokens)
    cancelled: Callable[[str], Mapping[str, int]]
    decisions: Callable[[], Iterable[Mapping[str, Any]] | None]
    clock: Callable[[], float] = time.time
    capacity: Callable[[str], Mapping[str, Any] | None] = lambda pool: None  # the capacity model's estimate
    # (verdict, share followed), or None where the sidecar does not pick the backends (core/picks.py)
    engine_picks: Callable[[str], tuple[str, float | None] | None] = lambda pool: None
    engine_drains: Callable[[str], tuple[DrainView, ...]] = lambda pool: ()  # the pool's draining engines
    long_prompts: Callable[[str], str | None] = lambda pool: None  # LoadController.long_prompts


def long_prompts_said(rule: str | None, quiet_s: float) -> str | None:
    """What keeps a pool's long prompts from its latency-bound requests, in words (the queue
    page's and `extproc admin state`'s): why a long prompt may wait while the pool has room."""
    if rule == "wait_for_quiet":
        quiet = (f"; one of a class without a latency target also until none came in the last {quiet_s:g} s, "
                 f"nor {QUIET_ARRIVALS} in the last {QUIET_ARRIVALS * quiet_s:g} s") if quiet_s else ""
        return ("Envoy places this pool's requests by a policy of its own, or is not known yet to follow the "
                "sidecar's picks, so long prompts are kept apart in time: each waits until "
                f"no latency-bound request and no other long prompt runs{quiet}; one still in its prefill when a "
                "latency-bound request arrives yields its engine, once")
    return {
        "placed_apart": "placed on engines apart from the latency-bound requests: a long prompt waits only for "
                        "an engine that may take it",
        "one_engine": "not kept apart: fewer than two engines answer, so a long prompt starts beside anything",
        "not_kept_apart": "not kept apart from latency-bound requests (capacity.keep_long_apart is off)",
    }.get(rule or "")


def _plain(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if value is None else dict(value)


def _picks(picks: tuple[str, float | None] | None) -> dict[str, Any]:
    if picks is None:
        return {}
    verdict, share = picks
    return {"engine_picks": verdict, "engine_picks_followed_share": None if share is None else round(share, 3)}


def _long_prompts(rule: str | None, quiet_s: float) -> dict[str, Any]:
    return {"long_prompts": rule, "long_quiet_s": quiet_s, "long_prompts_said": long_prompts_said(rule, quiet_s)}


def _ratio(value: float) -> float | None:
    return value if math.isfinite(value) else None


async def read_state(sources: StateSources, decisions_shown: int | None = None) -> SidecarState:
    """The state now; `decisions_shown` keeps only that many of the newest decisions."""
    config = sources.config()
    pools = []
    for name, pool in sorted(config.pools.items(), key=lambda item: item[0] != config.default_pool):
        snapshot = await sources.snapshot(name)
        breaker = sources.breaker(name)
        pools.append(PoolView(
            name=name, cluster=pool.cluster, fallback=pool.fallback,
            tier=tier_for(snapshot.depth, pool.tiers).name.lower(), tiers=pool.tiers.model_dump(),
            waiting=snapshot.depth, waiting_by_class=dict(snapshot.depth_by_class),
            waiting_by_branch=await sources.waiting_by_branch(name),
            inflight=snapshot.inflight, max_inflight=snapshot.max_inflight, max_inflight_configured=pool.max_inflight,
            latency_cap=sources.latency_cap(name, snapshot.max_inflight), inflight_unbounded=snapshot.unbounded_inflight,
            placed={endpoint: {"requests": n, "tokens": tokens}
                    for endpoint, (n, tokens) in sorted(sources.placed(name).items())},
            inflight_tokens=snapshot.inflight_tokens, token_budget=snapshot.budget_tokens,
            cancelled=dict(sources.cancelled(name)),
            breaker=BreakerView(
                instant=breaker["instant"], open_for_s=breaker["open_for_s"], rerouting=breaker["rerouting"],
                paged=breaker["paged"], paged_for_s=breaker["paged_for_s"], forced=breaker["forced"] or None,
                windows={label: WindowView(r.requests, r.failures, _ratio(r.ratio), r.tripped)
                         for label, r in breaker["windows"].items()},
            ),
            capacity=_plain(sources.capacity(name)),
            **_picks(sources.engine_picks(name)),
            draining_engines=sources.engine_drains(name),
            **_long_prompts(sources.long_prompts(name), pool.capacity.long_quiet_s),
        ))
    canary = sources.canary()
    records = sources.decisions()
    decisions = None
    if records is not None:
        newest_first = [dict(record) for record in reversed(list(records))]  # a copy: the gate appends meanwhile
        decisions = tuple(newest_first[:decisions_shown] if decisions_shown is not None else newest_first)
    classes = sorted(config.classes, key=lambda c: (config.classes[c].base, c))
    return SidecarState(
        generated_at=sources.clock(), replica=sources.replica, shared=sources.shared, draining=sources.draining(),
        config_version=sources.config_version(),
        classes=tuple(ClassView(c, config.classes[c].protected, config.classes[c].degradable,
                                config.classes[c].latency_target_s) for c in classes),
        pools=tuple(pools),
        canary=CanaryView(config.canary.pool, tuple(canary.digits), canary.batch, len(config.canary.order),
                          config.canary.order, canary.rolled_back_at is not None, canary.reason),
        shadow_share=sources.shadow_share(), shadow_share_by_operator=sources.shadow_share_by_operator(),
        decisions=decisions,
    )
