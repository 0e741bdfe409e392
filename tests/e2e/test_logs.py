"""The story of a request in logs and metrics: the sidecar's JSON decision lines, Envoy's access
log line carrying the sidecar's decision (dynamic metadata), the request-time histograms and the
backend scrape gauges, read back from a real stack (real Envoy, sidecar, simulated vLLM)."""

from __future__ import annotations

import json
import logging
import math
import shlex
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from extproc.core.config import ConfigError, Probes, parse_config
from extproc.server import SidecarServer
from extproc_testbed import stack as stack_module
from extproc_testbed.stack import SimSpec, Stack, StackPorts, envoy_binary, free_port, metric_sum

from ..conftest import OFFICER_KEY, TIME_SCALE, e2e_config
from ..helpers import chat, json_lines, metric, scrape, wait_until

# The decision record every decision line and every recent decision (the queue page's) holds.
RECORD_KEYS = {"ts", "request_id", "tenant", "pool", "class", "branch", "outcome", "wait_ms", "cost_tokens",
               "priority", "client_request_id"}
SECONDS_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 30, 60, 120,
                   math.inf]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The end-to-end config, with the primary's simulated vLLM polled for its /metrics and the
    fallback pointed at a backend nobody listens on."""
    work = tmp_path_factory.mktemp("logs")
    ports = StackPorts.random(primary=1)
    config = e2e_config()
    config["pools"]["primary"]["capacity"] = {"backends": [f"http://127.0.0.1:{ports.primary[0]}"]}
    config["pools"]["fallback"]["capacity"] = {"backends": [f"http://127.0.0.1:{free_port()}"]}
    path = work / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    # Envoy writes its access log out every 10 s by default (--file-flush-interval-msec): the
    # same Envoy, told to do it sooner, so the tests need not wait.
    envoy = work / "envoy"
    envoy.write_text(f'#!/bin/sh\nexec {shlex.quote(envoy_binary())} --file-flush-interval-msec 100 "$@"\n')
    envoy.chmod(0o755)
    sim_args = ("--time-scale", TIME_SCALE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stack_module, "envoy_binary", lambda: str(envoy))
        s = Stack(work, ports, path, primary=SimSpec("deepseek-sim", sim_args),
                  fallback=SimSpec("deepseek-sim-small", sim_args)).start()
    yield s
    s.stop()


def post(stack, body: bytes, **headers: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"{stack.url}/v1/chat/completions", body,
                                     {"content-type": "application/json", **headers}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers)


def one(records: list[dict], **wanted) -> dict:
    matches = [r for r in records if all(r.get(k) == v for k, v in wanted.items())]
    assert len(matches) == 1, f"{len(matches)} records match {wanted}"
    return matches[0]


def wait_for_line(path: Path, **wanted) -> dict:
    """The one JSON line of `path` with these fields (Envoy flushes its access log every second)."""
    wait_until(lambda: any(all(r.get(k) == v for k, v in wanted.items()) for r in json_lines(path)), 15,
               f"a line with {wanted} in {path.name}")
    return one(json_lines(path), **wanted)


def pause_primary(stack, paused: bool) -> None:
    request = urllib.request.Request(f"{stack.sim_url(0)}/sim/faults", json.dumps({"paused": paused}).encode(),
                                     {"content-type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=5).read()


def test_an_admitted_request_tells_its_story_in_both_logs(stack):
    status, headers = post(stack, chat(max_tokens=4), authorization=f"Bearer {OFFICER_KEY}",
                           **{"x-ticket-type": "loan_approval", "x-urgent-level": "1",
                              "x-request-id": "logs-admitted-1"})
    assert status == 200
    sidecar_log = stack.workdir / "sidecar.log"
    decision = wait_for_line(sidecar_log, client_request_id="logs-admitted-1", outcome="admitted")
    assert RECORD_KEYS <= set(decision)
    assert decision["tenant"] == "officer" and decision["branch"] == "0001"
    assert decision["pool"] == "primary" and decision["class"] == "loan_approval"
    assert decision["priority"] == pytest.approx(-0.1)  # loan base 0, one urgency level
    assert isinstance(decision["ts"], float) and isinstance(decision["request_id"], str)
    assert decision["wait_ms"] == int(headers["x-queue-wait-ms"])
    assert isinstance(decision["cost_tokens"], int) and decision["cost_tokens"] > 4  # prompt + max_tokens
    # the release follows, under the same request id, with how the exchange ended
    released = wait_for_line(sidecar_log, request_id=decision["request_id"], outcome="released")
    assert released["end"] == "completed" and released["status"] == 200
    assert released["duration_ms"] >= released["wait_ms"]

    # Envoy's line: what Envoy saw, and the sidecar's decision from its dynamic metadata
    access = wait_for_line(stack.workdir / "envoy.log", x_request_id="logs-admitted-1")
    assert access["request_id"] == decision["request_id"]  # joins the two logs
    assert access["status"] == 200 and access["details"] == "via_upstream"
    assert access["upstream_cluster"] == "vllm_primary"
    assert access["method"] == "POST" and access["path"] == "/v1/chat/completions"
    assert access["outcome"] == "admitted" and access["class"] == "loan_approval" and access["pool"] == "primary"
    assert access["tenant"] == "officer" and access["branch"] == "0001"
    assert access["priority"] == pytest.approx(decision["priority"])
    assert access["queue_wait_ms"] == decision["wait_ms"] and access["cost_tokens"] == decision["cost_tokens"]
    assert isinstance(access["duration_ms"], int) and access["upstream_host"].startswith("127.0.0.1:")


def test_refusals_are_logged_with_their_outcome(stack):
    # refused once its headers are read, before there is an exchange: no request id, no pool
    status, _ = post(stack, chat(), **{"x-urgent-level": "urgent!", "x-request-id": "logs-bad-header"})
    assert status == 400
    access = wait_for_line(stack.workdir / "envoy.log", x_request_id="logs-bad-header")
    assert access["outcome"] == "rejected_bad_request" and access["class"] == "unclassified"
    assert access["details"] == "extproc_rejected_bad_request"
    assert access["request_id"] is None and access["pool"] is None
    assert access["upstream_host"] is None and access["upstream_first_byte_ms"] is None  # no backend saw it

    # refused after its body: the exchange's record
    status, _ = post(stack, b'{"model": ', **{"x-request-id": "logs-bad-body"})
    assert status == 400
    decision = wait_for_line(stack.workdir / "sidecar.log", client_request_id="logs-bad-body")
    assert decision["outcome"] == "rejected_bad_request" and decision["pool"] is None
    assert decision["cost_tokens"] is None
    access = wait_for_line(stack.workdir / "envoy.log", x_request_id="logs-bad-body")
    assert access["request_id"] == decision["request_id"] and access["outcome"] == "rejected_bad_request"


def test_an_expired_wait_is_logged_with_its_wait(stack):
    pause_primary(stack, True)  # the blocker holds the primary's only slot
    try:
        blocker = urllib.request.Request(f"{stack.url}/v1/chat/completions", chat(max_tokens=2),
                                         {"content-type": "application/json", "x-ticket-type": "complaint"},
                                         method="POST")
        holding = threading.Thread(target=lambda: urllib.request.urlopen(blocker, timeout=30).read())
        holding.start()
        wait_until(lambda: metric(stack.metrics_url, "extproc_inflight", pool="primary") == 1, 15, "the blocker")
        status, headers = post(stack, chat(), **{"x-ticket-type": "quick_check", "x-request-id": "logs-expired"})
    finally:
        pause_primary(stack, False)
    holding.join(30)
    assert status == 503
    decision = wait_for_line(stack.workdir / "sidecar.log", client_request_id="logs-expired")
    assert decision["outcome"] == "expired_in_queue" and decision["class"] == "quick_check"
    assert decision["pool"] == "primary" and decision["wait_ms"] > 0  # it waited its class's 1 s (the timer's length is not asserted)
    assert decision["wait_ms"] == int(headers["x-queue-wait-ms"])
    access = wait_for_line(stack.workdir / "envoy.log", x_request_id="logs-expired")
    assert access["status"] == 503 and access["outcome"] == "expired_in_queue"
    assert access["queue_wait_ms"] == decision["wait_ms"] and access["pool"] == "primary"


def test_a_failover_names_the_pool_that_answered(stack):
    first_byte_before = {pool: metric(stack.metrics_url, "extproc_request_first_byte_seconds_count", pool=pool)
                         for pool in ("primary", "fallback")}
    # the primary answers 500 (x-sim-fault names its model); the fallback answers instead
    status, headers = post(stack, chat(max_tokens=2), **{"x-ticket-type": "complaint", "x-sim-fault": "deepseek-sim",
                                                          "x-request-id": "logs-failover"})
    assert status == 200 and headers["x-llm-fallback"] == "true"
    decision = wait_for_line(stack.workdir / "sidecar.log", client_request_id="logs-failover", outcome="admitted")
    assert decision["pool"] == "primary"  # where it was admitted first
    released = wait_for_line(stack.workdir / "sidecar.log", client_request_id="logs-failover", outcome="released")
    assert released["pool"] == "fallback" and released["status"] == 200 and released["end"] == "completed"
    access = wait_for_line(stack.workdir / "envoy.log", x_request_id="logs-failover")
    assert access["status"] == 200 and access["details"] == "extproc_failover" and access["fallback"] == "true"
    assert access["pool"] == "fallback" and access["outcome"] == "admitted"
    assert access["request_id"] == decision["request_id"]
    # the client's one first byte came from the fallback; the primary's failed answer never reached it
    first_byte = {pool: metric(stack.metrics_url, "extproc_request_first_byte_seconds_count", pool=pool)
                  for pool in ("primary", "fallback")}
    assert first_byte == {"primary": first_byte_before["primary"], "fallback": first_byte_before["fallback"] + 1}


def test_request_histograms_and_backend_gauges_are_scraped(stack):
    labels = {"pool": "primary", "class": "complaint"}
    names = ("extproc_request_first_byte_seconds", "extproc_request_duration_seconds")
    before = {name: metric(stack.metrics_url, f"{name}_count", **labels) for name in names}
    for _ in range(3):
        assert post(stack, chat(max_tokens=2), **{"x-ticket-type": "complaint"})[0] == 200
    # a duration is observed when the slot is released, which may come just after the client's last byte
    wait_until(lambda: all(metric(stack.metrics_url, f"{name}_count", **labels) >= before[name] + 3 for name in names),
               15, "the three exchanges to be observed")
    samples = scrape(stack.metrics_url)
    for name in names:
        assert metric_sum(samples, f"{name}_count", **labels) == before[name] + 3  # each exchange once
        buckets = sorted(float(dict(key)["le"]) for (n, key), _ in samples.items()
                         if n == f"{name}_bucket" and labels.items() <= dict(key).items())
        assert buckets == SECONDS_BUCKETS
    # the end of an exchange comes no earlier than its first byte
    assert (metric(stack.metrics_url, "extproc_request_duration_seconds_sum", **labels)
            >= metric(stack.metrics_url, "extproc_request_first_byte_seconds_sum", **labels))

    live = f"http://127.0.0.1:{stack.ports.primary[0]}/metrics"
    assert metric(stack.metrics_url, "extproc_backend_up", pool="primary", backend=live) == 1
    age = metric(stack.metrics_url, "extproc_backend_metrics_age_seconds", pool="primary", backend=live)
    assert 0 <= age < Probes().stale_after_s  # freshly read: the probe's last good poll is recent
    dead = [dict(key)["backend"] for (n, key) in samples if n == "extproc_backend_up" and dict(key)["pool"] == "fallback"]
    assert len(dead) == 1
    assert metric(stack.metrics_url, "extproc_backend_up", pool="fallback", backend=dead[0]) == 0
    assert metric(stack.metrics_url, "extproc_backend_metrics_age_seconds", pool="fallback", backend=dead[0]) == math.inf


def test_no_label_carries_a_tenant_a_branch_or_a_request_id(stack):
    post(stack, chat(max_tokens=2), authorization=f"Bearer {OFFICER_KEY}",
         **{"x-ticket-type": "complaint", "x-urgent-level": "9", "x-branch-id": "0417", "x-request-id": "logs-label"})
    decisions = [r for r in json_lines(stack.workdir / "sidecar.log") if "outcome" in r]
    identities = {"officer", "clerk", "anonymous", "0001", "0002", "0417", "logs-label"}
    identities |= {r["request_id"] for r in decisions if r["request_id"]}
    for name, labels in scrape(stack.metrics_url):
        names = {key for key, _ in labels}
        assert not names & {"tenant", "branch", "branch_id", "request_id", "key"}, name
        assert not {value for _, value in labels} & identities, name


# -- the switch, without Envoy -----------------------------------------------------------------

def _config(**extra) -> dict:
    return {"classes": {"complaint": {"base": 1}}, "default_class": "complaint",
            "pools": {"primary": {"cluster": "vllm_primary", "max_inflight": 2}}, "default_pool": "primary",
            "probes": {"nvml": "off"}, **extra}


@pytest.mark.parametrize("decisions", [True, False])
def test_the_switch_turns_the_lines_off_and_keeps_the_recent_decisions(decisions, capsys, caplog):
    caplog.set_level(logging.INFO, logger="extproc.decisions")
    server = SidecarServer(parse_config(_config(logging={"decisions": decisions})))
    gate, recent = server.gate, server.recent.records
    for _ in range(3):
        exchange = gate.open({":path": "/v1/models"})
        gate.pass_through(exchange)
    server.decision_log.flush()  # the lines are written off the event loop; the test reads them now
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert [r["outcome"] for r in recent] == ["passed_through"] * 3
    assert RECORD_KEYS == set(recent[-1])
    assert lines == (list(recent) if decisions else [])


def test_a_reload_turns_the_lines_off_and_on(capsys, caplog):
    """The switch follows a reload (server._apply gives every part that follows one the new configuration)."""
    caplog.set_level(logging.INFO, logger="extproc.decisions")
    server = SidecarServer(parse_config(_config()))

    def lines_of_one_request() -> int:
        server.gate.pass_through(server.gate.open({":path": "/v1/models"}))
        server.decision_log.flush()
        return sum(line.startswith("{") for line in capsys.readouterr().err.splitlines())

    def reload(config: dict) -> None:  # what server._apply does, without the capacity loop it restarts
        new, old = parse_config(config), server.config
        server.config = new
        for follow in server._follow_reloads:
            follow(new, old)

    assert lines_of_one_request() == 1
    reload(_config(logging={"decisions": False}))
    assert lines_of_one_request() == 0
    reload(_config(logging={"decisions": True}))
    assert lines_of_one_request() == 1


def test_the_recent_decisions_keep_the_newest_200():
    server = SidecarServer(parse_config(_config()))
    gate = server.gate
    ids = []
    for _ in range(230):
        exchange = gate.open({":path": "/v1/models"})
        gate.pass_through(exchange)
        ids.append(exchange.id)
    assert [r["request_id"] for r in server.recent.records] == ids[-200:]


@pytest.mark.parametrize(("logging_section", "key"), [
    ({"decisions": "sometimes"}, "logging.decisions"),
    ({"decision": False}, "logging.decision"),
])
def test_a_bad_logging_setting_is_refused_by_name(logging_section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(_config(logging=logging_section))


def test_a_backend_that_leaves_the_configuration_leaves_no_series():
    from extproc.ops.metrics import Metrics

    metrics = Metrics()
    for url in ("http://a/metrics", "http://b/metrics"):
        metrics.backend_up.labels("primary", url).set(1)
        metrics.backend_kv_usage.labels("primary", url).set(0.9)
        metrics.backend_requests.labels("primary", url, "running").set(3)
    metrics.forget_backend("primary", "http://b/metrics")
    metrics.forget_backend("primary", "http://never-seen/metrics")  # nothing to forget: no error
    names = ("extproc_backend_up", "extproc_backend_kv_usage", "extproc_backend_requests")
    backends = {s.labels["backend"] for family in metrics.registry.collect() if family.name in names
                for s in family.samples}
    assert backends == {"http://a/metrics"}
