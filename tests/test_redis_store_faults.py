"""The Redis stores under faults a real redis-server can be put through: a caller that leaves
while its script call is on its way, a connection given up while it opens."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.admission import Ticket
from extproc.core.config import Retries
from extproc.stores.redis_batch import ScriptBatch
from extproc.stores.redis_connection import RedisAddress
from extproc.stores.redis_control import RedisControlStore
from extproc.stores.redis_queue import RedisQueueStore


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


async def _until(condition, what: str, timeout: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := await condition()):
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)
    return value


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
        held = 0 if room else 1
        await _until(lambda: _state_is(store, inflight=held, depth=0), "the slot or place given back")
        if holder is not None:
            await store.release(holder)
        await _until(lambda: _state_is(store, inflight=0, depth=0), "an empty pool")
        assert redis_server.client().hlen("{extproc:p}:li") == 0
    finally:
        await store.stop()


async def _state_is(store: RedisQueueStore, inflight: int, depth: int) -> bool:
    snapshot = await store.snapshot("p")
    return (snapshot.inflight, snapshot.depth) == (inflight, depth)


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
        await _until(lambda: _state_is(store, inflight=0, depth=0), "the slot given back")
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
