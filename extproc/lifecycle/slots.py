"""Where this replica takes and gives back slots of the queue store: each lease it is granted is
told (core/events.py), placed on a backend when its pool picks them, and released exactly once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..core.capacity import Placing
from ..core.engine_drain import STOPPED_FAILURES
from ..core.events import DrainedEngineFailed, LaneWaited, Observers, PickRan, PicksJudged, SlotLeased, SlotReleased
from ..core.picks import Following, PickWatch
from ..stores.queue import Lease, QueueStore
from .exchange import Exchange
from .placement import BackendPicker

log = logging.getLogger("extproc")

LANE_POLL_S = 0.05  # how often a request waiting for an engine to start on looks again


@dataclass(frozen=True)
class LaneWait:
    """An admitted request waiting for an engine it may start on: a long prompt for one of its
    own, another class's prompt for its turn beside latency-bound requests (`Slots.wait_for_lane`)."""

    pool: str


def _placing(lease: Lease) -> Placing:
    return Placing(lease.ticket.cost, lease.ticket.long, lease.ticket.bounded)


def _returns_end(exchange: Exchange) -> bool:
    """Whether the returns of a request turned away end in a final answer: its class has a
    deadline (counted from its first attempt, lifecycle/waiting_room.py) within the time the
    attempt ledger remembers a request (`retries.window_s`: forgotten, it would look new), gives
    up on it there (it is not protected), and refusals are appointments the deadline bounds
    (`queue.appointments`)."""
    config = exchange.config
    policy = config.classes[exchange.class_name]
    return policy.deadline_s is not None and policy.deadline_s <= config.retries.window_s \
        and not policy.protected and config.queue.appointments


class Slots:
    def __init__(self, store: QueueStore, observers: Observers, picker: BackendPicker | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self._clock = clock
        self._sleep = sleep
        self.store = store
        self._emit = observers.emit  # who hears of the slots taken and given back, the picks followed
        self.picker = picker
        self.holding: set[str] = set()  # exchanges admitted by this replica and not yet released
        self.picks = PickWatch()  # whether Envoy sends placed requests where they were placed
        self._spilling: dict[str, list[str]] = {}  # pool -> the other classes' requests waiting for a turn, first first

    def granted(self, lease: Lease) -> Lease:
        self._emit(SlotLeased(lease.pool))
        return lease

    def hold(self, exchange: Exchange, place: bool = True) -> None:
        """The exchange is admitted: it holds its lease until `release`, and, for a pool whose
        backends the sidecar picks, its place on one (the backends to try, best first; not
        for the sidecar's own requests, which Envoy's relay balances)."""
        self.holding.add(exchange.id)
        lease = exchange.lease
        if place and self.picker is not None and lease is not None and self.picker.picks(lease.pool):
            ticket = lease.ticket
            exchange.endpoints = self.picker.pick(lease.pool, ticket.id, _placing(lease))
            if exchange.endpoints:  # every replica's picker counts it there
                self.store.place(lease, exchange.endpoints.split(",", 1)[0])

    def lane_needed(self, exchange: Exchange) -> LaneWait | None:
        """For a request that has its slot but no engine it may start on yet, what to
        `wait_for_lane` with: a long prompt without an engine of its own (core/long_lane.py), or
        one of a class without a latency target that would start beside latency-bound requests
        only for want of room elsewhere, before its turn there (core/spill.py), or while others
        wait for theirs there (they go first). None when it may be placed now, or where its pool does
        not pick, or Envoy is known to ignore the picks (PoolLine's `long_alone` holds long
        prompts there)."""
        lease = exchange.lease
        ticket = lease.ticket if lease is not None else None
        if self.picker is None or ticket is None or (ticket.bounded and not ticket.long) \
                or self.picks_followed(lease.pool) is False:
            return None
        if not ticket.long and self._spilling.get(lease.pool) and self.picker.beside_bound(lease.pool, _placing(lease)):
            return LaneWait(lease.pool)  # (others wait for their turn there before it)
        return None if self.picker.may_start(lease.pool, _placing(lease)) else LaneWait(lease.pool)

    async def wait_for_lane(self, exchange: Exchange, until: float, stop: Callable[[], bool]) -> bool:
        """Wait, holding the slot, until the request may start (or the gate's clock reaches
        `until`, or `stop()`: it is then placed anyway); meanwhile, for a long prompt, the
        latency-bound requests keep off the engine it will take; the others take their turns
        in the order they began to wait. False for a long prompt whose wait ran out where it
        would now go beside latency-bound requests for want of room on the engines free of them
        (`_refuses`): its prefill would hold up every one of them there for seconds, so the gate
        refuses it as the line refuses a wait run out."""
        assert self.picker is not None and exchange.lease is not None
        pool, placing = exchange.lease.pool, _placing(exchange.lease)
        if placing.long:
            self.picker.long_waiting(pool, placing, True)
        else:
            self._spilling.setdefault(pool, []).append(exchange.id)
        result = "cancelled"
        try:
            while not (ready := self._may_start(pool, placing, exchange.id)) and self._clock() < until and not stop():
                await self._sleep(LANE_POLL_S)
            result = "placed" if ready else "refused" if not stop() and self._refuses(exchange) else "timed_out"
        finally:
            if placing.long:
                self.picker.long_waiting(pool, placing, False)
            else:
                waiting = self._spilling[pool]
                waiting.remove(exchange.id)
                if not waiting:
                    del self._spilling[pool]
            self._emit(LaneWaited(pool, result, placing.long))
        return result != "refused"

    def _refuses(self, exchange: Exchange) -> bool:
        """Whether a request whose wait for an engine ran out is refused rather than placed: a
        long prompt of a class without a latency target (a latency-bound one would only be
        refused its own turn), where Envoy is not known to ignore the picks, that would go beside
        latency-bound requests while an engine that answers serves none (core/spill.py: it has no
        room there, or no lane may open). A retry the sidecar recognises too (core/retries.py),
        where its class's deadline bounds how often it comes back (`_returns_end`); else it is
        placed, so that no prompt is refused for ever. A client that neither names nor counts its
        attempts looks new each time."""
        assert self.picker is not None and exchange.lease is not None
        pool, placing = exchange.lease.pool, _placing(exchange.lease)
        return placing.long and not placing.bound and (not exchange.attempt.returning or _returns_end(exchange)) \
            and self.picks_followed(pool) is not False and self.picker.beside_bound(pool, placing)

    def _may_start(self, pool: str, placing: Placing, exchange_id: str) -> bool:
        assert self.picker is not None
        if not placing.long and self._spilling[pool][0] != exchange_id and self.picker.beside_bound(pool, placing):
            return False  # another waits for its turn there before it
        return self.picker.may_start(pool, placing)

    def ran_on(self, exchange: Exchange, endpoint: str) -> None:
        """A placed exchange answered from `endpoint`. Elsewhere than its pick (the pick was
        unhealthy, Envoy retried elsewhere, or the cluster balances by a policy of its own),
        what it holds is counted there from now on, and a draining engine counts it in its
        drain; and whether Envoy follows the picks at all is told (core/picks.py), but by no
        request placed on an engine on its way out or run on one (a retry off a stopped engine,
        or past the engines named), nor while the pool's engines change."""
        lease = exchange.lease
        if self.picker is None or lease is None or exchange.endpoints is None:
            return
        pool, pick = lease.pool, exchange.endpoints.split(",", 1)[0]
        followed = pick == endpoint
        self._emit(PickRan(pool, followed))
        if not followed:
            self.picker.landed(pool, endpoint)
        if followed or not (self.picker.engines_changing(pool) or self.picker.leaving(pool, pick)
                            or self.picker.leaving(pool, endpoint)):
            verdict = self.picks.observe(lease.pool, followed)
            if verdict is not None:
                self._told(lease.pool, verdict)
        if not followed and self.picker.moved(lease.ticket.id, endpoint):
            self.store.place(lease, endpoint)

    def failed_on_leaving_engine(self, exchange: Exchange, upstream: str, kind: str) -> bool:
        """The exchange failed (`kind`: core/breaker.failure_kind): whether it is a stopped
        engine's failure (a reset, a connection refused, a timeout: core/engine_drain.STOPPED_FAILURES)
        and the engine it was placed on, or Envoy's last host (`upstream`), is being drained or
        gone from its pool. Either: Envoy's route timeout spans its retries, so a request
        stopped late on a drained engine may time out on the one it was retried on. Its failure
        is then the drain's, not the pool's, and counted as such (core/engine_drain.py)."""
        lease = exchange.lease
        if self.picker is None or lease is None or exchange.endpoints is None or kind not in STOPPED_FAILURES:
            return False
        pool = lease.pool
        leaving = self.picker.leaving(pool, exchange.endpoints.split(",", 1)[0]) or \
            bool(upstream) and self.picker.leaving(pool, upstream)
        if leaving:
            self._emit(DrainedEngineFailed(lease.pool))
        return leaving

    def places_apart(self, pool: str) -> bool:
        """Whether this replica places `pool`'s requests and Envoy is not known to ignore it."""
        return self.picker is not None and self.picker.picks(pool) and self.picks_followed(pool) is not False

    def picks_followed(self, pool: str) -> bool | None:
        """Whether Envoy follows this replica's picks for `pool` (None: not known yet)."""
        state = self.picks.state(pool)
        return None if state is Following.UNKNOWN else state is Following.FOLLOWED

    def engine_picks(self, pool: str) -> tuple[str, float | None] | None:
        """Whether Envoy follows this replica's picks for `pool`, and the share of the last placed
        requests that ran where placed; None when the sidecar does not pick the pool's backends."""
        if self.picker is None or not self.picker.picks(pool):
            return None
        return self.picks.state(pool).value, self.picks.share(pool)

    def _told(self, pool: str, verdict: Following) -> None:
        self._emit(PicksJudged(pool, verdict is Following.IGNORED))
        share = self.picks.share(pool) or 0.0
        if verdict is Following.IGNORED:
            log.warning("pool %s: Envoy does not follow the sidecar's engine picks (%.0f %% of the last placed "
                        "requests ran on the engine named first): its cluster balances by a policy of its own, so "
                        "long prompts may share an engine with latency-bound requests; give the cluster the "
                        "override_host load-balancing policy of envoy/envoy.yaml (extproc check-config --envoy "
                        "names what is missing)", pool, 100 * share)
        else:
            log.info("pool %s: Envoy follows the sidecar's engine picks (%.0f %% of the last placed requests ran "
                     "on the engine named first)", pool, 100 * share)

    async def release(self, exchange: Exchange, end: str) -> None:
        """The exchange's slot goes back (once, however often this is called)."""
        self.holding.discard(exchange.id)
        lease = exchange.lease
        if lease is None or lease.released:
            return
        await self.release_lease(lease, end)

    async def release_lease(self, lease: Lease, end: str) -> None:
        self._emit(SlotReleased(lease.pool, end))
        if self.picker is not None:
            self.picker.release(lease.ticket.id)
        # Envoy resets the gRPC stream as soon as the exchange is over, which may cancel the
        # task running this; every store hands the release over before it first suspends.
        await self.store.release(lease)
