"""What the sidecar relies on in a platform team's `envoy.yaml` (`extproc check-config --envoy`).

The sidecar works through Envoy's ext_proc filter and Envoy's routing: a setting left at Envoy's
default can quietly undo a decision (a slot released at the first byte, picks ignored, a held
request answered 504). Each finding names where in the file it is and what follows from it.
Pure: a parsed Envoy configuration and the sidecar's in, findings out. Static resources only:
what arrives through xDS is not seen.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core.config import Config
from ..core.headers import POOL, REQUEST_HEADERS_READ
from ..core.pool_config import dns_backend

_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_OVERRIDE_HOST = "envoy.load_balancing_policies.override_host"
_PICKS_NAMESPACE, _PICKS_KEY = "envoy.lb", "x-gateway-destination-endpoint"  # lifecycle/placement.py
_ATTRIBUTES = {
    "upstream.address": "where a request ran: the picks cannot be checked, nor a moved request counted where it runs",
    "response.code_details": "why a request failed: the breaker cannot tell Envoy's own replies from the backend's",
}
_MODES = {  # setting: (what it must be, Envoy's default, what follows otherwise)
    "request_body_mode": ("BUFFERED", "NONE", "the sidecar never sees the body: nothing is costed or admitted"),
    "response_header_mode": ("SEND", "SEND", "no response is counted: the breaker sees nothing"),
    "response_trailer_mode": ("SEND", "SKIP", "the stream ends at the first byte: slots are released while the "
                                              "engine still generates"),
}


@dataclass(frozen=True)
class Finding:
    where: str  # a path in the file
    what: str  # what is missing or set against the sidecar, and what follows

    def __str__(self) -> str:
        return f"missing: {self.where}: {self.what}"


def _duration_s(value: Any) -> float | None:
    if isinstance(value, str) and (m := re.fullmatch(r"(\d+(?:\.\d+)?)s", value.strip())):
        return float(m.group(1))
    if isinstance(value, dict):
        return float(value.get("seconds", 0)) + float(value.get("nanos", 0)) / 1e9
    return None


def _http_managers(envoy: dict) -> Iterator[tuple[str, dict]]:
    for i, listener in enumerate((envoy.get("static_resources") or {}).get("listeners") or []):
        for j, chain in enumerate(listener.get("filter_chains") or []):
            for k, network in enumerate(chain.get("filters") or []):
                typed = network.get("typed_config") or {}
                if typed.get("@type") == _HCM:
                    yield f"listeners[{listener.get('name', i)}].filter_chains[{j}].filters[{k}]", typed


def _ext_proc_filters(envoy: dict) -> Iterator[tuple[str, dict, dict]]:
    for where, manager in _http_managers(envoy):
        for n, http_filter in enumerate(manager.get("http_filters") or []):
            typed = http_filter.get("typed_config") or {}
            if typed.get("@type") == _EXT_PROC:
                yield f"{where}.http_filters[{n}]", typed, manager


def _clusters(envoy: dict) -> dict[str, dict]:
    return {c.get("name"): c for c in (envoy.get("static_resources") or {}).get("clusters") or []}


def _reads_picks(cluster: dict) -> bool:
    for policy in ((cluster.get("load_balancing_policy") or {}).get("policies") or []):
        extension = policy.get("typed_extension_config") or {}
        if extension.get("name") != _OVERRIDE_HOST:
            continue
        for source in (extension.get("typed_config") or {}).get("override_host_sources") or []:
            metadata = source.get("metadata") or {}
            if metadata.get("key") == _PICKS_NAMESPACE and _PICKS_KEY in [p.get("key") for p in metadata.get("path") or []]:
                return True
    return False


_DNS_CLUSTER = "envoy.cluster.dns"  # STRICT_DNS as an extension (cluster_type)


def _resolved_names(cluster: dict) -> tuple[set[tuple[str, int]], str | None] | None:
    """The (name, port) endpoints a cluster resolves into one host per address, and its lookup
    family when set (None: it does not: STATIC, LOGICAL_DNS's first address alone, EDS)."""
    settings = cluster
    if cluster.get("type") != "STRICT_DNS":
        extension = cluster.get("cluster_type") or {}
        settings = extension.get("typed_config") or {}
        if extension.get("name") != _DNS_CLUSTER or settings.get("all_addresses_in_single_endpoint"):
            return None
    endpoints = set()
    for group in (cluster.get("load_assignment") or {}).get("endpoints") or []:
        for lb_endpoint in group.get("lb_endpoints") or []:
            socket_address = (((lb_endpoint.get("endpoint") or {}).get("address") or {}).get("socket_address") or {})
            endpoints.add((str(socket_address.get("address", "")).rstrip("."), socket_address.get("port_value")))
    return endpoints, settings.get("dns_lookup_family")


def _same_engines(name: str, pool, cluster: dict, family: str) -> Iterator[Finding]:
    """Envoy's cluster resolves each of the pool's dns:// names as the sidecar does."""
    names = [found for url in pool.capacity.backends if (found := dns_backend(url)) is not None]
    if not names:
        return
    resolved = _resolved_names(cluster)
    for host, port in names:
        if resolved is None or (host.rstrip("."), port) not in resolved[0]:
            yield Finding(f"clusters[{pool.cluster}].load_assignment",
                          f"has no STRICT_DNS endpoint {host}:{port}, which pools.{name}.capacity.backends "
                          f"discovers: the sidecar picks engines that are no hosts of the cluster")
    if resolved is not None and resolved[1] in ("V4_ONLY", "V6_ONLY") and resolved[1] != family:
        yield Finding(f"clusters[{pool.cluster}].dns_lookup_family",
                      f"is {resolved[1]}, not discovery.lookup_family {family}: Envoy and the sidecar see other "
                      "addresses for the same names")


def _routes_by_pool(manager: dict) -> bool:
    route_config = manager.get("route_config") or {}
    for host in route_config.get("virtual_hosts") or []:
        for route in host.get("routes") or []:
            if (route.get("route") or {}).get("cluster_header") == POOL:
                return True
    return False


def _short_idle_timeouts(where: str, manager: dict, longest_wait_s: float) -> Iterator[Finding]:
    """A route's `idle_timeout` (else the manager's `stream_idle_timeout`, 300 s unset) also runs
    while the sidecar holds the request in line: one shorter than the longest class wait ends a
    request still waiting with Envoy's 504 (`stream_idle_timeout`)."""
    base = where[:where.rindex(".http_filters")]
    stream = _duration_s(manager.get("stream_idle_timeout", "300s"))
    route_config = manager.get("route_config") or {}
    for h, host in enumerate(route_config.get("virtual_hosts") or []):
        for r, route in enumerate(host.get("routes") or []):
            action = route.get("route")
            if not action:
                continue
            idle = _duration_s(action["idle_timeout"]) if "idle_timeout" in action else stream
            if idle and idle < longest_wait_s:  # 0: no timeout
                yield Finding(f"{base}.route_config.virtual_hosts[{h}].routes[{r}].route.idle_timeout",
                              f"is {idle:g} s, below the longest class wait (max_wait_s {longest_wait_s:g} s): "
                              "a request still in the sidecar's line is ended with Envoy's 504")


def check_envoy(envoy: dict, config: Config) -> list[Finding]:
    """What of the sidecar's needs `envoy` leaves out, or sets against it."""
    filters = list(_ext_proc_filters(envoy))
    if not filters:
        return [Finding("http_filters", "no envoy.filters.http.ext_proc filter: no request reaches the sidecar")]
    findings: list[Finding] = []
    clusters = _clusters(envoy)
    for where, ext_proc, manager in filters:
        service = ((ext_proc.get("grpc_service") or {}).get("envoy_grpc") or {}).get("cluster_name")
        if service not in clusters:
            findings.append(Finding(f"{where}.grpc_service", f"names cluster {service!r}, which the file does not define"))
        mode = ext_proc.get("processing_mode") or {}
        for setting, (wanted, default, otherwise) in _MODES.items():
            if mode.get(setting, default) != wanted:
                findings.append(Finding(f"{where}.processing_mode.{setting}",
                                        f"is {mode.get(setting, default)}, not {wanted}: {otherwise}"))
        attributes = set(ext_proc.get("response_attributes") or [])
        for attribute, otherwise in _ATTRIBUTES.items():
            if attribute not in attributes:
                findings.append(Finding(f"{where}.response_attributes", f"lacks {attribute!r}: {otherwise}"))
        longest = _duration_s(ext_proc.get("max_message_timeout"))
        if longest is None or longest < config.limits.max_message_timeout_s:
            findings.append(Finding(f"{where}.max_message_timeout",
                                    f"is {ext_proc.get('max_message_timeout', 'unset (0: no hold)')}, below the "
                                    f"sidecar's limits.max_message_timeout_s ({config.limits.max_message_timeout_s:g} s): "
                                    "a request held in line is answered 504"))
        allowed = ((ext_proc.get("forward_rules") or {}).get("allowed_headers") or {}).get("patterns")
        if allowed is not None:
            exact = {p.get("exact", "").lower() for p in allowed if "exact" in p}
            unseen = sorted(h for h in REQUEST_HEADERS_READ if h not in exact)
            if unseen:
                findings.append(Finding(f"{where}.forward_rules.allowed_headers",
                                        f"leaves out {', '.join(unseen)}: the sidecar never sees them"))
        namespaces = set(((ext_proc.get("metadata_options") or {}).get("receiving_namespaces") or {}).get("untyped") or [])
        picking = [name for name, pool in config.pools.items() if pool.capacity.picks_backend]
        if picking and _PICKS_NAMESPACE not in namespaces:
            findings.append(Finding(f"{where}.metadata_options.receiving_namespaces.untyped",
                                    f"lacks {_PICKS_NAMESPACE!r}: the engines the sidecar picks never reach the clusters"))
        findings += _short_idle_timeouts(where, manager, max(c.max_wait_s for c in config.classes.values()))
        if not _routes_by_pool(manager):
            findings.append(Finding(f"{where[:where.rindex('.http_filters')]}.route_config",
                                    f"no route picks its cluster by {POOL}: every request goes to one cluster, "
                                    "whatever pool the sidecar routes it to (fallback, canary)"))
    for name, pool in config.pools.items():
        cluster = clusters.get(pool.cluster)
        if cluster is None:
            findings.append(Finding("clusters", f"pools.{name}.cluster {pool.cluster!r} is not defined"))
            continue
        findings += _same_engines(name, pool, cluster, config.discovery.lookup_family)
        if pool.capacity.picks_backend and not _reads_picks(cluster):
            policy = cluster.get("lb_policy", "ROUND_ROBIN") if "load_balancing_policy" not in cluster else "its own"
            findings.append(Finding(f"clusters[{pool.cluster}].load_balancing_policy",
                                    f"balances by {policy}, not by the sidecar's picks (override_host reading "
                                    f"{_PICKS_NAMESPACE}/{_PICKS_KEY}): pools.{name} picks each request's engine, "
                                    "and the picks are ignored; long prompts may share an engine with latency-bound "
                                    "requests"))
    return findings
