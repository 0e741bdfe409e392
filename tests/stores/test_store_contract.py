"""One contract, two stores: the in-process store and the Redis store behave the same."""

from __future__ import annotations

import asyncio
import contextlib
import time
from unittest import mock

import pytest

from extproc.core.admission import PoolLimits, Ticket
from extproc.core.appointments import AppointmentRequest
from extproc.stores.degradable_queue import DegradableQueueStore
from extproc.stores.local_queue import LocalQueueStore
from extproc.stores.queue import Lease, StoreClosed, Waiter, WaitExpired
from extproc.stores.redis_batch import ScriptBatch
from extproc.stores.redis_connection import RedisAddress
from extproc.stores.redis_queue import RedisQueueStore

PREFIX = "{extproc:p}"  # the keys of pool "p"


@pytest.fixture(params=["local", "redis", "redis-cluster", "degradable"])
async def make_store(request, redis_server):
    """Every QueueStore: in-process, Redis, Redis Cluster, and the degradable store (Redis first,
    the in-process store while Redis is down) with Redis answering."""
    stores = []

    async def make(max_inflight: dict[str, int], **options):
        if request.param == "local":
            store = LocalQueueStore(max_inflight, **options)
        elif request.param == "redis":
            redis_server.client().flushall()
            store = RedisQueueStore(redis_server.url, max_inflight, lease_s=5, **options)
            await store.start()
        elif request.param == "degradable":
            redis_server.client().flushall()
            shared = RedisQueueStore(redis_server.url, max_inflight, lease_s=5, on_error=lambda e: store.trip(e),
                                     **options)
            store = DegradableQueueStore(shared, LocalQueueStore(max_inflight, **options), "local", local_share=1.0,
                                         recheck_s=0.5, retry_after_s=1)
            await store.start()
        else:
            cluster = request.getfixturevalue("redis_cluster")
            for node in cluster.nodes:
                node.client().flushall()
            store = RedisQueueStore(RedisAddress(cluster.url, cluster=True), max_inflight, lease_s=5,
                                    key_prefix=f"t{len(stores)}", **options)
            await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        if not isinstance(store, LocalQueueStore):
            await store.stop()


def ticket(i: int, score: float, cls: str = "c", branch: str = "b", cost: int = 0, long: bool = False) -> Ticket:
    return Ticket(score=score, seq=i, id=f"t{i}", class_name=cls, branch_id=branch, cost=cost, long=long)


async def test_freed_slots_go_to_the_best_waiter(make_store):
    store = await make_store({"p": 1})
    lease = await store.enqueue("p", ticket(0, 1))
    assert isinstance(lease, Lease)
    low = await store.enqueue("p", ticket(1, 2))
    high = await store.enqueue("p", ticket(2, 0))
    assert isinstance(low, Waiter) and isinstance(high, Waiter)
    high_wait = asyncio.create_task(store.wait(high, 10))
    low_wait = asyncio.create_task(store.wait(low, 10))
    await asyncio.sleep(0.01)
    await store.release(lease)
    high_lease = await high_wait
    assert not low_wait.done() and (await store.snapshot("p")).inflight == 1
    await store.release(high_lease)
    await store.release(high_lease)  # twice: nothing more happens
    low_lease = await low_wait
    await store.release(low_lease)
    snapshot = await store.snapshot("p")
    assert snapshot.inflight == 0 and snapshot.depth == 0 and snapshot.inflight_tokens == 0


async def test_the_latency_cap_holds_back_only_the_classes_without_a_target(make_store):
    store = await make_store({"p": 4})
    await store.set_limits("p", PoolLimits(4, None, latency_cap=2))
    unbounded = [Ticket(score=2, seq=i, id=f"u{i}", class_name="archive", bounded=False) for i in range(3)]
    first, second = [await store.enqueue("p", t) for t in unbounded[:2]]
    assert isinstance(first, Lease) and isinstance(second, Lease)
    third = await store.enqueue("p", unbounded[2])
    assert isinstance(third, Waiter)  # two run: the cap holds it back
    bounded = await store.enqueue("p", Ticket(score=0, seq=9, id="loan", class_name="loan"))
    assert isinstance(bounded, Lease)  # a latency-bound request may use the whole pool
    waiting = asyncio.create_task(store.wait(third, 10))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await store.set_limits("p", PoolLimits(4, None, latency_cap=None))  # the cap lifted: it goes
    lease = await asyncio.wait_for(waiting, 5)
    for held in (first, second, bounded, lease):
        await store.release(held)
    assert (await store.snapshot("p")).inflight == 0


async def test_the_latency_cap_counts_only_the_classes_it_holds_back(make_store):
    store = await make_store({"p": 8})
    await store.set_limits("p", PoolLimits(8, None, latency_cap=2))
    loans = [await store.enqueue("p", Ticket(score=0, seq=i, id=f"loan{i}", class_name="loan")) for i in range(4)]
    assert all(isinstance(lease, Lease) for lease in loans)
    unbounded = [await store.enqueue("p", Ticket(score=2, seq=10 + i, id=f"u{i}", class_name="archive", bounded=False))
                 for i in range(3)]
    # four latency-bound requests run, yet two of the others still may: their floor is theirs
    assert [isinstance(lease, Lease) for lease in unbounded] == [True, True, False]
    await store.release(unbounded[0])
    lease = await store.wait(unbounded[2], 5)
    for held in (*loans, unbounded[1], lease):
        await store.release(held)
    assert (await store.snapshot("p")).inflight == 0


async def test_with_long_alone_a_long_ticket_waits_while_a_latency_bound_one_runs(make_store):
    """Where nothing keeps long prompts on engines of their own (Envoy places the requests), a
    long ticket waits until no latency-bound ticket runs, and blocks nobody behind it."""
    store = await make_store({"p": 8})
    await store.set_limits("p", PoolLimits(8, None, long_alone=True))
    loan = await store.enqueue("p", Ticket(score=0, seq=1, id="loan", class_name="loan"))
    assert isinstance(loan, Lease)
    long = await store.enqueue("p", Ticket(score=2, seq=2, id="long", class_name="archive", cost=9000, long=True,
                                           bounded=False))
    assert isinstance(long, Waiter)  # a loan runs
    short = await store.enqueue("p", Ticket(score=2, seq=3, id="short", class_name="archive", bounded=False))
    assert isinstance(short, Lease)  # the long one blocks nobody behind it
    waiting = asyncio.create_task(store.wait(long, 10))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # a short request of a class without a target is no reason to wait
    await store.release(loan)
    lease = await asyncio.wait_for(waiting, 5)  # no loan runs: it goes
    second = await store.enqueue("p", Ticket(score=2, seq=7, id="long3", class_name="archive", cost=9000, long=True,
                                             bounded=False))
    assert isinstance(second, Waiter)  # one long prompt at a time: they would prefill back to back
    store.withdraw(second)
    another = await store.enqueue("p", Ticket(score=0, seq=4, id="loan2", class_name="loan"))
    assert isinstance(another, Lease)  # a loan never waits for a long one
    for held in (short, lease, another):
        await store.release(held)
    await store.set_limits("p", PoolLimits(8, None))
    assert isinstance(await store.enqueue("p", Ticket(score=0, seq=5, id="loan3", class_name="loan")), Lease)
    assert isinstance(await store.enqueue("p", Ticket(score=2, seq=6, id="long2", class_name="archive", cost=9000,
                                                      long=True, bounded=False)), Lease)  # off: it goes beside it


async def test_a_quiet_spell_counts_once_the_line_has_watched_it(make_store):
    """A line that starts keeping latency-bound arrivals (long_alone with `long_quiet_s`) has seen
    no quiet spell yet: a long ticket of a class without a target waits one out from that moment
    (each store on its own clock), though no latency-bound ticket came; limits set again while
    it watches do not start the spell over."""
    store = await make_store({"p": 8})
    quiet = PoolLimits(8, None, long_alone=True, long_quiet_s=0.3)
    await store.set_limits("p", quiet)
    long = await store.enqueue("p", Ticket(score=2, seq=1, id="long", class_name="archive", cost=9000, long=True,
                                           bounded=False))
    assert isinstance(long, Waiter)
    waiting = asyncio.create_task(store.wait(long, 10))
    await asyncio.sleep(0.4)
    await store.set_limits("p", quiet)  # watching all along: the spell has passed, and this starts no other
    await store.release(await asyncio.wait_for(waiting, 0.25))  # (a spell started over would last 0.3 s)
    assert (await store.snapshot("p")).inflight == 0


async def test_with_long_alone_a_long_ticket_waits_for_a_quiet_spell_of_latency_bound_arrivals(make_store):
    """With `long_quiet_s`, a long ticket of a pool Envoy places also waits until latency-bound
    tickets arrive no oftener than one per that long: none in the last spell, not four in four
    (each store on its own clock: Redis's TIME), blocking nobody."""
    store = await make_store({"p": 8})
    await store.set_limits("p", PoolLimits(8, None, long_alone=True, long_quiet_s=60.0))
    loan = await store.enqueue("p", Ticket(score=0, seq=1, id="loan", class_name="loan"))
    assert isinstance(loan, Lease)
    await store.release(loan)  # none runs now; one came a moment ago
    long = await store.enqueue("p", Ticket(score=2, seq=2, id="long", class_name="archive", cost=9000, long=True,
                                           bounded=False))
    assert isinstance(long, Waiter)
    short = await store.enqueue("p", Ticket(score=2, seq=3, id="short", class_name="archive", bounded=False))
    assert isinstance(short, Lease)  # it blocks nobody behind it
    waiting = asyncio.create_task(store.wait(long, 10))
    await store.set_limits("p", PoolLimits(8, None, long_alone=True, long_quiet_s=60.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the loan came less than 60 s ago
    await store.set_limits("p", PoolLimits(8, None, long_alone=True, long_quiet_s=0.2))
    await asyncio.sleep(0.3)  # the spell passes: the next change of the pool lets it go
    await store.set_limits("p", PoolLimits(8, None, long_alone=True, long_quiet_s=0.2))
    lease = await asyncio.wait_for(waiting, 5)
    for held in (short, lease):
        await store.release(held)
    # four that came together: once the spell has passed, their rate still holds a long one
    quiet = PoolLimits(8, None, long_alone=True, long_quiet_s=1.0)
    await store.set_limits("p", quiet)
    for i in range(4):
        await store.release(await store.enqueue("p", Ticket(score=0, seq=10 + i, id=f"burst{i}", class_name="loan")))
    second = await store.enqueue("p", Ticket(score=2, seq=20, id="long2", class_name="archive", cost=9000, long=True,
                                             bounded=False))
    assert isinstance(second, Waiter)
    waiting = asyncio.create_task(store.wait(second, 20))
    await asyncio.sleep(1.3)  # past the spell (1 s), within four of them
    await store.set_limits("p", quiet)
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await asyncio.sleep(3.0)  # past four spells
    await store.set_limits("p", quiet)
    await store.release(await asyncio.wait_for(waiting, 5))
    await store.set_limits("p", PoolLimits(8, None, long_alone=True, long_quiet_s=60.0))
    await store.release(await store.enqueue("p", Ticket(score=0, seq=4, id="loan2", class_name="loan")))
    long_loan = await store.enqueue("p", Ticket(score=0, seq=5, id="long-loan", class_name="loan", cost=9000,
                                                long=True))
    assert isinstance(long_loan, Lease)  # a latency-bound one waits only for none to run
    await store.release(long_loan)
    assert (await store.snapshot("p")).inflight == 0


async def test_fifo_within_a_score_and_round_robin_across_branches(make_store):
    store = await make_store({"p": 1})
    holder = await store.enqueue("p", ticket(0, 1))
    # branch A bursts three tickets, then B and C send one each
    waiters = [await store.enqueue("p", ticket(i, 1, branch=b)) for i, b in enumerate("AAABC", start=1)]
    tasks = {w.ticket.id: asyncio.create_task(store.wait(w, 10)) for w in waiters}
    order = []
    current = holder
    for _ in waiters:
        await asyncio.sleep(0.01)
        await store.release(current)
        done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
        (task,) = done
        current = task.result()
        order.append(current.ticket.id)
        del tasks[current.ticket.id]
    await store.release(current)
    assert order == ["t1", "t4", "t5", "t2", "t3"]  # A, B, C, then A's burst


async def test_wait_expires_and_leaves_the_line(make_store):
    store = await make_store({"p": 1})
    await store.enqueue("p", ticket(0, 0))
    waiter = await store.enqueue("p", ticket(1, 0))
    with pytest.raises(WaitExpired):
        await store.wait(waiter, 0.05)
    assert (await store.snapshot("p")).depth == 0


async def test_a_cancelled_waiter_admitted_at_the_same_instant_gives_the_slot_back(make_store):
    store = await make_store({"p": 1})
    first = await store.enqueue("p", ticket(0, 0))
    waiter = await store.enqueue("p", ticket(1, 0))
    task = asyncio.create_task(store.wait(waiter, 10))
    await asyncio.sleep(0.01)
    await store.release(first)  # hands the slot to the waiter...
    task.cancel()  # ...which is cancelled before it can use it
    try:
        lease = await task
    except asyncio.CancelledError:
        lease = None
    if lease is not None:  # the admission won the race: the caller owns the slot
        await store.release(lease)
    snapshot = await store.snapshot("p")
    assert snapshot.inflight == 0 and snapshot.depth == 0


async def test_a_waiter_withdrawn_before_it_waits_leaves_the_line_or_gives_its_slot_back(make_store):
    store = await make_store({"p": 1})
    first = await store.enqueue("p", ticket(0, 0))
    in_line = await store.enqueue("p", ticket(1, 0))
    store.withdraw(in_line)  # never waited: its stream closed first
    await wait_for_snapshot(store, lambda s: s.depth == 0)
    admitted_meanwhile = await store.enqueue("p", ticket(2, 0))
    await store.release(first)  # the slot goes to the ticket in line, whose exchange is gone
    await wait_for_snapshot(store, lambda s: s.inflight == 1 and s.depth == 0)
    store.withdraw(admitted_meanwhile)
    await wait_for_snapshot(store, lambda s: s.inflight == 0 and s.depth == 0 and s.inflight_tokens == 0)


async def wait_for_snapshot(store, condition, timeout: float = 2.0) -> None:
    """A shared store hands withdrawals over at once and settles them a round trip later."""
    deadline = time.monotonic() + timeout
    while not condition(snapshot := await store.snapshot("p")):
        assert time.monotonic() < deadline, snapshot
        await asyncio.sleep(0.01)


async def test_token_budget_and_long_share(make_store):
    store = await make_store({"p": 10}, long_share={"p": 0.5})
    await store.set_limits("p", PoolLimits(10, 20000))
    first_long = await store.enqueue("p", ticket(0, 1, cost=9000, long=True))
    assert isinstance(first_long, Lease)
    second_long = await store.enqueue("p", ticket(1, 1, cost=9000, long=True))
    assert isinstance(second_long, Waiter)  # the long share (10000) is full...
    short = await store.enqueue("p", ticket(2, 1, cost=500))
    assert isinstance(short, Lease)  # ...which does not block a short one behind it
    assert (await store.snapshot("p")).inflight_tokens == 9500
    waiting = asyncio.create_task(store.wait(second_long, 10))
    await asyncio.sleep(0.01)
    await store.release(first_long)
    second = await waiting
    await store.release(second)
    await store.release(short)
    assert (await store.snapshot("p")).inflight_tokens == 0


async def test_a_long_ticket_bigger_than_the_long_share_goes_while_no_other_long_one_runs(make_store):
    """The share bounds long tickets beside each other, not one alone: a prompt bigger than the
    share is not held until the pool is empty, nor passed by the smaller long ones behind it."""
    store = await make_store({"p": 10}, long_share={"p": 0.5})
    await store.set_limits("p", PoolLimits(10, 20000))
    short = await store.enqueue("p", ticket(0, 1, cost=500))
    big = await store.enqueue("p", ticket(1, 1, cost=12000, long=True))
    assert isinstance(big, Lease)  # 12000 > a half of 20000, but no long one runs, and it fits
    smaller = await store.enqueue("p", ticket(2, 2, cost=6000, long=True))
    assert isinstance(smaller, Waiter)  # beside it, the share holds: 12000 + 6000 > 10000
    waiting = asyncio.create_task(store.wait(smaller, 10))
    await store.release(big)
    smaller = await waiting
    for lease in (smaller, short):
        await store.release(lease)
    assert (await store.snapshot("p")).inflight_tokens == 0


async def test_a_long_ticket_alone_takes_at_most_one_engines_part_of_the_budget(make_store):
    """Two engines, placed by Envoy (by count: every long one could land on one engine): a long
    ticket bigger than one engine's part waits for an empty pool, as any ticket over the share."""
    store = await make_store({"p": 10}, long_share={"p": 0.5})
    await store.set_limits("p", PoolLimits(10, 20000, engines=2))
    short = await store.enqueue("p", ticket(0, 1, cost=500))
    big = await store.enqueue("p", ticket(1, 1, cost=12000, long=True))
    assert isinstance(big, Waiter)  # 12000 > 10000, an engine's part
    waiting = asyncio.create_task(store.wait(big, 10))
    await store.release(short)
    await store.release(await waiting)  # alone in the pool: it goes


async def test_long_tickets_waiting_for_the_long_share_start_in_line_order(make_store):
    """A long ticket held by the share is passed by short ones, not by a smaller long one that
    would fit beside the long one running: else a stream of small long prompts starves it."""
    store = await make_store({"p": 10}, long_share={"p": 0.5})
    await store.set_limits("p", PoolLimits(10, 20000))
    running = await store.enqueue("p", ticket(0, 1, cost=6000, long=True))
    big = await store.enqueue("p", ticket(1, 1, cost=8000, long=True))
    small = await store.enqueue("p", ticket(2, 1, cost=3000, long=True))
    assert isinstance(big, Waiter) and isinstance(small, Waiter)  # 6000 + 3000 fits the share, but big is first
    short = await store.enqueue("p", ticket(3, 1, cost=500))
    assert isinstance(short, Lease)  # the long ones waiting do not hold up a short one
    big_wait = asyncio.create_task(store.wait(big, 10))
    small_wait = asyncio.create_task(store.wait(small, 10))
    await store.release(running)
    big = await big_wait
    assert (await store.snapshot("p")).inflight_tokens == 8500  # not the small one: 8000 + 3000 > 10000
    assert not small_wait.done()
    await store.release(big)
    for lease in (await small_wait, short):
        await store.release(lease)
    assert (await store.snapshot("p")).inflight_tokens == 0


async def test_the_long_share_follows_the_limits_when_they_carry_one(make_store):
    """Built with a fourth (four engines listed); two answer now: the limits say a half."""
    store = await make_store({"p": 10}, long_share={"p": 0.25})
    await store.set_limits("p", PoolLimits(10, 20000))
    first = await store.enqueue("p", ticket(0, 1, cost=4000, long=True))
    assert isinstance(first, Lease)
    second = await store.enqueue("p", ticket(1, 1, cost=4000, long=True))
    assert isinstance(second, Waiter)  # 8000 > a fourth of 20000
    waiting = asyncio.create_task(store.wait(second, 10))
    await store.set_limits("p", PoolLimits(10, 20000, long_share=0.5))
    second = await waiting  # 8000 <= a half
    await store.release(first)
    await store.release(second)


async def test_with_the_sidecar_placing_requests_a_ticket_fits_only_where_the_average_backend_has_room(make_store):
    # two backends of 10000 tokens each, placed least loaded first: 9000 + 2 x 6000 > 20000, so the
    # 6000 waits (on one backend beside 4500 of 9000 it would fit, on the other it would not: the
    # rule does not know the split, only that the least loaded has at most the average)
    store = await make_store({"p": 10})
    await store.set_limits("p", PoolLimits(10, 20000, spread=2))
    first = await store.enqueue("p", ticket(0, 1, cost=9000))
    assert isinstance(first, Lease)  # a lone ticket always goes
    big = await store.enqueue("p", ticket(1, 1, cost=6000))
    assert isinstance(big, Waiter)
    waiting = asyncio.create_task(store.wait(big, 10))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await store.set_limits("p", PoolLimits(10, 20000, spread=1))  # Envoy places: the sum alone counts
    lease = await asyncio.wait_for(waiting, 5)
    await store.release(first)
    await store.release(lease)
    await store.set_limits("p", PoolLimits(10, 20000, spread=2))
    small = [await store.enqueue("p", ticket(10 + i, 1, cost=4500)) for i in range(4)]
    assert [isinstance(s, Lease) for s in small] == [True, True, True, False]  # 9000 + 2 x 4500 <= 20000 < 13500 + 9000
    for held in small[:3]:
        await store.release(held)
    assert (await store.snapshot("p")).inflight_tokens == 4500  # the fourth got in on the first release
    await store.release(await store.wait(small[3], 5))
    assert (await store.snapshot("p")).inflight_tokens == 0


async def test_closing_answers_every_waiter(make_store):
    store = await make_store({"p": 1})
    await store.enqueue("p", ticket(0, 0))
    waiters = [await store.enqueue("p", ticket(i, 0)) for i in (1, 2)]
    tasks = [asyncio.create_task(store.wait(w, 10)) for w in waiters]
    await asyncio.sleep(0.01)
    await store.close()
    for task in tasks:
        with pytest.raises(StoreClosed):
            await task
    assert (await store.snapshot("p")).depth == 0
    with pytest.raises(StoreClosed):
        await store.enqueue("p", ticket(3, 0))


async def test_depth_by_class(make_store):
    store = await make_store({"p": 1})
    await store.enqueue("p", ticket(0, 0, cls="a"))
    for i, cls in enumerate(["a", "b", "b"], start=1):
        await store.enqueue("p", ticket(i, 0, cls=cls))
    snapshot = await store.snapshot("p")
    assert snapshot.depth == 3 and snapshot.depth_by_class == {"a": 1, "b": 2}


async def test_waiting_by_class_and_branch(make_store):
    store = await make_store({"p": 1})
    lease = await store.enqueue("p", ticket(0, 0, cls="a", branch="0001"))  # admitted: not waiting
    for i, (cls, branch) in enumerate([("a", "0001"), ("a", "0002"), ("b", "0002"), ("b", "0002")], start=1):
        await store.enqueue("p", ticket(i, i, cls=cls, branch=branch))
    assert await store.waiting_by_branch("p") == {"a": {"0001": 1, "0002": 1}, "b": {"0002": 2}}
    await store.release(lease)  # t1, the best score, is admitted in its place
    assert await store.waiting_by_branch("p") == {"a": {"0002": 1}, "b": {"0002": 2}}


async def test_cluster_store_spreads_pools_over_slots_and_renews(redis_cluster):
    """Each pool's keys share one hash tag (one slot); pools land on different masters."""
    pools = {f"pool{i}": 1 for i in range(6)}
    store = RedisQueueStore(RedisAddress(redis_cluster.url, cluster=True), pools, lease_s=5)
    await store.start()
    try:
        leases = [await store.enqueue(pool, ticket(i, 0)) for i, pool in enumerate(pools)]
        assert all(isinstance(lease, Lease) for lease in leases)
        await store.renew_all()  # one call per pool, each routed to its slot's master
        owners = {node.port for node in redis_cluster.nodes
                  if any(node.client().keys(f"{{extproc:{pool}}}:li") for pool in pools)}
        assert len(owners) >= 2
        for lease in leases:
            await store.release(lease)
        assert [(await store.snapshot(pool)).inflight for pool in pools] == [0] * len(pools)
        assert {pool: s.inflight for pool, s in (await store.snapshots()).items()} == dict.fromkeys(pools, 0)
    finally:
        await store.stop()


async def test_aging_serves_a_long_waiting_ticket_before_newer_better_ones(make_store):
    store = await make_store({"p": 1}, promote_after_s=0.2)
    holder = await store.enqueue("p", ticket(0, 0))
    old = await store.enqueue("p", ticket(1, 2.0, cls="archive"))
    old_wait = asyncio.create_task(store.wait(old, 10))
    await asyncio.sleep(0.3)  # the archive ticket is now past promote_after_s
    new = await store.enqueue("p", ticket(2, 0.0, cls="loan"))
    new_wait = asyncio.create_task(store.wait(new, 10))
    await asyncio.sleep(0.01)
    await store.release(holder)
    first = await asyncio.wait_for(old_wait, 5)
    assert not new_wait.done()
    await store.release(first)
    await store.release(await asyncio.wait_for(new_wait, 5))


async def test_depth_is_read_without_a_call_and_follows_own_operations(make_store):
    store = await make_store({"p": 1})
    assert store.depth("p") == 0
    held = await store.enqueue("p", ticket(0, 0))
    waiters = [await store.enqueue("p", ticket(i, 1)) for i in (1, 2, 3)]
    assert store.depth("p") == 3 == (await store.snapshot("p")).depth
    await store.release(held)
    await store.release(await store.wait(waiters[0], 5))
    await store.snapshot("p")
    assert store.depth("p") == 1
    for waiter in waiters[1:]:
        await store.release(await store.wait(waiter, 5))


async def test_the_state_an_enqueue_reports_is_the_pools_state(redis_server):
    """An enqueue answers with the pool's state, which the replica's pool watch takes as it is
    (tiers, gauges, the drain rate). One admitted at once into an empty line reports it from the
    counts the script just wrote, without reading them again: the same as a snapshot reads."""
    redis_server.client().flushall()
    reported = []
    store = RedisQueueStore(redis_server.url, {"p": 4}, lease_s=5, on_change=lambda pool, s: reported.append(s))
    await store.start()
    try:
        leases = [await store.enqueue("p", ticket(i, 1, cost=10 + i, long=i == 1)) for i in range(2)]
        assert reported[-1] == await store.snapshot("p")
        await store.release(leases[0])
        await store.enqueue("p", ticket(2, 1, cost=5))  # after a release: its count of slots given back
        assert reported[-1] == await store.snapshot("p")
        for i in range(3, 7):  # a line forms: the pool's state read from Redis again
            await store.enqueue("p", ticket(i, 1, cost=1))
        snapshot = await store.snapshot("p")
        assert reported[-1] == snapshot and snapshot.depth == 2 and snapshot.depth_by_class == {"c": 2}
    finally:
        await store.stop()


@contextlib.asynccontextmanager
async def replicas(server, max_inflight: int, *names: str, lease_s: float = 10):
    """Started Redis stores of pool "p", one per replica name, over an emptied server."""
    server.client().flushall()
    stores = [RedisQueueStore(server.url, {"p": max_inflight}, lease_s=lease_s, replica_id=name) for name in names]
    for store in stores:
        await store.start()
    try:
        yield stores
    finally:
        for store in stores:
            await store.stop()


async def test_a_replica_sees_the_others_queue_at_its_next_enqueue(redis_server):
    async with replicas(redis_server, 1, "a", "b") as (a, b):
        held = await a.enqueue("p", ticket(0, 0))
        waiting = [await a.enqueue("p", ticket(i, 1)) for i in (1, 2)]
        last = await b.enqueue("p", ticket(3, 1))
        assert all(isinstance(w, Waiter) for w in [*waiting, last])
        assert b.depth("p") == 3  # the enqueue script returns the shared depth with its answer
        await a.release(held)


async def test_only_the_owner_releases_or_renews_and_never_after_expiry(redis_server):
    async with replicas(redis_server, 2, "owner", "other", lease_s=0.5) as (owner, other):
        lease = await owner.enqueue("p", ticket(0, 0))
        foreign = Lease("p", lease.ticket)
        await other.release(foreign)  # not the owner: nothing changes
        assert (await owner.snapshot("p")).inflight == 1
        owner._leases["p"].pop(lease.ticket.id)  # stop renewing it, as a stopped process would
        await asyncio.sleep(0.7)  # past the lease: the next script reaps it
        await other.enqueue("p", ticket(1, 0))  # runs a dispatch, which reaps
        assert (await owner.snapshot("p")).inflight == 1  # only the new one
        await owner.release(lease)  # a late release after expiry changes nothing
        assert (await owner.snapshot("p")).inflight == 1
        lost, restored, *_ = await owner._run("renew", "p", "owner", 500, lease.ticket.id, 0, 0)
        assert lost == [lease.ticket.id] and restored == []  # nor can it be renewed


async def test_a_lease_redis_lost_is_counted_again_at_the_next_renewal(redis_server):
    client = redis_server.client()
    async with replicas(redis_server, 2, "owner") as (store,):
        kept = await store.enqueue("p", ticket(0, 0, cost=300))
        lost = await store.enqueue("p", ticket(1, 0, cost=700, long=True))
        # The write that admitted `lost` never reached the replica that was then promoted:
        client.hdel(f"{PREFIX}:li", "t1")
        client.zrem(f"{PREFIX}:lease", "t1")
        client.hset(f"{PREFIX}:st", mapping={"inflight": 1, "cost": 300, "lcost": 0})
        extra = await store.enqueue("p", ticket(2, 0))
        assert isinstance(extra, Lease)  # over-admitted: 3 running, Redis counts 2
        await store.renew_all()
        snapshot = await store.snapshot("p")
        assert (snapshot.inflight, snapshot.inflight_tokens) == (3, 1000)  # counts reconcile
        assert int(client.hget(f"{PREFIX}:st", "lcost")) == 700
        waiter = await store.enqueue("p", ticket(3, 0))
        assert isinstance(waiter, Waiter)  # and the limit holds again
        for lease in (kept, lost):
            await store.release(lease)
        last = await store.wait(waiter, 5)
        assert (await store.snapshot("p")).inflight == 2
        for lease in (extra, last):
            await store.release(lease)
    assert (client.hget(f"{PREFIX}:st", "inflight"), client.hlen(f"{PREFIX}:li")) == ("0", 0)


async def test_a_renewal_that_crosses_a_release_does_not_count_the_lease_again(redis_server):
    async with replicas(redis_server, 2, "owner") as (store,):
        lease = await store.enqueue("p", ticket(0, 0, cost=100))
        renewal = store._renewal("p")  # built while the lease is held...
        await store.release(lease)  # ...and the release reaches Redis first
        result = await store._run("renew", "p", *renewal)
        assert result[1] == ["t0"] and (await store.snapshot("p")).inflight == 1  # counted again
        await store._settle_renewal("p", result)
        assert (await store.snapshot("p")).inflight == 0  # and released again


async def test_a_replica_with_a_skewed_clock_neither_steals_nor_loses_slots(redis_server):
    """I3: expiry is decided by Redis's TIME; one replica's wall clock an hour behind or ahead
    changes nothing."""
    client = redis_server.client()
    def skew(seconds: float):
        real_time, real_ns = time.time, time.time_ns
        return mock.patch.multiple(time, time=lambda: real_time() + seconds,
                                   time_ns=lambda: real_ns() + int(seconds * 1e9))

    def redis_now_ms() -> int:
        seconds, micros = client.time()
        return seconds * 1000 + micros // 1000


    async with replicas(redis_server, 1, "honest", "skewed", lease_s=2) as (honest, skewed):
        held = await honest.enqueue("p", ticket(0, 0))
        with skew(-3600):  # behind: a replica reading its own clock would expire nothing...
            waiter = await skewed.enqueue("p", ticket(1, 0))
            await skewed.renew_all()
        with skew(+3600):  # ahead: ...or everything, stealing the honest replica's slot
            assert isinstance(waiter, Waiter) and isinstance(await skewed.enqueue("p", ticket(2, 1)), Waiter)
            await skewed.renew_all()
        assert client.hkeys(f"{PREFIX}:li") == ["t0"]
        await honest.release(held)
        with skew(+3600):
            lease = await skewed.wait(waiter, 5)
            await skewed.renew_all()
        expiry = float(client.zscore(f"{PREFIX}:lease", "t1"))
        assert redis_now_ms() < expiry <= redis_now_ms() + 2000  # one lease by Redis's clock
        await skewed.release(lease)


async def test_the_appointment_book_keeps_the_classes_order_spacing_and_deadlines(make_store):
    store = await make_store({"p": 1})
    archive = AppointmentRequest("archive", ("loan", "complaint"), (), earliest_s=10.0, spacing_s=1.0, latest_s=None,
                                 horizon_s=60.0)
    complaint = AppointmentRequest("complaint", ("loan",), (("archive", 60.0),), earliest_s=2.0, spacing_s=1.0,
                                   latest_s=30.0, horizon_s=30.0)
    first = await store.book_appointment("p", archive)
    second = await store.book_appointment("p", archive)
    assert first == pytest.approx(10.0, abs=0.05) and second == pytest.approx(11.0, abs=0.05)
    # a complaint is served before archive queries: it is booked before the ones booked earlier
    assert await store.book_appointment("p", complaint) == pytest.approx(2.0, abs=0.05)
    # and the next archive query comes one slot later than it would have
    assert await store.book_appointment("p", archive) == pytest.approx(13.0, abs=0.05)
    # none within the deadline: no appointment
    assert await store.book_appointment("p", AppointmentRequest("archive", (), (), 0.0, 1.0, 5.0, 60.0)) is None


async def test_the_appointment_book_reaches_no_further_than_each_classes_horizon(make_store):
    """core/appointments.book's horizon, kept alike by every store: a burst of refusals of a
    protected class (no latest time) is held to its horizon, and so are the classes after it."""
    store = await make_store({"p": 1})
    loan = AppointmentRequest("loan", (), (("complaint", 30.0),), earliest_s=0.5, spacing_s=0.5, latest_s=None,
                              horizon_s=2.0)
    complaint = AppointmentRequest("complaint", ("loan",), (), earliest_s=1.0, spacing_s=0.5, latest_s=20.0,
                                   horizon_s=30.0)
    assert await store.book_appointment("p", complaint) == pytest.approx(1.0, abs=0.05)
    delays = [await store.book_appointment("p", loan) for _ in range(20)]
    # the loans' book holds what drains within their 2 s; the rest are told 2 s and take no slot
    assert delays[:3] == pytest.approx([0.5, 1.0, 1.5], abs=0.05) and max(delays) <= 2.0
    # so the complaint booked before them moved back by those three slots only, not by twenty
    assert await store.book_appointment("p", complaint) == pytest.approx(3.0, abs=0.1)


async def test_a_request_turned_away_again_before_its_appointment_keeps_it(make_store):
    store = await make_store({"p": 1})

    def complaint(name: str, again: bool = False) -> AppointmentRequest:
        return AppointmentRequest("complaint", (), (), earliest_s=5.0, spacing_s=1.0, latest_s=30.0, horizon_s=30.0,
                                  name=name, again=again)

    assert await store.book_appointment("p", complaint("k")) == pytest.approx(5.0, abs=0.05)
    for _ in range(3):  # it comes back early, and is turned away again: the same time, no new slot
        assert await store.book_appointment("p", complaint("k", again=True)) == pytest.approx(5.0, abs=0.05)
    assert await store.book_appointment("p", complaint("other")) == pytest.approx(6.0, abs=0.05)
    # a first attempt of the same name is a request of its own: a slot of its own
    assert await store.book_appointment("p", complaint("k")) == pytest.approx(7.0, abs=0.05)
    assert await store.book_appointment("p", complaint("k", again=True)) == pytest.approx(7.0, abs=0.05)


async def test_a_ticket_that_comes_back_is_admitted_before_the_newer_ones_of_its_class(make_store):
    store = await make_store({"p": 1})
    holder = await store.enqueue("p", ticket(0, 2))
    newer = await store.enqueue("p", Ticket(score=2, seq=1, id="newer", class_name="c", branch_id="b1"))
    back = await store.enqueue("p", Ticket(score=2, seq=2, id="back", class_name="c", branch_id="b2", waited_s=30.0))
    waits = {w.ticket.id: asyncio.create_task(store.wait(w, 10)) for w in (newer, back)}
    await asyncio.sleep(0.01)
    await store.release(holder)
    done, _ = await asyncio.wait(waits.values(), return_when=asyncio.FIRST_COMPLETED)
    assert [task is waits["back"] for task in done] == [True]
    await store.release(waits["back"].result())
    await store.release(await waits["newer"])
    assert (await store.snapshot("p")).inflight == 0


async def test_placements_count_each_lease_where_it_runs_until_it_ends(make_store):
    store = await make_store({"p": 4})
    a = await store.enqueue("p", ticket(0, 0, cost=300))
    b = await store.enqueue("p", ticket(1, 0, cost=500))
    store.place(a, "10.0.0.1:8000")
    store.place(b, "10.0.0.1:8000")
    await wait_for_placements(store, {"10.0.0.1:8000": 800})
    store.place(b, "10.0.0.2:8000")  # Envoy sent it elsewhere: it moves
    await wait_for_placements(store, {"10.0.0.1:8000": 300, "10.0.0.2:8000": 500})
    await store.release(a)
    await wait_for_placements(store, {"10.0.0.2:8000": 500})
    store.place(a, "10.0.0.3:8000")  # released already: never placed again
    await store.release(b)
    await wait_for_placements(store, {})


async def wait_for_placements(store, expected: dict[str, int], timeout: float = 2.0) -> None:
    """Placing is handed over without suspending; a shared store applies it a moment later."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (placed := await store.placements("p")) != expected:
        assert asyncio.get_running_loop().time() < deadline, placed
        await asyncio.sleep(0.01)


async def test_every_replica_sees_what_the_others_placed_and_a_reaped_lease_leaves_its_backend(redis_server):
    async with replicas(redis_server, 4, "a", "b", lease_s=0.5) as (a, b):
        lease = await a.enqueue("p", ticket(0, 0, cost=700))
        a.place(lease, "10.0.0.1:8000")
        await wait_for_placements(b, {"10.0.0.1:8000": 700})  # b's picker counts it as placed by others
        b.place(Lease("p", lease.ticket), "10.0.0.2:8000")  # not b's lease: b cannot move it
        await asyncio.sleep(0.05)
        assert await b.placements("p") == {"10.0.0.1:8000": 700}
        a._leases["p"].pop(lease.ticket.id)  # a stops renewing it, as a killed replica would
        await asyncio.sleep(0.7)
        await b.enqueue("p", ticket(1, 0))  # a dispatch reaps the expired lease
        assert await b.placements("p") == {}


async def test_an_enqueue_delivered_twice_holds_one_slot(redis_server):
    """A script call can reach Redis twice (a batch sent again, a connection lost after the
    write): the second enqueue of an admitted or waiting ticket changes no count."""
    client = redis_server.client()
    async with replicas(redis_server, 1, "owner") as (store,):
        held = await store.enqueue("p", ticket(0, 0, cost=100))
        admitted, _ = await store._run("enqueue", "p", *store._enqueue_args(held.ticket))
        assert admitted == ["t0"]  # answered as admitted, as the first time
        waiter = await store.enqueue("p", ticket(1, 0))
        await store._run("enqueue", "p", *store._enqueue_args(waiter.ticket))
        snapshot = await store.snapshot("p")
        assert (snapshot.inflight, snapshot.inflight_tokens, snapshot.depth) == (1, 100, 1)
        await store.release(held)
        await store.release(await store.wait(waiter, 5))
        assert (await store.snapshot("p")).inflight == 0
        assert client.zcard(f"{PREFIX}:wait") == 0 and client.hlen(f"{PREFIX}:li") == 0


async def test_a_waiting_ticket_counted_again_by_its_owner_is_counted_once(redis_server):
    """Redis stopped answering while a ticket waited there: its owner admitted it in the
    degraded mode, and on recovery the renewal counts that lease in Redis, where the ticket still
    waits. It leaves the line then: the line never admits it, and counts it, a second time."""
    client = redis_server.client()
    async with replicas(redis_server, 1, "owner") as (store,):
        held = await store.enqueue("p", ticket(0, 0))
        waiter = await store.enqueue("p", ticket(1, 0))
        store._futures.pop(waiter.ticket.id)  # its waiter was failed over to the degraded mode
        elsewhere = Lease("p", waiter.ticket)  # and admitted there; Redis answers again:
        store.adopt(elsewhere)
        await store.renew_all()
        snapshot = await store.snapshot("p")
        assert (snapshot.inflight, snapshot.depth) == (2, 0)  # counted in Redis as it runs, out of line
        assert not client.exists(f"{PREFIX}:tk:t1")
        later = await store.enqueue("p", ticket(2, 0))
        await store.release(held)
        await store.release(elsewhere)
        await store.release(await store.wait(later, 5))
        assert (await store.snapshot("p")).inflight == 0
        assert client.hlen(f"{PREFIX}:li") == 0 and client.zcard(f"{PREFIX}:lease") == 0


async def test_after_redis_forgot_its_scripts_only_the_refused_calls_are_sent_again(redis_server):
    """A batch in which Redis ran some calls and refused others (a script it no longer knew)
    sends again only those it refused: a call that ran is not run twice."""
    redis_server.client().flushall()
    store = RedisQueueStore(redis_server.url, {"p": 1}, lease_s=5)  # not started: no background call
    try:
        redis_server.client().script_flush()
        redis_server.client().script_load(store._calls._scripts["book"].script)  # Redis knows this one only
        request = AppointmentRequest("c", (), (), earliest_s=0.0, spacing_s=60.0, latest_s=None, horizon_s=120.0)
        first, _ = await asyncio.gather(store.book_appointment("p", request), store.snapshot("p"))
        second = await store.book_appointment("p", request)
        assert first < 1 and 59 < second - first < 61  # one booking ahead of it, not two
    finally:
        await store.close()


async def test_a_batch_cut_short_by_its_timeout_leaves_no_reply_for_the_next_one(redis_server):
    """The store writes a batch on one pooled connection and reads its replies itself
    (stores/redis_batch.py). A batch cut short by its bound (Redis stalled) must not hand its
    connection back with a reply still to come: the next call would read the old call's reply."""
    client = RedisAddress(redis_server.url).connect(0.3)
    echo = client.register_script("return ARGV[1]")
    await echo(keys=["k"], args=["loaded"])
    calls = ScriptBatch(client, {"echo": echo}, cluster=False, op_timeout_s=0.3)
    try:
        redis_server.client().execute_command("CLIENT", "PAUSE", "800", "ALL")
        with pytest.raises(TimeoutError):
            await calls.submit("echo", "k", ("first",))
        await asyncio.sleep(1.0)  # the pause is over: Redis has answered "first" to that connection
        assert await calls.submit("echo", "k", ("second",)) == "second"
        assert await asyncio.gather(*(calls.submit("echo", "k", (str(i),)) for i in range(5))) == [str(i) for i in range(5)]
    finally:
        await client.aclose()


async def test_a_call_with_an_argument_redis_cannot_take_fails_with_redis_pys_error(redis_server):
    """The batch is packed by hiredis: an argument it cannot pack fails the batch with the
    error redis-py gives (DataError), and the next batch goes through."""
    from redis.exceptions import DataError

    client = RedisAddress(redis_server.url).connect(0.5)
    echo = client.register_script("return ARGV[1]")
    await echo(keys=["k"], args=["loaded"])
    calls = ScriptBatch(client, {"echo": echo}, cluster=False, op_timeout_s=0.5)
    try:
        with pytest.raises(DataError):
            await calls.submit("echo", "k", (None,))
        assert await calls.submit("echo", "k", ("next",)) == "next"
    finally:
        await client.aclose()


def _bounds(*, linger_s: float, urgent_s: float, company_s: float):
    """ScriptBatch's waits for company (LINGER_S, URGENT_LINGER_S, COMPANY_S) set for a test."""
    return mock.patch.multiple("extproc.stores.redis_batch", LINGER_S=linger_s, URGENT_LINGER_S=urgent_s,
                               COMPANY_S=company_s)


async def _echo_batch(redis_server) -> tuple[object, ScriptBatch]:
    client = RedisAddress(redis_server.url).connect(2.0)
    echo = client.register_script("return ARGV[1]")
    await echo(keys=["k"], args=["loaded"])
    return client, ScriptBatch(client, {"echo": echo}, cluster=False, op_timeout_s=2.0)


async def test_calls_handed_over_within_the_urgent_bound_go_in_one_write(redis_server):
    """Under load, an urgent call waits up to URGENT_LINGER_S for company: calls handed over
    in later turns of the loop, urgent or not, go in the same write (fewer writes: less CPU per
    request on both sides of the socket). The bounds are widened here so the test does not
    race them."""
    client, calls = await _echo_batch(redis_server)
    try:
        with _bounds(linger_s=30.0, urgent_s=0.2, company_s=30.0):
            first = calls.submit("echo", "k", ("first",))
            await calls.submit("echo", "k", ("warm",))  # (the connection opens on the first write)
            with mock.patch.object(calls._pipe, "send", wraps=calls._pipe.send) as send:
                answers = [calls.submit("echo", "k", ("a",))]
                for _ in range(3):
                    await asyncio.sleep(0)  # another turn of the loop
                answers.append(calls.submit("echo", "k", ("b",), urgent=False))
                answers.append(calls.submit("echo", "k", ("c",)))
                assert await asyncio.gather(*answers) == ["a", "b", "c"]
            assert send.call_count == 1 and len(send.call_args.args[0]) == 3
            assert await first == "first"
    finally:
        await client.aclose()


async def test_an_urgent_call_brings_a_lingering_write_forward_and_none_puts_it_off(redis_server):
    """A call that is not urgent may wait LINGER_S; an urgent one handed over meanwhile takes
    it along at its own, earlier bound. Urgent calls that keep coming never put a write off:
    the first one's bound stands."""
    client, calls = await _echo_batch(redis_server)
    try:
        await calls.submit("echo", "k", ("warm",))
        with _bounds(linger_s=30.0, urgent_s=0.05, company_s=30.0):
            lingering = calls.submit("echo", "k", ("later",), urgent=False)
            urgent = calls.submit("echo", "k", ("now",))
            assert await asyncio.wait_for(asyncio.gather(lingering, urgent), 10) == ["later", "now"]

            first = calls.submit("echo", "k", ("first",))
            for i in range(300):  # an urgent call every 10 ms: were each to put the write off, it never would go
                calls.submit("echo", "k", (str(i),))
                await asyncio.sleep(0.01)
                if first.done():
                    break
            assert first.done() and first.result() == "first"
    finally:
        await client.aclose()


async def test_a_call_that_comes_alone_does_not_wait_for_company(redis_server):
    """Nothing was handed over for a while: a call, urgent or not, goes in the next turn of the
    loop, whatever its bound (a quiet replica adds no wait to a decision). Were it to linger,
    these would wait 30 s."""
    client, calls = await _echo_batch(redis_server)
    try:
        await calls.submit("echo", "k", ("warm",))
        with _bounds(linger_s=30.0, urgent_s=30.0, company_s=0.05):
            for urgent in (True, False):
                await asyncio.sleep(0.1)  # longer than COMPANY_S: this call comes alone
                assert await asyncio.wait_for(calls.submit("echo", "k", ("alone",), urgent=urgent), 10) == "alone"
    finally:
        await client.aclose()
