"""The live queue page on the metrics port: GET /queue (one self-contained HTML page) and
GET /queue/state (the JSON it polls every second).

Read-only, and answered only to clients on loopback, whatever address the metrics port is bound
to: the page names tenants and branches, which a Prometheus scrape never sees. It shows the read
model the operator API's GetState shows too (state.py): every pool's line, limits, breaker and
cancellations, the canary, and the gate's latest decisions.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

from .state import SidecarState

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


def add_routes(app: web.Application, read: Callable[[int], Awaitable[SidecarState]]) -> None:
    """Serve the page and its state on `app` (the metrics endpoint's application); `read` gives
    the state with that many of the newest decisions."""
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
            body = state_json(await read(DECISIONS_SHOWN))
        except Exception as error:  # the store is unreachable: say so, the page keeps polling
            log.warning("queue page: state unavailable: %r", error)
            return web.json_response({"error": f"state unavailable: {error!r}"}, status=503,
                                     headers={"cache-control": "no-store"})
        return web.Response(text=body, content_type="application/json", headers={"cache-control": "no-store"})

    app.router.add_get(PAGE_PATH, serve_page)
    app.router.add_get(STATE_PATH, serve_state)


def state_json(state: SidecarState) -> str:
    """The state as strict JSON (a browser refuses NaN: the read model has none); decision
    fields that are not JSON types are shown as text."""
    return json.dumps(dataclasses.asdict(state), default=str, allow_nan=False)
