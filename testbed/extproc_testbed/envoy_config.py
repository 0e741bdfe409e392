"""Rendering the production Envoy template (envoy/envoy.yaml) for given addresses and ports.

The template is a valid Envoy config as it stands; rendering edits its structure (listener,
admin, cluster endpoints) rather than substituting text, so the file a platform team reads is
the file the demo and the tests run. `plain_least_request` makes from it the Envoy a platform
team writes itself: the same file, its model clusters balanced by plain least request. Mutual
TLS to the sidecar is a commented block of the template: rendered with it, that block is
uncommented as written, only its file names set.
"""

from __future__ import annotations

import re
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
STATS_LISTENER = "envoy_stats"
ADMIN_CLUSTER = "envoy_admin"


@dataclass(frozen=True)
class SidecarTls:
    """Envoy's side of mutual TLS to the sidecar: its client certificate and key, and the CA
    that signed the sidecar's certificate (PEM files)."""

    cert_file: str
    key_file: str
    ca_file: str


@dataclass(frozen=True)
class EnvoyLayout:
    listen: Address
    admin: Address
    extproc: list[Address]
    clusters: dict[str, list[Address]]  # model cluster name -> endpoints
    relay: Address | None = None  # the relay listener (dropped when None)
    without_sidecar: bool = False  # drop the ext_proc filter and the relay (side-by-side measurements)
    message_timeout_s: float | None = None  # the ext_proc filter's message_timeout, when not the template's
    stats: Address | None = None  # the envoy_stats listener (dropped when None)
    sidecar_tls: SidecarTls | None = None  # mutual TLS to the sidecar (render_file: the template's commented block)
    # the model clusters resolve their host names with this nameserver (c-ares), not the system's
    nameserver: Address | None = None
    dns_refresh_s: float | None = None  # and this often (Envoy's default: every 5 s)


def _socket(address: Address) -> dict[str, Any]:
    return {"socket_address": {"address": address[0], "port_value": address[1]}}


def render(template: dict[str, Any], layout: EnvoyLayout) -> dict[str, Any]:
    config = yaml.safe_load(yaml.safe_dump(template))  # deep copy
    config["admin"]["address"] = _socket(layout.admin)
    listeners = {listener["name"]: listener for listener in config["static_resources"]["listeners"]}
    addresses = {INGRESS_LISTENER: layout.listen, RELAY_LISTENER: None if layout.without_sidecar else layout.relay,
                 STATS_LISTENER: layout.stats}
    kept = []
    for name, address in addresses.items():
        if address is None:
            continue
        if name not in listeners:
            raise ValueError(f"the template has no listener named {name}")
        listeners[name]["address"] = _socket(address)
        kept.append(listeners[name])
    config["static_resources"]["listeners"] = kept
    endpoints = {"extproc": layout.extproc, **layout.clusters}
    if any(cluster["name"] == ADMIN_CLUSTER for cluster in config["static_resources"]["clusters"]):
        endpoints[ADMIN_CLUSTER] = [layout.admin]
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
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] in layout.clusters and cluster.get("type") == "STRICT_DNS":
            _resolve_with(cluster, layout.nameserver, layout.dns_refresh_s)
    return config


DNS_CLUSTER = "envoy.cluster.dns"  # STRICT_DNS as an extension: where Envoy 1.40 takes a refresh rate


def _resolve_with(cluster: dict[str, Any], nameserver: Address | None, refresh_s: float | None) -> None:
    """A STRICT_DNS cluster that asks `nameserver` (c-ares, as Envoy's default resolver does with
    the system's), every `refresh_s`."""
    if nameserver is not None:
        cluster["typed_dns_resolver_config"] = {
            "name": "envoy.network.dns_resolver.cares",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig",
                "resolvers": [_socket(nameserver)],
                "dns_resolver_options": {"no_default_search_domain": True},
            },
        }
    if refresh_s is not None:  # Cluster.dns_refresh_rate is deprecated: the same cluster, as the extension
        del cluster["type"]
        settings = {"@type": "type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster",
                    "dns_refresh_rate": f"{refresh_s:g}s"}
        for key in ("dns_lookup_family", "typed_dns_resolver_config"):
            if key in cluster:
                settings[key] = cluster.pop(key)
        cluster["cluster_type"] = {"name": DNS_CLUSTER, "typed_config": settings}


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


def sidecar_tls_socket(template_text: str, tls: SidecarTls) -> dict[str, Any]:
    """The template's commented `transport_socket` (the extproc cluster's mutual TLS),
    uncommented, with the files of `tls`."""
    lines = template_text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.fullmatch(r"\s*# transport_socket:", line)), None)
    if start is None:
        raise ValueError("the template has no commented transport_socket for the sidecar")
    indent = lines[start].index("#")
    block = [lines[start][indent + 2:]]
    for line in lines[start + 1:]:
        if not line.startswith(" " * indent + "#   "):
            break
        block.append(line[indent + 2:])
    socket = yaml.safe_load("\n".join(block))["transport_socket"]
    context = socket["typed_config"]["common_tls_context"]
    context["tls_certificates"] = [{"certificate_chain": {"filename": tls.cert_file},
                                    "private_key": {"filename": tls.key_file}}]
    context["validation_context"]["trusted_ca"] = {"filename": tls.ca_file}
    return socket


OVERRIDE_HOST = "envoy.load_balancing_policies.override_host"


def follows_picks(cluster: dict[str, Any]) -> bool:
    """Whether the cluster balances by the sidecar's engine picks (an override_host policy)."""
    policies = (cluster.get("load_balancing_policy") or {}).get("policies", [])
    return any(p.get("typed_extension_config", {}).get("name") == OVERRIDE_HOST for p in policies)


def plain_least_request(template: dict[str, Any]) -> dict[str, Any]:
    """A platform team's own Envoy: the template with every cluster that follows the sidecar's
    engine picks balanced by plain `lb_policy: LEAST_REQUEST` instead; the ext_proc filter as it
    stands (its processing mode and `upstream.address`), so the sidecar still decides and hears
    which engine served each request, but Envoy chooses the engine."""
    config = yaml.safe_load(yaml.safe_dump(template))  # deep copy
    for cluster in config["static_resources"]["clusters"]:
        if follows_picks(cluster):
            del cluster["load_balancing_policy"]
            cluster["lb_policy"] = "LEAST_REQUEST"
    return config


def render_file(layout: EnvoyLayout, out: Path, template: Path | None = None) -> Path:
    text = (template or template_path()).read_text("utf-8")
    config = render(yaml.safe_load(text), layout)
    if layout.sidecar_tls is not None and not layout.without_sidecar:
        extproc = next(c for c in config["static_resources"]["clusters"] if c["name"] == "extproc")
        extproc["transport_socket"] = sidecar_tls_socket(text, layout.sidecar_tls)
    out.write_text(yaml.safe_dump(config, sort_keys=False), "utf-8")
    return out
