"""A stateful property test of both stores against a plain reference model: class order, FIFO
within a class, round-robin across branches, exact slot counts, nothing orphaned."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from extproc.core.admission import Ticket
from extproc.stores.local_queue import LocalQueueStore
from extproc.stores.queue import Lease, WaitExpired
from extproc.stores.redis_queue import RedisQueueStore
from extproc_testbed.redis_server import RedisServer

CAPACITY = 2


class Reference:
    """What the line must do, written as plainly as possible."""

    def __init__(self):
        self.waiting: dict[str, tuple[float, int, int]] = {}  # id -> (score, round, seq)
        self.admitted: set[str] = set()
        self.next_round: dict[tuple[str, str], int] = {}
        self.serving: dict[str, int] = {}
        self.seq = 0

    def arrive(self, ticket_id: str, score: float, cls: str, branch: str) -> bool:
        round_ = max(self.next_round.get((cls, branch), 0), self.serving.get(cls, 0))
        self.next_round[(cls, branch)] = round_ + 1
        self.seq += 1
        self.waiting[ticket_id] = (score, round_, self.seq, cls)
        return ticket_id in self.fill()

    def fill(self) -> list[str]:
        admitted = []
        while len(self.admitted) < CAPACITY and self.waiting:
            ticket_id = min(self.waiting, key=lambda t: self.waiting[t][:3])
            _, round_, _, cls = self.waiting.pop(ticket_id)
            self.serving[cls] = max(self.serving.get(cls, 0), round_)
            self.admitted.add(ticket_id)
            admitted.append(ticket_id)
        return admitted


class StoreMachine(RuleBasedStateMachine):
    kind = "local"
    redis_url = ""

    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.model = Reference()
        self.leases: dict[str, Lease] = {}
        self.waiters = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.n = 0
        if self.kind == "local":
            self.store = LocalQueueStore({"p": CAPACITY})
        else:
            import redis

            redis.Redis.from_url(self.redis_url).flushall()
            self.store = RedisQueueStore(self.redis_url, {"p": CAPACITY}, lease_s=30)
            self.run(self.store.start())

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def teardown(self):
        for task in self.tasks.values():
            task.cancel()
        if self.tasks:
            self.run(asyncio.gather(*self.tasks.values(), return_exceptions=True))
        if isinstance(self.store, RedisQueueStore):
            self.run(asyncio.wait_for(self.store.stop(), 10))
        self.loop.close()

    def _collect(self, expected: list[str]) -> None:
        """The waiters the model admitted must be handed their slot; nobody else."""
        for ticket_id in expected:
            self.leases[ticket_id] = self.run(asyncio.wait_for(self.tasks.pop(ticket_id), 5))
            del self.waiters[ticket_id]
        self.run(asyncio.sleep(0.01))
        assert not any(task.done() for task in self.tasks.values())

    @rule(score=st.sampled_from([0.0, 1.0, 2.0]), branch=st.sampled_from("ABC"))
    def arrive(self, score, branch):
        self.n += 1
        ticket_id, cls = f"t{self.n}", f"c{int(score)}"
        result = self.run(self.store.enqueue("p", Ticket(score, self.n, ticket_id, cls, branch)))
        now = self.model.arrive(ticket_id, score, cls, branch)
        assert isinstance(result, Lease) == now
        if now:
            self.leases[ticket_id] = result
        else:
            self.waiters[ticket_id] = result
            self.tasks[ticket_id] = self.loop.create_task(self.store.wait(result, 60))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        ticket_id = data.draw(st.sampled_from(sorted(self.leases)))
        lease = self.leases.pop(ticket_id)
        self.run(self.store.release(lease))
        self.run(self.store.release(lease))  # a second release changes nothing
        self.model.admitted.discard(ticket_id)
        self._collect(self.model.fill())

    @precondition(lambda self: self.waiters)
    @rule(data=st.data(), how=st.sampled_from(["cancel", "expire"]))
    def leave(self, data, how):
        ticket_id = data.draw(st.sampled_from(sorted(self.waiters)))
        task = self.tasks.pop(ticket_id)
        waiter = self.waiters.pop(ticket_id)
        if how == "cancel":  # the client went away
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                self.run(task)
        else:  # its class's wait ran out
            task.cancel()
            self.run(asyncio.gather(task, return_exceptions=True))
            with pytest.raises(WaitExpired):
                self.run(self.store.wait(waiter, 0))
        del self.model.waiting[ticket_id]

    @invariant()
    def counts_match(self):
        snapshot = self.run(self.store.snapshot("p"))
        assert snapshot.inflight == len(self.model.admitted) == len(self.leases) <= CAPACITY
        assert snapshot.depth == len(self.model.waiting) == len(self.waiters)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-model")).start()
    yield server.url
    server.kill()


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_store_matches_the_reference_model(kind, redis_url):
    machine = type(f"{kind.title()}StoreMachine", (StoreMachine,), {"kind": kind, "redis_url": redis_url})
    run_state_machine_as_test(
        machine, settings=settings(max_examples=30 if kind == "redis" else 150, stateful_step_count=25, deadline=None)
    )
