"""Whether Envoy follows the sidecar's engine picks (core/picks.py), and that the sidecar says so."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import yaml

from extproc.core.config import load_config
from extproc.core.picks import Following, PickWatch
from extproc.envoy.config_check import check_envoy
from extproc_testbed.envoy_config import template_path
from extproc_testbed.stack import SimSpec, Stack, StackPorts, http_get

from ..conftest import e2e_config
from ..helpers import metric, wait_until


def test_nothing_is_known_until_enough_placed_requests_answered():
    watch = PickWatch(window=20, min_samples=10)
    assert [watch.observe("p", True) for _ in range(9)] == [None] * 9
    assert watch.state("p") is Following.UNKNOWN and watch.share("p") == 1.0
    assert watch.observe("p", True) is Following.FOLLOWED
    assert watch.state("other") is Following.UNKNOWN and watch.share("other") is None


def test_envoy_that_follows_is_told_from_one_that_balances_by_its_own_policy():
    watch = PickWatch()  # the last 50; followed from 96 %, ignored below 85 %, in between as it was
    # Envoy following: an ejected pick or a retry elsewhere now and then (one in 25) keeps the verdict
    verdicts = [watch.observe("p", i % 25 != 24) for i in range(300)]
    assert [v for v in verdicts if v is not None] == [Following.FOLLOWED]
    # then the cluster balances on its own (two engines: the pick matches by chance, half the time)
    verdicts = [watch.observe("p", i % 2 == 0) for i in range(200)]
    assert [v for v in verdicts if v is not None] == [Following.IGNORED]  # said once, not at every request
    assert watch.state("p") is Following.IGNORED
    # least request agrees with a pick by the least loaded engine more often than chance, up to
    # nine in ten for a while: still ignored, and said once (one threshold at 80 % over the last
    # 20 flipped it every few seconds)
    verdicts = [watch.observe("p", i % 5 != 4 if i < 200 else i % 10 != 9) for i in range(300)]
    assert [v for v in verdicts if v is not None] == []
    # and followed again once the cluster is fixed
    verdicts = [watch.observe("p", True) for _ in range(50)]
    assert [v for v in verdicts if v is not None] == [Following.FOLLOWED]
    # a following Envoy that misses more for a while (a pick ejected) is not called ignored...
    verdicts = [watch.observe("p", i % 10 != 9) for i in range(100)]
    assert [v for v in verdicts if v is not None] == []
    # ...and from nothing known, a share in between says nothing until a whole window is in
    # between; then the middle of the two thresholds (90 %) decides
    fresh = PickWatch()
    assert [fresh.observe("q", i % 12 != 5) for i in range(49)] == [None] * 49
    assert fresh.state("q") is Following.UNKNOWN
    assert fresh.observe("q", True) is Following.FOLLOWED  # 46 of 50
    lower = PickWatch()
    assert [v for v in (lower.observe("q", i % 8 != 5) for i in range(50)) if v] == [Following.IGNORED]  # 44 of 50


def test_each_pool_has_its_own_verdict():
    watch = PickWatch(window=10, min_samples=10)
    for _ in range(10):
        watch.observe("a", True)
        watch.observe("b", False)
    assert (watch.state("a"), watch.state("b")) == (Following.FOLLOWED, Following.IGNORED)


# -- what the sidecar relies on in a team's envoy.yaml (envoy/config_check.py) ----------------------

def _template() -> dict:
    return yaml.safe_load(template_path().read_text())


def _ext_proc(envoy: dict) -> dict:
    (ingress,) = [listener for listener in envoy["static_resources"]["listeners"] if listener["name"] == "llm_ingress"]
    manager = ingress["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f["typed_config"] for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")


def plain_least_request(envoy: dict) -> dict:
    """The template with every model cluster balanced by Envoy's least request, as a team writes it."""
    for cluster in envoy["static_resources"]["clusters"]:
        if cluster.pop("load_balancing_policy", None) is not None:
            cluster["lb_policy"] = "LEAST_REQUEST"
    return envoy


def test_the_template_gives_the_sidecar_everything_it_relies_on():
    assert check_envoy(_template(), load_config()) == []


def test_a_cluster_that_balances_by_its_own_policy_is_named_for_a_pool_that_picks():
    findings = check_envoy(plain_least_request(_template()), load_config())
    assert [f.where for f in findings] == ["clusters[vllm_primary].load_balancing_policy"]
    assert "balances by LEAST_REQUEST" in findings[0].what and "pools.primary" in findings[0].what
    # a pool that does not pick its engines relies on no policy
    config = load_config()
    primary = config.pools["primary"]
    unpicked = config.model_copy(update={"pools": {**config.pools, "primary": primary.model_copy(
        update={"capacity": primary.capacity.model_copy(update={"pick_backend": False})})}})
    assert check_envoy(plain_least_request(_template()), unpicked) == []


def test_each_setting_the_sidecar_relies_on_is_named_with_what_follows():
    envoy = _template()
    ext_proc = _ext_proc(envoy)
    ext_proc["processing_mode"].pop("response_trailer_mode")  # Envoy's default: SKIP
    ext_proc["processing_mode"]["request_body_mode"] = "NONE"
    ext_proc["response_attributes"] = ["response.code_details"]
    ext_proc["max_message_timeout"] = "30s"
    ext_proc["forward_rules"]["allowed_headers"]["patterns"] = [
        p for p in ext_proc["forward_rules"]["allowed_headers"]["patterns"] if p.get("exact") != "x-ticket-type"]
    ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] = ["extproc"]
    said = {f.where.rsplit(".", 1)[-1]: f.what for f in check_envoy(envoy, load_config())}
    assert "released while the engine still generates" in said["response_trailer_mode"]
    assert "nothing is costed" in said["request_body_mode"]
    assert "'upstream.address'" in said["response_attributes"]
    assert "504" in said["max_message_timeout"]
    assert "x-ticket-type" in said["allowed_headers"]
    assert "'envoy.lb'" in said["untyped"]
    assert len(said) == 6


def test_check_config_reads_an_envoy_yaml_and_says_what_is_missing(tmp_path):
    plain = tmp_path / "envoy.yaml"
    plain.write_text(yaml.safe_dump(plain_least_request(_template())))
    default = Path(__file__).resolve().parents[2] / "extproc" / "core" / "default_config.yaml"
    result = subprocess.run([sys.executable, "-m", "extproc", "check-config", str(default), "--envoy", str(plain)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "missing: clusters[vllm_primary].load_balancing_policy: balances by LEAST_REQUEST" in result.stdout
    result = subprocess.run([sys.executable, "-m", "extproc", "check-config", str(default), "--envoy",
                             str(template_path())], capture_output=True, text=True)
    assert result.returncode == 0 and "OK: it gives the sidecar what it relies on" in result.stdout


# -- through real Envoy: the sidecar says whether its picks are followed -----------------------------

def picking_config(ports: StackPorts) -> dict:
    config = e2e_config()
    config["classes"]["loan_approval"]["latency_target_s"] = 2  # (a target: long prompts are kept from loans)
    config["pools"]["primary"].update(max_inflight=8, capacity={
        "backends": [f"http://127.0.0.1:{p}" for p in ports.primary], "pick_backend": True})
    return config


@pytest.mark.parametrize("envoy", ["template", "plain least request"])
def test_the_sidecar_tells_whether_envoy_follows_its_engine_picks(tmp_path, envoy):
    """One request at a time over three idle engines: the sidecar names the same engine first
    each time (nothing runs anywhere); the template's override_host sends every request there,
    a plain least-request cluster wherever its own choice falls (one in three there)."""
    ports = StackPorts.random(primary=3)
    config_path = tmp_path / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(picking_config(ports)))
    stack = Stack(tmp_path, ports, config_path, primary=SimSpec("deepseek-sim", ("--time-scale", "0.05")))
    if envoy != "template":
        stack.envoy_template = tmp_path / "team-envoy.yaml"
        stack.envoy_template.write_text(yaml.safe_dump(plain_least_request(_template())))
    with stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-none", max_retries=0)
        for i in range(30):
            client.chat.completions.create(model="deepseek-sim", messages=[{"role": "user", "content": f"q{i}"}],
                                           max_tokens=2)
        ignored = envoy != "template"
        placed = {followed: metric(stack.metrics_url, "extproc_engine_picks_total", pool="primary",
                                   followed=followed) for followed in ("true", "false")}
        assert sum(placed.values()) == 30 and (placed["false"] > 0) == ignored, placed
        assert metric(stack.metrics_url, "extproc_engine_picks_ignored", pool="primary") == int(ignored)
        log = (tmp_path / "sidecar.log").read_text()
        assert ("Envoy does not follow the sidecar's engine picks" in log) == ignored
        assert ("Envoy follows the sidecar's engine picks" in log) != ignored
        def primary_pool() -> dict:
            (pool, *_), = [json.loads(http_get(f"http://127.0.0.1:{ports.metrics}/queue/state")[1])["pools"]]
            return pool

        primary = primary_pool()
        assert primary["name"] == "primary" and primary["engine_picks"] == ("ignored" if ignored else "followed")
        # and what keeps long prompts from the loans now: in time where Envoy places the requests,
        # on engines of their own where it follows the picks (three engines answer). The rule is
        # the one the last probe tick gave admission, and the verdict asks for a tick at once (the
        # wait: that tick's probes may still be under way when the last answer comes back).
        rule = "wait_for_quiet" if ignored else "placed_apart"
        seen: list[dict] = []
        wait_until(lambda: seen.append(primary_pool()) or seen[-1]["long_prompts"] == rule, timeout=10,
                   what=f"the long prompts' rule {rule}")
        primary = seen[-1]
        assert (primary["long_prompts"], primary["long_quiet_s"]) == (rule, 2.0)
        assert ("kept apart in time" in primary["long_prompts_said"]) == ignored
        state = subprocess.run([sys.executable, "-m", "extproc", "admin", "--address", f"127.0.0.1:{ports.admin}",
                                "state"], capture_output=True, text=True, timeout=30)
        assert state.returncode == 0
        assert ("ENGINE PICKS IGNORED" in state.stdout) == ignored
        assert ("engine picks followed" in state.stdout) != ignored
        # the primary's lines: its own, then those indented under it (the fallback pool, placed by
        # Envoy on one engine, has its own)
        lines = state.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("primary "))
        said = lines[start:next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))]
        quiet = ("          long prompts: Envoy places this pool's requests by a policy of its own, or is not known "
                 "yet to follow the sidecar's picks, so long prompts are kept apart in time: each waits until no "
                 "latency-bound request and no other long prompt runs; one of a class without a latency target "
                 "also until none came in the last 2 s, nor 4 in the last 8 s; one still in its prefill when a "
                 "latency-bound request arrives yields its engine, once")
        assert (quiet in said) == ignored, said
        assert any(line.startswith("          long prompts: placed on engines apart") for line in said) != ignored
