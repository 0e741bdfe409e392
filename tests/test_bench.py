"""The benchmarks run from the command line at a tiny size and write what they promise (no
timing asserts: the figures themselves belong to bench/RESULTS.md)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import e2e_config, start_stack

ROOT = Path(__file__).resolve().parents[1]


def extproc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "extproc", "bench", *args], capture_output=True, text=True,
                            timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


async def test_the_overhead_benchmarks_sidecar_has_room_for_every_request_of_its_load():
    """`extproc bench overhead` measures the admission path, not the waiting one: the limits the
    capacity loop sets for its sidecar (count, and the latency cap on classes without a target)
    leave room for every request its load keeps in flight (32 connections by default)."""
    from extproc.control.load_control import LoadController
    from extproc.core.config import parse_config
    from extproc.ops.metrics import Metrics
    from extproc.stores.local_queue import LocalQueueStore
    from extproc.testbed.overhead import sidecar_config
    from extproc.testbed.stack import metric_sum, parse_samples

    concurrency = 32
    config = parse_config(sidecar_config(4 * concurrency))
    store = LocalQueueStore({name: pool.max_inflight for name, pool in config.pools.items()})
    metrics = Metrics()
    load = LoadController(config, store, metrics, nvml=None)
    await load.start()
    try:
        for pool in config.pools:
            assert (await store.snapshot(pool)).max_inflight >= concurrency
            cap = metric_sum(parse_samples(metrics.render().decode()), "extproc_latency_limit", pool=pool)
            assert cap == -1 or cap >= concurrency  # -1: no cap
    finally:
        await load.stop()


def test_the_overhead_benchmark_writes_its_figures(tmp_path):
    out = tmp_path / "results"
    extproc("overhead", "--seconds", "1", "--rounds", "1", "--concurrency", "8", "--out", str(out))
    summary = json.loads((out / "overhead.json").read_text())
    assert set(summary["setups"]) == {"envoy_only", "floor", "floor_answers", "sidecar", "sidecar_redis",
                                      "sidecar_log_off", "sidecar_redis_log_off"}
    for setup in summary["setups"].values():
        assert setup["requests_per_s"] > 0 and setup["errors"] == 0
        assert setup["envoy_cpu_ms_per_request"] > 0
    assert summary["setups"]["envoy_only"]["cpu_ms_per_request"] is None  # no ext_proc to count
    assert all(summary["setups"][name]["cpu_ms_per_request"] > 0
               for name in ("floor", "floor_answers", "sidecar", "sidecar_redis"))
    assert summary["setups"]["sidecar_redis"]["redis_cpu_ms_per_request"] > 0  # the store's work, counted
    assert summary["setups"]["sidecar"]["redis_cpu_ms_per_request"] is None
    assert "floor_answers/floor" in summary["ratios"]
    sidecar_rounds = summary["setups"]["sidecar"]["vs_floor_rounds"]  # one round: one ratio, the figure
    assert len(sidecar_rounds) == 1 and summary["ratios"]["sidecar/floor"] == sidecar_rounds[0]
    assert len(summary["setups"]["floor"]["requests_per_s_rounds"]) == 6  # before the first setup, after each
    assert summary["goals"] == {"sidecar/floor": 0.8, "sidecar_redis/floor": 0.6}  # at the default log level
    assert {"sidecar/floor", "sidecar_redis/floor", "sidecar/envoy_only"} <= set(summary["ratios"])
    assert summary["machine"] and summary["command"].startswith("extproc bench overhead")
    assert summary["setups"]["sidecar"]["queued"] == 0 and summary["setups"]["sidecar_redis"]["queued"] == 0
    assert "What it costs per request" in (tmp_path / "RESULTS.md").read_text()


def test_the_scenario_benchmark_writes_its_figures_and_plots(tmp_path):
    out = tmp_path / "results"
    result = extproc("scenario", "--size", "0.05", "--backends", "2", "--search", "--min-backends", "2", "--max-backends", "2",
                     "--out", str(out))
    assert "envoy_only N=2" in result.stdout and "sidecar N=2" in result.stdout  # progress as it goes
    summary = json.loads((out / "scenario.json").read_text())
    assert set(summary["setups"]) == {"envoy_only", "sidecar"}
    for setup in summary["setups"].values():
        assert setup["requests"] > 0
        assert set(setup["classes"]) == {"loan_approval", "complaint", "archive_query"}
        for figures in setup["classes"].values():
            assert {"p50_s", "p95_s", "p99_s", "availability"} <= set(figures)
        assert {"oom_crashes", "availability", "goodput_tokens_per_s"} <= set(setup)
    assert set(summary["min_backends_for_slo"]) == {"envoy_only", "sidecar"}
    assert summary["command"].startswith("extproc bench scenario") and summary["machine"]
    for plot in ("latency_cdf.png", "queue_kv_over_time.png", "availability_over_time.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG")
    assert "What it buys under a burst" in (tmp_path / "RESULTS.md").read_text()


def test_the_ablation_leaves_out_one_mechanism_at_a_time(tmp_path):
    import yaml

    from extproc.testbed.scenario_setups import MECHANISMS, sidecar_config
    from extproc.testbed.stack import StackPorts

    ports = StackPorts.random(primary=3, long=1)

    def config(off: frozenset[str] = frozenset()) -> dict:
        return yaml.safe_load(sidecar_config(tmp_path, ports, 0.5, off).read_text())

    full = config()
    assert full["queue"]["engine_priority"] is True
    assert full["classes"]["loan_approval"]["latency_target_s"] == 1.0  # 2 s, at the time scale
    assert full["pools"]["primary"]["long_pool"] == "long"
    assert full["pools"]["primary"]["capacity"]["offload_request_tokens"] == 1000
    assert "latency_target_s" not in config(frozenset({"latency_target"}))["classes"]["loan_approval"]
    assert config(frozenset({"engine_priority"}))["queue"]["engine_priority"] is False
    assert "offload_request_tokens" not in config(frozenset({"offload"}))["pools"]["primary"]["capacity"]
    assert "long_pool" not in config(frozenset({"long_pool"}))["pools"]["primary"]
    assert full["pools"]["primary"]["capacity"]["pick_backend"] is full["pools"]["long"]["capacity"]["pick_backend"] is True
    unpicked = config(frozenset({"pick_backend"}))["pools"]
    assert unpicked["primary"]["capacity"]["pick_backend"] is unpicked["long"]["capacity"]["pick_backend"] is False
    bare = config(frozenset(MECHANISMS))
    assert "latency_target_s" not in bare["classes"]["loan_approval"] and bare["queue"]["engine_priority"] is False


def test_the_locustfile_runs_the_mix_against_a_stack(tmp_path):
    config = e2e_config()
    config["pools"]["primary"].update(max_inflight=8, tiers={"yellow": 30, "orange": 50, "red": 80, "hard_max": 200})
    stack = start_stack(tmp_path / "stack", config)
    try:
        run = subprocess.run(
            [str(Path(sys.executable).parent / "locust"), "-f", str(ROOT / "bench/locustfile.py"), "--host", stack.url,
             "--headless", "--csv", str(tmp_path / "locust"), "--only-summary"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            # about 40 tickets: each class appears (loans are a fifth of the mix; of the 10 or so
            # that 3 users sent in 4 s, none was a loan once in a while)
            env={**os.environ, "STEP_USERS": "6", "STEP_SECONDS": "3", "STEPS": "2"},
        )
    finally:
        stack.stop()
    assert run.returncode in (0, 1), run.stderr[-2000:]  # 1: some requests were refused
    rows = list(csv.DictReader((tmp_path / "locust_stats.csv").open()))
    classes = {row["Name"]: int(row["Request Count"]) for row in rows if row["Name"] != "Aggregated"}
    assert set(classes) == {"loan_approval", "complaint", "archive_query"} and all(classes.values())


def test_the_servicer_path_benchmark_drives_every_exchange_to_its_end():
    """Each exchange gets its three answers (a refused one would end at two): the script exits
    non-zero otherwise."""
    run = subprocess.run([sys.executable, str(ROOT / "bench/servicer_path.py"), "--exchanges", "50", "--rounds", "2",
                          "--concurrent", "8"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert set(report) == {"passthrough", "sidecar", "sidecar_log_off", "sidecar_redis"}
    assert all(r["best_us"] > 0 and r["median_us"] >= r["best_us"] for r in report.values())


def test_each_setup_is_compared_with_the_floor_runs_beside_it():
    from extproc.testbed.overhead import Round, floor_between, paired_with_floor

    order = floor_between(["envoy_only", "floor", "floor_answers", "sidecar", "sidecar_redis"])
    assert order == ["envoy_only", "floor", "floor_answers", "floor", "sidecar", "floor", "sidecar_redis", "floor"]
    rates = {0: 9000, 1: 2000, 2: 1900, 3: 1800, 4: 1500, 5: 1200, 6: 600, 7: 1000}  # the machine slows down
    runs = [(name, Round(rates[i], 1, 2, 0)) for i, name in enumerate(order)]
    assert paired_with_floor(runs) == [("floor_answers", 1900 / 1900), ("sidecar", 1500 / 1500),
                                       ("sidecar_redis", 600 / 1100)]
