"""The failure modes of the shared queue, against a real Redis that is killed and restarted."""

from __future__ import annotations

import asyncio

import pytest

from extproc.admission import Ticket
from extproc.failover_store import FailoverStore
from extproc.outcomes import Outcome, Rejection
from extproc.queue_store import Lease, LocalQueueStore, Waiter
from extproc.redis_store import RedisQueueStore

from .redis_server import RedisServer


def ticket(i: int) -> Ticket:
    return Ticket(1.0, i, f"f{i}", "c", "b")


@pytest.fixture
async def failover(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    stores = []

    async def make(mode: str, capacity: int = 1) -> FailoverStore:
        shared = RedisQueueStore(server.url, {"p": capacity}, lease_s=2, op_timeout_s=0.25)
        store = FailoverStore(shared, LocalQueueStore({"p": capacity}), mode, local_share=1.0, recheck_s=0.2,
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


async def test_closed_mode_answers_503_then_recovers(failover):
    server, make = failover
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


async def test_open_mode_admits_without_counting(failover):
    server, make = failover
    store = await make("open")
    server.kill()
    leases = [await store.enqueue("p", ticket(i)) for i in range(3)]  # capacity 1, all admitted
    assert all(isinstance(lease, Lease) for lease in leases)
    for lease in leases:
        await store.release(lease)
    assert (await store.snapshot("p")).inflight == 0


async def test_local_mode_moves_a_redis_waiter_without_new_traffic(failover):
    server, make = failover
    store = await make("local")
    holder = await store.enqueue("p", ticket(1))
    waiter = await store.enqueue("p", ticket(2))
    assert isinstance(waiter, Waiter)
    waiting = asyncio.create_task(store.wait(waiter, 30))
    await asyncio.sleep(0.1)
    server.kill()  # nobody else calls the store: the background report notices
    lease = await asyncio.wait_for(waiting, 5)  # placed again in the local store, which has room
    assert isinstance(lease, Lease) and store.degraded
    assert (await store.local.snapshot("p")).inflight == 1
    await store.release(lease)
    await store.release(holder)  # a Redis lease: its release fails quietly, it expires there
    assert (await store.local.snapshot("p")).inflight == 0
