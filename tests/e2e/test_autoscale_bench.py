"""The benchmarks of issue 20's capacity work: the autoscale controller's policies and bill
(pure parts, no processes), and one short real step of `extproc bench capacity`."""

from __future__ import annotations

import json
import subprocess
import sys

from extproc_testbed.autoscale import (
    STABILIZATION_S,
    Controller,
    Setup,
    burst_reading,
    engine_minutes,
    fixed_size,
    held_slo,
    time_to_enough,
)
from extproc_testbed.capacity_bench import predicted_pool_rps
from extproc_testbed.traffic import Traffic


def samples(waiting: float = 0, desired: float = 0) -> dict:
    return {("extproc_queue_depth", frozenset({("pool", "primary"), ("class", "complaint")})): waiting,
            ("extproc_desired_backends", frozenset({("pool", "primary")})): desired}


def controller(policy: str, base: int = 2, maximum: int = 6) -> Controller:
    setup = Setup(policy, base=base, maximum=maximum, time_scale=1.0, cold_start_s=60, queue_per_engine=10, model={})
    return Controller(stack=None, setup=setup, started=0.0)


def test_the_queue_rule_is_waiting_over_the_target_never_below_the_base():
    c = controller("queue")
    assert c.target(samples(waiting=0), 0) == 2
    assert c.target(samples(waiting=41), 1) == 5
    assert controller("queue").target(samples(waiting=500), 0) == 6  # the maximum


def test_the_prediction_policy_follows_the_desired_count():
    c = controller("predicted")
    assert c.target(samples(desired=4), 0) == 4
    assert controller("fixed").target(samples(desired=5, waiting=100), 0) == 2


def test_a_fixed_pool_of_n_holds_n_engines_whatever_the_metrics_say():
    assert fixed_size("fixed", 2) == 2 and fixed_size("fixed:5", 2) == 5
    c = controller("fixed:5", base=5, maximum=5)
    assert c.target(samples(desired=8, waiting=300), 0) == 5


def test_a_pool_holds_its_slo_only_when_every_class_does():
    assert held_slo({"in_time_by_class": {"loan_approval": 0.995, "complaint": 1.0}})
    assert not held_slo({"in_time_by_class": {"loan_approval": 0.989, "complaint": 1.0}})


def test_the_models_reading_in_the_burst_is_the_median_of_its_last_half():
    traffic = Traffic(steady_s=60, burst_s=240, recovery_s=60)
    series = [{"t": t, "desired": 9 if t < 180 else (3 if t % 40 else 4)} for t in range(0, 400, 10)]
    assert burst_reading(series, traffic, "desired") == 3  # 180 s to 300 s: nine threes, three fours
    assert burst_reading([], traffic, "desired") is None


def test_scale_in_waits_for_the_stabilization_window():
    c = controller("predicted")
    c.target(samples(desired=5), 0)
    assert c.target(samples(desired=2), STABILIZATION_S - 1) == 5
    assert c.target(samples(desired=2), STABILIZATION_S + 1) == 2


def test_the_bill_counts_engines_asked_for_and_time_to_enough_counts_serving_ones():
    series = [{"t": 0, "billed": 2, "serving": 2}, {"t": 60, "billed": 4, "serving": 2},
              {"t": 120, "billed": 4, "serving": 4}, {"t": 180, "billed": 2, "serving": 2}]
    assert engine_minutes(series, 180) == 2 + 4 + 4
    assert time_to_enough(series, burst_at=30, enough=4) == 90
    assert time_to_enough(series, burst_at=30, enough=5) is None


def test_the_models_pool_capacity_for_the_mix():
    # 0.2 / 10 + 0.3 / 5 + 0.5 / 2.5 = 0.28 engine-seconds per request: 2 engines carry 7.14 req/s
    assert round(predicted_pool_rps({"loan_approval": 10, "complaint": 5, "archive_query": 2.5}, 2), 2) == 7.14
    assert predicted_pool_rps({"loan_approval": 10, "complaint": None, "archive_query": 2.5}, 2) is None


def test_one_step_of_the_capacity_staircase_writes_capacity_per_class(tmp_path):
    result = subprocess.run([sys.executable, "-m", "extproc", "bench", "capacity", "--backends", "1", "--rps", "2",
                             "--step-seconds", "20", "--time-scale", "0.5", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "capacity.json").read_text())
    step = summary["steps"][0]
    assert set(step["classes"]) == {"loan_approval", "complaint", "archive_query"}
    assert 0 < step["availability"] <= 1
    assert all(isinstance(c["meets_slo"], bool) and c["rps"] > 0 for c in step["classes"].values())
    measured = [rps for rps in step["model"]["capacity_rps_per_engine"].values() if rps is not None]
    assert measured and all(rps > 0 for rps in measured)  # the sidecar's model measured the engine
    assert set(summary["highest_rps_meeting_slo_by_class"]) == set(step["classes"])
