"""The failure modes of the shared queue, against a real Redis that is killed and restarted."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.admission import PoolLimits, Ticket
from extproc.core.outcomes import Outcome, Rejection
from extproc.stores.degradable_queue import DegradableQueueStore
from extproc.stores.local_queue import LocalQueueStore
from extproc.stores.queue import Lease, Waiter
from extproc.stores.redis_connection import RedisAddress
from extproc.stores.redis_queue import RedisQueueStore
from extproc_testbed.redis_server import RedisSentinel, RedisServer

from ..tcp_proxy import SwitchableProxy


def ticket(i: int) -> Ticket:
    return Ticket(1.0, i, f"f{i}", "c", "b")


@pytest.fixture
async def degradable(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    stores = []

    async def make(mode: str, capacity: int = 1) -> DegradableQueueStore:
        shared = RedisQueueStore(server.url, {"p": capacity}, lease_s=2, op_timeout_s=0.25,
                                 on_error=lambda e: store.trip(e))
        store = DegradableQueueStore(shared, LocalQueueStore({"p": capacity}), mode, local_share=1.0, recheck_s=0.2,
                                     retry_after_s=3)
        await store.start()
        stores.append(store)
        return store

    yield server, make
    for store in stores:
        await store.stop()
    server.kill()


async def until(predicate, timeout: float = 10) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_closed_mode_answers_503_then_recovers(degradable):
    server, make = degradable
    store = await make("closed")
    server.kill()
    with pytest.raises(Rejection) as error:
        await store.enqueue("p", ticket(1))
    assert error.value.outcome is Outcome.REJECTED_STORE_UNAVAILABLE and error.value.retry_after_s == 3
    assert store.degraded
    server.start()
    await until(lambda: not store.degraded)
    lease = await store.enqueue("p", ticket(2))
    assert isinstance(lease, Lease)
    assert int(server.client().hget("{extproc:p}:st", "inflight")) == 1  # counted in Redis again
    await store.release(lease)
    assert int(server.client().hget("{extproc:p}:st", "inflight")) == 0


async def test_open_mode_admits_without_counting(degradable):
    server, make = degradable
    store = await make("open")
    server.kill()
    leases = [await store.enqueue("p", ticket(i)) for i in range(3)]  # capacity 1, all admitted
    assert all(isinstance(lease, Lease) for lease in leases)
    for lease in leases:
        await store.release(lease)
    assert (await store.snapshot("p")).inflight == 0


async def test_local_mode_moves_a_redis_waiter_without_new_traffic(degradable):
    server, make = degradable
    store = await make("local")
    holder = await store.enqueue("p", ticket(1))
    waiter = await store.enqueue("p", ticket(2))
    assert isinstance(waiter, Waiter)
    waiting = asyncio.create_task(store.wait(waiter, 30))
    snapshot = await store.snapshot("p")  # (the wait starts meanwhile)
    assert (snapshot.inflight, snapshot.depth) == (1, 1)  # the holder runs, the waiter is in Redis's line
    assert not waiting.done()
    server.kill()  # nobody else calls the store: the background report notices
    lease = await asyncio.wait_for(waiting, 5)  # placed again in the local store, which has room
    assert isinstance(lease, Lease) and store.degraded
    assert (await store.local.snapshot("p")).inflight == 1
    await store.release(lease)
    await store.release(holder)  # a Redis lease: its release fails quietly, it expires there
    assert (await store.local.snapshot("p")).inflight == 0


async def test_after_redis_comes_back_empty_its_counts_include_everything_still_running(degradable):
    server, make = degradable
    store = await make("local", capacity=2)
    before = [await store.enqueue("p", ticket(i)) for i in (1, 2)]  # admitted through Redis
    server.kill()
    during = await store.enqueue("p", ticket(3))  # admitted by the local store
    assert all(isinstance(lease, Lease) for lease in [*before, during]) and store.degraded
    await store.set_limits("p", PoolLimits(2, 50_000))  # the probes' latest word, while Redis is away
    server.start()  # same port, no data: every count and lease is gone
    await until(lambda: not store.degraded)
    state = server.client().hgetall("{extproc:p}:st")
    assert (state["inflight"], state["max"], state["budget"]) == ("3", "2", "50000")  # all three; the limits
    waiter = await store.enqueue("p", ticket(4))
    assert isinstance(waiter, Waiter)  # so nothing more is admitted until they end
    waiting = asyncio.create_task(store.wait(waiter, 10))
    await store.release(before[0])  # the release script admits in the same step whatever fits
    snapshot = await store.snapshot("p")
    assert (snapshot.inflight, snapshot.depth) == (2, 1)  # 2 still running: at the limit, the waiter still in line
    assert not waiting.done()
    await store.release(during)
    last = await asyncio.wait_for(waiting, 5)
    for lease in (before[1], last):
        await store.release(lease)
    assert server.client().hget("{extproc:p}:st", "inflight") == "0"
    assert (await store.local.snapshot("p")).inflight == 0


async def test_a_failover_that_loses_writes_ends_with_counts_that_match_what_runs(tmp_path):
    """I7: primary and replica; writes reach the primary only; the primary dies; the replica is
    promoted and the address clients use moves to it (as a managed Redis's endpoint does)."""
    primary = RedisServer(tmp_path / "primary").start()
    replication = await SwitchableProxy(primary.port).start()  # the replica's link to the primary
    replica = RedisServer(tmp_path / "replica").start()
    replica.client().replicaof("127.0.0.1", replication.port)
    proxy = await SwitchableProxy(primary.port).start()  # the address the sidecar uses
    shared = RedisQueueStore(proxy.url, {"p": 3}, lease_s=1.5, op_timeout_s=0.25, on_error=lambda e: store.trip(e))
    store = DegradableQueueStore(shared, LocalQueueStore({"p": 3}), "local", local_share=1.0, recheck_s=0.2,
                                 retry_after_s=3)
    await store.start()
    promoted = replica.client()
    try:
        a, b = [await store.enqueue("p", ticket(i)) for i in (1, 2)]
        await until(lambda: promoted.hlen("{extproc:p}:li") == 2)  # replicated
        replication.dropping = True  # from here on, writes stay on the primary: they will be lost
        c = await store.enqueue("p", ticket(3))  # its admission is lost
        await store.release(b)  # and so is this release
        assert all(isinstance(lease, Lease) for lease in (a, b, c))
        primary.kill()
        await replication.stop()
        promoted.replicaof("NO", "ONE")
        seconds, micros = promoted.time()
        promoted_at_ms = seconds * 1000 + micros // 1000
        # The lost release: b's lease was last renewed before the loss, so it ends within one
        # lease of the promotion by the new primary's own clock, and nobody renews it.
        assert float(promoted.zscore("{extproc:p}:lease", "f2")) <= promoted_at_ms + 1500
        assert promoted.hexists("{extproc:p}:li", "f3") == 0  # c's admission never arrived
        proxy.switch(replica.port)

        # The lost admission: c's owner renews it, and the renewal counts it again.
        await until(lambda: set(promoted.hkeys("{extproc:p}:li")) == {"f1", "f3"}, timeout=15)
        assert promoted.hget("{extproc:p}:st", "inflight") == "2"  # exactly what runs: a and c
        assert promoted.zscore("{extproc:p}:reaped", "f2") is not None  # b expired there
        await until(lambda: not store.degraded)
        d = await store.enqueue("p", ticket(4))
        assert isinstance(d, Lease)
        assert isinstance(await store.enqueue("p", ticket(5)), Waiter)  # the limit of 3 holds
        for lease in (a, c, d):
            await store.release(lease)
    finally:
        await store.stop()
        await proxy.stop()
        await replication.stop()
        primary.kill()
        replica.kill()


async def test_a_sentinel_failover_is_followed_and_the_counts_carry_over(tmp_path):
    primary = RedisServer(tmp_path / "primary").start()
    replica = RedisServer(tmp_path / "replica").start()
    replica.client().replicaof("127.0.0.1", primary.port)
    sentinel = RedisSentinel(tmp_path / "sentinel", primary.port).start()
    promoted = replica.client()
    store = None
    try:
        await until(lambda: sentinel.knows_replicas() == 1, timeout=20)
        shared = RedisQueueStore(RedisAddress(sentinels=(("127.0.0.1", sentinel.port),)), {"p": 3},
                                 lease_s=1.5, op_timeout_s=0.25, on_error=lambda e: store.trip(e))
        store = DegradableQueueStore(shared, LocalQueueStore({"p": 3}), "local", local_share=1.0, recheck_s=0.2,
                                     retry_after_s=3)
        await store.start()
        held = [await store.enqueue("p", ticket(i)) for i in (1, 2)]
        assert all(isinstance(lease, Lease) for lease in held)
        assert primary.client().hget("{extproc:p}:st", "inflight") == "2"  # found the master through Sentinel
        await until(lambda: promoted.hlen("{extproc:p}:li") == 2)

        primary.kill()
        await until(lambda: sentinel.master_port_now() == replica.port, timeout=30)  # Sentinel promotes
        await until(lambda: not store.degraded, timeout=15)  # and the store follows
        assert promoted.hget("{extproc:p}:st", "inflight") == "2"  # the held slots carried over
        third = await store.enqueue("p", ticket(3))
        assert isinstance(third, Lease) and promoted.hget("{extproc:p}:st", "inflight") == "3"
        assert isinstance(await store.enqueue("p", ticket(4)), Waiter)  # the limit holds on the new master
        for lease in (*held, third):
            await store.release(lease)
    finally:
        if store is not None:
            await store.stop()
        sentinel.kill()
        primary.kill()
        replica.kill()


async def test_after_redis_comes_back_no_connection_from_before_the_outage_trips_it_again(degradable):
    """Connections pooled before Redis went away are dead once it is back; the first call on one
    must not send the store back to its degraded mode (the client itself never retries)."""
    server, make = degradable
    store = await make("local", capacity=8)
    # Calls in flight together hold as many connections, which go back to the pool.
    leases = await asyncio.gather(*(store.enqueue("p", ticket(i)) for i in range(6)))
    await asyncio.gather(*(store.shared._client.ping() for _ in range(6)))
    for lease in leases:
        await store.release(lease)
    server.kill()
    held = await store.enqueue("p", ticket(100))  # served in the degraded mode: the outage is noticed
    await until(lambda: store.degraded)
    server.start()
    await until(lambda: not store.degraded)
    trips = []
    store._on_mode_change = trips.append
    leases = await asyncio.gather(*(store.enqueue("p", ticket(200 + i)) for i in range(6)))
    await asyncio.gather(*(store.shared._client.ping() for _ in range(6)))
    assert trips == [] and not store.degraded
    # Counted in Redis again: the six, and the one admitted during the outage, still held.
    assert int(server.client().hget("{extproc:p}:st", "inflight")) == 7
    for lease in [*leases, held]:
        await store.release(lease)
    assert int(server.client().hget("{extproc:p}:st", "inflight")) == 0
