"""Long prompts get a lane of their own where the sidecar picks engines (core/long_lane.py), and
a long prompt that has none waits for one, holding its slot, while the loans drain from the engine
it will take (lifecycle/slots.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from extproc.core.capacity import BackendLoad, BackendReading, Placing, backend_order
from extproc.core.events import LaneWaited, Observers, RequestDecided, SlotReleased
from extproc.core.long_lane import lane, long_may_start
from extproc.lifecycle.exchange import Attempt
from extproc.lifecycle.placement import BackendPicker
from extproc.lifecycle.slots import LANE_POLL_S, LaneWait, Slots

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
LONG = Placing(12000, long=True)
LOAN = Placing(600, bound=True)


def load(endpoint: str, used: int = 0, running: int = 0, long: int = 0, bound: int = 0,
         saturated: bool = False) -> BackendLoad:
    return BackendLoad(endpoint, 24576, used, running, saturated, long_running=long, bound_running=bound)


def test_a_long_prompt_starts_beside_long_ones_or_where_no_loan_runs():
    # loans on both engines, no long prompt anywhere: it must wait (it would stall a loan either way)
    assert not long_may_start([load(A, 1000, 2, bound=1), load(B, 1000, 2, bound=2)], LONG)
    # one engine free of loans: it may start there, and it is the one placement picks
    loads = [load(A, 1000, 2, bound=1), load(B, 3000, 3)]
    assert long_may_start(loads, LONG)
    assert backend_order(loads, LONG, 8)[0] == B
    # an engine already running long prompts takes another while it has room, loans or not
    assert long_may_start([load(A, 9000, 2, long=1, bound=1), load(B, 1000, 2, bound=2)], LONG)
    # ...but not when it has no room for it: a second lane would leave the loans no engine
    full_lane = [load(A, 20000, 3, long=1), load(B, 1000, 2)]
    assert not long_may_start(full_lane, LONG)
    # with three engines, two may take long prompts; the third stays the loans'
    assert long_may_start([*full_lane, load(C, 1000, 2, bound=1)], LONG)
    assert not long_may_start([load(A, 20000, 3, long=1), load(B, 20000, 3, long=1), load(C)], LONG)
    # an engine whose metrics are gone is no lane, and counts for nothing
    assert not long_may_start([load(A, saturated=True), load(B, 1000, 1, bound=1), load(C, 1000, 1, bound=1)], LONG)
    # where fewer than two engines answer nothing can be kept apart: waiting would only hold the slot
    assert long_may_start([load(A, 1000, 1, bound=1)], LONG)  # one engine
    assert long_may_start([load(A, saturated=True), load(B, 1000, 1, bound=1)], LONG)  # the other down
    assert long_may_start([load(A, saturated=True), load(B, saturated=True)], LONG)  # none polled yet


def test_the_loans_keep_off_the_lane_a_waiting_long_prompt_will_take():
    loads = [load(A, 1000, 2, bound=1), load(B, 3000, 3, bound=2)]
    assert lane(loads, waiting=None) is None  # nothing waits: the loans go where they like
    assert backend_order(loads, LOAN, 8, lane=None)[0] == A  # the least loaded
    # a long prompt waits: the lane it will take is the engine with the fewest loans, and new
    # loans go elsewhere, so that engine drains of them
    assert lane(loads, waiting=LONG) == A
    assert backend_order(loads, LOAN, 8, lane=A)[0] == B
    # ...of those with room for it: a lane it cannot fit in would drain for nothing
    assert lane([load(A, 20000, 2, bound=1), load(B, 3000, 3, bound=2)], waiting=LONG) == B
    # it may start already: no lane to drain
    assert lane([load(A, 1000, 2), load(B, 3000, 3, bound=2)], waiting=LONG) is None
    # three engines, the lane full: the next lane is opened where the fewest loans run
    three = [load(A, 20000, 3, long=1), load(B, 1000, 2, bound=2), load(C, 1000, 2, bound=1)]
    assert not long_may_start(three, LONG) and lane(three, waiting=LONG) == C
    # two engines, the lane full: the other stays the loans'; the long prompt waits for room
    assert lane(three[:2], waiting=LONG) is None
    # the lane chosen is kept while it can be one, though the other has more room by now: an engine
    # serves loans for a while after its last one started, and a lane that moved would drain neither
    moved = [load(A, 3000, 1), load(B, 1000, 1)]
    assert lane(moved, waiting=LONG) is None  # (neither serves a loan: it may start already)
    serving = [BackendLoad(A, 24576, 3000, 1, False, bound_lately=True),
               BackendLoad(B, 24576, 1000, 1, False, bound_lately=True)]
    assert lane(serving, waiting=LONG) == B and lane(serving, waiting=LONG, kept=A) == A
    assert lane([load(A, 20000, 2, long=1), serving[1]], waiting=LONG, kept=A) is None  # A took long ones
    # a full engine still beats the lane for a loan: it waits for a slot, not for seconds of prefill
    assert backend_order([load(A, 1000, 8, bound=3), load(B, 1000, 2)], LOAN, 8, lane=B)[0] == A


def _picker(keep_long_apart: bool = True, safety_factor: float = 1.0, bound_lately_s: float = 0.0,
            clock=None) -> BackendPicker:
    config = SimpleNamespace(pools={"p": SimpleNamespace(capacity=SimpleNamespace(
        picks_backend=True, backends=("http://10.0.0.1:8000", "http://10.0.0.2:8000"), kv_tokens_per_backend=None,
        max_num_seqs=32, safety_factor=safety_factor, keep_long_apart=keep_long_apart, spill_tokens_per_s=2048.0,
        bound_lately_s=bound_lately_s))})
    picker = BackendPicker(lambda: config, clock=clock) if clock else BackendPicker(lambda: config)
    picker.observe("p", {url: BackendReading(0.0, 65536, False) for url in config.pools["p"].capacity.backends})
    return picker


def test_the_picker_holds_a_long_prompt_until_an_engine_is_free_of_loans():
    picker = _picker()
    picker.pick("p", "loan1", LOAN)  # A
    picker.pick("p", "loan2", LOAN)  # B: the least loaded
    assert {endpoint for endpoint in picker.running("p")} == {A, B}
    assert not picker.may_start("p", LONG)
    picker.long_waiting("p", LONG, True)
    # while it waits, new loans keep off the engine it will take (the fewest loans, the most room)
    assert picker.pick("p", "loan3", LOAN).startswith(B)
    picker.release("loan1")
    assert picker.may_start("p", LONG)
    picker.long_waiting("p", LONG, False)
    assert picker.pick("p", "long", LONG).startswith(A)
    # the lane is taken: the loans keep to the other engine, more long prompts join it
    assert picker.pick("p", "loan4", LOAN).startswith(B)
    assert picker.pick("p", "long2", Placing(8000, long=True)).startswith(A)
    # without keep_long_apart nothing waits
    other = _picker(keep_long_apart=False)
    other.pick("p", "loan1", LOAN)
    other.pick("p", "loan2", LOAN)
    assert other.may_start("p", LONG)


def test_a_lane_keeps_the_pools_safety_factor_free():
    # the lane holds 40000 of 65536 tokens; 16000 more fit in the cache but not within 85 % of
    # it, and the other engine runs a loan: the long prompt waits (it once overflowed the lane)
    for safety_factor, may_start in ((1.0, True), (0.85, False)):
        picker = _picker(safety_factor=safety_factor)
        picker.pick("p", "long", Placing(40000, long=True))
        picker.pick("p", "loan", LOAN)
        assert picker.may_start("p", Placing(16000, long=True)) is may_start


def waits(heard: list, result: str, pool: str = "p") -> int:
    """How many of the long prompts' lane waits told (LaneWaited) ended with `result`."""
    return sum(1 for e in heard if isinstance(e, LaneWaited) and e.pool == pool and e.result == result)


class _Store:
    def __init__(self):
        self.placed = []

    def place(self, lease, endpoint):
        self.placed.append((lease.ticket.id, endpoint))


# the classes of the exchanges below: with a deadline, without one, protected (core/config.py)
_CLASSES = {"archive_query": SimpleNamespace(deadline_s=120.0, protected=False),
            "no_deadline": SimpleNamespace(deadline_s=None, protected=False),
            "protected": SimpleNamespace(deadline_s=120.0, protected=True),
            "past_memory": SimpleNamespace(deadline_s=600.0, protected=False)}  # past retries.window_s


def _exchange(ticket_id: str, placing: Placing, age_s: float = 0.0, class_name: str = "archive_query",
              appointments: bool = True):
    ticket = SimpleNamespace(id=ticket_id, cost=placing.cost, long=placing.long, bounded=placing.bound)
    config = SimpleNamespace(classes=_CLASSES, queue=SimpleNamespace(appointments=appointments),
                             retries=SimpleNamespace(window_s=300.0))
    return SimpleNamespace(id=ticket_id, lease=SimpleNamespace(pool="p", ticket=ticket, released=False), endpoints=None,
                           attempt=Attempt(age_s=age_s), config=config, class_name=class_name)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_admitted_long_prompt_waits_for_its_lane_then_is_placed_there():
    async def go():
        picker, clock, observers, heard = _picker(), _Clock(), Observers(), []
        observers.subscribe(LaneWaited, heard.append)
        slept: list[float] = []

        async def sleep(seconds: float) -> None:  # a stepped clock: at the first poll, loan1 ends
            slept.append(seconds)
            clock.now += seconds
            picker.release(f"loan{len(slept)}")

        store = _Store()
        slots = Slots(store, observers, picker, clock, sleep)
        for i in (1, 2):
            slots.hold(_exchange(f"loan{i}", LOAN))
        long = _exchange("long", LONG)
        assert slots.lane_needed(long) == LaneWait("p")
        await slots.wait_for_lane(long, until=10.0, stop=lambda: False)
        slots.hold(long)
        assert slept == [LANE_POLL_S]  # loan1 (A) ended at the first poll: A is free of loans...
        assert long.endpoints.startswith(A) and store.placed[-1] == ("long", A)  # ...and the long prompt went there
        assert waits(heard, "placed") == 1
        # a long prompt that finds no lane by the time it may wait is placed anyway, and counted so
        stuck_clock = _Clock()

        async def tick(seconds: float) -> None:
            stuck_clock.now += seconds

        stuck = Slots(_Store(), observers, _picker(), stuck_clock, tick)
        for i in (1, 2):
            stuck.hold(_exchange(f"loan{i}", LOAN))
        late = _exchange("late", LONG)
        await stuck.wait_for_lane(late, until=0.2, stop=lambda: False)
        assert stuck_clock.now == pytest.approx(0.2) and waits(heard, "timed_out") == 1
        # ...or at once when the sidecar drains
        await stuck.wait_for_lane(_exchange("draining", LONG), until=10.0, stop=lambda: True)
        assert stuck_clock.now == pytest.approx(0.2) and waits(heard, "timed_out") == 2
        # where Envoy ignores the picks, nothing waits for a lane (PoolLine's long_alone holds it)
        stuck.picks_followed = lambda pool: False
        assert stuck.lane_needed(_exchange("ignored", LONG)) is None
        # nor, where every engine serves loans, a short prompt of another class (nowhere better
        # to wait for: core/spill.py)
        assert stuck.lane_needed(_exchange("short", Placing(3000))) is None
        assert waits(heard, "placed") == 1

    asyncio.run(go())


def test_a_long_prompt_whose_wait_runs_out_with_its_lane_full_is_not_placed_beside_the_loans():
    async def go():
        clock, observers, heard = _Clock(), Observers(), []
        observers.subscribe(LaneWaited, heard.append)

        async def tick(seconds: float) -> None:
            clock.now += seconds

        picker = _picker(clock=clock)
        slots = Slots(_Store(), observers, picker, clock, tick)
        slots.hold(_exchange("lane", Placing(60000, long=True)))  # A: the long prompts' lane, its cache spoken for
        slots.hold(_exchange("loan", LOAN))  # B: the loans'
        late = _exchange("late", LONG)
        assert slots.lane_needed(late) == LaneWait("p")
        # its wait runs out with A still full: placed now it would go to B, beside the loan
        assert await slots.wait_for_lane(late, until=0.2, stop=lambda: False) is False
        assert clock.now == pytest.approx(0.2) and waits(heard, "refused") == 1 and waits(heard, "timed_out") == 0
        # and so is one that comes back, turned away once already, of a class whose deadline ends
        # its returns (a final answer past it)
        assert await slots.wait_for_lane(_exchange("again", LONG, 4.0), clock.now + 0.2, lambda: False) is False
        assert waits(heard, "refused") == 2
        # placed anyway: a latency-bound long prompt (refused, it would only miss its own
        # target); one that comes back where nothing would end its returns (no deadline, a
        # protected class, refusals that are no appointments): no prompt is refused for ever;
        # one whose wait the sidecar's drain cut short; and any where Envoy turned out to ignore
        # the picks
        for name, placing, age_s, class_name, appointments, stop in (
                ("long-loan", Placing(12000, long=True, bound=True), 0.0, "archive_query", True, False),
                ("no-deadline", LONG, 4.0, "no_deadline", True, False),
                ("protected", LONG, 4.0, "protected", True, False),
                ("forgotten", LONG, 4.0, "past_memory", True, False),  # (forgotten, it would look new)
                ("no-appointments", LONG, 4.0, "archive_query", False, False),
                ("draining", LONG, 0.0, "archive_query", True, True)):
            exchange = _exchange(name, placing, age_s, class_name, appointments)
            assert await slots.wait_for_lane(exchange, clock.now + 0.2, lambda: stop) is True, name
        slots.picks_followed = lambda pool: False
        assert await slots.wait_for_lane(_exchange("ignored", LONG), clock.now + 0.2, lambda: False) is True
        del slots.picks_followed
        assert waits(heard, "timed_out") == 7 and waits(heard, "refused") == 2
        # where every engine serves loans there is no lane to keep it off them: placed anyway
        picker.release("lane")
        slots.hold(_exchange("loan2", LOAN))
        assert {e for e in picker.running("p")} == {A, B}
        assert await slots.wait_for_lane(_exchange("nowhere", LONG), until=clock.now + 0.2, stop=lambda: False)
        assert waits(heard, "timed_out") == 8 and waits(heard, "refused") == 2

    asyncio.run(go())


# -- through the gate: a long prompt admitted, waiting for its lane (tests/unit/test_gate.py's rig) -----

def _lane_rig(**archive_query):

    from ..conftest import e2e_config
    from ..unit.test_gate import Rig

    classes = e2e_config()["classes"]
    classes["loan_approval"]["latency_target_s"] = 2.0
    classes["archive_query"].update(archive_query)
    rig = Rig(classes=classes, pools={
        "primary": {"cluster": "vllm_primary", "max_inflight": 8, "capacity": {
            "backends": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"], "pick_backend": True,
            "max_num_seqs": 8, "kv_tokens_per_backend": 65536, "bound_lately_s": 0}},
        "fallback": {"cluster": "vllm_fallback", "max_inflight": 4}})
    picker = BackendPicker(lambda: rig.config, clock=rig.clock)
    picker.observe("primary", {url: BackendReading(0.0, 65536, False) for url in
                               rig.config.pools["primary"].capacity.backends})
    rig.build_gate(picker=picker)
    return rig, picker


def _long_body() -> bytes:
    from ..helpers import chat

    return chat("word " * 8000, max_tokens=64)


def test_through_the_gate_a_long_prompt_waits_admitted_until_the_loans_leave_an_engine():
    async def go():
        rig, picker = _lane_rig()
        loan_a, _ = await rig.arrive("loan_approval")
        loan_b, _ = await rig.arrive("loan_approval")
        assert {loan_a.endpoints.split(",")[0], loan_b.endpoints.split(",")[0]} == {A, B}
        long = rig.gate.open({"x-ticket-type": "archive_query", ":path": "/v1/chat/completions"})
        # its slot is taken, but no engine is its own yet: the servicer is told to wait (and so
        # tells Envoy to hold the request longer than its message timeout)
        waiter = await rig.gate.enqueue(long, _long_body())
        assert waiter == LaneWait("primary") and long.outcome is None and await rig.inflight() == 3
        waiting = asyncio.create_task(rig.gate.wait(long, waiter))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done() and long.outcome is None
        rig.gate.response_started(loan_a, 200)
        await rig.gate.close(loan_a)  # the loan on loan_a's engine ends: that engine is a lane now
        await asyncio.wait_for(waiting, 1)
        assert long.outcome is Outcome.ADMITTED and long.endpoints.startswith(loan_a.endpoints.split(",")[0])
        assert long.queue_wait_s == rig.clock.now - long.arrived_at > 0  # the lane wait is part of its wait
        assert waits(rig.heard.events, "placed", pool="primary") == 1

    from extproc.core.outcomes import Outcome
    asyncio.run(go())


def test_a_client_that_leaves_while_its_long_prompt_waits_for_a_lane_gives_its_slot_back():
    async def go():
        rig, picker = _lane_rig()
        await rig.arrive("loan_approval")
        await rig.arrive("loan_approval")
        long = rig.gate.open({"x-ticket-type": "archive_query", ":path": "/v1/chat/completions"})
        waiting = asyncio.create_task(rig.gate.wait(long, await rig.gate.enqueue(long, _long_body())))
        for _ in range(5):
            await asyncio.sleep(0)
        assert await rig.inflight() == 3 and not waiting.done()
        waiting.cancel()  # the client went away: the servicer's task is cancelled, then closes
        await asyncio.gather(waiting, return_exceptions=True)
        await rig.gate.close(long)
        assert await rig.inflight() == 2 and long.outcome is Outcome.CANCELLED_CLIENT_GONE
        assert rig.told(SlotReleased, pool="primary", end="client_gone") == [SlotReleased("primary", "client_gone")]
        assert set(picker.running("primary")) == {A, B} and picker.running("primary")[A][0] == 1  # never placed
        assert len(rig.told(RequestDecided, outcome=Outcome.ADMITTED)) == 2  # the loans alone
        assert waits(rig.heard.events, "cancelled", pool="primary") == 1

    from extproc.core.outcomes import Outcome
    asyncio.run(go())


def test_through_the_gate_a_long_prompt_whose_lane_stays_full_is_refused_as_expired_and_gives_its_slot_back():
    async def go():
        rig, picker = _lane_rig()
        # engine A's cache is held by what others placed (a full lane); B runs a loan
        picker.observe("primary", {"http://10.0.0.1:8000": BackendReading(0.95, 65536, False),
                                   "http://10.0.0.2:8000": BackendReading(0.0, 65536, False)})
        loan, _ = await rig.arrive("loan_approval")
        assert loan.endpoints.startswith(B)
        long = rig.gate.open({"x-ticket-type": "archive_query", ":path": "/v1/chat/completions"})
        waiter = await rig.gate.enqueue(long, _long_body())
        assert waiter == LaneWait("primary") and await rig.inflight() == 2
        with pytest.raises(Rejection) as refused:
            await rig.gate.wait(long, waiter)  # (the stepped clock: its wait runs out at once)
        assert refused.value.outcome is Outcome.EXPIRED_IN_QUEUE and refused.value.retry_after_s
        assert long.outcome is Outcome.EXPIRED_IN_QUEUE and long.endpoints is None
        assert waits(rig.heard.events, "refused", pool="primary") == 1
        await rig.gate.close(long)
        assert await rig.inflight() == 1  # its slot is back; the loan alone holds one
        assert rig.told(SlotReleased, pool="primary", end="refused") == [SlotReleased("primary", "refused")]
        assert picker.running("primary") == {B: (1, loan.lease.ticket.cost)}  # the long prompt placed nowhere
        assert len(rig.told(RequestDecided, outcome=Outcome.ADMITTED)) == 1

    from extproc.core.outcomes import Outcome, Rejection
    asyncio.run(go())


def test_through_the_gate_a_long_retry_whose_lane_stays_full_is_refused_and_past_its_deadline_given_up():
    """A long archive query whose lane stays full is turned away with an appointment; it comes
    back (the same idempotency key) and its lane is still full: refused again, never placed beside
    the loan, and its wait there ran to its deadline, so the answer is final; each time its slot
    is given back."""
    async def go():
        rig, picker = _lane_rig(max_wait_s=10, deadline_s=60)
        picker.observe("primary", {"http://10.0.0.1:8000": BackendReading(0.95, 65536, False),
                                   "http://10.0.0.2:8000": BackendReading(0.0, 65536, False)})
        loan, _ = await rig.arrive("loan_approval")
        headers = {"x-ticket-type": "archive_query", ":path": "/v1/chat/completions", "idempotency-key": "long-1"}
        answers = []
        for _ in range(2):
            long = rig.gate.open(headers)
            waiter = await rig.gate.enqueue(long, _long_body())
            assert waiter == LaneWait("primary") and await rig.inflight() == 2
            with pytest.raises(Rejection) as refused:
                await rig.gate.wait(long, waiter)
            answers.append((long.attempt.returning, refused.value.outcome, refused.value.final))
            assert long.endpoints is None
            await rig.gate.close(long)
            await asyncio.sleep(0)  # (the attempt ledger hears of the end in a task of its own)
            assert await rig.inflight() == 1  # its slot is back
            rig.clock.now += refused.value.retry_after_s or 0
        assert answers[0] == (False, Outcome.EXPIRED_IN_QUEUE, False)  # an appointment
        assert answers[1][0] and answers[1][2], answers  # it came back, and was given up on
        assert long.attempt.age_s + rig.clock.now - long.arrived_at > 50  # its wait ran to its deadline
        assert waits(rig.heard.events, "refused", pool="primary") == 2
        assert picker.running("primary") == {B: (1, loan.lease.ticket.cost)}  # placed nowhere, ever

    from extproc.core.outcomes import Outcome, Rejection
    asyncio.run(go())


# -- through real Envoy ----------------------------------------------------------------------------

def test_through_real_envoy_a_long_prompt_that_waits_for_its_lane_is_answered(tmp_path):
    """Two loans run, one on each engine; a long prompt arrives, has its slot, and waits for an
    engine of its own longer than the ext_proc filter's message timeout (1 s in the template):
    the sidecar stretches it as for a wait in line, and the long prompt is answered when a loan
    ends, from an engine that runs no loan any more. (First a dozen short requests, so that the
    sidecar knows Envoy follows its picks: until then it keeps long prompts apart in time too.)"""
    import concurrent.futures
    import json
    import time

    import openai
    import yaml

    from extproc_testbed.stack import SimSpec, Stack, StackPorts, http_get

    from ..conftest import e2e_config
    from ..helpers import metric, wait_until

    ports = StackPorts.random(primary=2)
    config = e2e_config()
    config["classes"]["loan_approval"]["latency_target_s"] = 30.0
    config["pools"]["primary"].update(max_inflight=8, capacity={
        "backends": [f"http://127.0.0.1:{p}" for p in ports.primary], "pick_backend": True, "max_num_seqs": 8})
    path = tmp_path / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    with Stack(tmp_path, ports, path, primary=SimSpec("deepseek-sim", ("--time-scale", "1"))) as stack:
        for _ in range(100):  # placement counts an engine only once its metrics were read
            if all(metric(stack.metrics_url, "extproc_backend_saturated", pool="primary",
                          backend=f"http://127.0.0.1:{p}") == 0 for p in ports.primary):
                break
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-none", max_retries=0)

        def ask(ticket_type: str, content: str, max_tokens: int):
            return client.chat.completions.with_raw_response.create(
                model="deepseek-sim", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                extra_headers={"x-ticket-type": ticket_type})

        for i in range(12):
            assert ask("complaint", f"short {i}", 2).status_code == 200
        def rule() -> str | None:
            (pool, *_), = [json.loads(http_get(f"http://127.0.0.1:{ports.metrics}/queue/state")[1])["pools"]]
            return pool["long_prompts"]

        wait_until(lambda: rule() == "placed_apart", 10, "long prompts placed apart")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            loans = []
            for i in range(2):  # 600 tokens: about 3 s each on the simulator
                loans.append(pool.submit(ask, "loan_approval", f"loan {i}", 600))
                time.sleep(0.3)
            long = pool.submit(ask, "archive_query", "word " * 6000, 4).result(timeout=60)
            assert all(loan.result(timeout=60).status_code == 200 for loan in loans)
        assert long.status_code == 200
        assert int(long.headers["x-queue-wait-ms"]) > 1000  # it waited past Envoy's message timeout
        assert metric(stack.metrics_url, "extproc_long_lane_waits_total", pool="primary", result="placed") == 1
