"""Rendering the production Envoy template (envoy/envoy.yaml) for given addresses and ports.

The template is a valid Envoy config as it stands; rendering edits its structure (listener,
admin, cluster endpoints) rather than substituting text, so the file a platform team reads is
the file the demo and the tests run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Address = tuple[str, int]


def template_path() -> Path:
    """envoy/envoy.yaml of a source checkout, or the copy installed with the package."""
    here = Path(__file__).resolve()
    candidates = [here.parents[2] / "envoy" / "envoy.yaml", here.parent / "envoy.yaml"]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError("envoy/envoy.yaml not found next to the package")


INGRESS_LISTENER = "llm_ingress"
RELAY_LISTENER = "llm_relay"


@dataclass(frozen=True)
class EnvoyLayout:
    listen: Address
    admin: Address
    extproc: list[Address]
    clusters: dict[str, list[Address]]  # model cluster name -> endpoints
    relay: Address | None = None  # the relay listener (dropped when None)
    without_sidecar: bool = False  # drop the ext_proc filter and the relay (side-by-side measurements)
    message_timeout_s: float | None = None  # the ext_proc filter's message_timeout, when not the template's


def _socket(address: Address) -> dict[str, Any]:
    return {"socket_address": {"address": address[0], "port_value": address[1]}}


def render(template: dict[str, Any], layout: EnvoyLayout) -> dict[str, Any]:
    config = yaml.safe_load(yaml.safe_dump(template))  # deep copy
    config["admin"]["address"] = _socket(layout.admin)
    listeners = {listener["name"]: listener for listener in config["static_resources"]["listeners"]}
    if INGRESS_LISTENER not in listeners:
        raise ValueError(f"the template has no listener named {INGRESS_LISTENER}")
    listeners[INGRESS_LISTENER]["address"] = _socket(layout.listen)
    if layout.relay is not None and not layout.without_sidecar:
        if RELAY_LISTENER not in listeners:
            raise ValueError(f"the template has no listener named {RELAY_LISTENER}")
        listeners[RELAY_LISTENER]["address"] = _socket(layout.relay)
    else:
        config["static_resources"]["listeners"] = [listeners[INGRESS_LISTENER]]
    endpoints = {"extproc": layout.extproc, **layout.clusters}
    if layout.without_sidecar:
        _remove_sidecar(config)
        del endpoints["extproc"]
    elif layout.message_timeout_s is not None:
        _ext_proc(config)["typed_config"]["message_timeout"] = f"{layout.message_timeout_s:g}s"
    seen = set()
    for cluster in config["static_resources"]["clusters"]:
        name = cluster["name"]
        if name in endpoints:
            seen.add(name)
            cluster["load_assignment"]["endpoints"] = [
                {"lb_endpoints": [{"endpoint": {"address": _socket(a)}} for a in endpoints[name]]}
            ]
        else:  # a pool this layout does not run (e.g. no canary): no hosts, nothing to resolve
            cluster["load_assignment"]["endpoints"] = []
    missing = set(endpoints) - seen
    if missing:
        raise ValueError(f"the template has no cluster named {', '.join(sorted(missing))}")
    return config


def _http_manager(config: dict[str, Any]) -> dict[str, Any]:
    ingress = next(li for li in config["static_resources"]["listeners"] if li["name"] == INGRESS_LISTENER)
    return ingress["filter_chains"][0]["filters"][0]["typed_config"]


def _ext_proc(config: dict[str, Any]) -> dict[str, Any]:
    return next(f for f in _http_manager(config)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")


def _remove_sidecar(config: dict[str, Any]) -> None:
    manager = _http_manager(config)
    manager["http_filters"] = [
        f for f in manager["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
    ]
    clusters = config["static_resources"]["clusters"]
    config["static_resources"]["clusters"] = [c for c in clusters if c["name"] != "extproc"]


def render_file(layout: EnvoyLayout, out: Path, template: Path | None = None) -> Path:
    source = yaml.safe_load((template or template_path()).read_text("utf-8"))
    out.write_text(yaml.safe_dump(render(source, layout), sort_keys=False), "utf-8")
    return out
