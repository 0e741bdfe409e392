"""deploy/k8s/autoscaling/: the vLLM StatefulSet, KEDA's ScaledObject and the HPA on external
metrics, against their schemas (Kubernetes' own through kubernetes-validate, strict; KEDA's
vendored CRD, with unknown fields refused as `kubectl --validate=strict` does), and what they
must agree on with the sidecar: the metric and labels it exports, the bounds of its
`autoscale` settings, the scale-in protection, the vLLM flags."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import jsonschema
import promql_parser
import pytest
import yaml

from extproc.core.capacity import recommend_vllm_args

from .test_deploy import KUBERNETES_VERSION, k8s_sidecar_config, tool

ROOT = Path(__file__).resolve().parents[2]
DIR = ROOT / "deploy" / "k8s" / "autoscaling"
KEDA_CRD = ROOT / "tests" / "schemas" / "keda.sh_scaledobjects.yaml"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DIR / name).read_text()) if d]


def one(name: str, kind: str, workload: str = "vllm-primary") -> dict:
    """The `kind` of `name` for one model pool's engines (the primary's, unless named)."""
    found = [d for d in docs(name) if d["kind"] == kind and d["metadata"]["name"] == workload]
    assert len(found) == 1, f"{name}: expected one {kind} {workload}"
    return found[0]


def strict(schema: dict) -> dict:
    """The CRD's schema with unknown fields refused where it does not preserve them."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def keda_schema(version: str) -> dict:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "ScaledObject"
    served = {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["served"]}
    return strict(served[version])


def keda_errors(scaled_object: dict) -> list[str]:
    group, version = scaled_object["apiVersion"].split("/")
    assert group == "keda.sh"
    validator = jsonschema.Draft7Validator(keda_schema(version))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(scaled_object)]


def scaled_object() -> dict:
    return one("keda-scaledobject.yaml", "ScaledObject")


def hpa() -> dict:
    return one("hpa-external.yaml", "HorizontalPodAutoscaler")


def statefulset() -> dict:
    return one("vllm-primary.yaml", "StatefulSet")


def test_native_manifests_pass_kubernetes_validate_strict():
    files = [str(DIR / name) for name in ("vllm-drain.yaml", "vllm-primary.yaml", "vllm-archive.yaml", "hpa-external.yaml")]
    result = subprocess.run([tool("kubernetes-validate"), "--strict", "--kubernetes-version", KUBERNETES_VERSION, *files],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_misspelt_hpa_field_is_refused(tmp_path):
    broken = hpa()
    broken["spec"]["behavior"]["scaleDown"]["stabilisationWindowSeconds"] = 300
    path = tmp_path / "hpa.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run([tool("kubernetes-validate"), "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "stabilisationWindowSeconds" in result.stdout + result.stderr


def test_the_scaled_object_follows_kedas_crd():
    assert keda_errors(scaled_object()) == []


def test_each_model_pool_is_scaled_as_the_primary_is_on_its_own_metric():
    """The archive pool's ScaledObject and HPA are the primary's (every check here holds for them)
    but for their names, their pool's metric and its autoscale bounds (extproc-config.yaml)."""
    config = k8s_sidecar_config()

    def as_primary(document: dict, pool: str) -> dict:
        text = yaml.safe_dump(document).replace("vllm-archive", "vllm-primary")
        return yaml.safe_load(text.replace(f'pool="{pool}"', 'pool="primary"').replace(f"pool: {pool}", "pool: primary"))

    assert keda_errors(one("keda-scaledobject.yaml", "ScaledObject", "vllm-archive")) == []
    for name, kind, bounds in (("keda-scaledobject.yaml", "ScaledObject", ("minReplicaCount", "maxReplicaCount")),
                               ("hpa-external.yaml", "HorizontalPodAutoscaler", ("minReplicas", "maxReplicas"))):
        archive, primary = one(name, kind, "vllm-archive"), one(name, kind)
        autoscale = config.pools["archive"].autoscale
        assert [archive["spec"][b] for b in bounds] == [autoscale.min_backends, autoscale.max_backends]
        same = as_primary(archive, "archive")
        for b in bounds:
            same["spec"][b] = primary["spec"][b]
        if kind == "ScaledObject":
            same["spec"]["fallback"]["replicas"] = primary["spec"]["fallback"]["replicas"]
        assert same == primary, name


@pytest.mark.parametrize("path, value", [
    (("spec", "maxReplicas"), 8),  # the HPA's spelling, not KEDA's
    (("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleDown", "stabilizationWindow"), 300),
    (("spec", "triggers", 0, "metadata", "threshold"), 1),  # metadata values are strings
])
def test_the_crd_check_refuses_what_keda_would(path, value):
    broken = scaled_object()
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert keda_errors(broken)


def test_both_autoscalers_scale_the_vllm_statefulset_within_the_sidecars_bounds():
    bounds = k8s_sidecar_config().pools["primary"].autoscale
    target = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": statefulset()["metadata"]["name"]}
    so, h = scaled_object()["spec"], hpa()["spec"]
    assert so["scaleTargetRef"] == target and h["scaleTargetRef"] == target
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (bounds.min_backends, bounds.max_backends)
    assert (h["minReplicas"], h["maxReplicas"]) == (bounds.min_backends, bounds.max_backends)
    assert so["fallback"]["replicas"] <= bounds.max_backends


def test_the_replica_count_is_the_desired_count():
    trigger = scaled_object()["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "1"  # replicas = ceil(desired / 1)
    target = hpa()["spec"]["metrics"][0]["external"]["target"]
    assert target == {"type": "AverageValue", "averageValue": "1"}


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    found = []

    def walk(node):
        if isinstance(node, promql_parser.VectorSelector):
            labels = {m.name: m.value for m in node.matchers.matchers}
            found.append((node.name, labels))
        for attr in ("expr", "lhs", "rhs", "vector_selector", "args"):
            child = getattr(node, attr, None)
            if isinstance(child, list):
                for c in child:
                    walk(c)
            elif child is not None and not isinstance(child, (str, int, float)):
                walk(child)

    walk(promql_parser.parse(expr))
    return found


def adapter_rule() -> dict:
    configmap = one("hpa-external.yaml", "ConfigMap", "prometheus-adapter-extproc")
    rules = yaml.safe_load(configmap["data"]["config.yaml"])["externalRules"]
    assert len(rules) == 1
    return rules[0]


def test_the_queries_read_the_desired_count_and_add_no_hold_of_their_own():
    """The model holds its count above green and over scale_in_hold_s: a query holding it again
    (max_over_time) would stack a second stabilization window on the first."""
    keda_query = scaled_object()["spec"]["triggers"][0]["metadata"]["query"]
    adapter_query = adapter_rule()["metricsQuery"].replace("<<.LabelMatchers>>", 'pool="primary"')
    for query in (keda_query, adapter_query):
        read = selectors(query)
        assert read == [("extproc_desired_backends", {"pool": "primary"})], query
        assert "_over_time" not in query and query.lstrip().startswith("max"), query
    assert adapter_rule()["name"]["as"] == hpa()["spec"]["metrics"][0]["external"]["metric"]["name"]


def test_the_manifests_hold_the_settings_the_day_run_used():
    """`extproc bench scenario --day` ran these settings (compressed with its day): the model's
    bounds, utilisation, start-up horizon and scale-in hold, the HPA's windows and scale-in
    rate, the engines' sequences; its measurement windows (not compressed). The scale-in window
    is the model's: the HPA's own is shorter (a restarted replica's first readings)."""
    from extproc_testbed.day import DEPLOYED, REQUEST_CLOCK

    config = k8s_sidecar_config()
    autoscale, capacity = config.pools["primary"].autoscale, config.pools["primary"].capacity
    assert (autoscale.min_backends, autoscale.max_backends) == (DEPLOYED["min_backends"], DEPLOYED["max_backends"])
    assert autoscale.target_utilisation == DEPLOYED["target_utilisation"]
    assert autoscale.horizon_s == DEPLOYED["cold_start_s"]
    assert autoscale.scale_in_hold_s == DEPLOYED["scale_in_hold_s"] > DEPLOYED["hpa_scale_down_window_s"]
    assert DEPLOYED["hpa_scale_down_window_s"] >= autoscale.window_s  # a restarted replica's first window
    assert {key: getattr(autoscale, key) for key in REQUEST_CLOCK} == REQUEST_CLOCK
    assert capacity.max_num_seqs == DEPLOYED["max_num_seqs"]
    for behavior in (scaled_object()["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
                     hpa()["spec"]["behavior"]):
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] == DEPLOYED["hpa_scale_down_window_s"]
        assert [(p["type"], p["value"], p["periodSeconds"]) for p in behavior["scaleDown"]["policies"]] == \
            [("Pods", 1, DEPLOYED["scale_in_every_s"])]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert (scaled_object()["spec"]["minReplicaCount"], scaled_object()["spec"]["maxReplicaCount"]) == \
        (DEPLOYED["min_backends"], DEPLOYED["max_backends"])


def test_the_engines_run_the_recommended_vllm_flags_and_the_sidecars_limits():
    config = k8s_sidecar_config()
    pod = statefulset()["spec"]["template"]["spec"]
    vllm = pod["containers"][0]
    args = vllm["args"]
    for flag in recommend_vllm_args(1, 80, config.requests.max_model_len, config.requests.context_reserve):
        assert args[args.index(flag.flag) + 1] == flag.value, flag.flag
    assert int(args[args.index("--max-num-seqs") + 1]) == config.pools["primary"].capacity.max_num_seqs
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    service = one("vllm-primary.yaml", "Service")
    assert service["spec"]["clusterIP"] == "None" and statefulset()["spec"]["serviceName"] == service["metadata"]["name"]
