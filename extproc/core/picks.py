"""Whether Envoy follows the sidecar's engine picks, pure: what ran where, in, a verdict out.

For a pool whose backends the sidecar picks (`capacity.pick_backend`), the sidecar names the
engines to try, best first, and Envoy's override_host load-balancing policy on the pool's
cluster sends the request to the first healthy one (envoy/envoy.yaml). A cluster with a policy of
its own (least request, round robin: what a platform team writes by default) sends it wherever
that policy says, and what the sidecar decided about placement does not happen: long prompts are
not kept off the engines that serve latency-bound requests, and an engine can be handed more
than the sidecar counted on it. Every response says where the request ran (Envoy's
`upstream.address`), so the sidecar can tell.

Over the last `window` placed requests of a pool that answered, the share that ran on the
engine named first: at least `followed_share` reads as followed, below `ignored_below` as
ignored, and in between the verdict stays what it was (from nothing known, nothing until a
whole window is in between: then the middle of the two decides). A retry
on another engine (the first failed) or a pick that was ejected costs Envoy that follows a
request now and then; a policy of its own matches the pick by chance, and more often than one
request in as many engines when it balances by load too: least request on two engines chose the
sidecar's pick 75-80 % of the time, and a single threshold at 80 % read that as followed and
back every few seconds (the long prompts' rule flipped with it). Until `min_samples` requests
answered, nothing is known.
"""

from __future__ import annotations

import enum
from collections import deque


class Following(enum.Enum):
    UNKNOWN = "unknown"  # too few placed requests answered yet
    FOLLOWED = "followed"
    IGNORED = "ignored"


class PickWatch:
    def __init__(self, window: int = 50, min_samples: int = 10, followed_share: float = 0.96,
                 ignored_below: float = 0.85):
        self.window = window
        self.min_samples = min_samples
        self.followed_share = followed_share
        self.ignored_below = ignored_below
        self._seen: dict[str, deque[bool]] = {}
        self._state: dict[str, Following] = {}

    def observe(self, pool: str, followed: bool) -> Following | None:
        """A placed request of `pool` answered from the engine named first (`followed`) or from
        another one. Returns the pool's new verdict when this changed it, else None."""
        seen = self._seen.get(pool)
        if seen is None:
            seen = self._seen[pool] = deque(maxlen=self.window)
        seen.append(followed)
        if len(seen) < self.min_samples:
            return None
        share = sum(seen) / len(seen)
        was = self._state.get(pool, Following.UNKNOWN)
        state = Following.FOLLOWED if share >= self.followed_share \
            else Following.IGNORED if share < self.ignored_below else was
        if state is Following.UNKNOWN and len(seen) == self.window:  # a whole window in between: say which
            middle = (self.followed_share + self.ignored_below) / 2
            state = Following.FOLLOWED if share >= middle else Following.IGNORED
        if was is state:
            return None
        self._state[pool] = state
        return state

    def state(self, pool: str) -> Following:
        return self._state.get(pool, Following.UNKNOWN)

    def share(self, pool: str) -> float | None:
        """The share of the last placed requests that ran where they were placed (None: none yet)."""
        seen = self._seen.get(pool)
        return sum(seen) / len(seen) if seen else None
