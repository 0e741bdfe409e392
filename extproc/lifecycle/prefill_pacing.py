"""Where an admitted request of a class without a latency target waits for its prompt's turn on its
pool's prefill pace (core/prefill_pace.py), holding its slot, before it is placed and sent on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..core.config import Config
from ..core.events import FirstByte
from ..core.prefill_pace import PrefillPace
from ..ops.metrics import Metrics


@dataclass(frozen=True)
class PaceWait:
    """An admitted request whose prompt waits `delay_s` for its turn on the pool's prefill pace."""

    pool: str
    delay_s: float


class PrefillPacing:
    def __init__(self, config: Callable[[], Config], metrics: Metrics, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self._config = config
        self._clock = clock
        self._sleep = sleep
        self.metrics = metrics
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
        """For a request just admitted: how long its prompt waits for its turn (None: it starts
        now: a latency-bound class, a pool not paced, or a pace with room for it)."""
        if bounded or (pace := self._pace(pool)) is None:
            return None
        delay = pace.delay(self._clock(), prompt_tokens)
        limit = pace.limit(self._clock())
        self.metrics.prefill_pace_rate.labels(pool).set(-1 if limit is None else limit)
        return PaceWait(pool, delay) if delay > 0 else None

    async def wait(self, waiter: PaceWait, until: float, stop: Callable[[], bool]) -> None:
        """Wait, holding the slot, for the prompt's turn (or until the gate's clock reaches
        `until`, or `stop()`: it starts then)."""
        due = self._clock() + waiter.delay_s
        end = min(due, until)
        result = "cancelled"
        try:
            while (now := self._clock()) < end and not stop():
                await self._sleep(min(end - now, PACE_POLL_S))
            result = "started" if self._clock() >= due else "cut_short"  # its wait ran out, or the sidecar drains
        finally:
            self.metrics.prefill_paced.labels(waiter.pool, result).inc()


PACE_POLL_S = 0.25  # how often a paced request looks whether the sidecar drains
