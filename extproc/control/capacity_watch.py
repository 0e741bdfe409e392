"""The capacity model kept up to date (core/capacity_model.py): the gate's observations go in as
they happen (a bump on the hot path), and every `probes.interval_s` each pool's requests in
flight per engine are told to it (what the completions ran at: its service-time fit's x) and its
estimate is computed, exported (`extproc_desired_backends`, `extproc_capacity_rps`...) and kept for the
queue page and the yellow-tier webhook. A need beyond a pool's `autoscale.max_backends` is a
decision for a person: it goes to the alerts webhook (once per pool per `scale_out_every_s`,
all replicas together) and to the `ExtprocCapacityBeyondMax` alert."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from ..core.admission import Tier, tier_for
from ..core.capacity_model import CapacityModel, Estimate, ModelSettings
from ..core.config import Config
from ..core.events import FirstByte, RequestDecided, RequestFinished
from ..core.outcomes import Outcome
from ..ops.metrics import Metrics
from ..ops.webhooks import JsonPoster
from ..stores.queue import QueueStore
from .periodic import Periodic

log = logging.getLogger("extproc")

# The outcomes of a routed request that count as demand on its home pool (what the capacity
# model sizes the pool for): served, or turned away for want of room; not a malformed request.
DEMAND = frozenset((Outcome.ADMITTED, Outcome.SHED_OVERLOADED, Outcome.SHED_QUEUE_FULL, Outcome.EXPIRED_IN_QUEUE,
                    Outcome.DEFERRED, Outcome.REJECTED_PAST_DEADLINE, Outcome.REJECTED_UNAVAILABLE,
                    Outcome.CANCELLED_CLIENT_GONE))


def model_settings(config: Config, pool: str) -> ModelSettings:
    return ModelSettings(**config.pools[pool].autoscale.model_dump())


class CapacityWatch:
    def __init__(self, config: Callable[[], Config], store: QueueStore, metrics: Metrics,
                 backends_up: Callable[[str], int], kv_tokens: Callable[[str], int | None],
                 pager: JsonPoster | None = None, claim: Callable[[str, str, float], Awaitable[bool]] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 replicas_hearing: Callable[[str], int] = lambda pool: 1):
        self.config = config
        self.store = store
        self.metrics = metrics
        self.backends_up = backends_up
        self.kv_tokens = kv_tokens
        self.pager = pager
        self.claim = claim
        self.clock = clock
        # over how many replicas each pool's arrivals are spread: this one hears only its own
        # decisions (the line, the in-flight count and the engines it reads are the pool's)
        self.replicas_hearing = replicas_hearing
        current = config()
        targets = {name: c.latency_target_s for name, c in current.classes.items()}
        self.models = {name: CapacityModel(targets, pool.capacity.max_num_seqs, model_settings(current, name),
                                           kv_safety=pool.capacity.safety_factor, started_at=clock())
                       for name, pool in current.pools.items()}
        self.estimates: dict[str, Estimate] = {}
        self._concurrency: dict[str, float] = {}  # per engine, as of the last tick
        self._beyond: dict[str, bool] = {}
        self._loop = Periodic(self.tick, lambda: self.config().probes.interval_s, "capacity model tick failed")

    # -- the gate's observations ---------------------------------------------------------------

    # What it hears from the request path (core/events.py; server.py subscribes it).

    def decided(self, event: RequestDecided) -> None:
        """A first attempt's outcome on its home pool is demand (served, or turned away for want
        of room; not a malformed request, nor a client's retry counted twice)."""
        if event.home in self.models and event.first_attempt and event.outcome in DEMAND:
            self.models[event.home].arrived(self.clock(), event.class_name, self.replicas_hearing(event.home))

    def first_byte(self, event: FirstByte) -> None:
        """An admitted request's first byte: how long its engine took, at the pool's concurrency."""
        if event.pool in self.models and event.since_admission_s is not None:
            self.models[event.pool].responded(self.clock(), event.class_name, event.since_admission_s,
                                              self._concurrency.get(event.pool, 1.0))

    def finished(self, event: RequestFinished) -> None:
        if event.pool in self.models and event.end == "completed":
            self.models[event.pool].served(self.clock(), event.class_name, event.since_admission_s, event.cost)

    # -- the loop ------------------------------------------------------------------------------

    def capacity_of(self, pool: str) -> dict | None:
        """The pool's latest estimate as plain data (None: none yet)."""
        estimate = self.estimates.get(pool)
        return estimate.as_dict() if estimate is not None else None

    async def start(self) -> None:
        await self.tick()
        self._loop.start()

    async def stop(self) -> None:
        self._loop.stop()

    async def tick(self) -> None:
        config = self.config()
        now = self.clock()
        for name, model in self.models.items():
            pool = config.pools[name]
            model.settings = model_settings(config, name)  # a reload's settings, the samples kept
            model.targets = {class_name: c.latency_target_s for class_name, c in config.classes.items()}
            model.max_num_seqs = pool.capacity.max_num_seqs
            model.kv_safety = pool.capacity.safety_factor
            model.kv_tokens_per_engine = self.kv_tokens(name) or pool.capacity.kv_tokens_per_backend
            snapshot = await self.store.snapshot(name)
            up = self.backends_up(name)
            self._concurrency[name] = snapshot.inflight / max(1, up)
            model.ran_at(now, self._concurrency[name])  # what the completions ran at: the fit's x
            above_green = tier_for(snapshot.depth, pool.tiers) > Tier.GREEN
            estimate = model.estimate(now, up, snapshot.depth_by_class, above_green)
            self.estimates[name] = estimate
            self.export(name, estimate)
            self._check_beyond_max(name, estimate)

    def export(self, pool: str, estimate: Estimate) -> None:
        m = self.metrics
        m.desired_backends.labels(pool).set(estimate.desired)
        m.per_engine_concurrency.labels(pool).set(estimate.per_engine_concurrency)
        for horizon, value in (("now", estimate.needed_now), ("ahead", estimate.needed_ahead)):
            m.needed_backends.labels(pool, horizon).set(-1 if value is None else value)
        for class_name, rps in estimate.capacity_rps.items():
            m.capacity_rps.labels(pool, class_name).set(-1 if rps is None else rps)
        for class_name, fit in estimate.service_fit.items():
            for term in ("base", "per_request"):
                m.service_fit.labels(pool, class_name, term).set(-1 if fit is None else getattr(fit, f"{term}_s"))
        for class_name, rps in estimate.demand_rps.items():
            m.demand_rps.labels(pool, class_name).set(rps)
        maximum = self.config().pools[pool].autoscale.max_backends
        m.max_backends.labels(pool).set(-1 if maximum is None else maximum)
        m.capacity_beyond_max.labels(pool).set(int(estimate.beyond_max))

    def _check_beyond_max(self, pool: str, estimate: Estimate) -> None:
        was = self._beyond.get(pool, False)
        self._beyond[pool] = estimate.beyond_max
        if estimate.beyond_max and not was:
            log.warning("pool %s needs more engines than autoscale.max_backends allows: %s", pool, estimate.as_dict())
            if self.pager is not None:
                every = self.config().queue.scale_out_every_s
                claim = (lambda: self.claim(pool, "capacity_beyond_max", every)) if self.claim else None
                self.pager.post({"event": "capacity_beyond_max", "pool": pool,
                                 "max_backends": self.config().pools[pool].autoscale.max_backends,
                                 **estimate.as_dict()}, claim)
