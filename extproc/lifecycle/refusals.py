"""Every refusal the gate gives that is not an appointment (those: waiting_room.py), worded in
one place, each with its `retry-after`.

A `retry-after` is at least the configured floor, or the time the pool needs to drain its line
at the rate it drains now when that is longer (at most `retry_after_s.max`), spread by the
jitter (core/retries.retry_after_s). The status and the body each refusal gets are
core/outcomes.py's.
"""

from __future__ import annotations

import random
from collections.abc import Callable

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
        return Rejection(Outcome.REJECTED_DRAINING, "This gateway instance is shutting down; retry.",
                         self.retry_after(self.config.retry_after_s.draining, None))

    def for_route(self, chosen: Route) -> Rejection:
        """The refusal routing decided (`chosen.refusal`): no paired model, or no pool left (a shed
        request is turned away with an appointment: waiting_room.py)."""
        outcome = chosen.refusal
        assert outcome is not None
        if outcome is Outcome.REJECTED_NO_PAIRED_MODEL:
            return Rejection(outcome, f"The {chosen.home} pool is failing and the {chosen.pool} pool has no "
                             "model paired with the requested one; retry later.",
                             self.retry_after(self.config.retry_after_s.unavailable, None))
        opens_in = self._breaker_opens_in(chosen.home)
        return Rejection(outcome, f"The {chosen.home} pool is failing and no fallback pool can take the "
                         "request; retry later.",
                         retry_after_s(self.config.retry_after_s.unavailable, opens_in or None,
                                       self.config.retry_after_s, self._rng))

    def in_progress(self) -> Rejection:
        return Rejection(Outcome.REJECTED_IN_PROGRESS,
                         "A request with this idempotency-key / x-request-id is still being served; "
                         "wait for it instead of repeating it.", self.retry_after(1, None))

    def key_reused(self) -> Rejection:
        return Rejection(Outcome.REJECTED_KEY_REUSED,
                         "This idempotency-key was given to a different request within "
                         f"{self.config.retries.window_s:g} s; a retry must repeat its request exactly: "
                         "give a new request a new key.")

    def too_many_attempts(self, attempts: int) -> Rejection:
        return Rejection(Outcome.REJECTED_TOO_MANY_ATTEMPTS,
                         f"This request was attempted {attempts} times; it will not be run again "
                         f"within {self.config.retries.window_s:g} s.",
                         self.retry_after(self.config.retry_after_s.max, None))

    def over_retry_budget(self, branch: str) -> Rejection:
        return Rejection(Outcome.REJECTED_RETRY_BUDGET,
                         f"Branch {branch} is retrying more than its retry budget allows; retry later.",
                         self.retry_after(self.config.retry_after_s.overloaded, None))
