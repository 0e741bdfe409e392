"""The live queue page on the metrics port: GET /queue (one self-contained HTML page) and
GET /queue/state (the JSON it polls every second).

Read-only, and answered only to clients on loopback, whatever address the metrics port is bound
to: the page names tenants and branches, which a Prometheus scrape never sees. It reads the
same sources as the operator API's GetState (extproc/admin_service.py): the queue store's
snapshots, the load controller's limits, the breakers and the canary in the control plane,
plus the waiting tickets by class and branch and the gate's latest decisions.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..core.admission import tier_for

if TYPE_CHECKING:
    from ..server import SidecarServer

log = logging.getLogger("extproc")

PAGE_PATH = "/queue"
STATE_PATH = "/queue/state"
DECISIONS_SHOWN = 50  # the newest decisions the page lists

# Everything the page needs is inline; it may only call back to its own origin.
_PAGE_HEADERS = {
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
    "content-security-policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
}


def is_loopback(remote: str | None) -> bool:
    """True when the peer address is a loopback address (127.0.0.0/8, ::1, ::ffff:127.x)."""
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _decisions(records: Iterable[Mapping[str, Any]] | None, limit: int = DECISIONS_SHOWN) -> list[dict] | None:
    """The newest `limit` decision records, newest first (None when the gate keeps none)."""
    if records is None:
        return None
    newest_last = list(records)  # a copy: the gate appends while requests come and go
    return [dict(record) for record in itertools.islice(reversed(newest_last), limit)]


async def queue_state(server: SidecarServer) -> dict[str, Any]:
    """Everything the queue page shows, as JSON-ready data."""
    config = server.config
    control = server.control
    pools = []
    # The default pool first, the others as configured.
    for name, pool in sorted(config.pools.items(), key=lambda item: item[0] != config.default_pool):
        snapshot = await server.store.snapshot(name)
        by_branch = await server.store.waiting_by_branch(name)
        breaker = control.snapshot(name)
        limiter = server.load.latency.get(name)
        pools.append({
            "name": name,
            "cluster": pool.cluster,
            "fallback": pool.fallback,
            "tier": tier_for(snapshot.depth, pool.tiers).name.lower(),
            "tiers": pool.tiers.model_dump(),
            "waiting": snapshot.depth,
            "waiting_by_class": snapshot.depth_by_class,
            "waiting_by_branch": by_branch,
            "inflight": snapshot.inflight,
            "max_inflight": snapshot.max_inflight,
            "max_inflight_configured": pool.max_inflight,
            "latency_cap": None if limiter is None or not server.load.has_targets else limiter.applied(snapshot.max_inflight),
            "inflight_unbounded": snapshot.unbounded_inflight,
            # pools with capacity.pick_backend: what this replica placed on each backend, still running
            "placed": {endpoint: {"requests": n, "tokens": tokens}
                       for endpoint, (n, tokens) in sorted(server.gate.picker.running(name).items())}
            if server.gate.picker is not None else {},
            "inflight_tokens": snapshot.inflight_tokens,
            "token_budget": snapshot.budget_tokens,
            "breaker": {
                "instant": breaker["instant"],
                "open_for_s": breaker["open_for_s"],
                "rerouting": breaker["rerouting"],
                "paged": breaker["paged"],
                "paged_for_s": breaker["paged_for_s"],
                "forced": breaker["forced"] or None,
                "windows": {
                    label: {"requests": r.requests, "failures": r.failures, "failure_ratio": _finite(r.ratio),
                            "tripped": r.tripped}
                    for label, r in breaker["windows"].items()
                },
            },
        })
    canary = control.controls.canary
    classes = sorted(config.classes, key=lambda c: (config.classes[c].base, c))
    return {
        "generated_at": time.time(),
        "replica": server.replica,
        "shared": control.store.shared,
        "draining": server.gate.draining,
        "config_version": server.config_version,  # as extproc_config_info and the Reload answer show it
        "classes": [{"name": c, "protected": config.classes[c].protected,
                     "degradable": config.classes[c].degradable,
                     "latency_target_s": config.classes[c].latency_target_s} for c in classes],
        "pools": pools,
        "canary": {
            "pool": config.canary.pool,
            "digits": list(canary.digits),
            "batch": canary.batch,
            "batches": len(config.canary.order),
            "rolled_back": canary.rolled_back_at is not None,
            "rollback_reason": canary.reason,
        },
        "shadow_share": control.shadow_share,
        "decisions": _decisions(getattr(server.gate, "recent_decisions", None)),
    }


def add_routes(app: web.Application, server: SidecarServer) -> None:
    """Serve the page and its state on `app` (the metrics endpoint's application)."""
    page = resources.files("extproc.ops").joinpath("static/queue.html").read_bytes()

    def refuse(request: web.Request) -> web.Response | None:
        if is_loopback(request.remote):
            return None
        return web.json_response(
            {"error": "the queue page is served to loopback clients only "
                      "(open it on the sidecar's host, or through a port-forward)"},
            status=403,
        )

    async def serve_page(request: web.Request) -> web.Response:
        if (refused := refuse(request)) is not None:
            return refused
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=_PAGE_HEADERS)

    async def serve_state(request: web.Request) -> web.Response:
        if (refused := refuse(request)) is not None:
            return refused
        try:
            body = state_json(await queue_state(server))
        except Exception as error:  # the store is unreachable: say so, the page keeps polling
            log.warning("queue page: state unavailable: %r", error)
            return web.json_response({"error": f"state unavailable: {error!r}"}, status=503,
                                     headers={"cache-control": "no-store"})
        return web.Response(text=body, content_type="application/json", headers={"cache-control": "no-store"})

    app.router.add_get(PAGE_PATH, serve_page)
    app.router.add_get(STATE_PATH, serve_state)


def state_json(state: dict[str, Any]) -> str:
    """The state as strict JSON (a browser refuses NaN); decision fields that are not JSON
    types are shown as text."""
    return json.dumps(state, default=str, allow_nan=False)
