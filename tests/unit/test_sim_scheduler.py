"""The simulated engine's scheduler, step by step with a stepped clock: chunked prefill within a
token budget, decodes first, vLLM v1's preemption (the last to join under fcfs, the lowest
priority under the priority policy), the waiting line's order, and histograms that count what ran."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from extproc_testbed.sim_engine import SimEngine, SimParams


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def engine(**params) -> tuple[SimEngine, Clock, CollectorRegistry]:
    clock, registry = Clock(), CollectorRegistry()
    return SimEngine(SimParams(**params), registry, clock), clock, registry


def run_step(e: SimEngine, clock: Clock):
    step = e.schedule()
    clock.t += e.step_duration(step)
    e.finish(step)
    return step


def test_fcfs_is_the_default_and_keeps_arrival_order():
    assert SimParams().scheduling_policy == "fcfs"
    e, clock, _ = engine(max_num_seqs=1)
    first = e.submit(100, 1, {"name": "first"}, priority=5)
    e.submit(100, 1, {"name": "second"}, priority=0)  # better priority, ignored under fcfs
    assert [s for s, _ in run_step(e, clock).work] == [first]
    run_step(e, clock)
    assert [s["name"] for s in e.started] == ["first", "second"]


def test_a_step_never_holds_more_tokens_than_its_budget_and_decodes_come_first():
    e, clock, _ = engine(max_num_batched_tokens=2048)
    a = e.submit(3000, 4, {})
    b = e.submit(3000, 4, {})
    step = run_step(e, clock)
    assert step.work == [(a, 2048)]  # the first chunk of a's prompt fills the step
    assert a.generated == 0  # no token before the whole prompt is computed
    step = run_step(e, clock)
    assert step.work == [(a, 952), (b, 1096)]  # the rest of a, then a chunk of b
    assert a.generated == 1 and b.generated == 0
    step = run_step(e, clock)
    assert step.work == [(a, 1), (b, 1904)]  # a's decode first, b's remainder after it
    assert e.max_step_tokens_seen == 2048  # no step held more than the budget


def test_a_long_prefill_threshold_leaves_room_for_the_requests_behind_a_long_prompt():
    # vLLM's --long-prefill-token-threshold: a running prompt's chunk is capped, so a short
    # request that arrives during a long prefill joins the next step instead of waiting it out
    e, clock, _ = engine(max_num_batched_tokens=2048, long_prefill_token_threshold=512)
    long = e.submit(8000, 2, {})
    step = run_step(e, clock)
    assert step.work == [(long, 2048)]  # alone on the engine: nobody to starve, no cap
    short = e.submit(300, 2, {})
    step = run_step(e, clock)
    assert step.work == [(long, 512), (short, 300)]
    assert short.generated == 1 and long.generated == 0  # the short one's first token comes first
    uncapped, clock2, _ = engine(max_num_batched_tokens=2048)
    long2 = uncapped.submit(8000, 2, {})
    run_step(uncapped, clock2)
    short2 = uncapped.submit(300, 2, {})
    steps = 1
    while short2.generated == 0:
        run_step(uncapped, clock2)
        steps += 1
    assert steps == 5 and long2.computed >= 8000  # without the cap it waited for the whole long prompt


def test_the_step_time_follows_the_tokens_in_it():
    e, clock, _ = engine(max_num_batched_tokens=2048)
    e.submit(16000, 2, {})
    durations = []
    while e.running or e.waiting:
        before = clock.t
        run_step(e, clock)
        durations.append(clock.t - before)
    assert len(durations) == 8 + 1  # eight chunks (the last samples a token), one decode
    assert max(durations) < 0.4 and min(durations) < 0.01  # no single 3-second stall


def _fill_three(policy: str):
    # 96 tokens of KV (six 16-token blocks), three 32-token prompts: full after their prefill
    e, clock, _ = engine(kv_tokens=96, block_size=16, scheduling_policy=policy)
    a = e.submit(32, 8, {"name": "a"}, priority=1)
    b = e.submit(32, 8, {"name": "b"}, priority=9)
    c = e.submit(32, 8, {"name": "c"}, priority=5)
    run_step(e, clock)
    assert e.kv_used == 96 and all(s.generated == 1 for s in (a, b, c))
    return e, clock, (a, b, c)


def test_priority_preemption_picks_the_lowest_priority_running_request():
    e, clock, (a, b, c) = _fill_three("priority")
    step = run_step(e, clock)  # a's next token needs a block: b (priority 9) makes room
    assert step.preempted == [b]
    assert [s for s, _ in step.work] == [a, c]
    assert b.computed == 0 and b.kv_held == 0 and b in e.waiting and e.preemptions == 1
    while e.running or e.waiting:
        run_step(e, clock)
    assert b.generated == 8  # recomputed later, finished
    assert e.kv_used == 0


def test_fcfs_preemption_picks_the_last_to_join():
    e, clock, (a, b, c) = _fill_three("fcfs")
    step = run_step(e, clock)
    assert step.preempted == [c]  # a needs a block; c joined last
    assert [s for s, _ in step.work] == [a, b]


def test_the_priority_policy_orders_the_line_by_priority_then_arrival():
    e, clock, _ = engine(max_num_seqs=1, scheduling_policy="priority")
    for name, priority in (("late-low", 7), ("high", 0), ("low", 7), ("mid", 3)):
        e.submit(50, 1, {"name": name}, priority=priority)
    while e.running or e.waiting:
        run_step(e, clock)
    assert [s["name"] for s in e.started] == ["high", "mid", "late-low", "low"]


def test_histograms_count_what_ran_in_unscaled_seconds():
    e, clock, registry = engine(time_scale=0.5, max_num_seqs=1)
    e.submit(100, 3, {})
    e.submit(100, 2, {})
    while e.running or e.waiting:
        run_step(e, clock)

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "deepseek-sim", "engine": "0"})

    assert value("vllm:time_to_first_token_seconds_count") == 2
    assert value("vllm:inter_token_latency_seconds_count") == (3 - 1) + (2 - 1)
    assert value("vllm:e2e_request_latency_seconds_count") == 2
    assert value("vllm:request_queue_time_seconds_count") == 2
    # the second waited the whole first request; the clock ran at half the engine's time
    first_alone = 0.005 + 100 * 0.00018 + 2 * 0.005
    assert abs(value("vllm:request_queue_time_seconds_sum") - first_alone) < 1e-6
    assert value("vllm:num_preemptions_total") == 0
