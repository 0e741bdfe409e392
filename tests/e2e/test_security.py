"""Who may reach what.

- The operator API (gRPC) answers a caller beyond loopback only with the right token, compared
  in constant time; bound to loopback without a token, it cannot be reached from beyond at all.
- The live queue page refuses a client beyond loopback, whatever headers it sends.
- Through real Envoy and the sidecar, a client cannot pick its pool or cluster (x-llm-pool in
  any case or repeated, the canary's or the fallback's model, another branch) nor its priority
  (x-llm-priority / x-llm-class of its own, repeated).
- No HTTP/2 pseudo-header trick (odd :path forms, repeated or misplaced pseudo-headers, CONNECT,
  OPTIONS *), nor an HTTP/1.1 smuggling classic, gets a request to a backend without the
  sidecar's decision.

"Beyond loopback": the admin service does not look at its peer; it is guarded by where it
listens (config.Admin: a host other than 127.0.0.1, ::1 or localhost needs token_sha256) and,
once a token is configured, by TokenGuard on every call. The queue page looks at its peer
(queue_page.is_loopback: 127.0.0.0/8, ::1, ::ffff:127.x), so 127.0.0.2 still counts as local.
A real non-loopback source address is needed: this file uses one of the machine's own
addresses (here eth0's), reached over the kernel's local route, so client and server share the
machine but the server sees a peer that is not loopback (each test checks the source address a
connection really gets). Adding an address or a network namespace would change the machine
under other tests' feet; where the machine has no non-loopback address the tests needing one
are skipped, with the reason, never passed.

The end-to-end tests run real Envoy (envoy/envoy.yaml) and the real sidecar; the three model
clusters are served by recording stand-ins for vLLM (in-process, one per cluster), not by the
simulator: the simulator answers only its own routes (a smuggled `//v1/chat/completions` gets
an aiohttp 404 and is not counted) and keeps only the first value of a header, while the
recorders keep every request exactly as it arrived (method, raw path, every header value,
body), so where each request went and what it carried is read, not inferred.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import http.client
import ipaddress
import json
import shlex
import socket
import struct
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web

from extproc.admin.v1 import admin_pb2 as pb
from extproc.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.core.config import default_config_text, parse_config
from extproc.ops import admin_service
from extproc.server import SidecarServer
from extproc_testbed import stack as stack_module
from extproc_testbed.stack import Stack, StackPorts, envoy_binary, http_get

from ..conftest import OFFICER_KEY, e2e_config
from ..helpers import chat, json_lines, metric, wait_until

ADMIN_TOKEN = "sk-admin-security-test"
TELLER_KEY = "sk-test-teller"  # a tenant whose branch (0007) is in the canary


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- a source address beyond loopback ----------------------------------------------------------

_SIOCGIFADDR = 0x8915


def _interface_ipv4_addresses() -> list[str]:
    """Each interface's IPv4 address (Linux SIOCGIFADDR), loopback included."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            found.append(socket.inet_ntoa(answer[20:24]))
    return found


def beyond_loopback_address() -> str:
    """One of this machine's own IPv4 addresses that is not loopback and can be bound."""
    for address in _interface_ipv4_addresses():
        if ipaddress.ip_address(address).is_loopback:
            continue
        with socket.socket() as s:
            try:
                s.bind((address, 0))
            except OSError:
                continue
        return address
    # Not a skip: these tests are what shows who may reach what, and a machine that cannot run
    # them must say so, not pass.
    pytest.fail("this machine has no IPv4 address beyond loopback to be a remote client from "
                "(adding one needs CAP_NET_ADMIN and would change the network under other tests)")


def source_address_towards(address: str, port: int) -> str:
    """The source address the kernel gives a connection to (address, port): what the server sees."""
    with socket.create_connection((address, port), timeout=5) as s:
        return s.getsockname()[0]


# -- 1. the operator API ------------------------------------------------------------------------

def _sidecar_config(metrics_host: str = "127.0.0.1", **admin) -> dict:
    return e2e_config(listen={"metrics_host": metrics_host, "grpc_port": 0, "metrics_port": 0}, admin={"port": 0, **admin})


@pytest.fixture
async def exposed_admin():
    """A sidecar whose operator API listens on every address, as it must to be reached from
    another host: with a token (the configuration refuses it without one)."""
    server = SidecarServer(parse_config(_sidecar_config(host="0.0.0.0", token_sha256=[sha256(ADMIN_TOKEN)])))
    await server.start()
    yield server
    await server.stop()


_NO_PROXY = [("grpc.enable_http_proxy", 0)]


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


REFUSED_CREDENTIALS = {
    "none": (),
    "wrong token": _bearer("sk-admin-guess"),
    "empty bearer": (("authorization", "Bearer "),),
    "token less its last character": _bearer(ADMIN_TOKEN[:-1]),
    "token and one more character": _bearer(ADMIN_TOKEN + "x"),
    "token in another case": _bearer(ADMIN_TOKEN.upper()),
    "the configured digest as the token": _bearer(sha256(ADMIN_TOKEN)),
    "the token without a scheme": (("authorization", ADMIN_TOKEN),),
    "the token under the basic scheme": (("authorization", f"Basic {ADMIN_TOKEN}"),),
    "the token under another key": (("x-admin-token", ADMIN_TOKEN), ("x-authorization", f"Bearer {ADMIN_TOKEN}")),
}


async def test_the_admin_api_beyond_loopback_answers_only_the_right_token(exposed_admin):
    server = exposed_admin
    address = beyond_loopback_address()
    assert not ipaddress.ip_address(source_address_towards(address, server.admin_port)).is_loopback
    async with grpc.aio.insecure_channel(f"{address}:{server.admin_port}", options=_NO_PROXY) as channel:
        stub = pb_grpc.AdminStub(channel)
        calls = {
            "GetState": lambda md: stub.GetState(pb.GetStateRequest(), metadata=md, timeout=10),
            "SetBreaker": lambda md: stub.SetBreaker(
                pb.SetBreakerRequest(pool="primary", action=pb.SetBreakerRequest.FORCE_OPEN), metadata=md, timeout=10),
            "SetShadowShare": lambda md: stub.SetShadowShare(pb.SetShadowShareRequest(share=1.0), metadata=md,
                                                             timeout=10),
            "Drain": lambda md: stub.Drain(pb.DrainRequest(), metadata=md, timeout=10),
            "Reload": lambda md: stub.Reload(pb.ReloadRequest(), metadata=md, timeout=10),
        }
        for what, metadata in REFUSED_CREDENTIALS.items():
            for name, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, (what, name)

        # Nothing a refused call asked for happened.
        assert not server.gate.draining
        state = await stub.GetState(pb.GetStateRequest(), metadata=_bearer(ADMIN_TOKEN), timeout=10)
        assert state.pools[0].name == "primary" and state.pools[0].breaker.forced == ""
        assert state.shadow_share == 0.0 and not state.draining

        # The right token works, for reading and for acting (the scheme's case does not matter).
        forced = await stub.SetBreaker(pb.SetBreakerRequest(pool="primary", action=pb.SetBreakerRequest.FORCE_OPEN),
                                       metadata=(("authorization", f"bearer {ADMIN_TOKEN}"),), timeout=10)
        assert forced.pools[0].breaker.forced == "open"


async def test_the_admin_api_without_a_token_cannot_be_reached_beyond_loopback():
    """Bound to loopback (the default, the only place allowed without a token), the API does
    not even accept a connection from beyond; from loopback it answers."""
    server = SidecarServer(parse_config(_sidecar_config()))
    await server.start()
    try:
        address = beyond_loopback_address()
        with pytest.raises(ConnectionRefusedError):
            source_address_towards(address, server.admin_port)
        async with grpc.aio.insecure_channel(f"{address}:{server.admin_port}", options=_NO_PROXY) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unreachable:
                await pb_grpc.AdminStub(channel).GetState(pb.GetStateRequest(), timeout=5)
            assert unreachable.value.code() is grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.admin_port}", options=_NO_PROXY) as channel:
            state = await pb_grpc.AdminStub(channel).GetState(pb.GetStateRequest(), timeout=10)
            assert [p.name for p in state.pools] == ["primary", "fallback"]
    finally:
        await server.stop()


async def test_the_admin_token_is_compared_with_hmac_compare_digest(exposed_admin, monkeypatch):
    """The guard decides with hmac.compare_digest (constant time in the digests' content) on the
    SHA-256 of what was presented (constant length, whatever was presented) against each
    configured digest. Shown by behaviour, not by timing: every decision goes through
    compare_digest with exactly those arguments, and its answer is the decision (told "no",
    even the right token is refused), so a plain `==` or `in` would fail this test."""
    compared: list[tuple[str, str]] = []

    def spy(a, b):
        compared.append((a, b))
        return hmac.compare_digest(a, b)

    monkeypatch.setattr(admin_service, "hmac", SimpleNamespace(compare_digest=spy))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{exposed_admin.admin_port}", options=_NO_PROXY) as channel:
        stub = pb_grpc.AdminStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await stub.GetState(pb.GetStateRequest(), metadata=_bearer("sk-admin-guess"), timeout=10)
        assert wrong.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert compared == [(sha256("sk-admin-guess"), sha256(ADMIN_TOKEN))]

        await stub.GetState(pb.GetStateRequest(), metadata=_bearer(ADMIN_TOKEN), timeout=10)
        assert compared[1:] == [(sha256(ADMIN_TOKEN), sha256(ADMIN_TOKEN))]

        monkeypatch.setattr(admin_service, "hmac", SimpleNamespace(compare_digest=lambda a, b: False))
        with pytest.raises(grpc.aio.AioRpcError) as overruled:
            await stub.GetState(pb.GetStateRequest(), metadata=_bearer(ADMIN_TOKEN), timeout=10)
        assert overruled.value.code() is grpc.StatusCode.UNAUTHENTICATED


# -- 2. the queue page ----------------------------------------------------------------------------

@pytest.fixture
async def exposed_metrics():
    """A sidecar whose metrics port (and the queue page on it) listens on every address, as a
    Prometheus scrape from another host needs."""
    server = SidecarServer(parse_config(_sidecar_config(metrics_host="0.0.0.0")))
    await server.start()
    yield server
    await server.stop()


SPOOFED_LOCAL = {
    "x-forwarded-for": "127.0.0.1",
    "forwarded": "for=127.0.0.1;host=localhost;proto=http",
    "x-real-ip": "127.0.0.1",
    "x-forwarded-host": "localhost",
    "x-original-forwarded-for": "::1",
    "host": "127.0.0.1",
}


async def test_the_queue_page_refuses_a_client_beyond_loopback(exposed_metrics):
    port = exposed_metrics.metrics_port
    address = beyond_loopback_address()
    assert not ipaddress.ip_address(source_address_towards(address, port)).is_loopback
    remote = aiohttp.TCPConnector(local_addr=(address, 0), force_close=True)
    async with aiohttp.ClientSession(connector=remote) as session:
        base = f"http://{address}:{port}"
        for path in ("/queue", "/queue/state", "/queue?refresh=1", "/queue/state?decisions=1000"):
            for headers in ({}, SPOOFED_LOCAL):
                async with session.get(base + path, headers=headers) as refused:
                    assert refused.status == 403, (path, headers)
                    body = await refused.json()
                    assert "loopback" in body["error"] and "pools" not in body
        for path in ("/queue/", "//queue", "/QUEUE", "/queue/state/", "/queue/../queue/state"):
            async with session.get(base + path) as other:  # served by nothing else: no state leaks
                assert other.status in (403, 404), path
                assert '"pools"' not in await other.text()
        async with session.get(f"{base}/metrics") as scrape:  # the listener itself serves beyond loopback
            assert scrape.status == 200 and "extproc_inflight" in await scrape.text()

    async with aiohttp.ClientSession() as session:  # the same server, from loopback
        async with session.get(f"http://127.0.0.1:{port}/queue") as page:
            assert page.status == 200 and page.content_type == "text/html"
        async with session.get(f"http://127.0.0.1:{port}/queue/state") as state:
            assert state.status == 200 and [p["name"] for p in (await state.json())["pools"]] == ["primary", "fallback"]


# -- the gateway: real Envoy and sidecar, recording backends ------------------------------------

@dataclass(frozen=True)
class Received:
    """One request as a backend received it."""

    pool: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]  # lower-case names, every value, in order
    body: bytes

    def values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    @property
    def request_id(self) -> str | None:
        ids = self.values("x-request-id")
        return ids[0] if ids else None


class Backends:
    """Stand-ins for the vLLM engines of each cluster, in a thread and event loop of their own.
    Each records every request that reaches it, whatever its path (every request its HTTP
    parser accepts: Envoy's count of upstream requests covers the others), and answers as vLLM does: a
    completion for a POST naming its own model, 404 for another model, 400 for a body that is
    not JSON, its model list for a GET."""

    def __init__(self, engines: dict[str, tuple[int, str]]):  # pool -> (port, model)
        self.engines = engines
        self._received: list[Received] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="backends", daemon=True)
        self._servers: list[asyncio.AbstractServer] = []

    def _handler(self, pool: str, model: str):
        async def handle(request: web.BaseRequest) -> web.Response:
            body = await request.read()
            headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in request.raw_headers)
            with self._lock:
                self._received.append(Received(pool, request.method, request.raw_path, headers, body))
            if request.method == "GET":
                return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})
            try:
                payload = json.loads(body)
            except ValueError:
                return web.json_response({"error": {"message": "Request body is not valid JSON."}}, status=400)
            if not isinstance(payload, dict) or payload.get("model") != model:
                return web.json_response({"error": {"message": "The model does not exist.", "code": "model_not_found"}},
                                         status=404)
            return web.json_response({
                "id": f"chatcmpl-{pool}", "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            })

        return handle

    def start(self) -> Backends:
        self._thread.start()

        async def listen():
            for pool, (port, model) in self.engines.items():
                server = web.Server(self._handler(pool, model), access_log=None)
                self._servers.append(await self._loop.create_server(server, "127.0.0.1", port))

        asyncio.run_coroutine_threadsafe(listen(), self._loop).result(10)
        return self

    def stop(self) -> None:
        async def close():
            for server in self._servers:
                server.close()
                await server.wait_closed()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def with_id(self, request_id: str) -> list[Received]:
        return [r for r in self.received() if r.request_id == request_id]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """Envoy (the production template) and the sidecar, with a primary pool, a fallback pool and
    a canary pool for branches ending in 7, each cluster served by a recording backend."""
    work = tmp_path_factory.mktemp("security")
    ports = StackPorts.random(primary=1, canary=1)
    config = e2e_config()
    config["anonymous"] = yaml.safe_load(default_config_text())["anonymous"]  # the shipped rights
    config["pools"]["primary"]["max_inflight"] = 4
    config["pools"]["canary"] = {"cluster": "vllm_canary", "max_inflight": 2, "fallback": "fallback",
                                 "models": {"deepseek-sim": "deepseek-sim-next"}}
    config["canary"] = {"pool": "canary", "digits": ["7"]}
    config["tenants"].append({"name": "teller", "branch_id": "0007", "api_key_sha256": [sha256(TELLER_KEY)]})
    path = work / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    backends = Backends({"primary": (ports.primary[0], "deepseek-sim"),
                         "fallback": (ports.fallback[0], "deepseek-sim-small"),
                         "canary": (ports.canary[0], "deepseek-sim-next")}).start()
    # Envoy writes its access log out every 10 s by default: the same Envoy, told to do it sooner.
    envoy = work / "envoy"
    envoy.write_text(f'#!/bin/sh\nexec {shlex.quote(envoy_binary())} --file-flush-interval-msec 100 "$@"\n')
    envoy.chmod(0o755)
    stack = Stack(work, ports, path)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(stack_module, "envoy_binary", lambda: str(envoy))
            stack.start_sidecar()
            stack.start_envoy()
    except BaseException:
        stack.stop()
        backends.stop()
        raise
    yield stack, backends
    stack.stop()
    backends.stop()


def access_line(stack: Stack, request_id: str) -> dict:
    """Envoy's access log line of the request (it carries the sidecar's decision as metadata)."""
    def lines():
        return [r for r in json_lines(stack.workdir / "envoy.log") if r.get("x_request_id") == request_id]

    wait_until(lambda: lines(), 15, f"Envoy's access log line of {request_id}")
    found = lines()
    assert len(found) == 1, found
    return found[0]


def decisions(stack: Stack, request_id: str) -> list[dict]:
    """The sidecar's decision log lines of the request (its decision, then its release)."""
    def lines():
        return [r for r in json_lines(stack.workdir / "sidecar.log") if r.get("client_request_id") == request_id]

    wait_until(lambda: lines(), 15, f"the sidecar's decision on {request_id}")
    return lines()


def decided(stack: Stack, request_id: str) -> str:
    """The sidecar's decision on the request (not the record of its release)."""
    outcomes = [r["outcome"] for r in decisions(stack, request_id) if r["outcome"] != "released"]
    assert len(outcomes) == 1, outcomes
    return outcomes[0]


def http1(stack: Stack, method: str, path: str, headers: list[tuple[str, str]], body: bytes | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request with exactly these header names (case kept) and values (repeats kept)."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.ports.envoy, timeout=30)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers:
            connection.putheader(name, value)
        if body is not None:
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def served_by(stack: Stack, backends: Backends, request_id: str) -> Received:
    """The one backend reception of the request, checked against Envoy's record of where it went."""
    got = backends.with_id(request_id)
    assert len(got) == 1, f"{request_id} reached {[r.pool for r in got]}"
    access = access_line(stack, request_id)
    assert access["upstream_host"] == f"127.0.0.1:{stack.ports.pool_ports(got[0].pool)[0]}"
    assert access["upstream_cluster"] == f"vllm_{got[0].pool}"
    return got[0]


# -- 3. a client cannot pick its pool, cluster or priority ----------------------------------------

POOL_PICKS = {
    "fallback cluster": [("x-llm-pool", "vllm_fallback")],
    "canary cluster": [("x-llm-pool", "vllm_canary")],
    "upper case": [("X-LLM-Pool", "vllm_canary")],
    "mixed case, twice": [("X-Llm-Pool", "vllm_fallback"), ("x-LLM-POOL", "vllm_canary")],
    "a list": [("x-llm-pool", "vllm_canary,vllm_fallback")],
    "the sidecar's cluster": [("x-llm-pool", "extproc")],
    "an unknown cluster": [("x-llm-pool", "vllm_nowhere")],
    "the canary's backend by address": [("x-gateway-destination-endpoint", "127.0.0.1:{canary_port}")],
}


@pytest.mark.parametrize("pick", list(POOL_PICKS))
@pytest.mark.parametrize("method", ["POST", "GET"])
def test_a_client_cannot_pick_its_pool_or_cluster(gateway, pick, method):
    """POST: admitted, the sidecar sets the pool; GET: passed through without a body, where only
    the sidecar's stripping of the client's copy (and the route's) stands between the header
    and the route. Either way the request reaches the primary pool, and no x-llm-pool reaches
    the backend."""
    stack, backends = gateway
    request_id = f"pick-{method}-{pick}".replace(" ", "-").replace(",", "").replace("'", "")
    headers = [(name, value.format(canary_port=stack.ports.canary[0])) for name, value in POOL_PICKS[pick]]
    headers.append(("x-request-id", request_id))
    if method == "POST":
        status, _, body = http1(stack, "POST", "/v1/chat/completions", headers, chat(user=request_id))
        assert status == 200 and json.loads(body)["model"] == "deepseek-sim"
    else:
        status, _, body = http1(stack, "GET", "/v1/models", headers)
        assert status == 200 and json.loads(body)["data"][0]["id"] == "deepseek-sim"
    got = served_by(stack, backends, request_id)
    assert got.pool == "primary"
    assert got.values("x-llm-pool") == []
    access = access_line(stack, request_id)
    if method == "POST":
        assert access["outcome"] == "admitted" and access["pool"] == "primary"
        assert decided(stack, request_id) == "admitted"
    else:
        assert access["outcome"] == "passed_through"


def test_a_client_cannot_set_its_priority_or_class(gateway):
    """x-llm-priority and x-llm-class are the sidecar's: sent by a client (repeated, with a list
    value, in upper case), none of them reaches a backend; an admitted request carries exactly
    one of each, the sidecar's (the class and score its caller's identity and claims give).
    A caller that drops its key gains nothing: with the shipped anonymous rights, the clerk's
    branch claiming a loan without its key is served as an archive query, with no boost."""
    stack, backends = gateway
    forged = [("x-llm-priority", "-100"), ("X-LLM-Priority", "-100"), ("x-llm-priority", "-50, -60"),
              ("x-llm-class", "loan_approval"), ("X-LLM-Class", "loan_approval")]
    cases = [  # (request id, caller's headers, class and priority the backend must see)
        ("prio-anonymous", [], "archive_query", "2"),
        ("prio-clerk", [("authorization", "Bearer sk-test-clerk"), ("x-ticket-type", "loan_approval")],
         "complaint", "1"),  # a clerk may not claim a loan ticket: the nearest class it may
        ("prio-clerk-without-key", [("x-ticket-type", "loan_approval"), ("x-urgent-level", "3"),
                                    ("x-vip-level", "3"), ("x-branch-id", "0002")], "archive_query", "2"),
        ("prio-officer", [("authorization", f"Bearer {OFFICER_KEY}"), ("x-ticket-type", "loan_approval"),
                          ("x-urgent-level", "1")], "loan_approval", "-0.1"),
    ]
    for request_id, claims, class_name, priority in cases:
        status, _, _ = http1(stack, "POST", "/v1/chat/completions",
                             [*forged, *claims, ("x-request-id", request_id)], chat(user=request_id))
        assert status == 200
        got = served_by(stack, backends, request_id)
        assert got.pool == "primary"
        assert got.values("x-llm-priority") == [priority], request_id
        assert got.values("x-llm-class") == [class_name], request_id
        access = access_line(stack, request_id)
        assert access["class"] == class_name and access["priority"] == pytest.approx(float(priority))
        admitted = [r for r in decisions(stack, request_id) if r["outcome"] == "admitted"]
        assert len(admitted) == 1 and admitted[0]["priority"] == pytest.approx(float(priority))

    # Passed through (no body, no admission): the forged headers are stripped all the same.
    status, _, _ = http1(stack, "GET", "/v1/models", [*forged, ("x-request-id", "prio-get")])
    assert status == 200
    got = served_by(stack, backends, "prio-get")
    assert got.values("x-llm-priority") == [] and got.values("x-llm-class") == []


def test_a_model_or_branch_naming_another_pool_does_not_move_the_request(gateway):
    """The `model` names a model, not a pool: the canary's or the fallback's model sent to the
    default pool stays there (its engine refuses a model it does not serve, as vLLM does); a
    tenant's branch is its own, whatever x-branch-id it sends. The canary pool is really
    reachable: a branch in the canary gets there, with the canary's model written in."""
    stack, backends = gateway
    cases = [  # (request id, headers, model, pool, status)
        ("model-canary", [], "deepseek-sim-next", "primary", 404),
        ("model-fallback", [], "deepseek-sim-small", "primary", 404),
        ("model-fallback-from-canary-branch", [("authorization", f"Bearer {TELLER_KEY}")], "deepseek-sim-small",
         "primary", 404),  # the canary pairs no such model: the default pool serves it
        ("branch-claim", [("authorization", f"Bearer {OFFICER_KEY}"), ("x-branch-id", "0007")], "deepseek-sim",
         "primary", 200),
        ("canary-branch", [("authorization", f"Bearer {TELLER_KEY}")], "deepseek-sim", "canary", 200),
    ]
    for request_id, headers, model, pool, status in cases:
        answered, _, _ = http1(stack, "POST", "/v1/chat/completions", [*headers, ("x-request-id", request_id)],
                               chat(user=request_id, model=model))
        assert answered == status, request_id
        got = served_by(stack, backends, request_id)
        assert got.pool == pool, request_id
        access = access_line(stack, request_id)
        assert access["outcome"] == "admitted" and access["pool"] == pool, request_id
        sent = json.loads(got.body)["model"]
        assert sent == ("deepseek-sim-next" if pool == "canary" else model), request_id
    assert access_line(stack, "branch-claim")["branch"] == "0001"
    assert access_line(stack, "canary-branch")["branch"] == "0007"


# -- 4. HTTP/2 pseudo-header tricks cannot skip admission -----------------------------------------

def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack(headers: list[tuple[str, str]]) -> bytes:
    """A header block of literal fields without indexing, names and values as given (HTTP/2
    libraries refuse to send the malformed ones these tests need)."""
    block = b""
    for name, value in headers:
        n, v = name.encode("latin-1"), value.encode("latin-1")
        block += b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v
    return block


DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x4, 0x8, 0x20


def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


# HPACK's static table entries for :status, and the Huffman codes of the digits.
_STATIC_STATUS = {8: 200, 9: 204, 10: 206, 11: 304, 12: 400, 13: 404, 14: 500}
_HUFFMAN_DIGITS = {"00000": "0", "00001": "1", "00010": "2", **{format(0x19 + i, "06b"): str(3 + i) for i in range(7)}}


def _status_of(block: bytes) -> int | None:
    """The :status of a response header block (the first field, as HTTP/2 requires), as Envoy
    encodes it on a fresh connection: a static table entry, or a literal with :status's name."""
    first = block[0]
    if first & 0x80:
        return _STATIC_STATUS.get(first & 0x7F)
    index = first & (0x3F if first & 0x40 else 0x0F)
    if index not in _STATIC_STATUS:
        return None
    length, raw = block[1] & 0x7F, block[2:2 + (block[1] & 0x7F)]
    if not block[1] & 0x80:
        return int(raw)
    bits, digits = "".join(format(b, "08b") for b in raw), ""
    while bits and not set(bits) <= {"1"}:  # padding is all ones
        code = next(c for c in _HUFFMAN_DIGITS if bits.startswith(c))
        digits, bits = digits + _HUFFMAN_DIGITS[code], bits[len(code):]
    return int(digits) if length else None


class H2Answer(NamedTuple):
    status: int | None  # None: the stream was reset or the connection closed, no response
    ended: str  # "response", "reset", "goaway", "closed"


def h2_exchange(port: int, frames: list[bytes]) -> H2Answer:
    """Send `frames` on a fresh prior-knowledge HTTP/2 connection (stream 1) and read until the
    response ends or the stream or connection is closed."""
    status = None
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(SETTINGS, 0, 0) + b"".join(frames))
        buffer = b""
        try:
            while True:
                while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
                    chunk = s.recv(65536)
                    if not chunk:
                        return H2Answer(status, "closed")
                    buffer += chunk
                length, kind, flags = int.from_bytes(buffer[:3], "big"), buffer[3], buffer[4]
                stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                if kind == SETTINGS and not flags & 1:
                    s.sendall(h2_frame(SETTINGS, 1, 0))
                elif kind == PING and not flags & 1:
                    s.sendall(h2_frame(PING, 1, 0, payload))
                elif kind == GOAWAY:
                    return H2Answer(status, "goaway")
                elif stream == 1 and kind == RST_STREAM:
                    return H2Answer(status, "reset")
                elif stream == 1 and kind == HEADERS and status is None:
                    block = payload
                    if flags & PADDED:
                        block = block[1:len(block) - block[0]]
                    if flags & PRIORITY_FLAG:
                        block = block[5:]
                    status = _status_of(block)
                if stream == 1 and kind in (DATA, HEADERS) and flags & END_STREAM:
                    return H2Answer(status, "response")
        except ConnectionResetError:
            return H2Answer(status, "closed")


BODY = chat("smuggled?", max_tokens=4)


def _request(path: str | None, request_id: str, method: str = "POST", extra: tuple = (), before: tuple = ()
             ) -> list[tuple[str, str]]:
    headers = [*before, (":method", method), (":scheme", "http"), (":authority", "gateway")]
    if path is not None:
        headers.append((":path", path))
    return [*headers, ("content-type", "application/json"), ("x-request-id", request_id), *extra]


def _with_body(headers: list[tuple[str, str]], body: bytes = BODY) -> list[bytes]:
    return [h2_frame(HEADERS, END_HEADERS, 1, hpack(headers)), h2_frame(DATA, END_STREAM, 1, body)]


def _smuggling_attempts() -> dict[str, list[bytes]]:
    """name -> the frames of stream 1; every one names itself in x-request-id h2-<name>."""
    paths = {
        "plain": "/v1/chat/completions",
        "query": "/v1/chat/completions?x",
        "query-stream": "/v1/chat/completions?stream=true&model=deepseek-sim-next",
        "double-slash": "//v1/chat/completions",
        "dot-segment": "/v1/./chat/completions",
        "dot-dot-segment": "/v1/../v1/chat/completions",
        "dot-dot-above-root": "/../v1/chat/completions",
        "encoded-dot-dot": "/%2e%2e/v1/chat/completions",
        "encoded-slash": "/v1/chat%2Fcompletions",
        "trailing-dot-dot": "/v1/chat/completions/..",
        "upper-case": "/V1/CHAT/COMPLETIONS",
        "fragment": "/v1/chat/completions#x",
        "semicolon": "/v1/chat/completions;x=1",
        "backslash": "/v1\\chat\\completions",
        "other-endpoint": "/v1/completions",
        "models-with-a-body": "/v1/models",
        "health-with-a-body": "/health",
        "no-leading-slash": "v1/chat/completions",
        "absolute-form": "http://elsewhere/v1/chat/completions",
        "asterisk": "*",
        "empty": "",
        "space": "/v1/chat/completions HTTP/1.1",
        "nul": "/v1/chat/completions\x00",
        "newline": "/v1/chat/completions\r\nx-llm-pool: vllm_canary",
    }
    attempts = {name: _with_body(_request(path, f"h2-{name}")) for name, path in paths.items()}
    attempts.update({
        "no-path": _with_body(_request(None, "h2-no-path")),
        "two-paths": _with_body(_request("/health", "h2-two-paths", extra=((":path", "/v1/chat/completions"),))),
        "path-after-a-header": _with_body([(":method", "POST"), (":scheme", "http"), (":authority", "gateway"),
                                           ("x-request-id", "h2-path-after-a-header"),
                                           (":path", "/v1/chat/completions")]),
        "unknown-pseudo-header": _with_body(_request("/v1/chat/completions", "h2-unknown-pseudo-header",
                                                     before=((":pool", "vllm_canary"),))),
        "upper-case-header-name": _with_body(_request("/v1/chat/completions", "h2-upper-case-header-name",
                                                      extra=(("X-LLM-Pool", "vllm_canary"),))),
        "get-with-a-body": _with_body(_request("/v1/chat/completions", "h2-get-with-a-body", method="GET")),
        "lower-case-method": _with_body(_request("/v1/chat/completions", "h2-lower-case-method", method="post")),
        "connect": _with_body([(":method", "CONNECT"), (":authority", "127.0.0.1:1"), ("x-request-id", "h2-connect")]),
        "options-asterisk": _with_body(_request("*", "h2-options-asterisk", method="OPTIONS")),
        "host-disagrees": _with_body(_request("/v1/chat/completions", "h2-host-disagrees", extra=(("host", "other"),))),
        "https-scheme": _with_body([(":method", "POST"), (":scheme", "https"), (":authority", "gateway"),
                                    (":path", "/v1/chat/completions"), ("x-request-id", "h2-https-scheme")]),
        "transfer-encoding": _with_body(_request("/v1/chat/completions", "h2-transfer-encoding",
                                                 extra=(("transfer-encoding", "chunked"),))),
        "content-length-zero": _with_body(_request("/v1/chat/completions", "h2-content-length-zero",
                                                   extra=(("content-length", "0"),))),
        "content-length-short": _with_body(_request("/v1/chat/completions", "h2-content-length-short",
                                                    extra=(("content-length", "2"),))),
        "pool-and-priority-headers": _with_body(_request("/v1/chat/completions", "h2-pool-and-priority-headers", extra=(
            ("x-llm-pool", "vllm_canary"), ("x-llm-pool", "vllm_fallback"), ("x-llm-priority", "-100"),
            ("x-llm-priority", "-100")))),
        "body-then-trailers": [h2_frame(HEADERS, END_HEADERS, 1, hpack(_request("/v1/chat/completions",
                                                                                 "h2-body-then-trailers"))),
                               h2_frame(DATA, 0, 1, BODY),
                               h2_frame(HEADERS, END_HEADERS | END_STREAM, 1, hpack([("x-trailer", "1")]))],
        "body-in-two-frames": [h2_frame(HEADERS, END_HEADERS, 1, hpack(_request("/v1/chat/completions",
                                                                                 "h2-body-in-two-frames"))),
                               h2_frame(DATA, 0, 1, BODY[:10]), h2_frame(DATA, END_STREAM, 1, BODY[10:])],
        "no-body": [h2_frame(HEADERS, END_HEADERS | END_STREAM, 1, hpack(_request("/v1/chat/completions",
                                                                                   "h2-no-body")))],
    })
    return attempts


def _admitted_total(stack: Stack) -> float:
    return metric(stack.metrics_url, "extproc_admission_outcomes_total", outcome="admitted")


def _upstream_requests(stack: Stack) -> int:
    """Envoy's own count of requests it sent to the model clusters (whatever became of them)."""
    _, text = http_get(f"http://127.0.0.1:{stack.ports.envoy_admin}/stats?filter=upstream_rq_total")
    total = 0
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if name in {f"cluster.vllm_{pool}.upstream_rq_total" for pool in ("primary", "fallback", "canary", "long")}:
            total += int(value)
    return total


def _fate(stack: Stack, backends: Backends, request_id: str, answer: H2Answer | None) -> str:
    """What became of the request: "refused" (no backend saw it), "admitted", or "passed through"
    (it had no body, and a backend saw none). Fails for a request that reached a backend without
    the sidecar's decision to admit it. `answer`: the client's view, None when not read."""
    got = backends.with_id(request_id)
    assert len(got) <= 1, f"{request_id} reached backends {len(got)} times"
    if answer is not None and answer.status is None:  # reset or closed: Envoy refused it
        assert not got, f"{request_id} reached {got[0].pool}, and the client got no response"
        return "refused"
    access = access_line(stack, request_id)  # Envoy parsed it: its line names it
    if answer is not None:
        assert access["status"] == answer.status, (request_id, access, answer)
    if access["upstream_host"] is None:  # Envoy sent it nowhere (a backend that cannot parse it records nothing)
        assert not got and access["status"] >= 400, (request_id, access)
        return "refused"
    outcome = decided(stack, request_id)
    assert outcome in ("admitted", "passed_through"), (
        f"{request_id} reached {access['upstream_host']}, the sidecar's decision: {outcome}")
    assert access["outcome"] == outcome, (request_id, access)  # Envoy's record of the decision agrees
    if outcome == "passed_through":
        assert access["bytes_received"] == 0 and all(r.body == b"" for r in got), request_id
        return "passed through"
    assert access["pool"] == "primary" and access["upstream_cluster"] == "vllm_primary", access
    assert all(json.loads(r.body) == json.loads(BODY) for r in got), request_id
    return "admitted"


def test_http2_pseudo_header_tricks_cannot_skip_admission(gateway):
    """Every :path form and pseudo-header trick, each on its own connection: a request that
    reaches a backend was admitted by the sidecar (its decision log and Envoy's record agree),
    with its whole body, in the pool the sidecar chose; every other one was refused, by Envoy
    or by the sidecar; and Envoy sent the model clusters nothing else."""
    stack, backends = gateway
    admitted_before, upstream_before = _admitted_total(stack), _upstream_requests(stack)
    received_before = len(backends.received())
    attempts = _smuggling_attempts()
    answers = {name: h2_exchange(stack.ports.envoy, frames) for name, frames in attempts.items()}
    fates = {name: _fate(stack, backends, f"h2-{name}", answers[name]) for name in attempts}

    reached = sum(fate != "refused" for fate in fates.values())
    assert _upstream_requests(stack) - upstream_before == reached  # nothing unnamed went upstream
    new = backends.received()[received_before:]
    # What the backends recorded: all of those, but the `post` one (admitted, sent upstream as
    # Envoy got it, and refused by the backend's HTTP parser before any handler sees it).
    assert sorted(r.request_id for r in new) == sorted(
        f"h2-{name}" for name, fate in fates.items() if fate != "refused" and name != "lower-case-method")
    # Each admitted once (CONNECT is admitted too, then finds no route: no backend).
    assert _admitted_total(stack) - admitted_before >= sum(fate == "admitted" for fate in fates.values())
    assert all(r.values("x-llm-pool") == [] and len(r.values("x-llm-priority")) == 1 for r in new if r.body)
    # Not vacuous: the odd paths Envoy lets through reach a backend verbatim (Envoy does not
    # normalise them), admitted; the malformed ones are refused.
    assert {name for name, fate in fates.items() if fate == "admitted"} >= {
        "plain", "query", "double-slash", "dot-segment", "dot-dot-segment", "encoded-slash", "upper-case",
        "other-endpoint", "get-with-a-body", "body-then-trailers", "body-in-two-frames",
        "pool-and-priority-headers"}
    assert backends.with_id("h2-double-slash")[0].path == "//v1/chat/completions"
    assert backends.with_id("h2-dot-dot-segment")[0].path == "/v1/../v1/chat/completions"
    assert fates["no-body"] == "passed through"
    for name in ("no-leading-slash", "absolute-form", "asterisk", "empty", "space", "nul", "newline", "no-path",
                 "two-paths", "path-after-a-header", "unknown-pseudo-header", "upper-case-header-name",
                 "connect", "options-asterisk", "transfer-encoding", "content-length-zero", "content-length-short"):
        assert fates[name] == "refused", name


def test_http2_headers_then_trailers_without_a_body_cannot_skip_admission(gateway):
    stack, backends = gateway
    frames = [h2_frame(HEADERS, END_HEADERS, 1, hpack(_request("/v1/chat/completions", "h2-trailers-only",
                                                               extra=(("x-llm-pool", "vllm_canary"),)))),
              h2_frame(HEADERS, END_HEADERS | END_STREAM, 1, hpack([("x-trailer", "1")]))]
    answer = h2_exchange(stack.ports.envoy, frames)
    assert _fate(stack, backends, "h2-trailers-only", answer) == "refused"


def _raw_http1(port: int, data: bytes) -> bytes:
    """Send raw bytes on one HTTP/1.1 connection and read until Envoy closes it."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):
                out += chunk
    return out


def test_http1_smuggling_classics_cannot_skip_admission(gateway):
    """Content-Length against Transfer-Encoding, two lengths, a second request hidden after the
    first one's body, chunked bodies with trailers: every request a backend gets was admitted."""
    stack, backends = gateway
    admitted_before, upstream_before = _admitted_total(stack), _upstream_requests(stack)
    length = str(len(BODY)).encode()

    def head(request_id: str, *lines: bytes, close: bool = True) -> bytes:
        lines = (*lines, b"Connection: close") if close else lines
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\ncontent-type: application/json\r\n"
                b"x-request-id: " + request_id.encode() + b"\r\n"
                + b"".join(line + b"\r\n" for line in lines) + b"\r\n")

    chunked = hex(len(BODY))[2:].encode() + b"\r\n" + BODY + b"\r\n0\r\n"
    attempts = {
        "h1-cl-te": head("h1-cl-te", b"Content-Length: 4", b"Transfer-Encoding: chunked") + chunked + b"\r\n",
        "h1-te-cl": head("h1-te-cl", b"Transfer-Encoding: chunked", b"Content-Length: 4") + chunked + b"\r\n",
        "h1-two-lengths": head("h1-two-lengths", b"Content-Length: 4", b"Content-Length: " + length) + BODY,
        "h1-te-obfuscated": head("h1-te-obfuscated", b"Transfer-Encoding: xchunked", b"Content-Length: 4")
        + chunked + b"\r\n",
        "h1-pipelined": head("h1-pipelined", b"Content-Length: " + length, close=False) + BODY
        + head("h1-inner", b"Content-Length: " + length) + BODY,
        "h1-chunked-trailers": head("h1-chunked-trailers", b"Transfer-Encoding: chunked") + chunked
        + b"x-t: 1\r\n\r\n",
        "h1-trailers-only": head("h1-trailers-only", b"Transfer-Encoding: chunked") + b"0\r\nx-t: 1\r\n\r\n",
    }
    for data in attempts.values():
        _raw_http1(stack.ports.envoy, data)

    names = [*attempts, "h1-inner"]
    fates = {name: _fate(stack, backends, name, None) if backends.with_id(name) else "refused" for name in names}
    assert _upstream_requests(stack) - upstream_before == sum(fate != "refused" for fate in fates.values())
    assert _admitted_total(stack) - admitted_before == sum(fate == "admitted" for fate in fates.values())
    # Not vacuous: the well-formed ones got through (the pipelined pair as two admitted requests).
    assert fates["h1-pipelined"] == fates["h1-inner"] == fates["h1-chunked-trailers"] == "admitted"
    for name in ("h1-cl-te", "h1-te-cl", "h1-two-lengths", "h1-trailers-only"):
        assert fates[name] == "refused", name


async def test_the_admin_api_and_the_ext_proc_port_listen_on_ipv6_loopback():
    """`admin.host: "::1"` is loopback, allowed without a token: the server must bind it (the
    address in brackets, as gRPC reads it) and answer there."""
    import grpc

    from extproc.core.config import parse_config
    from extproc.server import SidecarServer

    from ..conftest import e2e_config

    config = parse_config(e2e_config(listen={"host": "::1", "grpc_port": 0, "metrics_port": 0},
                                     admin={"host": "::1", "port": 0}))
    server = SidecarServer(config)
    await server.start()
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with grpc.aio.insecure_channel(f"[::1]:{server.grpc_port}") as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert server.admin_port > 0
    finally:
        await server.stop()
