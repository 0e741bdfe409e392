"""Engines drained before they go: the drains themselves (core/engine_drain.py) on a clock passed
in; the loop that follows them (control/engine_drains.py) over engines told by the test; the
engine picker that names no draining engine; and the gate, whose breaker counts no failure of an
engine stopped under its requests."""

from __future__ import annotations

import pytest

from extproc.control.engine_drains import EngineDrainWatch
from extproc.core.admission import PoolLimits
from extproc.core.capacity import BackendReading, Placing
from extproc.core.config import ConfigError, parse_config
from extproc.core.engine_drain import (DRAINING, ENDED_CANCELLED, ENDED_DEADLINE, ENDED_IDLE, IDLE, OPERATOR,
                                       OVERDUE, REMOVED, DrainRefused, EngineDrains, Ending, drained_back, serving)
from extproc.core.events import DrainedEngineFailed, UpstreamCounted
from extproc.lifecycle.placement import BackendPicker
from extproc.lifecycle.slots import Slots
from extproc.ops.metrics import Metrics
from extproc_testbed.stack import metric_sum, parse_samples

from ..conftest import e2e_config
from .test_gate import Rig

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
ENGINES = frozenset({A, B, C})
IDLE_RUNNING: dict[str, tuple[int, int]] = {}


# -- the drains, pure ------------------------------------------------------------------------------------

def test_a_drained_engine_gets_nothing_new_and_its_state_follows_what_it_runs_and_its_deadline():
    drains = EngineDrains()
    drains.follow("p", ENGINES, IDLE_RUNNING, 0.0, 60)
    drains.drain("p", ENGINES, A, 10.0, 30)
    assert drains.draining("p") == {A} and drains.draining("other") == frozenset()
    assert serving(("http://10.0.0.1:8000", "http://10.0.0.2:8000"), drains.draining("p")) == ("http://10.0.0.2:8000",)
    running = {A: (2, 300), B: (5, 900)}
    (view,) = drains.views("p", running, 20.0)
    assert (view.engine, view.reason, view.state, view.requests, view.tokens) == (A, OPERATOR, DRAINING, 2, 300)
    assert view.for_s == 10.0 and view.deadline_in_s == 20.0 and not view.gone
    assert drains.follow("p", ENGINES, running, 20.0, 60) == []  # nothing ended yet
    assert drains.views("p", {A: (1, 100)}, 45.0)[0].state == OVERDUE
    assert drains.views("p", {}, 45.0)[0].state == IDLE


def test_each_drain_is_counted_once_by_how_it_ended_first():
    drains = EngineDrains()
    drains.follow("p", ENGINES, IDLE_RUNNING, 0.0, 60)
    drains.drain("p", ENGINES, A, 0.0, 30)
    assert drains.follow("p", ENGINES, {A: (1, 10)}, 1.0, 60) == []
    assert drains.follow("p", ENGINES, {}, 2.0, 60) == [Ending("p", A, OPERATOR, ENDED_IDLE)]
    assert drains.follow("p", ENGINES, {A: (1, 10)}, 40.0, 60) == []  # (a late retry landed there): counted once
    assert drains.undrain("p", A) is None  # already counted
    assert drains.draining("p") == frozenset()

    drains.drain("p", ENGINES, B, 50.0, 5)
    assert drains.follow("p", ENGINES, {B: (2, 10)}, 56.0, 60) == [Ending("p", B, OPERATOR, ENDED_DEADLINE)]
    drains.drain("p", ENGINES, C, 60.0, 5)
    assert drains.undrain("p", C) == Ending("p", C, OPERATOR, ENDED_CANCELLED)  # taken back before either


def test_an_operator_is_told_what_cannot_be_drained():
    drains = EngineDrains()
    with pytest.raises(DrainRefused, match="has no engine 10.0.0.9:8000") as unknown:
        drains.drain("p", ENGINES, "10.0.0.9:8000", 0.0, 30)
    assert unknown.value.missing
    drains.drain("p", ENGINES, A, 0.0, 30)
    drains.drain("p", ENGINES, B, 0.0, 30)
    with pytest.raises(DrainRefused, match="last engine of pool p that takes requests") as last:
        drains.drain("p", ENGINES, C, 0.0, 30)
    assert not last.value.missing
    drains.drain("p", ENGINES, A, 10.0, 100)  # again: a new deadline, the same drain
    assert drains.views("p", {A: (1, 1)}, 20.0)[0].deadline_in_s == 90.0
    with pytest.raises(DrainRefused, match="is not draining") as not_drained:
        drains.undrain("p", C)
    assert not_drained.value.missing


def test_an_engine_gone_from_the_pool_drains_until_idle_and_is_forgotten_after_its_deadline():
    drains = EngineDrains()
    assert drains.follow("p", ENGINES, IDLE_RUNNING, 0.0, 30) == []  # the engines known at start: nothing gone
    assert drains.follow("p", ENGINES - {A}, {A: (2, 50)}, 1.0, 30) == []
    (view,) = drains.views("p", {A: (2, 50)}, 1.0)
    assert (view.engine, view.reason, view.state, view.gone) == (A, REMOVED, DRAINING, True)
    assert drains.draining("p") == {A}
    assert drains.follow("p", ENGINES - {A}, {}, 5.0, 30) == [Ending("p", A, REMOVED, ENDED_IDLE)]
    assert drains.views("p", {}, 20.0)[0].state == IDLE  # listed, idle, until its deadline
    with pytest.raises(DrainRefused, match="cannot take requests again"):
        drains.undrain("p", A)
    drains.follow("p", ENGINES - {A}, {}, 31.0, 30)
    assert drains.views("p", {}, 31.0) == () and drains.draining("p") == frozenset()

    # one that comes back in its name's answer is an engine again
    drains.follow("p", ENGINES - {B}, {B: (1, 1)}, 40.0, 30)
    assert drains.follow("p", ENGINES, {B: (1, 1)}, 41.0, 30) == [Ending("p", B, REMOVED, ENDED_CANCELLED)]
    assert drains.draining("p") == frozenset()


def test_an_engine_an_operator_drained_that_then_leaves_is_forgotten_once_idle_past_its_deadline():
    drains = EngineDrains()
    drains.follow("p", ENGINES, IDLE_RUNNING, 0.0, 30)
    drains.drain("p", ENGINES, A, 0.0, 10)
    drains.follow("p", ENGINES - {A}, {A: (1, 1)}, 1.0, 30)
    (view,) = drains.views("p", {A: (1, 1)}, 1.0)
    assert view.reason == OPERATOR and view.gone
    drains.follow("p", ENGINES - {A}, {}, 11.0, 30)
    assert drains.draining("p") == frozenset()


# -- the watch, the picker and the gate ---------------------------------------------------------------------

URL_A, URL_B, URL_C = f"http://{A}", f"http://{B}", f"http://{C}"


def picking_config(backends=(URL_A, URL_B), pick_backend: bool = True):
    raw = e2e_config()
    raw["pools"]["primary"].update(max_inflight=8, capacity={"backends": list(backends), "pick_backend": pick_backend})
    return raw["pools"]


class Listed:
    """The pools' engines as the configuration lists them (the discovery, for listed backends)."""

    def __init__(self, config):
        self.config = config

    def engines(self, pool: str) -> tuple[str, ...]:
        return self.config().pools[pool].capacity.backends

    def changing(self, pool: str) -> bool:
        return False


def watched(rig: Rig) -> tuple[EngineDrainWatch, BackendPicker]:
    """The drains over the rig's engines, and the gate's picker reading them."""
    ticked: list[str] = []

    async def tick() -> None:
        ticked.append("tick")

    watch = EngineDrainWatch(lambda: rig.config, Listed(lambda: rig.config), rig.metrics, on_change=tick,
                             clock=rig.clock)
    picker = BackendPicker(lambda: rig.config, watch)
    watch.running = picker.running
    idle = BackendReading(0.0, 100_000, saturated=False)
    picker.observe("primary", {URL_A: idle, URL_B: idle})
    watch.ticked = ticked  # type: ignore[attr-defined]
    return watch, picker


async def test_a_drained_engine_is_never_picked_nor_counted_and_comes_back_when_undrained():
    rig = Rig(pools=picking_config())
    watch, picker = watched(rig)
    await watch.start()
    try:
        assert {picker.pick("primary", f"t{i}", Placing(100)).split(",")[0] for i in range(4)} == {A, B}
        await watch.drain("primary", A)
        assert watch.ticked == ["tick"]  # the capacity loop runs at once: the budget loses the engine
        assert watch.serving("primary") == (URL_B,) and watch.engines("primary") == (URL_A, URL_B)
        assert all(picker.pick("primary", f"u{i}", Placing(100)) == B for i in range(4))  # named for no new request
        assert not watch.changing("primary")  # a drain is no change of the engines Envoy knows
        (view,) = watch.views("primary")
        assert (view.engine, view.state, view.requests, view.tokens) == (A, DRAINING, 2, 200)
        samples = parse_samples(rig.metrics.render().decode())
        assert metric_sum(samples, "extproc_draining_engines", pool="primary", state="draining") == 1
        assert metric_sum(samples, "extproc_draining_requests", pool="primary") == 2
        for i in (0, 1, 2, 3):
            picker.release(f"t{i}")
        watch.follow()
        assert watch.views("primary")[0].state == DRAINING  # it ran requests less than settle_s ago
        rig.clock.advance(rig.config.engine_drain.settle_s)
        watch.follow()
        assert watch.views("primary")[0].state == IDLE
        samples = parse_samples(rig.metrics.render().decode())
        assert metric_sum(samples, "extproc_engine_drains_total", pool="primary", reason="operator", result="idle") == 1
        assert metric_sum(samples, "extproc_draining_requests", pool="primary") == 0
        await watch.undrain("primary", "http://10.0.0.1:8000")  # a base URL names it too
        assert watch.serving("primary") == (URL_A, URL_B) and watch.views("primary") == ()
        assert picker.pick("primary", "v", Placing(100)).split(",")[0] == A  # the least loaded, named again
    finally:
        await watch.stop()


async def test_what_the_watch_refuses():
    rig = Rig(pools=picking_config())
    watch, _ = watched(rig)
    for pool, engine, said, missing, invalid in (
            ("nowhere", A, "no pool named", True, False),
            ("primary", "vllm-0:8000", "an engine is named IP:PORT", False, True),  # no engine's name: malformed
            ("primary", "10.0.0.1", "an engine is named IP:PORT", False, True),
            ("primary", "10.0.0.9:8000", "has no engine", True, False),
            ("fallback", A, "does not pick its engines", False, False)):
        with pytest.raises(DrainRefused, match=said) as refused:
            await watch.drain(pool, engine)
        assert (refused.value.missing, refused.value.invalid) == (missing, invalid), engine
    for deadline_s in (float("nan"), float("inf"), -1.0, 0.0):
        with pytest.raises(DrainRefused, match="finite number of seconds") as refused:
            await watch.drain("primary", A, deadline_s)
        assert refused.value.invalid and watch.draining("primary") == frozenset()
    await watch.drain("primary", A)
    with pytest.raises(DrainRefused, match="last engine"):
        await watch.drain("primary", B)
    assert watch.ticked == ["tick"]


async def test_a_failure_of_an_engine_stopped_under_its_requests_is_never_the_breakers():
    rig = Rig(pools=picking_config())
    watch, picker = watched(rig)
    rig.build_gate(picker=picker)
    reset = "upstream_reset_before_response_started{connection_termination}"
    on_a, _ = await rig.arrive()
    on_b, _ = await rig.arrive()
    assert on_a.endpoints.split(",")[0] == A and on_b.endpoints.split(",")[0] == B
    await watch.drain("primary", A)
    rig.gate.response_started(on_a, 503, reset, A)  # Envoy could not retry it elsewhere
    assert len(rig.told(DrainedEngineFailed, pool="primary")) == 1
    assert len(rig.told(UpstreamCounted, pool="primary")) == 0
    assert all(w.requests == 0 for w in rig.control.snapshot("primary")["windows"].values())
    rig.gate.response_started(on_b, 503, reset, B)  # an engine that is not going: the pool's failure
    assert len(rig.told(UpstreamCounted, pool="primary", result="reset")) == 1
    assert len(rig.told(DrainedEngineFailed, pool="primary")) == 1
    for exchange in (on_a, on_b):
        await rig.gate.close(exchange)


async def test_an_engine_gone_from_the_pool_while_it_runs_requests_fails_them_outside_the_breaker():
    """Its name no longer answers with it (a reload here): the picker names it no more, and a
    request still running there that fails is the drain's."""
    rig = Rig(pools=picking_config())
    watch, picker = watched(rig)
    rig.build_gate(picker=picker)
    watch.follow()
    on_a, _ = await rig.arrive()
    assert on_a.endpoints.split(",")[0] == A
    rig.config = parse_config(e2e_config(pools=picking_config(backends=(URL_B,))))
    assert picker.leaving("primary", A) and not picker.leaving("primary", B)  # before the loop saw it
    watch.follow()
    (view,) = watch.views("primary")
    assert (view.engine, view.reason, view.requests, view.gone) == (A, REMOVED, 1, True)
    rig.gate.response_started(on_a, 503, "upstream_reset_before_response_started{connection_termination}", A)
    assert len(rig.told(DrainedEngineFailed, pool="primary")) == 1
    assert len(rig.told(UpstreamCounted, pool="primary")) == 0
    await rig.gate.close(on_a)
    rig.clock.advance(rig.config.engine_drain.settle_s)
    watch.follow()
    assert watch.views("primary")[0].state == IDLE


def test_a_pool_that_does_not_pick_has_no_drains():
    metrics = Metrics()
    config = parse_config(e2e_config(pools=picking_config(pick_backend=False)))
    watch = EngineDrainWatch(lambda: config, Listed(lambda: config), metrics)
    watch.follow()
    assert watch.views("primary") == ()
    assert not [name for name, _ in parse_samples(metrics.render().decode()) if "drain" in name]


# -- what a drain must not do ---------------------------------------------------------------------------

def test_a_deadline_that_is_no_finite_number_of_seconds_is_refused_wherever_it_comes_from():
    drains = EngineDrains()
    drains.follow("p", ENGINES, IDLE_RUNNING, 0.0, 30)
    for deadline_s in (float("nan"), float("inf"), float("-inf"), 0.0):
        with pytest.raises(DrainRefused, match="finite number of seconds") as refused:
            drains.drain("p", ENGINES, A, 0.0, deadline_s)
        assert refused.value.invalid and not refused.value.missing
    assert drains.draining("p") == frozenset()
    for deadline_s in (float("inf"), float("nan")):  # the configuration's (YAML's .inf, .nan)
        with pytest.raises(ConfigError, match="engine_drain.deadline_s: Input should be a finite number"):
            parse_config(e2e_config(engine_drain={"deadline_s": deadline_s}))
    with pytest.raises(ConfigError, match="engine_drain.settle_s"):
        parse_config(e2e_config(engine_drain={"settle_s": float("inf")}))


def test_an_address_back_after_it_was_gone_is_a_new_engine_whoever_drained_the_old_one():
    """An operator drains pod vllm-primary-0; the pod is deleted, and its replacement takes the
    same address: the new pod is not drained."""
    drains = EngineDrains()
    drains.follow("p", ENGINES, IDLE_RUNNING, 0.0, 330)
    drains.drain("p", ENGINES, A, 0.0, 330)
    assert drains.follow("p", ENGINES - {A}, {A: (1, 10)}, 10.0, 330) == []  # gone, still running one
    assert drains.follow("p", ENGINES, {}, 60.0, 330) == [Ending("p", A, OPERATOR, ENDED_CANCELLED)]
    assert drains.draining("p") == frozenset() and drains.views("p", {}, 60.0) == ()
    assert drains.follow("p", ENGINES, {}, 1e6, 330) == []


def test_a_drained_engine_reads_idle_only_once_nothing_ran_or_answered_there_for_the_settle_time():
    drains = EngineDrains(settle_s=5)
    drains.follow("p", ENGINES, IDLE_RUNNING, 0.0, 60)
    drains.drain("p", ENGINES, A, 10.0, 60)
    assert drains.views("p", {}, 12.0)[0].state == DRAINING  # just drained: a request may be on its way there
    assert drains.follow("p", ENGINES, {A: (1, 10)}, 14.0, 60) == []  # it runs one
    assert drains.follow("p", ENGINES, {}, 16.0, 60) == []  # it ended 2 s ago at most
    assert drains.views("p", {}, 18.9)[0].state == DRAINING
    assert drains.follow("p", ENGINES, {}, 19.0, 60) == [Ending("p", A, OPERATOR, ENDED_IDLE)]
    # a request the sidecar did not place there answered from there (Envoy's retry past the engines it named)
    assert drains.landed("p", A, 30.0) is not None and drains.landed("p", B, 30.0) is None  # B does not drain
    (view,) = drains.views("p", {}, 31.0)
    assert (view.state, view.landed) == (DRAINING, 1)
    assert drains.follow("p", ENGINES, {}, 35.0, 60) == []  # counted once
    assert drains.views("p", {}, 35.0)[0].state == IDLE


async def test_a_request_envoy_ran_on_a_drained_engine_counts_in_its_drain_and_tells_nothing_of_the_picks():
    rig = Rig(pools=picking_config())
    watch, picker = watched(rig)
    rig.build_gate(picker=picker)
    settle = rig.config.engine_drain.settle_s
    watch.follow()
    await watch.drain("primary", A)
    rig.clock.advance(settle)
    watch.follow()
    assert watch.views("primary")[0].state == IDLE
    on_b, _ = await rig.arrive()
    assert on_b.endpoints == B  # the drained engine is named for none
    rig.gate.response_started(on_b, 200, "via_upstream", A)  # yet it ran there: B failed, Envoy balanced over every host
    (view,) = watch.views("primary")
    assert (view.state, view.requests, view.landed) == (DRAINING, 1, 1)  # its charge moved there
    assert rig.gate.slots.picks.share("primary") is None  # not a sign that Envoy ignores the picks
    await rig.gate.close(on_b)
    watch.follow()
    assert watch.views("primary")[0].state == DRAINING  # settling
    rig.clock.advance(settle)
    watch.follow()
    assert watch.views("primary")[0].state == IDLE and watch.views("primary")[0].landed == 1


class Placed:
    """An exchange as Slots.ran_on reads it: its lease and the engines named for it."""

    def __init__(self, ticket_id: str, endpoints: str):
        self.endpoints = endpoints
        self.lease = type("Lease", (), {"pool": "primary", "released": True, "ticket": type("Ticket", (), {"id": ticket_id})()})()


async def test_a_drain_leaves_out_of_the_picks_verdict_only_what_ran_or_was_placed_on_an_engine_on_its_way_out():
    # Envoy balancing by a policy of its own, an idle drain listed all along: the verdict is still "ignored"
    rig = Rig(pools=picking_config(backends=(URL_A, URL_B, URL_C)))
    watch, picker = watched(rig)
    watch.follow()
    await watch.drain("primary", C)
    slots = Slots(rig.store, rig.observers, picker)
    for i in range(60):
        placed = picker.pick("primary", f"t{i}", Placing(100))
        slots.ran_on(Placed(f"t{i}", placed), (A, B, C)[i % 3])  # round robin, the drained engine included
        picker.release(f"t{i}")
    assert slots.engine_picks("primary")[0] == "ignored"
    # Envoy following the picks: what was placed on an engine that then drains and ran elsewhere
    # (a retry off the stopped engine) is left out
    rig = Rig(pools=picking_config())
    watch, picker = watched(rig)
    watch.follow()
    slots = Slots(rig.store, rig.observers, picker)
    placed = {f"t{i}": picker.pick("primary", f"t{i}", Placing(100)) for i in range(40)}
    await watch.drain("primary", A)
    for ticket, endpoints in placed.items():
        slots.ran_on(Placed(ticket, endpoints), B)
    assert slots.engine_picks("primary") == ("followed", 1.0)


async def test_a_reload_that_stops_a_pool_picking_ends_its_drains():
    rig = Rig(pools=picking_config(backends=(URL_A, URL_B, URL_C)))
    watch, picker = watched(rig)
    watch.follow()
    await watch.drain("primary", A)
    picker.pick("primary", "t", Placing(100))  # (on B or C)
    rig.config = parse_config(e2e_config(pools=picking_config(backends=(URL_A, URL_B, URL_C), pick_backend=False)))
    watch.follow()
    assert watch.draining("primary") == frozenset() and watch.views("primary") == ()
    assert watch.serving("primary") == (URL_A, URL_B, URL_C)  # every engine in the budget again
    assert rig.counted("extproc_engine_drains_total", pool="primary", reason="operator", result="cancelled") == 1
    assert rig.counted("extproc_draining_engines", pool="primary") == 0
    assert rig.counted("extproc_draining_requests", pool="primary") == 0
    rig.config = parse_config(e2e_config(pools=picking_config(backends=(URL_A, URL_B, URL_C))))
    watch.follow()  # picking again: afresh, nothing drains
    assert watch.draining("primary") == frozenset()
    await watch.drain("primary", A)
    await watch.undrain("primary", A)


async def test_an_engine_is_named_as_the_discovery_names_it():
    rig = Rig(pools=picking_config())
    watch, _ = watched(rig)
    await watch.drain("primary", "[::ffff:10.0.0.1]:8000")  # IPv4-mapped: the engine 10.0.0.1:8000
    assert watch.draining("primary") == {A}
    await watch.undrain("primary", "http://[::ffff:10.0.0.1]:8000")
    assert watch.draining("primary") == frozenset()


async def test_what_this_replica_runs_on_draining_engines_is_given_back_to_the_limits():
    rig = Rig(pools=picking_config(backends=(URL_A, URL_B, URL_C)))
    watch, picker = watched(rig)
    watch.follow()
    for i in range(6):
        picker.pick("primary", f"t{i}", Placing(100 * (i + 1)))
    on_a = {e: r for e, r in picker.running("primary").items() if e == A}[A]
    assert watch.held("primary") == (0, 0)
    await watch.drain("primary", A)
    assert watch.held("primary") == on_a
    # the serving engines' limits, with it added back (the count within the pool's max_inflight)
    assert drained_back(PoolLimits(4, 1000, spread=2), 2, 300, 64) == PoolLimits(6, 1300, spread=2)
    assert drained_back(PoolLimits(4, None), 2, 300, 5) == PoolLimits(5, None)
    assert drained_back(PoolLimits(4, 1000), 0, 0, 64) == PoolLimits(4, 1000)


async def test_only_a_stopped_engines_failures_are_the_drains_on_whichever_host_the_request_ended():
    rig = Rig(pools=picking_config())
    watch, picker = watched(rig)
    rig.build_gate(picker=picker)
    placed = [(await rig.arrive())[0] for _ in range(4)]
    on_a = [e for e in placed if e.endpoints.split(",")[0] == A]
    on_b = [e for e in placed if e.endpoints.split(",")[0] == B]
    await watch.drain("primary", A)
    # stopped late on the drained engine, retried on B, where Envoy's route timeout (spanning both) ran out
    rig.gate.response_started(on_a[0], 504, "upstream_response_timeout", B)
    assert len(rig.told(DrainedEngineFailed, pool="primary")) == 1
    assert len(rig.told(UpstreamCounted, pool="primary")) == 0
    # the drained engine's own answer: the pool's
    rig.gate.response_started(on_a[1], 500, "via_upstream", A)
    assert len(rig.told(UpstreamCounted, pool="primary", result="http_5xx")) == 1
    # placed on B, reset on B: the pool's
    rig.gate.response_started(on_b[0], 503, "upstream_reset_before_response_started{connection_termination}", B)
    assert len(rig.told(UpstreamCounted, pool="primary", result="reset")) == 1
    assert len(rig.told(DrainedEngineFailed, pool="primary")) == 1
    for exchange in placed:
        await rig.gate.close(exchange)


class Moving:
    """The pools' engines as a discovery tells them, changed by the test."""

    def __init__(self, *urls: str) -> None:
        self.urls = urls

    def engines(self, pool: str) -> tuple[str, ...]:
        return self.urls

    def changing(self, pool: str) -> bool:
        return False


async def test_what_runs_on_an_engine_gone_from_its_name_is_given_back_before_its_drain_is_followed():
    """The discovery runs the capacity loop as soon as an engine leaves its name, before the drains'
    next follow lists it as draining: what this replica still runs there is held back all the same
    (as placement's `leaving` has it), so the serving engines keep their whole room meanwhile."""
    rig = Rig(pools=picking_config(backends=(URL_A, URL_B, URL_C)))
    discovery = Moving(URL_A, URL_B, URL_C)
    watch = EngineDrainWatch(lambda: rig.config, discovery, rig.metrics, clock=rig.clock)
    picker = BackendPicker(lambda: rig.config, watch)
    watch.running = picker.running
    idle = BackendReading(0.0, 100_000, saturated=False)
    picker.observe("primary", {URL_A: idle, URL_B: idle, URL_C: idle})
    watch.follow()
    for i in range(6):
        picker.pick("primary", f"t{i}", Placing(100 * (i + 1)))
    on_a = picker.running("primary")[A]
    assert on_a[0] >= 1 and watch.held("primary") == (0, 0)
    discovery.urls = (URL_B, URL_C)  # A left its name's answer; the drains have not followed yet
    assert watch.draining("primary") == frozenset() and watch.serving("primary") == (URL_B, URL_C)
    assert picker.leaving("primary", A)
    assert watch.held("primary") == on_a  # (was (0, 0): the serving engines lost A's leftovers' room)
    watch.follow()  # now a drain, removed: the same
    assert watch.draining("primary") == {A} and watch.held("primary") == on_a
    for i in range(6):
        picker.release(f"t{i}")
    assert watch.held("primary") == (0, 0)
