"""The third control level at run time: every pool's breaker, the canary, the shadow share and
the attempt ledger, over a control store (in-process, or Redis shared by every replica).

Outcomes are counted where they happen (`record`); a state change is applied here at once and
written to the store in the background, compare-and-swap on its version. Only the replica whose
write wins acts on it: it logs, pages (deep level) and rolls the canary back (the canary pool
tripped). Every quarter second `tick` sends the outcomes counted since the last tick, reads
back the shared windows, states and controls, and applies what time alone changes (a hold
that ran out). While the store is unreachable each replica goes on with its own counts.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import replace

from ..core.breaker import Instant, Permit, PoolBreaker, ProbeKind, Transition
from ..core.canary import CanaryState, initial_state
from ..core.config import Config
from ..core.events import Observers, UpstreamCounted
from ..core.retries import AttemptStart, Verdict
from ..ops.metrics import Metrics
from ..ops.webhooks import JsonPoster
from ..stores.control import Controls, ControlStore, Deltas

log = logging.getLogger("extproc.breaker")
TICK_S = 0.25
_INSTANT_NAMES = {Instant.CLOSED: "closed", Instant.OPEN: "open", Instant.HALF_OPEN: "half_open"}


def window_label(seconds: float) -> str:
    return f"{seconds:g}s"

class ControlPlane:
    def __init__(self, config: Config, store: ControlStore, metrics: Metrics,
                 rng: random.Random | None = None, observers: Observers | None = None):
        self.config = config
        self.store = store
        self.metrics = metrics
        self._emit = (observers or Observers()).emit  # who hears each upstream outcome counted
        self.rng = rng or random.Random()
        self.breakers = {name: PoolBreaker(pool.breaker) for name, pool in config.pools.items()}
        self._remote_version = {name: 0 for name in config.pools}
        self._dirty: set[str] = set()
        self._deltas: Deltas = {}
        self._actions: dict[str, list[Transition]] = {name: [] for name in config.pools}
        self._locks = {name: asyncio.Lock() for name in config.pools}
        self.controls = Controls(0, initial_state(config.canary.digits, config.canary.order))
        metrics.shadow_share.set_function(lambda: self.shadow_share)  # as a reload or an operator sets it
        self._controls_written = False
        self.pager = JsonPoster(config.alerts.webhook, "alert") if config.alerts.webhook else None
        self.running_keys: dict[str, int] = {}  # named attempts this replica runs (key -> count)
        self.store_ok = True
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._ticks = 0

    @property
    def clock(self) -> Callable[[], float]:
        return self.store.clock

    def reconfigure(self, config: Config) -> None:
        """A reload: new breaker thresholds and times (states kept), canary order, file's shadow share."""
        self.config = config
        for name, breaker in self.breakers.items():
            breaker.settings = config.pools[name].breaker

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.store.start()
        await self._load_controls()
        await self.tick()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        if self.pager is not None:
            await self.pager.close()
        await self.store.stop()

    async def _load_controls(self) -> None:
        """The shared controls if another replica wrote them, else write the configured ones."""
        try:
            current = await self.store.controls()
            if current is None:
                current = await self.store.swap_controls(0, replace(self.controls, version=1))
            self.controls = current
            self._controls_written = True
        except Exception as error:
            self._store_failed(error)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except Exception:  # (a cancellation is no Exception: it ends the loop)
                log.exception("control tick failed")

    # -- routing reads ------------------------------------------------------------------------

    def permit(self, pool: str) -> tuple[Permit, ProbeKind | None]:
        return self.breakers[pool].route_permit(self.clock())

    @property
    def canary_digits(self) -> frozenset[str]:
        return frozenset(self.controls.canary.digits)

    @property
    def shadow_share(self) -> float:
        """The share in force: the one an operator set at run time, else the file's."""
        return self.config.shadow.share if self.controls.shadow_share is None else self.controls.shadow_share

    def opens_in(self, pool: str) -> float:
        """Seconds until `pool`'s instant level half-opens (0 when it is not open)."""
        return max(0.0, self.breakers[pool].state.open_until - self.clock())

    async def take_probe(self, pool: str, kind: ProbeKind) -> bool:
        breaker = self.breakers[pool]
        try:
            if kind is ProbeKind.HALF_OPEN:
                return await self.store.take_probe(pool, breaker.state.open_until, breaker.half_open_probes)
            return await self.store.claim_once(pool, "rerouting_probe", breaker.probe_interval_s)
        except Exception as error:
            self._store_failed(error)
            return False  # not known to be ours: the request goes to the fallback

    async def claim_signal(self, pool: str, what: str, every_s: float) -> bool:
        """Whether this replica sends `what` for `pool` now (one replica per `every_s`); with the
        store unreachable, every replica sends it: a signal heard twice beats one never sent."""
        try:
            return await self.store.claim_once(pool, what, every_s)
        except Exception as error:
            self._store_failed(error)
            return True

    async def return_probe(self, pool: str) -> None:
        """A half-open probe ended without an outcome (its client left): another may go."""
        try:
            await self.store.return_probe(pool, self.breakers[pool].state.open_until)
        except Exception as error:
            self._store_failed(error)

    # -- outcomes -----------------------------------------------------------------------------

    def record(self, pool: str, failed: bool, probe: ProbeKind | None = None, kind: str = "") -> None:
        """Count one upstream outcome of `pool` (`kind`: the failure's, told with it: UpstreamCounted)."""
        now = self.clock()
        breaker = self.breakers[pool]
        before = breaker.state
        transitions = breaker.record(now, failed, probe)
        if self.store.shared:  # what the next sync sends to the other replicas
            for level, window in breaker.windows.items():
                bucket = self._deltas.setdefault(pool, {}).setdefault(level, {})
                index = window.index(now)
                requests, failures = bucket.get(index, (0, 0))
                bucket[index] = (requests + 1, failures + int(failed))
        self._emit(UpstreamCounted(pool, kind or ("failure" if failed else "success")))
        if breaker.state is not before:  # states are replaced, never changed in place
            self._changed(pool, transitions)

    def _changed(self, pool: str, transitions: list[Transition]) -> None:
        self._actions[pool].extend(transitions)
        self._dirty.add(pool)
        self._export(pool)
        task = asyncio.get_running_loop().create_task(self._commit(pool))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _commit(self, pool: str) -> None:
        """Write this replica's changes of `pool`'s state; act on each only if its write wins.

        A change counted while the previous one is on its way to the store (a write to Redis
        suspends) is not lost: it marks the pool dirty again, and is written next, over the
        version the previous write made."""
        async with self._locks[pool]:
            breaker = self.breakers[pool]
            while pool in self._dirty:
                self._dirty.discard(pool)  # before the await: a change meanwhile marks it again
                base = breaker.state
                expected = self._remote_version[pool]
                proposed = replace(base, version=expected + 1)
                actions, self._actions[pool] = self._actions[pool], []
                try:
                    result = await self.store.swap_breaker(pool, expected, proposed)
                except Exception as error:
                    self._store_failed(error)
                    result = proposed  # unreachable store: act on our own counts
                self._remote_version[pool] = result.version
                if result == proposed:
                    if breaker.state is base:
                        breaker.adopt(proposed)
                    else:  # changed meanwhile: the newer state stays, on the version just written
                        breaker.adopt(replace(breaker.state, version=result.version))
                    for transition in actions:
                        await self._act(pool, transition)
                else:
                    breaker.adopt(result)  # another replica changed it first: its result stands
                    self._dirty.discard(pool)
                    self._actions[pool].clear()
            self._export(pool)

    async def _act(self, pool: str, transition: Transition) -> None:
        breaker = self.breakers[pool]
        rates = {window_label(breaker.windows[level].length_s): round(ratio, 4)
                 for level, ratio in transition.ratios.items()}
        self.metrics.breaker_transitions.labels(pool, transition.level, transition.to).inc()
        message = f"pool {pool} breaker {transition.level} -> {transition.to} (failure ratios {rates})"
        if transition.to in ("open", "rerouting", "paged"):
            log.error(message)
        else:
            log.warning(message)
        if transition.level == "deep" and transition.to == "paged":
            self.metrics.pages.labels(pool).inc()
            if self.pager is not None:  # latched: sent until delivered, or the level is reset
                self.pager.post({"event": "breaker_deep", "pool": pool, "failure_ratios": rates,
                                 "since": transition.at, "severity": "page",
                                 "action": f"extproc admin breaker {pool} reset, once the pool is repaired"},
                                keep_trying=lambda: self.breakers[pool].state.paged)
        if pool == self.config.canary.pool and transition.to in ("open", "rerouting") and self.controls.canary.digits:
            await self._roll_canary_back(f"canary pool breaker {transition.level} {transition.to}")

    async def _roll_canary_back(self, reason: str) -> None:
        digits = self.controls.canary.digits
        changed = await self._update_controls(lambda c: replace(c, canary=c.canary.roll_back_all(reason, self.clock())))
        if changed:
            self.metrics.canary_rollbacks.labels(self.config.canary.pool, "automatic").inc()
            log.error("canary rolled back: digits %s go to %s again (%s)", ",".join(digits),
                      self.config.canary_of, reason)
            if self.pager is not None:
                self.pager.post({"event": "canary_rollback", "pool": self.config.canary.pool,
                                 "digits": list(digits), "reason": reason, "severity": "alert"},
                                keep_trying=lambda: self.controls.canary.rolled_back_at is not None)

    # -- time and sharing ---------------------------------------------------------------------

    async def tick(self) -> None:
        """Share counts, adopt what other replicas decided, apply what time changes."""
        self._ticks += 1
        sent, self._deltas = self._deltas, {}
        try:
            synced = await self.store.sync(sent)
            if not self.store_ok:
                log.warning("control store answers again: breaker state shared again")
            self.store_ok = True
        except Exception as error:
            self._store_failed(error)
            synced = None
            for pool, levels in sent.items():  # keep them for the next try
                for level, counts in levels.items():
                    mine = self._deltas.setdefault(pool, {}).setdefault(level, {})
                    for index, (r, f) in counts.items():
                        r0, f0 = mine.get(index, (0, 0))
                        mine[index] = (r0 + r, f0 + f)
        if synced is not None:
            self._adopt(synced)
        now = self.clock()
        for pool, breaker in self.breakers.items():
            before = breaker.state
            transitions = breaker.evaluate(now)
            if breaker.state is not before:
                self._changed(pool, transitions)
            self._export(pool)
        if self._ticks % max(1, int(self.config.redis.lease_s / 3 / TICK_S)) == 0 and self.running_keys:
            try:
                await self.store.renew_attempts(list(self.running_keys))
            except Exception as error:
                self._store_failed(error)

    def _adopt(self, synced) -> None:
        for pool, levels in synced.windows.items():
            breaker = self.breakers[pool]
            for level, buckets in levels.items():
                breaker.windows[level].load(buckets, synced.now)
                for index, (r, f) in self._deltas.get(pool, {}).get(level, {}).items():
                    breaker.windows[level].add_at(index, r, f, synced.now)  # counted since the sync left
        for pool, state in synced.states.items():
            if pool not in self._dirty and not self._locks[pool].locked() and state.version != self._remote_version[pool]:
                self.breakers[pool].adopt(state)
                self._remote_version[pool] = state.version
            self.breakers[pool].apply_fresh_starts()
        if synced.controls is not None and synced.controls.version != self.controls.version:
            self.controls = synced.controls
        self._export_controls()

    def _store_failed(self, error: BaseException) -> None:
        if self.store_ok:
            log.error("control store unreachable (%s: %s): breakers count this replica's outcomes alone",
                      type(error).__name__, error)
        self.store_ok = False

    # -- operators ----------------------------------------------------------------------------

    async def force(self, pool: str, mode: str | None) -> None:
        await self._operate(pool, lambda b: b.force(mode, self.clock()))

    async def reset(self, pool: str) -> None:
        await self._operate(pool, lambda b: b.reset(self.clock()))

    async def _operate(self, pool: str, change: Callable[[PoolBreaker], None]) -> None:
        if pool not in self.breakers:
            raise KeyError(pool)
        async with self._locks[pool]:
            for _ in range(5):
                breaker = self.breakers[pool]
                expected = self._remote_version[pool]
                change(breaker)
                proposed = replace(breaker.state, version=expected + 1)
                try:
                    result = await self.store.swap_breaker(pool, expected, proposed)
                except Exception as error:
                    self._store_failed(error)
                    result = proposed
                self._remote_version[pool] = result.version
                breaker.adopt(result)
                if result == proposed:
                    break
            self._dirty.discard(pool)
            self._actions[pool].clear()
        self._export(pool)

    async def _update_controls(self, change: Callable[[Controls], Controls]) -> bool:
        for _ in range(5):
            current = self.controls
            proposed = replace(change(current), version=current.version + 1)
            try:
                result = await self.store.swap_controls(current.version, proposed)
            except Exception as error:
                self._store_failed(error)
                result = proposed
            self.controls = result
            if result == proposed:
                self._export_controls()
                return True
        return False

    async def canary_advance(self) -> CanaryState:
        await self._update_controls(lambda c: replace(c, canary=c.canary.advance(self.config.canary.order)))
        return self.controls.canary

    async def canary_roll_back(self) -> CanaryState:
        before = self.controls.canary.digits
        await self._update_controls(lambda c: replace(c, canary=c.canary.roll_back()))
        if before != self.controls.canary.digits:
            self.metrics.canary_rollbacks.labels(self.config.canary.pool or "", "operator").inc()
        return self.controls.canary

    async def set_shadow_share(self, share: float | None) -> float:
        """An operator's share, in force over the file's until cleared (None); the share in force."""
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError("the shadow share is between 0 and 1")
        await self._update_controls(lambda c: replace(c, shadow_share=share))
        return self.shadow_share

    # -- named attempts -----------------------------------------------------------------------

    async def begin_attempt(self, key: str, digest: str = "", fresh: bool = False) -> AttemptStart:
        try:
            start = await self.store.begin_attempt(key, digest, fresh)
        except Exception as error:
            self._store_failed(error)
            start = AttemptStart(Verdict.FIRST)  # unknown: let it run rather than refuse it
        if start.verdict in (Verdict.FIRST, Verdict.RETRY):
            self.running_keys[key] = self.running_keys.get(key, 0) + 1
        return start

    async def finish_attempt(self, key: str, failed_in: str | None) -> None:
        count = self.running_keys.get(key, 0) - 1
        if count > 0:
            self.running_keys[key] = count
        else:
            self.running_keys.pop(key, None)
        try:
            await self.store.finish_attempt(key, failed_in)
        except Exception as error:
            self._store_failed(error)

    # -- metrics ------------------------------------------------------------------------------

    def _export(self, pool: str) -> None:
        breaker = self.breakers[pool]
        now = self.clock()
        state = breaker.state
        m = self.metrics
        m.breaker_state.labels(pool, "instant").set(int(breaker.instant_level(now)))
        m.breaker_state.labels(pool, "sustained").set(int(state.rerouting))
        m.breaker_state.labels(pool, "deep").set(int(state.paged))
        m.breaker_state.labels(pool, "forced").set({None: 0, "open": 1, "closed": 2}[state.forced])
        for level in PoolBreaker.LEVELS:
            reading = breaker.reading(level, now)
            label = window_label(breaker.windows[level].length_s)
            m.breaker_error_ratio.labels(pool, label).set(reading.ratio)
            m.breaker_window_requests.labels(pool, label).set(reading.requests)

    def _export_controls(self) -> None:
        canary = self.controls.canary
        pool = self.config.canary.pool or ""
        self.metrics.canary_batch.labels(pool).set(canary.batch)
        self.metrics.canary_rolled_back.labels(pool).set(int(canary.rolled_back_at is not None))

    def snapshot(self, pool: str) -> dict:
        """A pool's breaker for the admin API: levels, ratios per window, volumes."""
        breaker = self.breakers[pool]
        now = self.clock()
        state = breaker.state
        return {
            "instant": _INSTANT_NAMES[breaker.instant_level(now)],
            "open_for_s": max(0.0, state.open_until - now) if breaker.instant_level(now) is Instant.OPEN else 0.0,
            "rerouting": state.rerouting, "paged": state.paged,
            "paged_for_s": now - state.paged_since if state.paged else 0.0, "forced": state.forced or "",
            "windows": {window_label(breaker.windows[level].length_s): breaker.reading(level, now)
                        for level in PoolBreaker.LEVELS},
        }
