"""The third level at run time, over each control store: probes, pages, canary rollback, and
replicas sharing one Redis (standalone and Cluster) agreeing on every breaker."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from extproc.control.plane import ControlPlane
from extproc.core.breaker import Permit, ProbeKind
from extproc.core.config import parse_config
from extproc.core.retries import Verdict
from extproc.ops.metrics import Metrics
from extproc.stores.control import LocalControlStore
from extproc.stores.factory import build_control_store
from extproc.stores.redis_connection import RedisAddress
from extproc.stores.redis_control import RedisControlStore
from extproc_testbed.redis_server import RedisServer

from ..conftest import e2e_config
from ..helpers import async_wait_until


def plane_config(webhook: str | None = None, redis_url: str | None = None, cluster: bool = False):
    raw = e2e_config()
    fast = {"instant": {"min_requests": 4, "threshold": 0.5, "open_s": 0.5, "probes": 2},
            "sustained": {"min_requests": 1000}, "deep": {"min_requests": 8, "threshold": 0.5}}
    for pool in raw["pools"].values():
        pool["breaker"] = fast
    raw["pools"]["canary"] = {"cluster": "vllm_canary", "max_inflight": 2, "fallback": "fallback", "breaker": fast}
    raw["canary"] = {"pool": "canary", "digits": ["3", "7"], "order": "3701245689"}
    raw["alerts"] = {"webhook": webhook}
    if redis_url:
        raw["redis"] = {"url": redis_url, "cluster": cluster}
    return parse_config(raw)


def _make_planes(request, redis_server):
    made: list[ControlPlane] = []

    async def make(n: int = 1, webhook: str | None = None) -> list[ControlPlane]:
        if request.param == "local":
            assert n == 1, "replicas share state only through Redis"
            config = plane_config(webhook)
        elif request.param == "redis":
            redis_server.client().flushall()
            config = plane_config(webhook, redis_server.url)
        else:
            cluster = request.getfixturevalue("redis_cluster")
            for node in cluster.nodes:
                node.client().flushall()
            config = plane_config(webhook, cluster.url, cluster=True)
        group = []
        for _ in range(n):
            plane = ControlPlane(config, build_control_store(config), Metrics())
            await plane.start()
            group.append(plane)
        made.extend(group)
        return group

    return make, made


@pytest.fixture(params=["local", "redis", "redis-cluster"])
async def planes(request, redis_server):
    """make(n, webhook) -> n started ControlPlanes over one store."""
    make, made = _make_planes(request, redis_server)
    yield make
    for plane in made:
        await plane.stop()


@pytest.fixture(params=["redis", "redis-cluster"])
async def shared_planes(request, redis_server):
    """The same, for replicas that share one Redis."""
    make, made = _make_planes(request, redis_server)
    yield make
    for plane in made:
        await plane.stop()


async def settle(*planes: ControlPlane) -> None:
    """Let writes land and every replica read the shared state back."""
    for _ in range(3):
        await asyncio.sleep(0.05)
        for plane in planes:
            await plane.tick()


def trip(plane: ControlPlane, pool: str = "primary", failures: int = 4) -> None:
    for _ in range(failures):
        plane.record(pool, True)


async def test_exactly_the_half_open_probes_are_let_through(planes):
    (plane,) = await planes(1)
    trip(plane)
    await settle(plane)
    assert plane.permit("primary")[0] is Permit.NO
    await asyncio.sleep(0.55)
    assert plane.permit("primary") == (Permit.PROBE, ProbeKind.HALF_OPEN)
    granted = [await plane.take_probe("primary", ProbeKind.HALF_OPEN) for _ in range(5)]
    assert granted == [True, True, False, False, False]
    await plane.return_probe("primary")  # a probe whose client left gives its permit back
    assert await plane.take_probe("primary", ProbeKind.HALF_OPEN)
    plane.record("primary", False, ProbeKind.HALF_OPEN)
    plane.record("primary", False, ProbeKind.HALF_OPEN)
    await settle(plane)
    assert plane.permit("primary") == (Permit.YES, None)


async def test_the_deep_level_pages_once_and_an_operator_resets_it(planes):
    from ..helpers import webhook_receiver

    async with webhook_receiver() as (url, received):
        (plane,) = await planes(1, webhook=url)
        for _ in range(8):
            plane.record("fallback", True)
        await settle(plane)
        for _ in range(8):
            plane.record("fallback", True)
        await settle(plane)
        await async_wait_until(lambda: any(r["event"] == "breaker_deep" for r in received), 5, "the page")
        await settle(plane)  # more failures, more ticks: still one page
        pages = [r for r in received if r["event"] == "breaker_deep"]
        assert len(pages) == 1 and pages[0]["pool"] == "fallback" and pages[0]["failure_ratios"]["300s"] == 1.0
        assert plane.breakers["fallback"].state.paged
        await plane.reset("fallback")
        await settle(plane)
        assert not plane.breakers["fallback"].state.paged


async def test_the_canary_rolls_back_by_itself_when_its_pool_trips(planes):
    from ..helpers import webhook_receiver

    async with webhook_receiver() as (url, received):
        (plane,) = await planes(1, webhook=url)
        assert plane.canary_digits == frozenset("37")
        assert (await plane.canary_advance()).digits == "370"
        trip(plane, "canary")
        await settle(plane)
        await asyncio.sleep(0.3)
        assert plane.canary_digits == frozenset()
        assert plane.controls.canary.reason == "canary pool breaker instant open"
        rollbacks = [r for r in received if r["event"] == "canary_rollback"]
        assert len(rollbacks) == 1 and rollbacks[0]["digits"] == ["3", "7", "0"]
        assert (await plane.canary_advance()).digits == "3"  # an operator starts again
        assert plane.controls.canary.rolled_back_at is None


async def test_two_replicas_agree_on_every_breaker(shared_planes):
    a, b = await shared_planes(2)
    trip(a, failures=2)  # below the minimum volume on each replica...
    trip(b, failures=2)
    await settle(a, b)  # ...but not summed over both
    await settle(a, b)
    assert a.permit("primary")[0] is Permit.NO and b.permit("primary")[0] is Permit.NO
    opened = sum(p.metrics.breaker_transitions.labels("primary", "instant", "open").value for p in (a, b))
    assert opened == 1  # one replica's write won; the other adopted it
    await asyncio.sleep(0.55)
    granted = [await p.take_probe("primary", ProbeKind.HALF_OPEN) for p in (a, b, a, b)]
    assert granted.count(True) == 2  # the half-open probes are counted across replicas

    await a.force("fallback", "open")
    await settle(a, b)
    assert b.permit("fallback")[0] is Permit.NO
    await b.reset("fallback")
    await settle(a, b)
    assert a.permit("fallback")[0] is Permit.YES

    await a.canary_advance()
    await a.set_shadow_share(0.25)
    await settle(a, b)
    assert b.canary_digits == frozenset("370") and b.shadow_share == 0.25
    await b.set_shadow_share(None)  # cleared: each replica's configured share again
    await settle(a, b)
    assert a.controls.shadow_share is None and a.shadow_share == a.config.shadow.share == 0.0
    assert a.canary_digits == frozenset("370")


async def test_a_named_request_runs_once_across_replicas(shared_planes):
    a, b = await shared_planes(2)
    assert (await a.begin_attempt("req-1")).verdict is Verdict.FIRST
    assert (await b.begin_attempt("req-1")).verdict is Verdict.IN_PROGRESS
    await a.finish_attempt("req-1", "primary")
    retry = await b.begin_attempt("req-1")
    assert (retry.verdict, retry.failed_in) == (Verdict.RETRY, "primary")


async def test_an_unreachable_store_leaves_each_replica_its_own_breaker(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    config = plane_config(redis_url=server.url)
    plane = ControlPlane(config, build_control_store(config), Metrics())
    await plane.start()
    try:
        server.kill()
        trip(plane)  # counted and applied locally, the write fails
        await settle(plane)
        assert not plane.store_ok
        assert plane.permit("primary")[0] is Permit.NO
        assert (await plane.begin_attempt("k")).verdict is Verdict.FIRST  # unknown: let it run
    finally:
        await plane.stop()


def test_the_store_follows_the_queue():
    assert isinstance(build_control_store(plane_config()), LocalControlStore)
    shared = build_control_store(plane_config(redis_url="redis://127.0.0.1:1/0"))
    assert isinstance(shared, RedisControlStore) and shared.address == RedisAddress("redis://127.0.0.1:1/0")


class SlowSwaps(LocalControlStore):
    """A control store whose writes take a while (as a round trip to Redis does): each waits
    until the test lets it go."""

    def __init__(self, retries):
        super().__init__(retries)
        self.go = asyncio.Event()

    async def swap_breaker(self, pool, expected_version, state):
        await self.go.wait()
        return await super().swap_breaker(pool, expected_version, state)


async def test_a_change_counted_while_the_previous_one_is_being_written_is_kept_and_acted_on_once():
    config = plane_config()
    store = SlowSwaps(config.retries)
    metrics = Metrics()
    plane = ControlPlane(config, store, metrics)
    trip(plane)  # the instant level opens: its write is on its way
    await asyncio.sleep(0.01)
    assert plane.breakers["primary"].state.instant.value == 1
    for _ in range(4):  # and, meanwhile, the deep level trips (8 outcomes, half of them failures)
        plane.record("primary", False)
    assert plane.breakers["primary"].state.paged
    store.go.set()
    for _ in range(5):
        await asyncio.sleep(0.01)
    state = plane.breakers["primary"].state
    assert state.paged and state.instant.value == 1  # neither change lost
    assert (await store.swap_breaker("primary", -1, state)).paged  # and the stored state has both
    for _ in range(3):
        await plane.tick()  # time re-derives nothing that was acted on already
        await asyncio.sleep(0.01)
    assert metric_total(metrics, "extproc_breaker_transitions_total", level="deep", to="paged") == 1
    assert metric_total(metrics, "extproc_breaker_transitions_total", level="instant", to="open") == 1
    await plane.stop()


def metric_total(metrics: Metrics, name: str, **labels: str) -> float:
    from extproc_testbed.stack import metric_sum, parse_samples

    return metric_sum(parse_samples(metrics.render().decode()), name, **labels)


@contextlib.asynccontextmanager
async def paged(fail_first: int):
    """A control plane whose fallback pool has just gone deep (a page posted), and a pager
    that refuses the first `fail_first` posts."""
    from ..helpers import webhook_receiver

    async with webhook_receiver(fail_first=fail_first) as (url, received):
        config = plane_config(url)
        plane = ControlPlane(config, LocalControlStore(config.retries), Metrics())
        await plane.start()
        try:
            for _ in range(8):
                plane.record("fallback", True)
            await settle(plane)
            yield plane, received
        finally:
            await plane.stop()


async def test_a_page_the_pager_did_not_take_is_sent_again_until_it_does():
    async with paged(fail_first=2) as (plane, received):
        # refused twice (after 1 s, then 2 s more): delivered on the third try, once
        await async_wait_until(lambda: len(received) == 1, 10, "the page to be delivered")
        assert received[0]["event"] == "breaker_deep"


async def test_a_page_no_longer_wanted_is_not_sent_again():
    async with paged(fail_first=100) as (plane, received):
        await plane.reset("fallback")  # an operator reset the level before the pager came back
        # at its next try it sees the reset, and stops
        await async_wait_until(lambda: not plane.pager._pending, 5, "the page to be given up")
        assert received == []


async def test_after_redis_comes_back_no_control_call_fails_on_a_connection_from_before(tmp_path):
    """Connections pooled before Redis went away are dead once it is back, and the client never
    retries: a call that meets the outage drops the idle ones, so none fails after it."""
    server = RedisServer(tmp_path / "redis").start()
    config = plane_config(redis_url=server.url)
    store = build_control_store(config)
    try:
        assert all(await asyncio.gather(*(store.claim_once("primary", f"before-{i}", 60) for i in range(6))))
        server.kill()
        with pytest.raises(RedisConnectionError):
            await store.controls()
        server.start()
        after = await asyncio.gather(*(store.claim_once("primary", f"after-{i}", 60) for i in range(6)),
                                     return_exceptions=True)
        assert after == [True] * 6
    finally:
        await store.stop()
        server.kill()
