"""One contract, every control store: the in-process store, Redis and a three-master Redis
Cluster keep the third level's state the same way (stores/control.ControlStore)."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.breaker import BreakerState
from extproc.core.canary import CanaryState
from extproc.core.config import Retries
from extproc.core.retries import Verdict
from extproc.stores.control import Controls, LocalControlStore
from extproc.stores.redis_connection import RedisAddress
from extproc.stores.redis_control import RedisControlStore

POOLS = ["p", "q"]
LEVELS = {pool: {"instant": (0.1, 10), "sustained": (1.0, 60)} for pool in POOLS}
RETRIES = Retries(max_attempts=2)


@pytest.fixture(params=["local", "redis", "redis-cluster"])
async def make_store(request, redis_server):
    made = []

    async def make(lease_s: float = 10.0):
        if request.param == "local":
            store = LocalControlStore(RETRIES, lease_s=lease_s)
        elif request.param == "redis":
            if not made:
                redis_server.client().flushall()
            store = RedisControlStore(RedisAddress(redis_server.url), POOLS, LEVELS, RETRIES, lease_s=lease_s)
        else:
            cluster = request.getfixturevalue("redis_cluster")
            if not made:
                for node in cluster.nodes:
                    node.client().flushall()
            store = RedisControlStore(RedisAddress(cluster.url, cluster=True), POOLS, LEVELS, RETRIES, lease_s=lease_s)
        await store.start()
        made.append(store)
        return store

    yield make
    for store in made:
        await store.stop()


async def test_a_breaker_state_is_written_only_over_the_version_it_was_built_on(make_store):
    store = await make_store()
    first = BreakerState(version=1, rerouting=True)
    assert await store.swap_breaker("p", 0, first) == first
    stale = BreakerState(version=1, paged=True)
    assert await store.swap_breaker("p", 0, stale) == first  # another replica won: its state stands
    second = BreakerState(version=2, rerouting=False, paged=True)
    assert await store.swap_breaker("p", 1, second) == second
    assert await store.swap_breaker("q", 0, BreakerState(version=1)) == BreakerState(version=1)  # pools apart


async def test_exactly_the_half_open_probes_of_an_opening_are_permitted_and_given_back(make_store):
    store = await make_store()
    assert [await store.take_probe("p", 10.0, 2) for _ in range(3)] == [True, True, False]
    await store.return_probe("p", 10.0)
    assert await store.take_probe("p", 10.0, 2) and not await store.take_probe("p", 10.0, 2)
    assert await store.take_probe("p", 20.0, 2)  # a new opening has permits of its own
    assert await store.take_probe("q", 10.0, 2)  # and so has another pool
    for _ in range(4):
        await store.return_probe("q", 30.0)  # an opening nobody probed: nothing to give back
    assert [await store.take_probe("q", 30.0, 1) for _ in range(2)] == [True, False]


async def test_a_claim_goes_to_one_caller_per_period(make_store):
    store = await make_store()
    assert await store.claim_once("p", "scale_out", 60)
    assert not await store.claim_once("p", "scale_out", 60)
    assert await store.claim_once("q", "scale_out", 60)  # another pool
    assert await store.claim_once("p", "rerouting_probe", 60)  # another signal
    assert await store.claim_once("p", "short", 0.05)
    await asyncio.sleep(0.1)  # its period ran out
    assert await store.claim_once("p", "short", 0.05)


def test_a_local_claim_comes_back_after_its_period_on_the_stores_clock():
    now = [100.0]
    store = LocalControlStore(RETRIES, clock=lambda: now[0])
    assert asyncio.run(store.claim_once("p", "scale_out", 60))
    now[0] += 59.9
    assert not asyncio.run(store.claim_once("p", "scale_out", 60))
    now[0] += 0.2
    assert asyncio.run(store.claim_once("p", "scale_out", 60))


async def test_the_controls_are_written_only_over_the_version_they_were_built_on(make_store):
    store = await make_store()
    assert await store.controls() is None
    rolled_out = Controls(1, CanaryState("37", None, None), 0.1)
    assert await store.swap_controls(0, rolled_out) == rolled_out
    assert await store.swap_controls(0, Controls(1, CanaryState(), 0.5)) == rolled_out
    assert await store.controls() == rolled_out


async def test_a_named_request_runs_once_at_a_time_and_at_most_max_attempts_times(make_store):
    store = await make_store()
    assert (await store.begin_attempt("k")).verdict is Verdict.FIRST
    assert (await store.begin_attempt("k")).verdict is Verdict.IN_PROGRESS
    await store.renew_attempts(["k"])
    await store.finish_attempt("k", "p")
    retry = await store.begin_attempt("k")
    assert (retry.verdict, retry.attempt, retry.failed_in) == (Verdict.RETRY, 2, "p")
    await store.finish_attempt("k", None)
    assert (await store.begin_attempt("k")).verdict is Verdict.TOO_MANY
    assert (await store.begin_attempt("other")).verdict is Verdict.FIRST


async def test_a_name_is_bound_to_its_request_and_a_fresh_first_attempt_starts_it_over(make_store):
    store = await make_store()
    assert (await store.begin_attempt("k", "cheap")).verdict is Verdict.FIRST
    assert (await store.begin_attempt("k", "costly")).verdict is Verdict.OTHER_REQUEST
    await store.finish_attempt("k", None)
    other = await store.begin_attempt("k", "costly")
    assert (other.verdict, other.age_s) == (Verdict.OTHER_REQUEST, 0.0)  # no age, no place
    assert (await store.begin_attempt("k", "cheap")).verdict is Verdict.RETRY
    # a body-named first attempt starts over, even beside a copy still running...
    assert (await store.begin_attempt("b", "d", fresh=True)).verdict is Verdict.FIRST
    await asyncio.sleep(1.0)
    copy = await store.begin_attempt("b", "d", fresh=True)
    assert (copy.verdict, copy.age_s) == (Verdict.FIRST, 0.0)
    await store.finish_attempt("b", "p")
    # ...and its retry finds the fresh one (aged from it, not from the copy before it)
    retry = await store.begin_attempt("b", "d")
    assert (retry.verdict, retry.attempt, retry.failed_in) == (Verdict.RETRY, 2, "p") and retry.age_s < 1.0


async def test_a_running_attempt_whose_holder_stopped_renewing_may_be_retried(make_store):
    store = await make_store(lease_s=0.05)
    assert (await store.begin_attempt("k")).verdict is Verdict.FIRST
    await asyncio.sleep(0.1)  # its lease ran out: the replica running it is gone
    assert (await store.begin_attempt("k")).verdict is Verdict.RETRY


async def test_a_shared_store_sums_every_replicas_counts_and_a_local_one_has_none_to_sum(make_store):
    first, second = await make_store(), await make_store()
    if not first.shared:
        assert await first.sync({"p": {"instant": {1: (5, 1)}}}) is None
        return
    synced = await first.sync({})
    index = int(synced.now / 0.1)
    await first.sync({"p": {"instant": {index: (3, 1)}}})
    synced = await second.sync({"p": {"instant": {index: (2, 2)}}})
    assert dict((i, (r, f)) for i, r, f in synced.windows["p"]["instant"])[index] == (5, 3)
    assert synced.windows["q"]["instant"] == []
