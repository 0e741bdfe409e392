"""The load tools' shipped configurations (bench/guidellm/, bench/inference-perf/) parse, carry
the keys each tool needs to reach the sidecar as the seed's classes, and keep the seed's mix; and
`extproc bench loadtools` reads the tools' reports. None of the tools is needed: the files are
read as YAML, the reports are small ones written here in the tools' shapes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from extproc.core.config import parse_config
from extproc_testbed import loadtools
from extproc_testbed.demo import DEMO_KEYS, demo_config
from extproc_testbed.report import loadtools_section
from extproc_testbed.traffic import CLASSES

ROOT = Path(__file__).resolve().parents[2]
GUIDELLM = ROOT / "bench" / "guidellm"
INFERENCE_PERF = ROOT / "bench" / "inference-perf"
SEED_MIX = {"loan_approval": 0.2, "complaint": 0.3, "archive_query": 0.5}  # traffic.ticket's weights
CONFIG = parse_config(demo_config(), "demo")  # the load tools run against `make demo`
USABLE_CONTEXT = int(CONFIG.requests.max_model_len * (1 - CONFIG.requests.context_reserve))


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), path
    return data


def _check_claims(headers: dict, api_key: str | None) -> None:
    """The headers name a class of the shipped config, and the caller may claim what they claim."""
    assert all(isinstance(v, str) for v in headers.values()), "header values must be strings"
    ticket = headers["x-ticket-type"]
    assert ticket in CONFIG.classes
    rights = CONFIG.anonymous
    if api_key is not None:
        assert api_key in DEMO_KEYS
        digest = hashlib.sha256(api_key.encode()).hexdigest()
        (rights,) = [t for t in CONFIG.tenants if digest in t.api_key_sha256]
        assert rights.name == DEMO_KEYS[api_key]
        assert headers.get("x-branch-id") == rights.branch_id  # the tenant's branch wins anyway: say it
    assert rights.may_claim(ticket)
    assert int(headers.get("x-urgent-level", 0)) <= rights.max_urgent_level
    assert int(headers.get("x-vip-level", 0)) <= rights.max_vip_level


def test_the_classes_are_the_seeds():
    assert set(SEED_MIX) == set(CLASSES) == set(CONFIG.classes)


@pytest.mark.parametrize("path", sorted(GUIDELLM.glob("*.yaml")), ids=lambda p: p.name)
def test_guidellm_scenarios(path: Path):
    scenario = _load(path)
    spec = scenario["spec"]
    backend = spec["backend"]
    assert backend["kind"] == "openai_http"
    assert backend["request_format"] == "/v1/chat/completions"
    assert backend["target"] == "http://127.0.0.1:10000"
    _check_claims(backend["extras"]["headers"], backend.get("api_key"))
    assert spec["profile"]["kind"] in {"sweep", "constant"}  # poisson once bunched its schedule
    if spec["profile"]["kind"] == "sweep":
        assert spec["profile"]["strategy_type"] == "constant"
    kinds = [c["kind"] for c in spec["constraints"]]
    assert kinds == ["max_requests"]  # max_duration cancels what is in flight
    assert spec["tokenizer"] == {"kind": "hf_auto", "model": "bench/.tokenizer"}
    (data,) = spec["data"]
    assert data["kind"] == "synthetic_text"
    assert data["prompt_tokens_max"] + data["output_tokens_max"] <= USABLE_CONTEXT
    for step in scenario.get("benchmarks", []):
        assert set(step) <= {"profile.rate", "constraints[0].count"}
        assert step["constraints[0].count"] >= 1 and step["profile.rate"] > 0


def test_guidellm_mix_keeps_the_seeds_shares():
    scenarios = {c: _load(GUIDELLM / f"constant-{c}.yaml") for c in CLASSES}
    for name, scenario in scenarios.items():
        assert scenario["spec"]["backend"]["extras"]["headers"]["x-ticket-type"] == name
    steps = {name: [s["profile.rate"] for s in scenario["benchmarks"]] for name, scenario in scenarios.items()}
    totals = [sum(rates) for rates in zip(*steps.values(), strict=True)]
    for name, rates in steps.items():
        assert len(rates) == len(totals)
        for rate, total in zip(rates, totals, strict=True):
            assert rate == pytest.approx(SEED_MIX[name] * total, abs=0.01)
    # the first step is also the spec's own (what runs when the benchmarks list is dropped)
    for scenario in scenarios.values():
        assert scenario["spec"]["profile"]["rate"] == scenario["benchmarks"][0]["profile.rate"]
    # run at once, the three must not send the same prompts in step
    assert len({s["spec"]["seed"]["value"] for s in scenarios.values()}) == len(scenarios)


def test_inference_perf_configs_keep_the_mix_and_reach_chat():
    configs = {c: _load(INFERENCE_PERF / f"{c}.yaml") for c in CLASSES}
    stage_rates = {}
    for name, config in configs.items():
        assert config["api"] == {**config["api"], "type": "chat", "streaming": True}
        assert config["api"]["headers"]["x-ticket-type"] == name
        _check_claims(config["api"]["headers"], config["server"].get("api_key"))
        data = config["data"]
        assert data["type"] == "synthetic" and data["multimodal"] == {}  # the only way to /v1/chat/completions
        dist = data["input_distribution"]
        assert dist["min"] <= 500 <= dist["mean"] and dist["max"] <= USABLE_CONTEXT
        assert "output_distribution" in data  # required, though ignored on the chat path
        assert config["server"]["base_url"] == "http://127.0.0.1:10000"
        assert config["server"]["model_name"] == "deepseek-sim"
        assert config["tokenizer"]["pretrained_model_name_or_path"] == "bench/.tokenizer"
        assert config["load"]["type"] == "constant"
        stages = config["load"]["stages"]
        assert [set(s) for s in stages] == [{"rate", "duration"}] * len(stages)
        assert len({s["duration"] for s in stages}) == 1
        stage_rates[name] = [s["rate"] for s in stages]
    assert len({c["load"]["base_seed"] for c in configs.values()}) == len(configs)  # not the same prompts in step
    totals = [sum(rates) for rates in zip(*stage_rates.values(), strict=True)]
    assert totals == sorted(totals) and len(set(totals)) == len(totals)  # a staircase
    for name, rates in stage_rates.items():
        for rate, total in zip(rates, totals, strict=True):
            assert rate == pytest.approx(SEED_MIX[name] * total, abs=0.01)


def test_inference_perf_keys_are_its_own():
    """Keys from its config models (0.7.0, which forbid unknown keys): a typo fails the tool at
    start-up; here it fails first."""
    known = {
        "api": {"type", "streaming", "headers"},
        "data": {"type", "multimodal", "input_distribution", "output_distribution"},
        "load": {"type", "stages", "num_workers", "worker_max_concurrency", "request_timeout", "base_seed"},
        "server": {"type", "model_name", "base_url", "ignore_eos", "api_key"},
        "tokenizer": {"pretrained_model_name_or_path"},
        "report": {"request_lifecycle"},
        "storage": {"local_storage"},
    }
    distribution = {"type", "mean", "std_dev", "min", "max"}
    for path in INFERENCE_PERF.glob("*.yaml"):
        config = _load(path)
        assert set(config) <= set(known), path
        for section, keys in known.items():
            assert set(config.get(section, {})) <= keys, (path, section)
        for key in ("input_distribution", "output_distribution"):
            assert set(config["data"][key]) <= distribution


def _guidellm_report() -> dict:
    def dist(p50: float, p99: float) -> dict:
        return {"successful": {"mean": p50, "percentiles": {"p50": p50, "p95": p99, "p99": p99}, "pdf": None},
                "errored": {"mean": 0}, "incomplete": {"mean": 0}, "total": {"mean": p50}}

    error = {"request_args": json.dumps({"headers": {"x-ticket-type": "loan_approval"}}),
             "info": {"error": "Client error '429 Too Many Requests' for url 'http://127.0.0.1:10000/v1/chat/completions'"}}
    metrics = {"request_totals": {"successful": 9, "errored": 2, "incomplete": 0, "total": 11},
               "requests_per_second": dist(3.4, 3.4), "time_to_first_token_ms": dist(80, 133),
               "time_per_output_token_ms": dist(6.5, 7), "request_latency": dist(0.4, 0.5),
               "prompt_token_count": dist(800, 1200), "text": {"big": "x" * 1000}}
    return {"benchmarks": [{"config": {"strategy": {"type_": "constant", "rate": 3.4}}, "metrics": metrics,
                            "requests": {"successful": [], "errored": [error, {**error, "info": {"error": "x '503 Service Unavailable' y"}}]}}]}


def test_collect_reads_both_tools_reports(tmp_path: Path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_guidellm_report()))
    run = tmp_path / "ip" / "loan_approval"
    run.mkdir(parents=True)
    stage = {"successes": {"count": 10, "throughput": {"requests_per_sec": 2.0},
                           "latency": {"time_to_first_token": {"median": 0.1, "p90": 0.2, "p99": 0.3},
                                       "time_per_output_token": {"median": 0.005, "p90": 0.006, "p99": 0.007},
                                       "request_latency": {"median": 0.4, "p90": 0.5, "p99": 0.6}},
                           "prompt_tokens": {"median": 450, "p90": 900, "p99": 3000}},
             "failures": {"count": 1, "by_label": {"429 - Too Many Requests": {"count": 1, "messages": []}}}}
    for name in ("summary_lifecycle_metrics.json", "stage_0_lifecycle_metrics.json"):
        (run / name).write_text(json.dumps(stage))
    (run / "config.yaml").write_text("load:\n  stages:\n  - rate: 0.8\n    duration: 30\n")
    out = tmp_path / "results" / "loadtools"
    summary = loadtools.collect(out, sweep, None, tmp_path / "ip", {"guidellm_sweep": "guidellm run ..."}, "")
    (bench,) = summary["guidellm_sweep"]
    assert bench["strategy"] == "constant@3.40"
    assert bench["errored_by_status"] == {"429": 1, "503": 1}
    assert bench["ttft_ms"]["p99"] == 133 and bench["headers"] == {"x-ticket-type": "loan_approval"}
    (stage_summary,) = summary["inference_perf_mix"]["loan_approval"]["stages"]
    assert stage_summary["rate"] == 0.8 and stage_summary["ttft_ms"] == {"p50": 100, "p90": 200, "p99": 300}
    assert stage_summary["failed_by_label"] == {"429 - Too Many Requests": 1}
    small = json.loads((out / "guidellm-sweep.json").read_text())
    assert "requests" not in small["benchmarks"][0] and "text" not in small["benchmarks"][0]["metrics"]
    text = "\n".join(loadtools_section(summary))
    assert "429: 1, 503: 1" in text and "guidellm run ..." in text and "| loan_approval | 0.8 | 10 / 1 |" in text
