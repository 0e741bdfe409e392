"""The benchmarks run from the command line at a tiny size and write what they promise (no
timing asserts: the figures themselves belong to bench/RESULTS.md)."""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import e2e_config, start_stack

ROOT = Path(__file__).resolve().parents[2]


def extproc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "extproc", "bench", *args], capture_output=True, text=True,
                            timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def assert_provenance(results: dict, args: tuple[str, ...]) -> None:
    """The results file says which commit of this checkout ran, on which machine, by which command."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    p = results["provenance"]
    assert p["commit"] == (head.stdout.strip() if head.returncode == 0 else None), p["note"]
    assert isinstance(p["clean"], bool) or p["commit"] is None
    assert p["command"] == "extproc bench " + shlex.join(args)
    assert p["machine"]["cores"] == os.cpu_count() and p["machine"]["cpu"] and p["machine"]["envoy"]
    assert p["date"].endswith("Z") and p["date"][:4].isdigit()


async def test_the_overhead_benchmarks_sidecar_has_room_for_every_request_of_its_load():
    """`extproc bench overhead` measures the admission path, not the waiting one: the limits the
    capacity loop sets for its sidecar (count, and the latency cap on classes without a target)
    leave room for every request its load keeps in flight (32 connections by default)."""
    from extproc.control.load_control import LoadController
    from extproc.core.config import parse_config
    from extproc.ops.metrics import Metrics
    from extproc.stores.local_queue import LocalQueueStore
    from extproc_testbed.overhead import sidecar_config
    from extproc_testbed.stack import metric_sum, parse_samples

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
    args = ("scenario", "--size", "0.05", "--backends", "2", "--search", "--min-backends", "2", "--max-backends", "2",
            "--out", str(out))
    result = extproc(*args)
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
    # the seed's engines by default: they die when their KV cache overflows, as they said themselves
    assert summary["kv_exhausted"] == "crash" and summary["other_behaviours"] == {}
    assert all(setup["engines_on_kv_exhausted"] == ["crash"] for setup in summary["setups"].values())
    assert_provenance(summary, args)
    page = (tmp_path / "RESULTS.md").read_text()
    assert "What it buys under a burst" in page
    assert f"Provenance: commit {summary['provenance']['commit'][:7]} (" in page


def test_the_scenario_runs_with_engines_that_preempt_as_vllm_does(tmp_path):
    """`--kv-exhausted queue`: the engines are started in vLLM's behaviour (they say so in
    /sim/stats) and the results name it and count their preemptions. Whether they preempt
    rather than die is the simulator's own test (tests/e2e/test_sim.py); this short a run may
    never fill a KV cache."""
    out = tmp_path / "results"
    args = ("scenario", "--size", "0.05", "--backends", "2", "--kv-exhausted", "queue", "--out", str(out))
    result = extproc(*args)
    assert "queue: sidecar N=2" in result.stdout
    summary = json.loads((out / "scenario.json").read_text())
    assert summary["kv_exhausted"] == "queue" and summary["other_behaviours"] == {}
    assert "queue mode" in summary["pool"] and "preempts and recomputes" in summary["pool"]
    for setup in summary["setups"].values():
        assert setup["requests"] > 0
        assert setup["engines_on_kv_exhausted"] == ["queue"]
        assert setup["oom_crashes"] == 0 and isinstance(setup["engine_preemptions"], int)
    assert_provenance(summary, args)
    assert "queue mode (an engine whose KV cache overflows preempts" in (tmp_path / "RESULTS.md").read_text()


def test_the_ablation_leaves_out_one_mechanism_at_a_time(tmp_path):
    import yaml

    from extproc_testbed.scenario_setups import MECHANISMS, sidecar_config
    from extproc_testbed.stack import StackPorts

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
    from extproc_testbed.overhead import Round, floor_between, paired_with_floor

    order = floor_between(["envoy_only", "floor", "floor_answers", "sidecar", "sidecar_redis"])
    assert order == ["envoy_only", "floor", "floor_answers", "floor", "sidecar", "floor", "sidecar_redis", "floor"]
    rates = {0: 9000, 1: 2000, 2: 1900, 3: 1800, 4: 1500, 5: 1200, 6: 600, 7: 1000}  # the machine slows down
    runs = [(name, Round(rates[i], 1, 2, 0)) for i, name in enumerate(order)]
    assert paired_with_floor(runs) == [("floor_answers", 1900 / 1900), ("sidecar", 1500 / 1500),
                                       ("sidecar_redis", 600 / 1100)]


def _rendered(tmp_path: Path, template: Path | None, without_sidecar: bool) -> Path:
    from extproc_testbed.envoy_config import EnvoyLayout, render_file

    layout = EnvoyLayout(("127.0.0.1", 10000), ("127.0.0.1", 9901), [("127.0.0.1", 50051)],
                         {"vllm_primary": [("127.0.0.1", 8001), ("127.0.0.1", 8002)],
                          "vllm_fallback": [("127.0.0.1", 8003)]},
                         relay=("127.0.0.1", 10001), without_sidecar=without_sidecar)
    out = tmp_path / f"{(template or Path('template')).stem}-{without_sidecar}.yaml"
    return render_file(layout, out, template)


def test_the_matrix_cells_render_a_valid_envoy_and_a_sidecar_config(tmp_path):
    """Every cell's Envoy validates (`envoy --mode validate`) with and without the sidecar: the
    plain one balances every model cluster by LEAST_REQUEST, without the override_host policy,
    and keeps the ext_proc filter as the template has it (upstream.address included); the
    sidecar's configuration parses, its pool at the engines' slot count."""
    import yaml

    from extproc.core.config import parse_config
    from extproc_testbed.envoy_config import follows_picks, template_path
    from extproc_testbed.scenario_setups import CELLS, envoy_alone_template, envoy_template, shipped_config
    from extproc_testbed.stack import StackPorts, envoy_binary

    assert [c.name for c in CELLS] == [f"{e}-{s}-{c}" for e in ("template", "plain") for s in (8, 32)
                                       for c in ("honour", "ignore")]
    template = yaml.safe_load(template_path().read_text())
    model_clusters = {c["name"] for c in template["static_resources"]["clusters"] if follows_picks(c)}
    assert {"vllm_primary", "vllm_fallback", "vllm_long", "vllm_canary"} <= model_clusters

    def ext_proc(config: dict) -> dict | None:
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        return next((f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"), None)

    for plain in (False, True):
        work = tmp_path / f"plain-{plain}"
        work.mkdir()
        for seqs in (8, 32):
            for with_sidecar in (True, False):
                source = envoy_template(work, plain) if with_sidecar else envoy_alone_template(work, 2, seqs, plain)
                path = _rendered(work, source, not with_sidecar)
                run = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True,
                                     text=True, timeout=60)
                assert run.returncode == 0, run.stdout + run.stderr
                config = yaml.safe_load(path.read_text())
                clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
                for name in model_clusters:
                    assert follows_picks(clusters[name]) is not plain
                    assert (clusters[name].get("lb_policy") == "LEAST_REQUEST") is plain
                if with_sidecar:
                    assert ext_proc(config) == ext_proc(yaml.safe_load(_rendered(work, None, False).read_text()))
                    assert "upstream.address" in ext_proc(config)["typed_config"]["response_attributes"]
                else:
                    assert ext_proc(config) is None
                    assert clusters["vllm_primary"]["circuit_breakers"]["thresholds"][0]["max_requests"] == 2 * seqs
    ports = StackPorts.random(primary=2)
    for seqs in (8, 32):
        config = parse_config(yaml.safe_load(shipped_config(tmp_path, ports, 0.5, seqs).read_text()))
        primary = config.pools["primary"]
        assert primary.max_inflight == 2 * seqs and primary.fallback is None
        assert primary.capacity.max_num_seqs == seqs and primary.capacity.pick_backend
        assert list(primary.capacity.backends) == [f"http://127.0.0.1:{p}" for p in ports.primary]


def _fake_setup(loan_in_time: float, burst_p99: float | None, availability: float, crashes: int = 0) -> dict:
    classes = {name: {"in_time": 1.0, "availability": availability} for name in ("complaint", "archive_query")}
    classes["loan_approval"] = {"in_time": loan_in_time, "burst_p50_s": 0.8, "burst_p99_s": burst_p99,
                                "availability": availability}
    slow = {"loans": 40, "slow": 3, "failed": 1, "beside_long_prefill": 2, "by_phase": {"burst": 3},
            "by_engine": {"127.0.0.1:8001": 2, "127.0.0.1:8002": 1},
            "medians_s": {"earlier_attempts_s": 0.0, "line_s": 1.2, "engine_queue_s": 0.4, "prefill_s": 0.9,
                          "decode_s": 0.5, "elsewhere_s": 0.01, "beside_prefill_s": 1.1, "beside_long_prefill_s": 0.7}}
    return {"classes": classes, "availability": availability, "oom_crashes": crashes, "goodput_in_time_rps": 6.5,
            "attempts_per_request": 1.4, "slow_loans": slow, "engine_picks_ignored": 0.0}


def test_the_matrix_table_is_built_from_its_results(tmp_path):
    """Each cell is one row, the sidecar against Envoy alone; the targets it misses are named; the
    slow loans' time is broken down; write_results puts the section into RESULTS.md."""
    from extproc_testbed.report import write_results
    from extproc_testbed.report_scenario import matrix_misses, matrix_section
    from extproc_testbed.traffic import Traffic

    traffic = Traffic.independent_burst()
    assert (traffic.steady_rps, traffic.burst_rps, traffic.steady_s, traffic.burst_s, traffic.recovery_s,
            traffic.mix) == (4.0, 16.0, 30.0, 40.0, 30.0, (15, 35, 50))

    def cell(clients: str, sidecar: dict) -> dict:
        return {"envoy": "plain", "max_num_seqs": 32, "kv_tokens": 65536, "clients": clients, "backends": 2,
                "setups": {"envoy_only": _fake_setup(0.4, 12.5, 0.77, crashes=3), "sidecar": sidecar},
                "traffic": traffic.__dict__, "time_scale": 0.5, "command": "extproc bench scenario --matrix",
                "machine": "2 cores", "seconds": 120}

    summary = {"cells": {"template-32-honour": cell("honour", _fake_setup(0.995, 1.7, 1.0)),
                         "plain-32-ignore": cell("ignore", _fake_setup(0.5, 11.5, 0.79))}}
    assert matrix_misses(summary["cells"]["template-32-honour"]) == []
    assert matrix_misses(summary["cells"]["plain-32-ignore"]) == ["loans within 2 s 0.5", "burst p99 11.5 s",
                                                                  "availability 0.79 < 0.95"]
    lines = matrix_section(summary)
    table = lines[lines.index(next(line for line in lines if line.startswith("| cell | loans"))):]
    rows = {name: next(line for line in table if line.startswith(f"| {name} |"))
            for name in ("plain-32-ignore", "template-32-honour")}
    assert "**0.995 / 0.4**" in rows["template-32-honour"] and "| 1 / 0.77 |" in rows["template-32-honour"]
    assert rows["template-32-honour"].endswith("| 6.5 / 6.5 | 0 / 3 | 1.4 / 1.4 | no | none |")
    slow_rows = [line for line in lines if line.startswith("| plain-32-ignore | sidecar |")]
    assert slow_rows == ["| plain-32-ignore | sidecar | 3 / 1 / 40 | 0 / 1.2 / 0.4 / 0.9 / 0.5 / 0.01; 1.1; 0.7 (2) | "
                         "2 / 1 |"]
    # cells written before provenance was kept say so, together
    assert "- Provenance of template-32-honour, plain-32-ignore: recorded before provenance was kept (commit " \
           "unknown)." in lines
    (tmp_path / "results" / "matrix").mkdir(parents=True)
    (tmp_path / "results" / "matrix" / "matrix.json").write_text(json.dumps(summary))
    page = write_results(tmp_path / "results").read_text()
    assert "## The matrix: what users vary" in page and "| plain-32-ignore |" in page
    # the same cells on other draws of the traffic (--out bench/results/NAME): a section of their
    # own after the matrix, naming their folder
    other = {"cells": {"template-32-honour": cell("honour", _fake_setup(0.98, 2.5, 1.0))}}
    (tmp_path / "results" / "draws-2" / "matrix").mkdir(parents=True)
    (tmp_path / "results" / "draws-2" / "matrix" / "matrix.json").write_text(json.dumps(other))
    page = write_results(tmp_path / "results").read_text()
    first, second = page.split("## The matrix on other draws of the traffic (`results/draws-2/matrix/matrix.json`)")
    assert "## The matrix: what users vary" in first and "**0.995 / 0.4**" in first and "**0.98 / 0.4**" in second
    assert "Plots: `results/draws-2/matrix/CELL.png`" in second and "Plots: `results/matrix/CELL.png`" in first
    # engines run with --long-prefill-token-threshold: the section says so, in its title and its text
    capped = {"cells": {"plain-32-ignore": {**cell("ignore", _fake_setup(0.997, 1.5, 0.99)),
                                            "long_prefill_token_threshold": 512}}}
    (tmp_path / "results" / "capped" / "matrix").mkdir(parents=True)
    (tmp_path / "results" / "capped" / "matrix" / "matrix.json").write_text(json.dumps(capped))
    page = write_results(tmp_path / "results").read_text()
    _, third = page.split("## The matrix with engines run with `--long-prefill-token-threshold 512` "
                          "(`results/capped/matrix/matrix.json`)")
    assert "`--scheduling-policy priority`, `--long-prefill-token-threshold 512`." in third
    assert "**0.997 / 0.4**" in third and "--long-prefill-token-threshold" not in first


async def test_clients_that_ignore_retry_after_retry_at_once_and_answers_keep_the_engines_timings():
    """Against a real HTTP server refusing with 429 and `retry-after: 30`: a complaint's
    hand-written loop retries ten times within moments, a loan's SDK-like client makes its three
    attempts after `retry-after-ms`; an answer's `x-queue-wait-ms` and `x-sim-*` headers land in
    the outcome (the sidecar's in its scaled milliseconds, the engine's unscaled)."""
    import random

    import aiohttp
    from aiohttp import web

    from extproc_testbed.traffic import IMPATIENT_CLASSES, IMPATIENT_RETRIES, Client

    from ..helpers import serving

    async def handler(request: web.Request) -> web.Response:
        if request.headers.get("x-ticket-type") == "answered":
            return web.json_response({"usage": {"completion_tokens": 4}}, headers={
                "x-queue-wait-ms": "500", "x-sim-engine": "127.0.0.1:8001", "x-sim-engine-queue-ms": "300",
                "x-sim-prefill-ms": "700", "x-sim-decode-ms": "250", "x-sim-beside-prefill-ms": "600",
                "x-sim-beside-long-prefill-ms": "400"})
        return web.json_response({"error": {}}, status=429, headers={"retry-after": "30", "retry-after-ms": "20"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    async with serving(app) as port:
        async with aiohttp.ClientSession() as session:
            client = Client(f"http://127.0.0.1:{port}", 0.1, session, time.monotonic(), frozenset(IMPATIENT_CLASSES))

            def item(class_name: str) -> dict:
                return {"class": class_name, "long": False, "body": {"model": "m"},
                        "headers": {"x-ticket-type": class_name}}

            complaint = await client.send(item("complaint"), random.Random(1))
            loan = await client.send(item("loan_approval"), random.Random(1))
            client.impatient = frozenset({"answered"})
            answered = await client.send(item("answered"), random.Random(1))
    assert [status for _, status in complaint.attempts] == [429] * (1 + IMPATIENT_RETRIES) and not complaint.ok
    assert [status for _, status in loan.attempts] == [429] * 3
    assert answered.ok and len(answered.attempts) == 1 and answered.completion_tokens == 4
    assert answered.queue_wait_s == pytest.approx(5.0)  # 500 ms at a time scale of 0.1
    assert (answered.engine, answered.engine_queue_s, answered.prefill_s, answered.decode_s, answered.beside_prefill_s,
            answered.beside_long_prefill_s) == ("127.0.0.1:8001", 0.3, 0.7, 0.25, 0.6, 0.4)
