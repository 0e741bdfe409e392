"""The refusals the gate decides that are not an appointment (those: waiting_room.py), each with
its `retry-after` over the state it sees now.

A `retry-after` is at least the configured floor, or the time the pool needs to drain its line
at the rate it drains now when that is longer (at most `retry_after_s.max`), spread by the
jitter (core/retries.retry_after_s). The wording, the status and the body each refusal gets are
core/outcomes.py's (its constructors).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..core import outcomes
from ..core.config import Config
from ..core.outcomes import Outcome, Rejection
from ..core.retries import retry_after_s
from ..core.routing import Route


class Refusals:
    def __init__(self, config: Config, depth: Callable[[str], int],
                 seconds_to_drain: Callable[[str, int], float | None],
                 breaker_opens_in: Callable[[str], float], rng: random.Random):
        self.config = config
        self._depth = depth
        self._seconds_to_drain = seconds_to_drain
        self._breaker_opens_in = breaker_opens_in
        self._rng = rng

    def retry_after(self, floor_s: int, pool: str | None) -> int:
        drain = None if pool is None else self._seconds_to_drain(pool, self._depth(pool))
        return retry_after_s(floor_s, drain, self.config.retry_after_s, self._rng)

    def draining(self) -> Rejection:
        return outcomes.draining(self.retry_after(self.config.retry_after_s.draining, None))

    def for_route(self, chosen: Route) -> Rejection:
        """The refusal routing decided (`chosen.refusal`): no paired model, or no pool left (a shed
        request is turned away with an appointment: waiting_room.py)."""
        outcome = chosen.refusal
        assert outcome in (Outcome.REJECTED_NO_PAIRED_MODEL, Outcome.REJECTED_UNAVAILABLE), outcome
        if outcome is Outcome.REJECTED_NO_PAIRED_MODEL:
            return outcomes.no_paired_model(chosen.home, chosen.pool,
                                            self.retry_after(self.config.retry_after_s.unavailable, None))
        opens_in = self._breaker_opens_in(chosen.home)
        return outcomes.unavailable(chosen.home, retry_after_s(self.config.retry_after_s.unavailable, opens_in or None,
                                                               self.config.retry_after_s, self._rng))

    def in_progress(self) -> Rejection:
        return outcomes.in_progress(self.retry_after(1, None))

    def key_reused(self) -> Rejection:
        return outcomes.key_reused(self.config.retries.window_s)

    def too_many_attempts(self, attempts: int) -> Rejection:
        return outcomes.too_many_attempts(attempts, self.config.retries.window_s,
                                          self.retry_after(self.config.retry_after_s.max, None))

    def over_retry_budget(self, branch: str) -> Rejection:
        return outcomes.over_retry_budget(branch, self.retry_after(self.config.retry_after_s.overloaded, None))
