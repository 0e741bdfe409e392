"""Where an admitted request of a class without a latency target waits for its prompt's turn on its
pool's prefill pace (core/prefill_pace.py), holding its slot, before it is placed and sent on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..core.config import Config
from ..core.events import FirstByte, Observers, PaceWaited
from ..core.prefill_pace import PrefillPace
from ..ops.metrics import Metrics


@dataclass(frozen=True)
class PaceWait:
    """An admitted request whose prompt waits for its turn on the pool's prefill pace: until `due`
    on the gate's clock."""

    pool: str
    due: float


class PrefillPacing:
    def __init__(self, config: Callable[[], Config], metrics: Metrics, observers: Observers,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 placed_apart: Callable[[str], bool] = lambda pool: True):
        self._config = config
        # Whether the sidecar places the pool's requests and Envoy follows (else Envoy's own policy
        # places them): the rate the latency set applies only there. Where Envoy places them, a
        # loan slowed past its target is most often one put beside a long prompt, which no pace
        # prevents, and the cut only took the other classes' throughput (the matrix's plain
        # cells); a surge is spread everywhere.
        self._placed_apart = placed_apart
        self._clock = clock
        self._sleep = sleep
        self.metrics = metrics  # (the gauge of the pace in force, written as the metrics are read)
        self._emit = observers.emit  # who hears of the prompts that waited their turn
        self.paces: dict[str, PrefillPace] = {}

    def _pace(self, pool: str) -> PrefillPace | None:
        """The pool's pace, with the configuration in force (None: the pool is not paced)."""
        config = self._config()
        capacity = config.pools[pool].capacity
        if not capacity.prefill_pace:
            return None
        pace = self.paces.get(pool) or self.paces.setdefault(pool, PrefillPace())
        return pace.configure(capacity.latency_window_s, config.probes.interval_s)

    def first_byte(self, event: FirstByte) -> None:
        """A request answered (its first byte): a latency-bound one's latency is the pace's measure."""
        target = self._config().classes[event.class_name].latency_target_s
        if target and event.succeeded and (pace := self._pace(event.pool)) is not None:
            pace.observe(self._clock(), event.since_arrival_s, target)

    def needed(self, pool: str, bounded: bool, prompt_tokens: int) -> PaceWait | None:
        """For a request just admitted: until when its prompt waits for its turn (None: it starts
        now: a latency-bound class, a pool not paced, or a pace with room for it). Its tokens
        take their place on the schedule either way."""
        if bounded or (pace := self._pace(pool)) is None:
            return None
        now = self._clock()
        delay = pace.delay(now, prompt_tokens, cut=self._placed_apart(pool))
        return PaceWait(pool, now + delay) if delay > 0 else None

    def publish_gauges(self) -> None:
        """The pace in force in each pool, as the metrics are read."""
        now = self._clock()
        for pool in self._config().pools:
            pace = self._pace(pool)
            limit = None if pace is None else pace.limit(now, cut=self._placed_apart(pool))
            self.metrics.prefill_pace_rate.labels(pool).set(-1 if limit is None else limit)

    async def wait(self, waiter: PaceWait, until: float, stop: Callable[[], bool]) -> None:
        """Wait, holding the slot, for the prompt's turn (or until the gate's clock reaches
        `until`, or `stop()`: it starts then)."""
        due = waiter.due
        end = min(due, until)
        result = "cancelled"
        try:
            while (now := self._clock()) < end and not stop():
                await self._sleep(min(end - now, PACE_POLL_S))
            result = "started" if self._clock() >= due else "cut_short"  # its wait ran out, or the sidecar drains
        finally:
            self._emit(PaceWaited(waiter.pool, result))


PACE_POLL_S = 0.05  # how often a paced request looks whether the sidecar drains
