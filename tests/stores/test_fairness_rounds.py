"""The fairness rounds between branches remember only the branches of the last while, in this
process (core/admission.PoolLine) and in Redis (P:rr, P:ra): every x-branch-id ever seen must
not stay in them for good, and forgetting a quiet branch changes nobody else's order."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.admission import PoolLine, Ticket
from extproc.stores.local_queue import LocalQueueStore
from extproc.stores.queue import Lease, Waiter
from extproc.stores.redis_queue import RedisQueueStore

RR, RA = "{extproc:p}:rr", "{extproc:p}:ra"  # pool "p"'s rounds in Redis


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ticket(n: int, branch: str) -> Ticket:
    return Ticket(score=1.0, seq=n, id=f"t{n}", class_name="c", branch_id=branch)


async def test_ten_thousand_branches_leave_the_in_process_rounds_bounded():
    clock = Clock()
    store = LocalQueueStore({"p": 4}, clock=clock)
    for n in range(10_000):
        lease = await store.enqueue("p", ticket(n, f"branch-{n}"))
        assert isinstance(lease, Lease)
        await store.release(lease)
        clock.now += 0.1  # a new branch every 0.1 s: 600 of them within the 60 s a branch is remembered
    assert len(store._lines["p"]._branches) <= 601


async def test_ten_thousand_branches_leave_the_rounds_in_redis_bounded(redis_server):
    """A branch is forgotten once its last new ticket is older than a ticket lives (1 ms here)."""
    client = redis_server.client()
    client.flushall()
    # (room for ten times a batch: a renewal that crosses a batch's releases counts them again a moment)
    store = RedisQueueStore(redis_server.url, {"p": 1000}, lease_s=5, max_wait_s=0, ttl_margin_s=0.001)
    await store.start()
    try:
        largest = 0
        for start in range(0, 10_000, 100):
            leases = await asyncio.gather(*(store.enqueue("p", ticket(n, f"branch-{n}"))
                                            for n in range(start, start + 100)))
            assert all(isinstance(lease, Lease) for lease in leases)
            await asyncio.gather(*(store.release(lease) for lease in leases))
            largest = max(largest, client.hlen(RR), client.zcard(RA))
        assert largest <= 1000
    finally:
        await store.stop()


async def order_served(store, arrivals: list[tuple[int, str]], clock: Clock | None, quiet_s: float) -> list[str]:
    """Branch A had a turn; `quiet_s` later, B, A and C send a ticket each while the one slot is
    taken. Returns the order their tickets are admitted in."""
    holder = await store.enqueue("p", ticket(0, "H"))
    first_of_a = await store.enqueue("p", ticket(1, "A"))
    assert isinstance(first_of_a, Waiter)
    await store.release(holder)
    running = await store.wait(first_of_a, 5)  # A's turn in the round being served
    if clock is not None:
        clock.now += quiet_s
    else:
        await asyncio.sleep(quiet_s)
    waiters = [await store.enqueue("p", ticket(n, branch)) for n, branch in arrivals]
    order = []
    for waiter in waiters:
        assert isinstance(waiter, Waiter)
    pending = {asyncio.create_task(store.wait(w, 5)): w for w in waiters}
    while pending:
        await store.release(running)
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        (task,) = done
        running = task.result()
        order.append(pending.pop(task).ticket.branch_id)
    await store.release(running)
    return order


@pytest.mark.parametrize("kind", ["local", "redis"])
async def test_a_branch_that_just_had_its_turn_still_waits_for_the_others_but_a_quiet_one_starts_afresh(
        redis_server, kind):
    arrivals = [(2, "B"), (3, "A"), (4, "C")]

    async def served(quiet_s: float) -> list[str]:
        if kind == "local":
            clock = Clock()
            return await order_served(LocalQueueStore({"p": 1}, clock=clock), arrivals, clock, quiet_s * 100)
        redis_server.client().flushall()
        store = RedisQueueStore(redis_server.url, {"p": 1}, lease_s=5, max_wait_s=1.5, ttl_margin_s=0.5)
        await store.start()
        try:
            return await order_served(store, arrivals, None, quiet_s)
        finally:
            await store.stop()

    assert await served(0) == ["B", "C", "A"]  # A had its turn in this round: B and C first
    # quiet past what a branch is remembered for (60 s here, 2 s in Redis, as long as a ticket
    # lives): A is a new branch again, and takes its place in this round by its arrival
    assert await served(3.0) == ["B", "A", "C"]


def test_a_branch_in_line_is_remembered_however_long_its_ticket_waits():
    line = PoolLine(1, forget_after_s=60)
    assert line.offer(ticket(0, "H"), now=0) == [ticket(0, "H")]
    assert line.offer(ticket(1, "A"), now=0) == []  # round 0, and it waits
    assert line.offer(ticket(2, "B"), now=100) == []  # round 0: A's ticket waited past 60 s
    assert line.offer(ticket(3, "A"), now=100) == []  # round 1: A still has one in this round
    assert line.offer(ticket(4, "C"), now=100) == []  # round 0
    served = []
    for holder in ("t0", "t1", "t2", "t4"):
        (admitted,) = line.release(holder, now=100)
        served.append(admitted.branch_id)
    assert served == ["A", "B", "C", "A"]
