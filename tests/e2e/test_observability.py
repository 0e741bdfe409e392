"""The alert rules and the Grafana dashboard, checked with real tools.

promtool checks the Prometheus configs and the rules and runs the rules' unit tests; every PromQL
expression of the rules and the dashboard is parsed by a real PromQL parser, and each metric it
reads (with the labels it matches and groups by) is looked for in what a real sidecar, its real
Envoy (through the envoy_stats listener Prometheus scrapes) and a simulated vLLM export after
requests went through Envoy.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.server import SidecarServer
from extproc_testbed.envoy_config import EnvoyLayout, render_file
from extproc_testbed.stack import (
    LOOPBACK, ManagedProcess, SimSpec, Stack, StackPorts, envoy_binary, free_port, http_get, parse_samples,
)
from extproc_testbed.stack import wait_until as wait_for_process

from ..conftest import OFFICER_KEY, TIME_SCALE, e2e_config
from ..helpers import chat, scrape, sidecar_from_file, wait_until

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "extproc.json"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
PROMETHEUS_CONFIGS = [PROMETHEUS_DIR / "prometheus.yml", PROMETHEUS_DIR / "kubernetes.yml"]
RUNBOOK_LINK = "{{ $externalLabels.runbook_base }}/runbook.md#"

SEVERITIES = {"page", "warning", "info"}
# Series Prometheus makes itself rather than scrapes, with their label names (None: any).
PROMETHEUS_OWN: dict[str, set[str] | None] = {"up": {"job", "instance"}, "ALERTS": None}
TARGET_LABELS = {"job", "instance"}  # Prometheus adds them to every scraped series
# Grafana's interval variables: PromQL durations once Grafana has filled them in.
GRAFANA_INTERVALS = ("$__rate_interval", "$__interval", "$__range")
# The sample names of a metric family, by its type (a family declared with no sample yet).
SAMPLE_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


# ---------------------------------------------------------------------------- reading the files


def load_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def with_grafana_intervals(expr: str) -> str:
    for variable in GRAFANA_INTERVALS:
        expr = expr.replace(variable, "5m")
    return expr


def rule_queries() -> list[tuple[str, str]]:
    return [(f"alert {rule['alert']}", rule["expr"]) for rule in load_rules()]


def dashboard_queries() -> list[tuple[str, str]]:
    """Every query of the dashboard as PromQL: panel targets, annotations, and each template
    variable's `label_values(SELECTOR, LABEL)` as `group by (LABEL) (SELECTOR)`."""
    dashboard = load_dashboard()
    queries = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r} query {target['refId']}", with_grafana_intervals(target["expr"])))
    for annotation in dashboard["annotations"]["list"]:
        queries.append((f"annotation {annotation['name']!r}", with_grafana_intervals(annotation["expr"])))
    for variable in dashboard["templating"]["list"]:
        found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]["query"])
        assert found, f"variable {variable['name']}: not a label_values(SELECTOR, LABEL) query"
        queries.append((f"variable {variable['name']!r}", f"group by ({found[2]}) ({found[1]})"))
    return queries


def heading_anchors(markdown: str) -> set[str]:
    """The anchors a Markdown renderer gives the headings (GitHub's rule)."""
    anchors = set()
    for line in markdown.splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading[1].strip().lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


# ---------------------------------------------------------------------------- PromQL


def children(node) -> list:
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(node, promql_parser.AggregateExpr):
        return [node.expr, node.param]
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.UnaryExpr | promql_parser.ParenExpr | promql_parser.SubqueryExpr):
        return [node.expr]
    return []


def nodes(node) -> Iterator:
    yield node
    for child in children(node):
        if isinstance(child, promql_parser.Expr):
            yield from nodes(child)


def metric_name(selector) -> str | None:
    if selector.name:
        return selector.name
    for matcher in selector.matchers.matchers:
        if matcher.name == "__name__" and matcher.op == promql_parser.MatchOp.Equal:
            return matcher.value
    return None


def selectors(ast) -> list:
    return [node for node in nodes(ast) if isinstance(node, promql_parser.VectorSelector)]


def exported_series(*texts: str) -> dict[str, dict[str, set[str]] | None]:
    """Each series name in Prometheus text with the values seen of each label; a family declared
    with no sample yet (a labelled metric never set) gives its sample names with None. A counter
    keeps the name it is written with, as Prometheus does (Envoy's have no `_total`; the parser
    would add one)."""
    series: dict[str, dict[str, set[str]] | None] = {}
    for text in texts:
        written = set(re.findall(r"^([A-Za-z_:][\w:]*)", text, re.M))
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name if sample.name in written else sample.name.removesuffix("_total")
                labels = series.get(name) or {}
                series[name] = labels
                for label, value in sample.labels.items():
                    labels.setdefault(label, set()).add(value)
            if not family.samples:
                for suffix in SAMPLE_SUFFIXES.get(family.type, ("",)):
                    series.setdefault(family.name + suffix, None)
    return series


def label_names(name: str, exported: dict) -> set[str] | None:
    if name in PROMETHEUS_OWN:
        return PROMETHEUS_OWN[name]
    labels = exported[name]
    return None if labels is None else set(labels) | TARGET_LABELS


def query_problems(where: str, expr: str, exported: dict) -> list[str]:
    """What is wrong with one query: it does not parse, or it reads a series nobody exports, a
    label that series lacks, or a label value it never takes."""
    try:
        ast = promql_parser.parse(expr)
    except Exception as error:  # the parser's own error type is not exported
        return [f"{where}: does not parse ({error}): {expr}"]
    problems = []
    for selector in selectors(ast):
        name = metric_name(selector)
        if name is None:
            problems.append(f"{where}: a selector without a metric name: {expr}")
        elif name not in exported and name not in PROMETHEUS_OWN:
            problems.append(f"{where}: {name} is not exported")
        elif (known := label_names(name, exported)) is not None:
            for matcher in selector.matchers.matchers:
                if matcher.name == "__name__":
                    continue
                if matcher.name not in known:
                    problems.append(f"{where}: {name} has no label {matcher.name!r}")
                elif (matcher.op == promql_parser.MatchOp.Equal and matcher.name not in TARGET_LABELS
                      and name not in PROMETHEUS_OWN and "$" not in matcher.value
                      and matcher.value not in exported[name][matcher.name]):
                    problems.append(f"{where}: {name} never has {matcher.name}={matcher.value!r} "
                                    f"(seen: {sorted(exported[name][matcher.name])})")
    for node in nodes(ast):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None \
                and node.modifier.type == promql_parser.AggModifierType.By:
            known = [label_names(metric_name(s), exported) for s in selectors(node.expr)
                     if metric_name(s) in exported or metric_name(s) in PROMETHEUS_OWN]
            if known and all(k is not None for k in known):
                missing = set(node.modifier.labels) - set().union(*known)
                if missing:
                    problems.append(f"{where}: groups by {sorted(missing)}, a label none of its series has")
    return problems


# ---------------------------------------------------------------------------- promtool


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    program = shutil.which("promtool")
    if program is None:
        pytest.fail("promtool is not installed: apt-get install prometheus (.ci/run installs it)")
    return subprocess.run([program, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def promtool(*args: str) -> str:
    result = run_promtool(*args)
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{result.stdout}{result.stderr}"
    return result.stdout + result.stderr


def test_promtool_accepts_the_configs_and_the_rules():
    for config in PROMETHEUS_CONFIGS:
        promtool("check", "config", str(config))  # loads alerts.yml too
    output = promtool("check", "rules", str(RULES))
    assert f"SUCCESS: {len(load_rules())} rules found" in output


def test_the_rules_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", str(RULE_TESTS))


def test_the_unit_tests_fail_when_an_alert_does_not_fire_as_expected(tmp_path):
    """The unit tests have teeth: a firing alert expected silent makes promtool fail."""
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tests["rule_files"] = [str(RULES)]
    case = next(case for group in tests["tests"] for case in group["alert_rule_test"] if case["exp_alerts"])
    case["exp_alerts"] = []
    broken = tmp_path / "alerts_test.yml"
    broken.write_text(yaml.safe_dump(tests))
    result = run_promtool("test", "rules", str(broken))
    assert result.returncode != 0
    assert case["alertname"] in result.stdout + result.stderr


# ---------------------------------------------------------------------------- the rules' shape


def test_every_alert_has_a_duration_a_severity_and_a_runbook_entry():
    anchors = heading_anchors(RUNBOOK.read_text())
    rules = load_rules()
    assert rules
    for rule in rules:
        name = rule["alert"]
        assert promql_parser.parse_duration(rule["for"]).total_seconds() > 0, name
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"], name
        link = rule["annotations"]["runbook_url"]
        assert link == f"{RUNBOOK_LINK}{name.lower()}", f"{name}: runbook link {link}"
        assert name.lower() in anchors, f"{name}: docs/runbook.md has no heading for it"
    deep = [rule for rule in rules if 'level="deep"' in rule["expr"]]
    assert deep and all(rule["labels"]["severity"] == "page" for rule in deep)


def test_runbook_links_are_absolute_urls_from_one_configured_base():
    """Alertmanager and pagers show runbook_url as it is: a link relative to the repository leads
    nowhere. Every Prometheus config sets the base the alerts' links start with, and the unit
    tests read the links as Prometheus builds them."""
    for config in PROMETHEUS_CONFIGS:
        base = yaml.safe_load(config.read_text())["global"]["external_labels"]["runbook_base"]
        assert re.fullmatch(r"https://[^\s/]+/\S*[^/]", base), f"{config.name}: runbook_base {base!r}"
    groups = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    for group in groups:
        base = group["external_labels"]["runbook_base"]
        for case in group["alert_rule_test"]:
            for alert in case["exp_alerts"]:
                link = alert["exp_annotations"]["runbook_url"]
                assert link == f"{base}/runbook.md#{case['alertname'].lower()}", link


def test_every_alert_is_tested_firing_and_silent():
    cases = [case for group in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in group["alert_rule_test"]]
    for rule in load_rules():
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case["exp_alerts"] for case in mine), f"{rule['alert']}: no test where it fires"
        assert any(not case["exp_alerts"] for case in mine), f"{rule['alert']}: no test where it must stay silent"


# ---------------------------------------------------------------------------- the dashboard's shape


def test_the_dashboard_reads_the_provisioned_datasource():
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    dashboard = load_dashboard()
    users = [(f"panel {p['title']!r}", p["datasource"]) for p in dashboard_panels(dashboard) if p["type"] != "row"]
    users += [(f"panel {p['title']!r} query {t['refId']}", t["datasource"])
              for p in dashboard_panels(dashboard) for t in p.get("targets", [])]
    users += [(f"variable {v['name']!r}", v["datasource"]) for v in dashboard["templating"]["list"]]
    users += [(f"annotation {a['name']!r}", a["datasource"]) for a in dashboard["annotations"]["list"]]
    for where, datasource in users:
        assert datasource == {"type": "prometheus", "uid": uid}, where
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"pool", "class"}
    ids = [p["id"] for p in dashboard_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"


def test_the_query_checker_finds_names_labels_and_values():
    """The checks below are only as good as this reading of PromQL."""
    exported = exported_series(
        "# TYPE w_seconds histogram\n"
        'w_seconds_bucket{pool="p",le="1.0"} 1\nw_seconds_bucket{pool="p",le="+Inf"} 1\n'
        'w_seconds_sum{pool="p"} 0.5\nw_seconds_count{pool="p"} 1\n'
        "# TYPE g gauge\n"
        "# TYPE c_total counter\n"
        'c_total{level="deep"} 3\n'
        "# TYPE envoy_c counter\n"
        'envoy_c{prefix="in"} 0\n'
    )
    assert exported["g"] is None and exported["c_total"] == {"level": {"deep"}}
    assert exported["envoy_c"] == {"prefix": {"in"}} and "envoy_c_total" not in exported
    good = 'histogram_quantile(0.99, sum by (le, pool) (rate(w_seconds_bucket{pool=~"$pool"}[5m]))) > g or c_total{level="deep"}'
    assert query_problems("good", good, exported) == []
    assert query_problems("bare histogram", "rate(w_seconds[5m])", exported) == ["bare histogram: w_seconds is not exported"]
    assert query_problems("label", 'sum by (class) (c_total{class="x"})', exported) == [
        "label: c_total has no label 'class'", "label: groups by ['class'], a label none of its series has"]
    assert query_problems("value", 'c_total{level="paged"}', exported) == [
        "value: c_total never has level='paged' (seen: ['deep'])"]
    assert query_problems("syntax", "sum(rate(g[5m])", exported)[0].startswith("syntax: does not parse")
    assert query_problems("own", 'up{job="extproc"} == 0 or absent(up{job="extproc"})', exported) == []


# ---------------------------------------------------------------------------- against real exports


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        return response.status


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict[str, set[str]] | None]:
    """The series a real sidecar (its backends' capacity read, every class served once through
    Envoy), its Envoy (read as Prometheus reads it: through the envoy_stats listener) and one of
    its simulated vLLM backends export."""
    workdir = tmp_path_factory.mktemp("observability")
    ports = StackPorts.random(primary=1)
    config = e2e_config()
    config["classes"]["loan_approval"]["latency_target_s"] = 30
    config["pools"]["primary"]["capacity"] = {"backends": [f"http://{LOOPBACK}:{p}" for p in ports.primary]}
    config["pools"]["fallback"]["capacity"] = {"backends": [f"http://{LOOPBACK}:{p}" for p in ports.fallback]}
    config["probes"] = {"interval_s": 0.2, "stale_after_s": 2, "timeout_s": 0.5, "nvml": "off"}
    config_path = workdir / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(config))
    sim_args = ("--time-scale", TIME_SCALE)
    with Stack(workdir, ports, config_path, primary=SimSpec("deepseek-sim", sim_args),
               fallback=SimSpec("deepseek-sim-small", sim_args)) as stack:
        for ticket in config["classes"]:
            status = post(f"{stack.url}/v1/chat/completions", chat(max_tokens=4),
                          {"authorization": f"Bearer {OFFICER_KEY}", "x-ticket-type": ticket})
            assert status == 200, ticket

        def backends_read() -> bool:
            samples = scrape(stack.metrics_url)
            return sum(1 for name, _ in samples if name == "extproc_backend_kv_usage") == len(ports.primary + ports.fallback)

        wait_until(backends_read, what="the sidecar to read its backends' metrics")
        sidecar_status, sidecar = http_get(stack.metrics_url)
        vllm_status, vllm = http_get(f"{stack.sim_url(0)}/metrics")
        envoy_status, envoy = http_get(f"http://{LOOPBACK}:{ports.envoy_stats}{envoy_job()['metrics_path']}")
    assert (sidecar_status, vllm_status, envoy_status) == (200, 200, 200)
    return exported_series(sidecar, vllm, envoy)


def envoy_job() -> dict:
    jobs = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())["scrape_configs"]
    return next(job for job in jobs if job["job_name"] == "envoy")


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_query_reads_what_the_sidecar_and_vllm_export(source, exported):
    queries = rule_queries() if source == "rules" else dashboard_queries()
    assert queries
    problems = [problem for where, expr in queries for problem in query_problems(where, expr, exported)]
    assert problems == [], "\n".join(problems)


# ---------------------------------------------------------------------------- what feeds the new alerts


def latency_targets(server: SidecarServer) -> dict[str, float]:
    return {dict(labels)["class"]: value for (name, labels), value in parse_samples(server.metrics.render().decode()).items()
            if name == "extproc_latency_target_seconds"}


async def test_the_latency_targets_are_exported_and_follow_a_reload(tmp_path):
    """ExtprocLatencyTargetMissed compares each class's p99 first byte with its target, read from
    the sidecar: a reload that changes or drops a target changes the series at once."""
    config = e2e_config(listen={"grpc_port": 0, "metrics_port": 0}, admin={"port": 0})
    config["classes"]["loan_approval"]["latency_target_s"] = 2
    config["classes"]["complaint"]["latency_target_s"] = 5
    path = tmp_path / "extproc.yaml"
    server = sidecar_from_file(path, config)
    await server.start()
    try:
        assert latency_targets(server) == {"loan_approval": 2, "complaint": 5}
        config["classes"]["loan_approval"]["latency_target_s"] = 1.5
        del config["classes"]["complaint"]["latency_target_s"]
        path.write_text(yaml.safe_dump(config))
        assert (await server.reload("test")).accepted
        assert latency_targets(server) == {"loan_approval": 1.5}
    finally:
        await server.stop()


def test_envoys_stats_listener_serves_its_metrics_and_nothing_else_of_its_admin(tmp_path):
    """Prometheus reads Envoy through the envoy_stats listener (job envoy), which is on the pod's
    address: it answers /stats/prometheus, with the ext_proc filter's counters the alerts read,
    and nothing of the admin interface that could change or stop Envoy."""
    admin, stats = free_port(), free_port()
    layout = EnvoyLayout(listen=(LOOPBACK, free_port()), admin=(LOOPBACK, admin), extproc=[(LOOPBACK, free_port())],
                         clusters={"vllm_primary": [(LOOPBACK, free_port())], "vllm_fallback": []},
                         stats=(LOOPBACK, stats))
    envoy = ManagedProcess("envoy", [envoy_binary(), "-c", str(render_file(layout, tmp_path / "envoy.yaml")),
                                     "--concurrency", "1", "--use-dynamic-base-id", "--log-level", "warn"],
                           tmp_path / "envoy.log")
    envoy.start()
    try:
        wait_for_process(lambda: http_get(f"http://{LOOPBACK}:{admin}/ready")[0] == 200, 30, "Envoy to be ready", envoy)
        base = f"http://{LOOPBACK}:{stats}"
        status, text = http_get(base + envoy_job()["metrics_path"])
        assert status == 200
        assert 'envoy_http_ext_proc_message_timeouts{envoy_http_conn_manager_prefix="llm_ingress"} 0' in text
        for path in ("/config_dump", "/clusters", "/stats", "/runtime", "/stats/prometheus/../../config_dump", "/"):
            assert http_get(base + path)[0] == 404, path
        for path in ("/quitquitquit", "/healthcheck/fail", "/runtime_modify?x=1", "/drain_listeners", "/logging?level=off"):
            request = urllib.request.Request(base + path, data=b"", method="POST")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=5)
            assert refused.value.code == 404, path
        assert envoy.alive() and http_get(f"http://{LOOPBACK}:{admin}/ready") == (200, "LIVE\n")
    finally:
        envoy.stop()
