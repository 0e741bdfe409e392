"""The Redis stores under faults a real redis-server can be put through: a caller that leaves
while its script call is on its way, a connection given up while it opens, Redis gone while
several replicas share a pool."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.admission import PoolLimits, Ticket
from extproc.core.config import Config, Retries
from extproc.stores.factory import build_queue_store
from extproc.stores.queue import Lease
from extproc.stores.redis_batch import ScriptBatch
from extproc.stores.redis_connection import RedisAddress
from extproc.stores.redis_control import RedisControlStore
from extproc.stores.redis_queue import RedisQueueStore
from extproc_testbed.redis_server import RedisServer


async def test_a_call_handed_over_while_a_given_up_connection_closes_is_answered_on_its_own(redis_server):
    """A connection that could not open in time is given up, with the calls handed to it. Its
    opener ends a moment later; a call handed over meanwhile goes on the next connection, and
    hears only from that one: the old connection's end must not reach it."""
    client = RedisAddress(redis_server.url).connect(0.3)
    echo = client.register_script("return ARGV[1]")
    await echo(keys=["k"], args=["loaded"])
    calls = ScriptBatch(client, {"echo": echo}, cluster=False, op_timeout_s=0.3)
    try:
        redis_server.pause()  # the connection opens as far as the kernel goes, and waits for Redis
        try:
            with pytest.raises(TimeoutError):
                await calls.submit("echo", "k", ("first",))
            second = calls.submit("echo", "k", ("second",))  # the first connection's opener still ends
        finally:
            redis_server.resume()
        assert await second == "second"
        assert await asyncio.gather(*(calls.submit("echo", "k", (str(i),)) for i in range(5))) == [str(i) for i in range(5)]
    finally:
        await calls.close()
        await client.aclose()


async def _handed_to_redis(store: RedisQueueStore) -> None:
    """Until the script call just asked for is written (Redis may not read it yet)."""
    await asyncio.sleep(0)  # the caller's task hands it over
    assert store._calls._batch
    while store._calls._batch:
        await asyncio.sleep(0.001)


async def _until_pool_holds(store: RedisQueueStore, inflight: int, depth: int, what: str) -> None:
    """Until pool "p" counts `inflight` admitted and `depth` waiting: what is given back is
    handed over when an answer comes, and settles a round trip later."""
    deadline = asyncio.get_running_loop().time() + 5
    while ((snapshot := await store.snapshot("p")).inflight, snapshot.depth) != (inflight, depth):
        assert asyncio.get_running_loop().time() < deadline, f"{what}: {snapshot}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("room", [True, False], ids=["admitted", "in-line"])
async def test_an_enqueue_whose_caller_leaves_on_its_way_holds_nothing(redis_server, room):
    """The client leaves while its enqueue is written but not answered (Redis stopped a moment):
    the script still runs, and its slot, or its place in line, goes back when the answer comes,
    not a lease (a minute here) or a TTL later. Nobody else would: the gate never saw a lease or a
    waiter to give back."""
    redis_server.client().flushall()
    store = RedisQueueStore(redis_server.url, {"p": 1}, lease_s=60, op_timeout_s=5)
    await store.start()
    try:
        holder = None if room else await store.enqueue("p", Ticket(1.0, 0, "holder", "c"))
        redis_server.pause()
        try:
            leaving = asyncio.create_task(store.enqueue("p", Ticket(1.0, 1, "leaving", "c")))
            await _handed_to_redis(store)
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving
        finally:
            redis_server.resume()
        await _until_pool_holds(store, 0 if room else 1, 0, "the slot or place given back")
        if holder is not None:
            await store.release(holder)
        await _until_pool_holds(store, 0, 0, "an empty pool")
        assert redis_server.client().hlen("{extproc:p}:li") == 0
    finally:
        await store.stop()


async def test_a_waiter_cancelled_again_while_it_leaves_the_line_holds_nothing(redis_server):
    """A waiter is cancelled, and cancelled again while its withdrawal is on its way; the slot
    freed just before reached it meanwhile ('holds'): that answer still gives the slot back."""
    redis_server.client().flushall()
    store = RedisQueueStore(redis_server.url, {"p": 1}, lease_s=60, op_timeout_s=5)
    await store.start()
    try:
        holder = await store.enqueue("p", Ticket(1.0, 0, "holder", "c"))
        waiter = await store.enqueue("p", Ticket(1.0, 1, "waiter", "c"))
        waiting = asyncio.create_task(store.wait(waiter, 60))
        await asyncio.sleep(0.05)
        redis_server.pause()
        try:
            release = store.release_soon(holder)  # Redis will admit the waiter in its place...
            waiting.cancel()  # ...before it reads the waiter's withdrawal
            await _handed_to_redis(store)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        finally:
            redis_server.resume()
        await release
        await _until_pool_holds(store, 0, 0, "the slot given back")
    finally:
        await store.stop()


async def test_a_probe_permit_whose_caller_leaves_on_its_way_goes_back(redis_server):
    """A half-open probe's permit is taken for a request that leaves while the call is on its
    way: the gate never learns it held one, so the store gives it back when the answer comes,
    and the opening keeps all its permits (a lost one would shrink them for PROBE_TTL_MS)."""
    redis_server.client().flushall()
    store = RedisControlStore(RedisAddress(redis_server.url), ["p"], {"p": {"instant": (0.1, 10)}}, Retries(),
                              op_timeout_s=5)
    await store.take_probe("p", 1.0, 1)  # (the script loaded, the connection open)
    await store.return_probe("p", 1.0)
    redis_server.pause()
    try:
        leaving = asyncio.create_task(store.take_probe("p", 10.0, 2))
        await asyncio.sleep(0.1)  # written, not answered
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
    finally:
        redis_server.resume()
    client = redis_server.client()
    deadline = asyncio.get_running_loop().time() + 5
    while client.get("{extproc:p}:probe:10000") != "0":
        assert asyncio.get_running_loop().time() < deadline, "the permit given back"
        await asyncio.sleep(0.02)
    assert [await store.take_probe("p", 10.0, 2) for _ in range(3)] == [True, True, False]
    await store.stop()


def _replica_config(redis_url: str, max_inflight: int, **redis_settings) -> Config:
    return Config.model_validate({
        "classes": {"c": {"base": 0}}, "default_class": "c",
        "pools": {"p": {"cluster": "x", "max_inflight": max_inflight}}, "default_pool": "p",
        "redis": {"url": redis_url, "op_timeout_s": 0.25, **redis_settings}})


async def _admitted_at_once(store, tickets: int, replica: int) -> int:
    """How many of `tickets` new requests the store admits at once (the rest wait)."""
    results = [await store.enqueue("p", Ticket(1.0, n, f"r{replica}-{n}", "c")) for n in range(tickets)]
    return sum(isinstance(result, Lease) for result in results)


async def test_with_redis_down_the_replicas_together_admit_at_most_the_pool(tmp_path):
    """Five replicas share a pool of 10 slots through Redis, which then dies: each falls back to
    its in-process line with a share of the pool, and the five shares hold 10 at most (each one
    over the five replicas Redis counted live; not a fixed half each, 25 in all)."""
    server = RedisServer(tmp_path / "redis").start()
    stores = [build_queue_store(_replica_config(server.url, 10), lambda pool, snapshot: None, lambda degraded: None)
              for _ in range(5)]
    try:
        for store in stores:
            await store.start()
        for store in stores:  # every replica renews within a third of a lease, and the capacity loop
            await store.shared.renew_all()  # sets the limits at every tick: as they would be by now
            await store.set_limits("p", PoolLimits(10))
        server.kill()
        admitted = [await _admitted_at_once(store, 10, i) for i, store in enumerate(stores)]
        assert all(store.degraded for store in stores)
        assert sum(admitted) <= 10 and admitted == [2] * 5
    finally:
        for store in stores:
            await store.stop()
        server.kill()


@pytest.mark.parametrize(("settings", "each"), [({"replicas": 4}, 3), ({}, 6), ({"replicas": 4, "local_share": 0.2}, 2)],
                         ids=["configured", "never-counted", "share-set"])
async def test_a_replica_that_never_reached_redis_takes_its_configured_share(tmp_path, settings, each):
    """Redis is down from the start, so nothing was counted: the configured replicas decide the
    share (12 slots over 4 replicas: 3), else two replicas are assumed; `local_share`, when set,
    decides it whatever the replicas."""
    dead = RedisServer(tmp_path / "redis")  # never started: its port refuses connections
    store = build_queue_store(_replica_config(dead.url, 12, **settings), lambda pool, snapshot: None,
                              lambda degraded: None)
    try:
        await store.start()
        assert await _admitted_at_once(store, 12, 0) == each and store.degraded
    finally:
        await store.stop()
