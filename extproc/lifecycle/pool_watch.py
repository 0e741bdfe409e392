"""Each pool's state as its store reports it: the queue-depth tier (and what a change of tier
sets off), how fast the line drains, and the pool gauges, written when metrics are read
(`publish_gauges`, which server.py has the metrics call before each render)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..core.admission import Tier, tier_for
from ..core.appointments import DrainMeter, ahead_of
from ..core.config import Config
from ..core.events import Observers, TierChanged
from ..ops.metrics import Metrics
from ..stores.queue import PoolSnapshot

log = logging.getLogger("extproc")

DRAIN_READING_S = 0.05  # the drain rate is read at most this often (the store reports every change)

_TIER_ACTIONS = {
    Tier.GREEN: "normal",
    Tier.YELLOW: "scale-out signal",
    Tier.ORANGE: "degrading degradable classes to the fallback pool",
    Tier.RED: "shedding unprotected classes",
}


class PoolWatch:
    def __init__(self, config: Config, metrics: Metrics, clock: Callable[[], float],
                 observers: Observers):
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.observers = observers
        self._tiers: dict[str, Tier] = {}
        self._depths: dict[str, int] = {}  # the depth each pool's tier was last read at
        self._drain = {name: DrainMeter(min_interval_s=DRAIN_READING_S) for name in config.pools}
        self._bases = {name: policy.base for name, policy in config.classes.items()}
        self._snapshots: dict[str, PoolSnapshot] = {}

    def changed(self, pool: str, snapshot: PoolSnapshot) -> None:
        """Note a pool's state, its drain rate, and act on a change of tier (called by the store
        on every change: kept cheap; the gauges are written when metrics are read)."""
        self._snapshots[pool] = snapshot
        self._drain[pool].observe(self.clock(), snapshot.released_total)
        if snapshot.depth != self._depths.get(pool):
            self._retier(pool, snapshot.depth)

    def snapshot(self, pool: str) -> PoolSnapshot | None:
        """The pool's state as last reported (None before the first report)."""
        return self._snapshots.get(pool)

    def ahead(self, pool: str, class_name: str) -> int:
        """The requests in `pool`'s line served before or with one of `class_name` (its class and
        the classes of a lower base), as last reported."""
        snapshot = self._snapshots.get(pool)
        if snapshot is None or not snapshot.depth:
            return 0
        return ahead_of(self._bases[class_name], snapshot.depth_by_class, self._bases)

    def drain_rate(self, pool: str) -> float | None:
        """Requests a second the pool's line drains at now (None before it has drained)."""
        return self._drain[pool].rate

    def seconds_to_drain(self, pool: str, depth: int) -> float | None:
        """How long `pool`'s line of `depth` takes to drain at the rate it drains now."""
        return self._drain[pool].seconds_to_drain(depth)

    def reconfigure(self, config: Config) -> None:
        """New tiers: read again at the depths last seen."""
        self.config = config
        self._bases = {name: policy.base for name, policy in config.classes.items()}
        for pool, snapshot in self._snapshots.items():
            self._retier(pool, snapshot.depth)

    def _retier(self, pool: str, depth: int) -> None:
        self._depths[pool] = depth
        tier = tier_for(depth, self.config.pools[pool].tiers)
        previous = self._tiers.get(pool, Tier.GREEN)
        if tier != previous:
            self._tiers[pool] = tier
            self.metrics.tier.labels(pool).set(int(tier))
            log.warning("pool %s tier %s -> %s at queue depth %d (%s)",
                        pool, previous.name.lower(), tier.name.lower(), depth, _TIER_ACTIONS[tier])
            self.observers.emit(TierChanged(pool, previous, tier, depth))

    def publish_gauges(self) -> None:
        for pool, snapshot in self._snapshots.items():
            self.metrics.inflight.labels(pool).set(snapshot.inflight)
            self.metrics.inflight_tokens.labels(pool).set(snapshot.inflight_tokens)
            self.metrics.max_inflight.labels(pool).set(snapshot.max_inflight)
            by_class = snapshot.depth_by_class
            for class_name in self.config.classes:
                self.metrics.queue_depth.labels(pool, class_name).set(by_class.get(class_name, 0))
