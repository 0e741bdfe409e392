"""The multi-window circuit breaker of one pool, pure: outcomes in, decisions out, time passed in.

Theory of operation
-------------------
Every upstream outcome of a pool is a success or a failure (see `is_failure`) and is counted in
three rolling windows, each a ring of buckets with a running total, so counting and reading a
window are O(1). A window below its minimum volume never trips; at or above it, it trips when
its failure ratio is at or above its threshold. The three windows drive three levels:

==========  =======  ====================================================================
level       window   when it trips, and how it ends
==========  =======  ====================================================================
instant     1 s      OPEN: no new request goes to the pool for `open_s`. Then HALF_OPEN:
                     exactly `probes` requests go to it; when all succeed the level closes,
                     when one fails it opens again for longer (`open_s x backoff^n`, at
                     most `max_open_s`).
sustained   60 s     REROUTING: requests go to the fallback pool. One request every
                     `probe_interval_s` still goes to the pool, so the window keeps
                     measuring it; rerouting ends once the window's ratio has stayed at or
                     below `recover_below` for `hold_s` (hysteresis: no flapping).
deep        300 s    PAGED: a person is called. Latched: only an operator's reset ends it.
==========  =======  ====================================================================

The instant level's back-off keeps growing while the pool keeps failing soon after each close,
and starts over once the level has stayed closed for `max_open_s`: a pool whose error rate
oscillates around the threshold is opened for longer each time, not flapped every 30 s.

An operator can also force the breaker open (nothing goes to the pool) or closed (it always
takes traffic, whatever the windows say); `reset` clears every level, window and force.

`route_permit` tells the router whether a request may go to the pool: `YES`, `PROBE` (it may,
as one of the half-open or rerouting probes: the caller must obtain the permit, see
`ProbeKind`, and report the result with `probe=True`) or `NO`. State that several replicas share
lives in `BreakerState`, a plain value: a shared store keeps one copy, versioned, and replicas
replace theirs with it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from .pool_config import BreakerSettings


def is_failure(status: int) -> bool:
    """A failed upstream outcome: a 5xx or a 429, whether the backend answered it or Envoy did
    for it (connect failure, reset, timeout, no healthy host: Envoy's own 503 or 504)."""
    return status >= 500 or status == 429


# Envoy's response details, by the failure kind they mean (the first marker found wins).
# (`remote_connection_failure` is a connect failure; `connection_termination`, a reset.)
_FAILURE_MARKERS = (("no_healthy_upstream", "no_healthy_upstream"), ("connection_failure", "connect_failure"),
                    ("connect_error", "connect_failure"), ("overflow", "overflow"), ("timeout", "timeout"),
                    ("reset", "reset"), ("connection_termination", "reset"))
# Every label `failure_kind` gives: the results an upstream outcome is counted under.
UPSTREAM_RESULTS = ("success", "http_429", "http_5xx", *dict.fromkeys(kind for _, kind in _FAILURE_MARKERS))


def failure_kind(status: int, details: str) -> str:
    """The label of an upstream outcome, from its status and Envoy's `response.code_details`
    (`via_upstream` when the backend answered)."""
    if not is_failure(status):
        return "success"
    if status == 429:
        return "http_429"
    if details.startswith("via_upstream") or not details:
        return "http_5xx"
    for marker, kind in _FAILURE_MARKERS:
        if marker in details:
            return kind
    return "http_5xx"


class Instant(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class Permit(enum.Enum):
    YES = "yes"
    PROBE = "probe"
    NO = "no"


class ProbeKind(enum.Enum):
    HALF_OPEN = "half_open"  # at most `probes` per opening, across replicas
    REROUTING = "rerouting"  # at most one per `probe_interval_s`, across replicas


class Window:
    """A rolling count of (requests, failures) over `length_s`, in buckets of `bucket_s`."""

    def __init__(self, length_s: float, buckets: int):
        if length_s <= 0 or buckets < 1:
            raise ValueError("a window needs a positive length and at least one bucket")
        self.length_s = length_s
        self.bucket_s = length_s / buckets
        self.buckets = buckets
        self._counts: dict[int, list[int]] = {}  # bucket index -> [requests, failures]
        self.total = 0
        self.failures = 0
        self._oldest = None  # lowest index that may still be in _counts
        self._newest = -math.inf  # highest index counted so far

    def index(self, now: float) -> int:
        return math.floor(now / self.bucket_s)

    def _evict(self, current: int) -> None:
        """Drop the buckets that left the window as of bucket `current`."""
        first_live = current - self.buckets + 1
        if self._oldest is None or self._oldest >= first_live:
            return
        if first_live - self._oldest > len(self._counts):
            stale = [i for i in self._counts if i < first_live]
        else:
            stale = [i for i in range(self._oldest, first_live) if i in self._counts]
        for i in stale:
            requests, failures = self._counts.pop(i)
            self.total -= requests
            self.failures -= failures
        self._oldest = first_live

    def add(self, now: float, failed: bool) -> int:
        """Count one outcome at `now`; return its bucket index (O(1): the hot path)."""
        current = math.floor(now / self.bucket_s)
        counts = self._counts.get(current) if current == self._newest else None  # (nothing to evict in it)
        if counts is None:
            self._evict(current)
            counts = self._counts.setdefault(current, [0, 0])
            if self._oldest is None or current < self._oldest:
                self._oldest = current
            self._newest = max(current, self._newest)
        counts[0] += 1
        self.total += 1
        if failed:
            counts[1] += 1
            self.failures += 1
        return current

    def add_at(self, index: int, requests: int, failures: int, now: float) -> None:
        """Add counts to bucket `index` (used to merge counts other replicas made)."""
        current = self.index(now)
        self._evict(current)
        if index <= current - self.buckets:
            return  # already outside the window
        counts = self._counts.setdefault(index, [0, 0])
        counts[0] += requests
        counts[1] += failures
        self.total += requests
        self.failures += failures
        if self._oldest is None or index < self._oldest:
            self._oldest = index

    def counts(self, now: float) -> tuple[int, int]:
        self._evict(self.index(now))
        return self.total, self.failures

    def ratio(self, now: float) -> float:
        total, failures = self.counts(now)
        return failures / total if total else 0.0

    def buckets_at(self, now: float) -> dict[int, tuple[int, int]]:
        self._evict(self.index(now))
        return {i: (c[0], c[1]) for i, c in self._counts.items()}

    def load(self, buckets: Iterable[tuple[int, int, int]], now: float) -> None:
        """Take these (index, requests, failures) as the whole content of the window."""
        self._counts.clear()
        self.total = self.failures = 0
        self._oldest = None
        for index, requests, failures in buckets:
            self.add_at(index, requests, failures, now)

    def drop_through(self, index: int) -> None:
        """Forget every bucket up to and including `index` (a fresh start at that time)."""
        for i in [i for i in self._counts if i <= index]:
            requests, failures = self._counts.pop(i)
            self.total -= requests
            self.failures -= failures


@dataclass(frozen=True)
class BreakerState:
    """What replicas share of one pool's breaker (floats are seconds on the shared clock)."""

    version: int = 0
    instant: Instant = Instant.CLOSED
    open_until: float = 0.0
    reopenings: int = 0  # openings in a row (for the back-off)
    closed_since: float = 0.0  # the back-off starts over once closed for `max_open_s`
    probes_ok: int = 0  # half-open probes that succeeded in this half-open period
    rerouting: bool = False
    rerouting_since: float = 0.0
    healthy_since: float | None = None  # sustained: ratio at or below recover_below since
    paged: bool = False
    paged_since: float = 0.0
    forced: str | None = None  # None, "open" or "closed"
    # Fresh starts: the instant window forgets what came before its last close from half-open,
    # every window what came before a reset (so old counts in a shared store do not come back).
    instant_from: float | None = None
    windows_from: float | None = None

    def as_fields(self) -> dict[str, str]:
        return {
            "version": str(self.version), "instant": str(int(self.instant)), "open_until": repr(self.open_until),
            "reopenings": str(self.reopenings),
            "closed_since": repr(self.closed_since), "probes_ok": str(self.probes_ok),
            "rerouting": str(int(self.rerouting)), "rerouting_since": repr(self.rerouting_since),
            "healthy_since": "" if self.healthy_since is None else repr(self.healthy_since),
            "paged": str(int(self.paged)), "paged_since": repr(self.paged_since), "forced": self.forced or "",
            "instant_from": "" if self.instant_from is None else repr(self.instant_from),
            "windows_from": "" if self.windows_from is None else repr(self.windows_from),
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> BreakerState:
        if not fields:
            return cls()
        return cls(
            version=int(fields["version"]), instant=Instant(int(fields["instant"])),
            open_until=float(fields["open_until"]), reopenings=int(fields["reopenings"]),
            closed_since=float(fields["closed_since"]),
            probes_ok=int(fields["probes_ok"]), rerouting=fields["rerouting"] == "1",
            rerouting_since=float(fields["rerouting_since"]),
            healthy_since=float(fields["healthy_since"]) if fields["healthy_since"] else None,
            paged=fields["paged"] == "1", paged_since=float(fields["paged_since"]), forced=fields["forced"] or None,
            instant_from=float(fields["instant_from"]) if fields.get("instant_from") else None,
            windows_from=float(fields["windows_from"]) if fields.get("windows_from") else None,
        )


@dataclass(frozen=True)
class Transition:
    """A change of level, for logs, metrics and alerts."""

    level: str  # "instant", "sustained", "deep"
    to: str  # "open", "half_open", "closed", "rerouting", "paged", "cleared"
    at: float
    ratios: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WindowReading:
    requests: int
    failures: int
    ratio: float
    tripped: bool


class PoolBreaker:
    """One pool's three windows and its shared `state` (see the theory of operation)."""

    LEVELS = ("instant", "sustained", "deep")

    def __init__(self, settings: BreakerSettings):
        self.settings = settings
        s = settings
        self.windows = {
            "instant": Window(s.instant.window_s, s.instant.buckets),
            "sustained": Window(s.sustained.window_s, s.sustained.buckets),
            "deep": Window(s.deep.window_s, s.deep.buckets),
        }
        self._windows = tuple(self.windows.values())
        self.state = BreakerState()

    # -- reading ------------------------------------------------------------------------------

    def reading(self, level: str, now: float) -> WindowReading:
        window = self.windows[level]
        level_settings = getattr(self.settings, level)
        total, failures = window.counts(now)
        ratio = failures / total if total else 0.0
        tripped = total >= level_settings.min_requests and ratio >= level_settings.threshold
        return WindowReading(total, failures, ratio, tripped)

    def ratios(self, now: float) -> dict[str, float]:
        return {level: self.reading(level, now).ratio for level in self.LEVELS}

    def instant_level(self, now: float) -> Instant:
        """The instant level as of `now` (an OPEN whose time is up reads HALF_OPEN)."""
        s = self.state
        if s.instant is Instant.OPEN and now >= s.open_until:
            return Instant.HALF_OPEN
        return s.instant

    def route_permit(self, now: float) -> tuple[Permit, ProbeKind | None]:
        """May a new request go to this pool now?"""
        s = self.state
        if s.forced == "closed":
            return Permit.YES, None
        if s.forced == "open":
            return Permit.NO, None
        instant = self.instant_level(now)
        if instant is Instant.OPEN:
            return Permit.NO, None
        if instant is Instant.HALF_OPEN:
            return Permit.PROBE, ProbeKind.HALF_OPEN
        if s.rerouting:
            return Permit.PROBE, ProbeKind.REROUTING
        return Permit.YES, None

    @property
    def half_open_probes(self) -> int:
        return self.settings.instant.probes

    @property
    def probe_interval_s(self) -> float:
        return self.settings.sustained.probe_interval_s

    # -- counting -----------------------------------------------------------------------------

    def record(self, now: float, failed: bool, probe: ProbeKind | None = None) -> list[Transition]:
        """Count one outcome and return the level changes it causes."""
        for window in self._windows:
            window.add(now, failed)
        s = self.state
        if not failed and probe is None and s.instant is Instant.CLOSED and not s.rerouting and not self._past_a_threshold(s):
            return []  # nothing to change: the common case, kept cheap
        return self.evaluate(now, probe_result=(probe, failed) if probe is not None else None)

    def _past_a_threshold(self, s: BreakerState) -> bool:
        """Whether a level that could still trip is at or past its threshold (the windows were
        just brought up to date by `record`)."""
        for level, window in self.windows.items():
            if (level == "deep" and s.paged) or window.failures == 0:  # (every threshold is above 0)
                continue
            settings = getattr(self.settings, level)
            if window.total >= settings.min_requests and window.failures / window.total >= settings.threshold:
                return True
        return False

    def evaluate(self, now: float, probe_result: tuple[ProbeKind, bool] | None = None) -> list[Transition]:
        """Apply the windows (and a probe's result) to the state; return what changed."""
        before = self.state
        s = before
        changes: list[Transition] = []

        def note(level: str, to: str) -> None:
            changes.append(Transition(level, to, now, self.ratios(now)))

        if s.forced is None:
            s = self._evaluate_instant(s, now, probe_result, note)
            s = self._evaluate_sustained(s, now, note)
        if not s.paged and self.reading("deep", now).tripped:
            s = replace(s, paged=True, paged_since=now)
            note("deep", "paged")
        if s != before:
            self.state = replace(s, version=before.version + 1)
        return changes

    def _evaluate_instant(self, s: BreakerState, now: float, probe_result, note) -> BreakerState:
        instant = self.instant_level(now)
        if instant is Instant.HALF_OPEN and probe_result is not None and probe_result[0] is ProbeKind.HALF_OPEN:
            if probe_result[1]:
                return self._open(s, now, note)
            ok = s.probes_ok + 1
            if ok >= self.settings.instant.probes:
                window = self.windows["instant"]
                window.drop_through(window.index(now))  # a fresh start: old failures do not re-open it
                note("instant", "closed")
                return replace(s, instant=Instant.CLOSED, closed_since=now, probes_ok=0, instant_from=now)
            return replace(s, instant=Instant.HALF_OPEN, probes_ok=ok)
        if instant is Instant.CLOSED and self.reading("instant", now).tripped:
            return self._open(s, now, note)
        return s

    def _open(self, s: BreakerState, now: float, note) -> BreakerState:
        i = self.settings.instant
        settled = s.instant is Instant.CLOSED and now - s.closed_since >= i.max_open_s
        reopenings = 0 if settled else s.reopenings
        open_s = min(i.max_open_s, i.open_s * i.backoff ** reopenings)
        note("instant", "open")
        return replace(s, instant=Instant.OPEN, open_until=now + open_s, reopenings=reopenings + 1, probes_ok=0)

    def _evaluate_sustained(self, s: BreakerState, now: float, note) -> BreakerState:
        reading = self.reading("sustained", now)
        settings = self.settings.sustained
        if not s.rerouting:
            if reading.tripped:
                note("sustained", "rerouting")
                return replace(s, rerouting=True, rerouting_since=now, healthy_since=None)
            return s
        if reading.ratio > settings.recover_below:
            return replace(s, healthy_since=None) if s.healthy_since is not None else s
        healthy_since = now if s.healthy_since is None else s.healthy_since
        if now - healthy_since >= settings.hold_s:
            note("sustained", "cleared")
            return replace(s, rerouting=False, healthy_since=None)
        return replace(s, healthy_since=healthy_since) if s.healthy_since is None else s

    # -- operators ----------------------------------------------------------------------------

    def force(self, mode: str | None, now: float) -> None:
        if mode not in (None, "open", "closed"):
            raise ValueError(f"force mode must be 'open', 'closed' or None, not {mode!r}")
        self.state = replace(self.state, forced=mode, version=self.state.version + 1)

    def reset(self, now: float) -> None:
        """Clear every level, window and force: the pool takes traffic again."""
        for window in self.windows.values():
            window.drop_through(window.index(now))
        self.state = BreakerState(version=self.state.version + 1, windows_from=now)

    def adopt(self, state: BreakerState) -> None:
        """Take the shared copy of the state (a newer version from another replica)."""
        self.state = state

    def apply_fresh_starts(self) -> None:
        """Drop what the state's fresh starts exclude (after loading a shared store's counts)."""
        s = self.state
        for level, window in self.windows.items():
            for start in (s.windows_from, s.instant_from if level == "instant" else None):
                if start is not None:
                    window.drop_through(window.index(start))
