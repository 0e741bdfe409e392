"""The multi-window breaker, pure, with an injected clock; and a stateful property test of it
against a plain reference model (I8)."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from extproc.core.breaker import (
    UPSTREAM_RESULTS,
    BreakerState,
    Instant,
    Permit,
    PoolBreaker,
    ProbeKind,
    Window,
    failure_kind,
    is_failure,
)
from extproc.core.pool_config import BreakerSettings


def settings_(**levels) -> BreakerSettings:
    return BreakerSettings.model_validate(levels)


def feed(breaker: PoolBreaker, now: float, ok: int, failed: int):
    changes = []
    for _ in range(ok):
        changes += breaker.record(now, False)
    for _ in range(failed):
        changes += breaker.record(now, True)
    return changes


def test_what_counts_as_a_failure():
    assert [is_failure(s) for s in (200, 400, 404, 429, 499, 500, 503)] == [
        False, False, False, True, False, True, True]


@pytest.mark.parametrize("status, details, kind", [
    (200, "via_upstream", "success"),
    (429, "via_upstream", "http_429"),
    (500, "via_upstream", "http_5xx"),
    (503, "upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}",
     "connect_failure"),
    (503, "upstream_reset_before_response_started{connection_termination}", "reset"),
    (504, "response_timeout", "timeout"),
    (503, "no_healthy_upstream", "no_healthy_upstream"),
    (503, "upstream_reset_before_response_started{overflow}", "overflow"),
    (502, "", "http_5xx"),
])
def test_a_failure_is_labelled_by_envoys_response_details(status, details, kind):
    assert failure_kind(status, details) == kind
    assert kind in UPSTREAM_RESULTS


def test_window_counts_in_buckets_and_forgets_what_left_it():
    window = Window(1.0, 10)
    for t in (0.0, 0.05, 0.55, 0.95):
        window.add(t, failed=t > 0.5)
    assert window.counts(0.95) == (4, 2)
    assert window.counts(1.04) == (2, 2)  # bucket [0, 0.1) left the window at 1.0
    assert window.counts(1.56) == (1, 1)
    assert window.counts(5.0) == (0, 0)
    window.add(5.0, True)
    assert window.counts(5.0) == (1, 1)
    assert window.ratio(5.0) == 1.0


def test_a_window_trips_only_at_or_above_its_threshold_past_its_minimum_volume():
    breaker = PoolBreaker(settings_())  # instant: 30 % of at least 10 in 1 s
    assert feed(breaker, 0.0, ok=0, failed=9) == []  # 100 % but below the minimum volume
    assert breaker.route_permit(0.0) == (Permit.YES, None)

    breaker = PoolBreaker(settings_())
    assert feed(breaker, 0.0, ok=8, failed=2) == []  # 10 requests, 20 %
    assert breaker.instant_level(0.0) is Instant.CLOSED
    changes = feed(breaker, 0.0, ok=0, failed=1)  # 11 requests, 27 %
    assert changes == []
    changes = feed(breaker, 0.0, ok=0, failed=1)  # 12 requests, 4 failures: 33 %
    assert [(c.level, c.to) for c in changes] == [("instant", "open")]

    exactly = PoolBreaker(settings_())
    changes = feed(exactly, 0.0, ok=7, failed=3)  # exactly 30 % of exactly 10
    assert [(c.level, c.to) for c in changes] == [("instant", "open")]


def test_open_then_exactly_the_half_open_probes_then_closed():
    breaker = PoolBreaker(settings_(instant={"open_s": 30, "probes": 3}))
    feed(breaker, 0.0, ok=0, failed=10)
    assert breaker.route_permit(10.0) == (Permit.NO, None)
    assert breaker.route_permit(30.0) == (Permit.PROBE, ProbeKind.HALF_OPEN)
    assert breaker.record(30.1, False, ProbeKind.HALF_OPEN) == []
    assert breaker.record(30.2, False, ProbeKind.HALF_OPEN) == []
    assert breaker.route_permit(30.3) == (Permit.PROBE, ProbeKind.HALF_OPEN)
    changes = breaker.record(30.3, False, ProbeKind.HALF_OPEN)
    assert [(c.level, c.to) for c in changes] == [("instant", "closed")]
    assert breaker.route_permit(30.4) == (Permit.YES, None)


def test_a_failed_probe_opens_again_for_longer_and_the_back_off_starts_over_once_settled():
    breaker = PoolBreaker(settings_(instant={"open_s": 30, "probes": 1, "backoff": 2, "max_open_s": 100}))
    feed(breaker, 0.0, ok=0, failed=10)
    assert breaker.state.open_until == 30.0
    breaker.record(30.0, True, ProbeKind.HALF_OPEN)
    assert breaker.state.open_until == 30.0 + 60.0
    breaker.record(90.0, True, ProbeKind.HALF_OPEN)
    assert breaker.state.open_until == 90.0 + 100.0  # capped at max_open_s
    breaker.record(190.0, False, ProbeKind.HALF_OPEN)
    assert breaker.instant_level(190.0) is Instant.CLOSED
    feed(breaker, 200.0, ok=0, failed=10)  # failing again soon after: the back-off goes on
    assert breaker.state.open_until == 200.0 + 100.0
    breaker.record(300.0, False, ProbeKind.HALF_OPEN)
    feed(breaker, 401.0, ok=0, failed=10)  # closed for max_open_s: it starts over
    assert breaker.state.open_until == 401.0 + 30.0


def test_outcomes_of_requests_admitted_before_the_opening_do_not_close_it():
    breaker = PoolBreaker(settings_())
    feed(breaker, 0.0, ok=0, failed=10)
    feed(breaker, 31.0, ok=5, failed=0)  # not probes: late answers of earlier requests
    assert breaker.instant_level(31.0) is Instant.HALF_OPEN


def test_sustained_reroutes_until_healthy_for_the_hold_with_probes_in_between():
    s = settings_(instant={"min_requests": 1000}, sustained={"threshold": 0.2, "min_requests": 20,
                                                              "recover_below": 0.1, "hold_s": 30})
    breaker = PoolBreaker(s)
    changes = feed(breaker, 0.0, ok=15, failed=5)  # 25 % of 20
    assert [(c.level, c.to) for c in changes] == [("sustained", "rerouting")]
    assert breaker.route_permit(1.0) == (Permit.PROBE, ProbeKind.REROUTING)
    # One good probe a second dilutes the 5 failures: 5 / (20 + 30) = 10 % at t = 30, when the
    # hold starts; the window then stays healthy, so rerouting ends 30 s later.
    for t in range(1, 60):
        assert breaker.record(float(t), False, ProbeKind.REROUTING) == []
    assert breaker.state.rerouting and breaker.state.healthy_since == 30.0
    changes = breaker.record(60.0, False, ProbeKind.REROUTING)
    assert [(c.level, c.to) for c in changes] == [("sustained", "cleared")]
    assert breaker.route_permit(61.0) == (Permit.YES, None)


def test_no_flapping_under_an_error_rate_oscillating_around_the_threshold():
    s = settings_(instant={"min_requests": 10_000})  # the sustained level alone
    breaker = PoolBreaker(s)
    transitions = []
    for second in range(900):  # 15 minutes, 10 requests a second, 15 % and 25 % errors by turns
        rate = 0.25 if (second // 20) % 2 else 0.15
        failures = round(10 * rate + (0.5 if second % 2 else -0.5))
        for i in range(10):
            transitions += breaker.record(second + i / 10, i < failures)
        transitions += breaker.evaluate(second + 0.99)
    sustained = [(c.to, c.at) for c in transitions if c.level == "sustained"]
    assert len(sustained) == 1 and sustained[0][0] == "rerouting"


def test_the_deep_level_latches_until_reset():
    s = settings_(instant={"min_requests": 10_000}, sustained={"min_requests": 10_000},
                  deep={"threshold": 0.15, "min_requests": 50})
    breaker = PoolBreaker(s)
    changes = feed(breaker, 0.0, ok=40, failed=10)  # 20 % of 50
    assert [(c.level, c.to) for c in changes] == [("deep", "paged")]
    assert breaker.state.paged and breaker.state.paged_since == 0.0
    feed(breaker, 400.0, ok=500, failed=0)  # healthy for longer than the window: still latched
    assert breaker.state.paged
    assert breaker.route_permit(400.0) == (Permit.YES, None)  # paging does not move traffic
    breaker.reset(401.0)
    assert not breaker.state.paged
    assert breaker.reading("deep", 401.0).requests == 0


def test_forcing_open_and_closed():
    breaker = PoolBreaker(settings_())
    breaker.force("open", 0.0)
    assert breaker.route_permit(0.0) == (Permit.NO, None)
    breaker.force("closed", 0.0)
    feed(breaker, 0.0, ok=0, failed=50)
    assert breaker.route_permit(0.1) == (Permit.YES, None)  # forced closed ignores the windows
    breaker.force(None, 1.0)
    feed(breaker, 1.0, ok=0, failed=10)
    assert breaker.route_permit(1.0) == (Permit.NO, None)


def test_the_shared_state_round_trips_through_its_fields():
    state = BreakerState(7, Instant.OPEN, 12.5, 2, 11.25, 1, True, 3.0, None, True, 1.5, "open", 11.25, None)
    assert BreakerState.from_fields(state.as_fields()) == state
    assert BreakerState.from_fields({}) == BreakerState()


# -- a stateful property test against a plain reference model -----------------------------------

SETTINGS = settings_(
    instant={"window_s": 1, "buckets": 4, "threshold": 0.5, "min_requests": 4, "open_s": 5, "probes": 2,
             "backoff": 2, "max_open_s": 20},
    sustained={"window_s": 10, "buckets": 5, "threshold": 0.3, "min_requests": 6, "recover_below": 0.1,
               "hold_s": 4, "probe_interval_s": 1},
    deep={"window_s": 30, "buckets": 6, "threshold": 0.2, "min_requests": 10},
)


class Reference:
    """The documented rules written plainly: every outcome kept, windows recounted each time."""

    def __init__(self, s: BreakerSettings):
        self.s = s
        self.events: list[tuple[int, float, bool]] = []  # (sequence, time, failed)
        self.cleared = {"instant": -1, "sustained": -1, "deep": -1}  # events up to this sequence are gone
        self.instant, self.open_until, self.reopenings, self.closed_since, self.ok = "closed", 0.0, 0, 0.0, 0
        self.rerouting, self.healthy_since, self.paged, self.forced = False, None, False, None

    def counts(self, level: str, now: float) -> tuple[int, int]:
        lv = getattr(self.s, level)
        width = lv.window_s / lv.buckets
        current = math.floor(now / width)
        live = [f for seq, t, f in self.events
                if seq > self.cleared[level] and math.floor(t / width) > current - lv.buckets]
        return len(live), sum(live)

    def tripped(self, level: str, now: float) -> bool:
        total, failures = self.counts(level, now)
        lv = getattr(self.s, level)
        return total >= lv.min_requests and failures / total >= lv.threshold

    def ratio(self, level: str, now: float) -> float:
        total, failures = self.counts(level, now)
        return failures / total if total else 0.0

    def instant_now(self, now: float) -> str:
        return "half_open" if self.instant == "open" and now >= self.open_until else self.instant

    def permit(self, now: float) -> Permit:
        if self.forced == "closed":
            return Permit.YES
        if self.forced == "open" or self.instant_now(now) == "open":
            return Permit.NO
        if self.instant_now(now) == "half_open" or self.rerouting:
            return Permit.PROBE
        return Permit.YES

    def open(self, now: float) -> None:
        i = self.s.instant
        if self.instant == "closed" and now - self.closed_since >= i.max_open_s:
            self.reopenings = 0
        self.open_until = now + min(i.max_open_s, i.open_s * i.backoff ** self.reopenings)
        self.reopenings += 1
        self.instant, self.ok = "open", 0

    def record(self, now: float, failed: bool, probe: bool) -> None:
        self.events.append((len(self.events), now, failed))
        self.evaluate(now, (failed,) if probe else None)

    def evaluate(self, now: float, probe=None) -> None:
        if self.forced is None:
            state = self.instant_now(now)
            if state == "half_open" and probe is not None:
                if probe[0]:
                    self.open(now)
                elif self.ok + 1 >= self.s.instant.probes:
                    self.instant, self.ok, self.closed_since = "closed", 0, now
                    self.cleared["instant"] = len(self.events) - 1
                else:
                    self.instant, self.ok = "half_open", self.ok + 1
            elif state == "closed" and self.tripped("instant", now):
                self.open(now)
            if not self.rerouting:
                if self.tripped("sustained", now):
                    self.rerouting, self.healthy_since = True, None
            elif self.ratio("sustained", now) > self.s.sustained.recover_below:
                self.healthy_since = None
            else:
                self.healthy_since = now if self.healthy_since is None else self.healthy_since
                if now - self.healthy_since >= self.s.sustained.hold_s:
                    self.rerouting, self.healthy_since = False, None
        if not self.paged and self.tripped("deep", now):
            self.paged = True

    def reset(self) -> None:
        events, cleared = self.events, len(self.events) - 1
        self.__init__(self.s)
        self.events = events
        self.cleared = dict.fromkeys(self.cleared, cleared)


class BreakerAgainstReference(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.now = 0.0
        self.breaker = PoolBreaker(SETTINGS)
        self.model = Reference(SETTINGS)

    @rule(failed=st.booleans(), count=st.integers(1, 6))
    def outcomes(self, failed, count):
        for _ in range(count):
            probe = self.breaker.route_permit(self.now)[1]
            self.breaker.record(self.now, failed, probe if probe is ProbeKind.HALF_OPEN else None)
            self.model.record(self.now, failed, probe is ProbeKind.HALF_OPEN)

    @rule(seconds=st.sampled_from([0.05, 0.2, 0.5, 1.0, 2.5, 6.0, 15.0, 40.0]))
    def time_passes(self, seconds):
        self.now += seconds
        self.breaker.evaluate(self.now)
        self.model.evaluate(self.now)

    @rule(mode=st.sampled_from([None, "open", "closed"]))
    def operator_forces(self, mode):
        self.breaker.force(mode, self.now)
        self.model.forced = mode

    @rule()
    def operator_resets(self):
        self.breaker.reset(self.now)
        self.model.reset()

    @invariant()
    def same_decisions(self):
        if not hasattr(self, "breaker"):
            return
        assert self.breaker.route_permit(self.now)[0] is self.model.permit(self.now)
        assert self.breaker.state.rerouting == self.model.rerouting
        assert self.breaker.state.paged == self.model.paged
        for level in PoolBreaker.LEVELS:
            reading = self.breaker.reading(level, self.now)
            assert (reading.requests, reading.failures) == self.model.counts(level, self.now)


BreakerAgainstReference.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_breaker_against_reference = BreakerAgainstReference.TestCase
