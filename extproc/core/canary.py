"""The canary rollout by branch, pure: which tail digits of branch ids go to the canary pool.

The seed rolls a new model version out by the last digit of the institution id, in ten
batches. `order` lists the digits in rollout order; advancing a batch adds the next one,
rolling back removes the last one added. When the canary pool's breaker opens or starts
rerouting, every digit is rolled back at once and the rollback is remembered (with its reason)
until an operator advances again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CanaryState:
    digits: str = ""  # in the order they were added
    rolled_back_at: float | None = None  # an automatic rollback, on the shared clock
    reason: str | None = None

    @property
    def batch(self) -> int:
        return len(self.digits)

    def advance(self, order: str) -> CanaryState:
        for digit in order:
            if digit not in self.digits:
                return CanaryState(self.digits + digit)
        return CanaryState(self.digits)  # every digit is in already

    def roll_back(self) -> CanaryState:
        return CanaryState(self.digits[:-1], self.rolled_back_at, self.reason)

    def roll_back_all(self, reason: str, now: float) -> CanaryState:
        return CanaryState("", now, reason)


def initial_state(digits: tuple[str, ...], order: str) -> CanaryState:
    """The configured digits, in rollout order."""
    return CanaryState("".join(d for d in order if d in digits))
