"""`extproc check-config --envoy`: a route whose idle timeout is shorter than the longest class
wait ends a request still in the sidecar's line with Envoy's 504 (the route's `idle_timeout`
runs while the sidecar holds the request; the template's is 60 s)."""

from __future__ import annotations

import copy

import yaml

from extproc.core.config import load_config, parse_config
from extproc.envoy.config_check import check_envoy
from extproc_testbed.envoy_config import template_path


def template() -> dict:
    return yaml.safe_load(template_path().read_text())


def config_with_wait(max_wait_s: float):
    raw = yaml.safe_load((load_config().model_dump_json()))
    raw["classes"]["archive_query"]["max_wait_s"] = max_wait_s
    return parse_config(raw)


def idle_findings(envoy: dict, config) -> list[str]:
    return [f.where for f in check_envoy(envoy, config) if f.where.endswith("idle_timeout")]


def test_the_template_holds_every_shipped_wait():
    assert idle_findings(template(), load_config()) == []


def test_a_wait_longer_than_a_routes_idle_timeout_is_found_on_every_route_it_cuts():
    found = idle_findings(template(), config_with_wait(90))
    assert found and all(".route_config.virtual_hosts[" in where for where in found)
    assert idle_findings(template(), config_with_wait(59)) == []


def test_without_a_route_idle_timeout_the_managers_stream_idle_timeout_applies():
    envoy = copy.deepcopy(template())
    for manager in _managers(envoy):
        for host in manager["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                route.get("route", {}).pop("idle_timeout", None)
        manager["stream_idle_timeout"] = "100s"
    assert idle_findings(envoy, config_with_wait(90)) == []
    assert idle_findings(envoy, config_with_wait(120)) != []


def _managers(envoy: dict):
    for listener in envoy["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for f in chain.get("filters", []):
                if f["name"] == "envoy.filters.network.http_connection_manager":
                    yield f["typed_config"]
