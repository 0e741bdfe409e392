"""Where the third level's state lives: breaker windows and states, probe permits, the canary,
the shadow share, and the attempts of named requests.

`ControlStore` is the contract. `LocalControlStore` keeps the state in this process;
`RedisControlStore` (redis_control.py) keeps one copy in Redis, shared by every replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..core.breaker import BreakerState
from ..core.canary import CanaryState
from ..core.config import Retries
from ..core.retries import AttemptLedger, AttemptStart

# pool -> level -> bucket index -> (requests, failures)
Deltas = dict[str, dict[str, dict[int, tuple[int, int]]]]


@dataclass(frozen=True)
class Controls:
    """What operators set at run time, apart from the configuration file (a reload leaves it
    as it is), versioned: the canary rollout, and the shadow share an operator set (None: none,
    the file's `shadow.share` applies)."""

    version: int = 0
    canary: CanaryState = CanaryState()
    shadow_share: float | None = None

    def as_fields(self) -> dict[str, str]:
        # (`operator_shadow_share`: the `shadow_share` field of earlier versions held the file's
        # share too, written at start; it is no longer read)
        return {
            "version": str(self.version), "canary_digits": self.canary.digits,
            "canary_rolled_back_at": "" if self.canary.rolled_back_at is None else repr(self.canary.rolled_back_at),
            "canary_reason": self.canary.reason or "",
            "operator_shadow_share": "" if self.shadow_share is None else repr(self.shadow_share),
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> Controls | None:
        if not fields:
            return None
        at = fields.get("canary_rolled_back_at", "")
        canary = CanaryState(fields.get("canary_digits", ""), float(at) if at else None,
                             fields.get("canary_reason") or None)
        share = fields.get("operator_shadow_share", "")
        return cls(int(fields["version"]), canary, float(share) if share else None)


@dataclass
class Synced:
    """What a sync brought back: the shared clock, summed windows, states, controls."""

    now: float
    windows: dict[str, dict[str, list[tuple[int, int, int]]]] = field(default_factory=dict)  # pool -> level -> buckets
    states: dict[str, BreakerState] = field(default_factory=dict)
    controls: Controls | None = None


class ControlStore(Protocol):
    """Where the third level's state lives. Every implementation keeps this contract (one suite
    runs over all of them: tests/stores/test_control_store_contract.py)."""

    shared: bool  # several replicas share it (their counts are summed by `sync`)
    clock: Callable[[], float]  # the store's clock: Redis TIME for a shared store

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def sync(self, deltas: Deltas) -> Synced | None:
        """Send the outcomes counted since the last sync; the windows summed over every replica,
        every pool's breaker state and the controls come back (None: not shared)."""

    async def swap_breaker(self, pool: str, expected_version: int, state: BreakerState) -> BreakerState:
        """Write `state` if the stored one still has `expected_version`; the stored state after."""

    async def take_probe(self, pool: str, opening: float, limit: int) -> bool:
        """One of the `limit` half-open probe permits of the opening at `opening`, if one is left."""

    async def return_probe(self, pool: str, opening: float) -> None:
        """A probe of that opening ended without an outcome: its permit goes back."""

    async def claim_once(self, pool: str, what: str, every_s: float) -> bool:
        """True for the first claim of `what` for `pool` in each `every_s`, across replicas:
        one replica acts (a rerouting probe, a scale-out signal), the others stand down."""

    async def swap_controls(self, expected_version: int, controls: Controls) -> Controls:
        """Write `controls` if the stored ones still have `expected_version`; the stored ones after."""

    async def controls(self) -> Controls | None:
        """The stored controls (None: nobody wrote any yet)."""

    async def begin_attempt(self, key: str, digest: str = "", fresh: bool = False) -> AttemptStart:
        """An attempt of the request named `key` starts: `digest` the request itself (a name
        given to another request is not its retry), `fresh` a first attempt by its client's
        word, which starts the name over (the attempt ledger: core/retries.py)."""

    async def renew_attempts(self, keys: list[str]) -> None:
        """The named attempts still running here: their leases are renewed."""

    async def finish_attempt(self, key: str, failed_in: str | None) -> None:
        """A named attempt ended (in failure in `failed_in`, or not)."""


class LocalControlStore:
    """Everything in this process; the breakers' own windows are the only count."""

    shared = False

    def __init__(self, retries: Retries, clock: Callable[[], float] = time.monotonic, lease_s: float = 10.0):
        self.clock = clock
        self._states: dict[str, BreakerState] = {}
        self._controls: Controls | None = None
        self._probes: dict[tuple[str, float], int] = {}
        self._claimed_until: dict[tuple[str, str], float] = {}
        self._ledger = AttemptLedger(retries, lease_s)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def sync(self, deltas: Deltas) -> Synced | None:
        return None

    async def swap_breaker(self, pool: str, expected_version: int, state: BreakerState) -> BreakerState:
        current = self._states.get(pool, BreakerState())
        if current.version != expected_version:
            return current
        self._states[pool] = state
        return state

    async def take_probe(self, pool: str, opening: float, limit: int) -> bool:
        key = (pool, opening)
        if self._probes.get(key, 0) >= limit:
            return False
        self._probes = {k: v for k, v in self._probes.items() if k[0] != pool or k[1] == opening}
        self._probes[key] = self._probes.get(key, 0) + 1
        return True

    async def return_probe(self, pool: str, opening: float) -> None:
        key = (pool, opening)
        if self._probes.get(key, 0) > 0:
            self._probes[key] -= 1

    async def claim_once(self, pool: str, what: str, every_s: float) -> bool:
        now = self.clock()
        if self._claimed_until.get((pool, what), now) > now:
            return False
        self._claimed_until[(pool, what)] = now + every_s
        return True

    async def swap_controls(self, expected_version: int, controls: Controls) -> Controls:
        current = self._controls or Controls()
        if current.version != expected_version:
            return current
        self._controls = controls
        return controls

    async def controls(self) -> Controls | None:
        return self._controls

    async def begin_attempt(self, key: str, digest: str = "", fresh: bool = False) -> AttemptStart:
        return self._ledger.begin(key, self.clock(), digest, fresh)

    async def renew_attempts(self, keys: list[str]) -> None:
        self._ledger.renew(keys, self.clock())

    async def finish_attempt(self, key: str, failed_in: str | None) -> None:
        self._ledger.finish(key, failed_in, self.clock())
