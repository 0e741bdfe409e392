"""Engines discovered through DNS, against a real DNS server on loopback (dnsmasq, tests/dns_server.py)
whose records the tests change: the resolvers read its answers; a running sidecar's engines, probes,
budget and series follow its records; and through real Envoy, whose STRICT_DNS cluster resolves the
same name, an engine added to the name receives requests and one removed receives none while every
request is answered."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import struct
import threading
import urllib.error
import urllib.request

import pytest
import yaml
from aiohttp import web

from extproc.control.discovery import NameserverResolver, SystemResolver, resolver_for
from extproc.core.capacity import Placing
from extproc.core.config import parse_config
from extproc.core.discovery import DiscoverySettings, Resolution
from extproc.server import SidecarServer
from extproc_testbed.stack import (LOOPBACK, ManagedProcess, SimSpec, Stack, StackPorts, free_port, http_get,
                                   metric_sum, parse_samples, port_is_free, wait_until)

from ..conftest import e2e_config
from ..dns_server import Dnsmasq
from ..helpers import async_wait_until, sidecar_from_file
from .test_capacity import VLLM_TEXT

NAME = "engines.svc.test"
ENGINES = ("127.0.0.2", "127.0.0.3")  # loopback addresses Linux answers on without setup


@pytest.fixture
def dns(tmp_path):
    server = Dnsmasq(tmp_path / "dns").start()
    yield server
    server.stop()


def engine_port() -> int:
    """A port free on every engine address."""
    while True:
        port = free_port()
        if all(port_is_free(port, host) for host in ENGINES):
            return port


# -- the resolvers ------------------------------------------------------------------------------------

async def test_the_nameserver_resolver_reads_a_real_servers_answers(dns):
    dns.set(NAME, ["127.0.0.3", "127.0.0.2"])
    dns.set("v6.svc.test", ["fd00::2", "fd00::1"])
    resolver = resolver_for(DiscoverySettings(nameserver=dns.nameserver))
    assert isinstance(resolver, NameserverResolver)
    assert await resolver.resolve(NAME, "V4_ONLY", 2) == Resolution(("127.0.0.2", "127.0.0.3"))
    assert await resolver.resolve("v6.svc.test", "V6_ONLY", 2) == Resolution(("fd00::1", "fd00::2"))
    assert await resolver.resolve(NAME, "V6_ONLY", 2) == Resolution()  # no AAAA record: empty
    assert await resolver.resolve("gone.svc.test", "V4_ONLY", 2) == Resolution()  # NXDOMAIN: empty
    dns.set(NAME, [])
    assert await resolver.resolve(NAME, "V4_ONLY", 2) == Resolution()
    assert await resolver.resolve("10.0.0.7", "V4_ONLY", 2) == Resolution(("10.0.0.7",))  # dns://10.0.0.7:8000


async def test_an_answer_too_large_for_udp_is_read_over_tcp(tmp_path):
    server = Dnsmasq(tmp_path / "dns", "--edns-packet-max=512").start()
    try:
        many = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(80)]  # 80 records: over 512 bytes
        server.set(NAME, many)
        assert len(server.ask(NAME)) < 80  # over UDP: a part, truncated
        resolution = await NameserverResolver(server.address).resolve(NAME, "V4_ONLY", 2)
        assert sorted(resolution.addresses) == sorted(many) and resolution.failure is None
    finally:
        server.stop()


async def test_a_nameserver_that_is_gone_silent_or_garbled_is_a_failure_never_an_empty_answer():
    closed = free_port()  # nobody listens: the kernel answers port unreachable
    resolution = await NameserverResolver((LOOPBACK, closed)).resolve(NAME, "V4_ONLY", 1)
    assert resolution.failure is not None and not resolution.empty
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind((LOOPBACK, 0))
        resolution = await NameserverResolver(silent.getsockname()).resolve(NAME, "V4_ONLY", 0.3)
        assert resolution.failure == f"no answer from {LOOPBACK}:{silent.getsockname()[1]} within 0.3 s"

    class Garbled(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.transport = transport

        def datagram_received(self, data, addr):
            self.transport.sendto(data[:2] + b"\x81\x80" + b"\xff" * 40, addr)  # its id, then nonsense

    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(Garbled, local_addr=(LOOPBACK, 0))
    try:
        resolution = await NameserverResolver(transport.get_extra_info("sockname")).resolve(NAME, "V4_ONLY", 1)
        assert resolution.failure is not None and not resolution.empty
    finally:
        transport.close()


async def test_a_truncated_answer_cut_inside_a_record_is_asked_again_over_tcp_and_another_querys_passed_over():
    """A server that cuts its UDP answer to fit may cut it inside a record; a datagram of another
    query (a late answer, a spoofer's guess) is no answer to this one: the answer may still come."""
    addresses = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]

    def answer(query: bytes, truncated: bool) -> bytes:
        question = query[12:query.index(b"\0", 12) + 5]
        records = b"".join(b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 0, 4) + socket.inet_aton(a) for a in addresses)
        flags = 0x8180 | (0x0200 if truncated else 0)
        message = query[:2] + struct.pack(">HHHHH", flags, 1, 3, 0, 0) + question + records
        return message[:-6] if truncated else message  # the count kept, the last record cut

    class Udp(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.transport = transport

        def datagram_received(self, data, addr):
            self.transport.sendto(answer(bytes([data[0] ^ 0xFF]) + data[1:], False), addr)  # another id
            self.transport.sendto(answer(data, True), addr)

    async def tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        query = await reader.readexactly(int.from_bytes(await reader.readexactly(2), "big"))
        writer.write(len(answer(query, False)).to_bytes(2, "big") + answer(query, False))
        await writer.drain()
        writer.close()

    loop = asyncio.get_running_loop()
    while True:  # a port free for both
        transport, _ = await loop.create_datagram_endpoint(Udp, local_addr=(LOOPBACK, 0))
        try:
            server = await asyncio.start_server(tcp, LOOPBACK, transport.get_extra_info("sockname")[1])
            break
        except OSError:
            transport.close()
    try:
        resolution = await NameserverResolver(transport.get_extra_info("sockname")).resolve(NAME, "V4_ONLY", 2)
        assert resolution == Resolution(tuple(addresses))
    finally:
        transport.close()
        server.close()


async def test_the_system_resolver_reads_the_hosts_file():
    assert isinstance(resolver_for(DiscoverySettings()), SystemResolver)
    assert await SystemResolver().resolve("localhost", "V4_ONLY", 5) == Resolution(("127.0.0.1",))


# -- a running sidecar follows the records ---------------------------------------------------------------

@pytest.fixture
async def metrics_endpoints():
    """vLLM's /metrics on each engine address, one port: an idle engine of 32768 KV tokens."""
    app = web.Application()
    async def idle(request: web.Request) -> web.Response:
        return web.Response(text=VLLM_TEXT.replace("0.42", "0.0"))

    app.router.add_get("/metrics", idle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = engine_port()
    for host in ENGINES:
        await web.TCPSite(runner, host, port).start()
    yield port
    await runner.cleanup()


def engines_budget(n: int) -> int:
    """The budget of `n` idle engines of 32768 KV tokens (safety factor 0.85)."""
    return int(n * 32768 * 0.85)


async def budget_of(server: SidecarServer) -> int | None:
    return (await server.store.snapshot("primary")).budget_tokens


async def until(read, wanted, what: str, timeout: float = 15.0) -> None:
    """Wait until the coroutine function `read` returns `wanted`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (got := await read()) != wanted:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {got}, not {wanted}")
        await asyncio.sleep(0.05)


async def test_a_sidecars_engines_probes_budget_and_series_follow_the_records(dns, metrics_endpoints):
    port = metrics_endpoints
    dns.set(NAME, ["127.0.0.2"])
    raw = e2e_config(listen={"host": LOOPBACK, "grpc_port": 0, "metrics_port": 0}, admin={"port": 0}, relay={"url": None},
                     probes={"nvml": "off", "interval_s": 60},  # the limits move with the engines, not with a poll
                     discovery={"interval_s": 0.2, "nameserver": dns.nameserver})
    raw["pools"]["primary"].update(max_inflight=8, capacity={"backends": [f"dns://{NAME}:{port}"], "pick_backend": True})
    server = SidecarServer(parse_config(raw))
    await server.start()

    async def budget() -> int | None:
        return await budget_of(server)

    def series() -> dict:
        return parse_samples(server.metrics.render().decode())

    def up(host: str) -> float | None:
        backend = f"http://{host}:{port}/metrics"
        found = [v for (n, labels), v in series().items() if n == "extproc_backend_up" and ("backend", backend) in labels]
        return found[0] if found else None

    def engines() -> tuple[str, ...]:
        return server.discovery.engines("primary")

    try:
        assert engines() == (f"http://127.0.0.2:{port}",)  # resolved before the first limits
        assert await budget() == engines_budget(1) and up("127.0.0.2") == 1 and up("127.0.0.3") is None
        assert metric_sum(series(), "extproc_discovered_engines", pool="primary") == 1

        dns.set(NAME, ["127.0.0.2", "127.0.0.3"])  # an engine appears: probed and counted at once
        await async_wait_until(lambda: len(engines()) == 2, what="the new engine")
        await async_wait_until(lambda: up("127.0.0.3") == 1, what="its probe")
        await until(budget, engines_budget(2), "two engines' budget")
        picks = {server.gate.picker.pick("primary", f"t{i}", Placing(1000)).split(",")[0] for i in range(4)}
        assert picks == {f"127.0.0.2:{port}", f"127.0.0.3:{port}"}  # placed on both
        for i in range(4):
            server.gate.picker.release(f"t{i}")

        dns.set(NAME, ["127.0.0.3"])  # an engine disappears: never picked again, its series gone
        await async_wait_until(lambda: len(engines()) == 1, what="the engine to go")
        assert {server.gate.picker.pick("primary", f"u{i}", Placing(1000)) for i in range(4)} == {f"127.0.0.3:{port}"}
        await async_wait_until(lambda: up("127.0.0.2") is None, what="its series to go")
        await until(budget, engines_budget(1), "one engine's budget")
        assert f"127.0.0.2:{port}" not in server.metrics.render().decode()

        dns.stop()  # the nameserver goes: failures, the engine known stays
        await async_wait_until(
            lambda: metric_sum(series(), "extproc_discovery_resolutions_total", host=NAME, result="failed") >= 3,
            what="failed resolutions")
        assert engines() == (f"http://127.0.0.3:{port}",) and await budget() == engines_budget(1)
        assert metric_sum(series(), "extproc_discovered_engines", pool="primary") == 1
    finally:
        await server.stop()


async def test_a_name_that_answers_nxdomain_twice_leaves_the_pool_no_engine_and_no_budget(dns, metrics_endpoints):
    port = metrics_endpoints
    dns.set(NAME, ["127.0.0.2"])
    raw = e2e_config(listen={"host": LOOPBACK, "grpc_port": 0, "metrics_port": 0}, admin={"port": 0}, relay={"url": None},
                     probes={"nvml": "off", "interval_s": 60},
                     discovery={"interval_s": 0.2, "nameserver": dns.nameserver})
    raw["pools"]["primary"].update(max_inflight=8, capacity={"backends": [f"dns://{NAME}:{port}"], "pick_backend": True})
    server = SidecarServer(parse_config(raw))
    await server.start()
    try:
        dns.set(NAME, [])  # a headless Service with no ready pod: NXDOMAIN
        await async_wait_until(lambda: server.discovery.engines("primary") == (), what="the engines to go")
        state = server.discovery.names[NAME]
        assert state.empties >= 2  # not at the first empty answer
        await until(lambda: budget_of(server), 0, "no budget")
        assert server.gate.picker.pick("primary", "t", Placing(1000)) is None  # Envoy's cluster is empty too
        dns.set(NAME, ["127.0.0.2"])  # a pod is ready again
        await async_wait_until(lambda: len(server.discovery.engines("primary")) == 1, what="the engine to come back")
        await async_wait_until(lambda: server.gate.picker.pick("primary", "u", Placing(1)) is not None, what="a pick")
    finally:
        await server.stop()


async def test_a_reload_that_names_the_engines_by_dns_resolves_them_before_it_returns(tmp_path, dns, metrics_endpoints):
    port = metrics_endpoints
    dns.set(NAME, ["127.0.0.2", "127.0.0.3"])
    raw = e2e_config(listen={"host": LOOPBACK, "grpc_port": 0, "metrics_port": 0}, admin={"port": 0}, relay={"url": None},
                     probes={"nvml": "off", "interval_s": 60}, discovery={"interval_s": 60, "nameserver": dns.nameserver})
    raw["pools"]["primary"].update(max_inflight=8, capacity={"backends": [f"http://127.0.0.2:{port}"], "pick_backend": True})
    path = tmp_path / "extproc.yaml"
    server = sidecar_from_file(path, raw)
    await server.start()
    try:
        assert await budget_of(server) == engines_budget(1)
        raw["pools"]["primary"]["capacity"]["backends"] = [f"dns://{NAME}:{port}"]
        path.write_text(yaml.safe_dump(raw))
        assert (await server.reload("test")).accepted
        # at once, not at the next resolution (a minute away)
        assert server.discovery.engines("primary") == (f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}")
        assert await budget_of(server) == engines_budget(2)
    finally:
        await server.stop()


class HeldResolver:
    """Answers each name with its addresses; a name in `held` once its event is set."""

    def __init__(self, answers: dict[str, tuple[str, ...]]) -> None:
        self.answers = answers
        self.held: dict[str, asyncio.Event] = {}
        self.asked: list[str] = []

    async def resolve(self, name: str, family: str, timeout_s: float) -> Resolution:
        self.asked.append(name)
        if name in self.held:
            await self.held[name].wait()
        return Resolution(self.answers[name])


async def test_while_a_reload_resolves_its_names_the_pool_keeps_the_engines_and_budget_in_force(tmp_path,
                                                                                               metrics_endpoints):
    """Until the names a reload lists are resolved, the configuration in force stays in force: a
    pool never has no engine meanwhile, which a capacity tick would take for a budget of 0."""
    port = metrics_endpoints
    raw = e2e_config(listen={"host": LOOPBACK, "grpc_port": 0, "metrics_port": 0}, admin={"port": 0}, relay={"url": None},
                     probes={"nvml": "off", "interval_s": 60}, discovery={"interval_s": 60})
    raw["pools"]["primary"].update(max_inflight=8, capacity={"backends": [f"dns://old.svc.test:{port}"],
                                                             "pick_backend": True})
    path = tmp_path / "extproc.yaml"
    server = sidecar_from_file(path, raw)
    resolver = server.discovery.resolver = HeldResolver({"old.svc.test": ENGINES[:1], "new.svc.test": ENGINES})
    resolver.held["new.svc.test"] = asyncio.Event()
    await server.start()
    try:
        assert await budget_of(server) == engines_budget(1)
        raw["pools"]["primary"]["capacity"]["backends"] = [f"dns://new.svc.test:{port}"]
        path.write_text(yaml.safe_dump(raw))
        reload = asyncio.ensure_future(server.reload("test"))
        await async_wait_until(lambda: "new.svc.test" in resolver.asked, what="the reload's resolution")
        assert server.discovery.engines("primary") == (f"http://127.0.0.2:{port}",)
        await server.load.tick()  # a capacity tick meanwhile (its own, or one a resolution set off)
        assert await budget_of(server) == engines_budget(1)
        resolver.held["new.svc.test"].set()
        assert (await reload).accepted
        assert server.discovery.engines("primary") == (f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}")
        assert await budget_of(server) == engines_budget(2)
    finally:
        resolver.held["new.svc.test"].set()
        await server.stop()


# -- through real Envoy ------------------------------------------------------------------------------------

def served(host: str, port: int) -> float:
    """Requests an engine has answered (its own count)."""
    status, text = http_get(f"http://{host}:{port}/metrics")
    assert status == 200
    return metric_sum(parse_samples(text), "vllm:request_success_total")


def running(host: str, port: int) -> float:
    samples = parse_samples(http_get(f"http://{host}:{port}/metrics")[1])
    return metric_sum(samples, "vllm:num_requests_running") + metric_sum(samples, "vllm:num_requests_waiting")


def post_chat(url: str, i: int) -> int:
    body = json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": f"q{i}"}],
                       "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def batch(url: str, n: int = 6) -> list[int]:
    """`n` requests at once: the sidecar spreads them over the engines it knows."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: post_chat(url, i), range(n)))


def test_through_envoy_an_engine_added_to_the_name_gets_requests_and_one_removed_gets_none(tmp_path, dns):
    port = engine_port()
    dns.set(NAME, ["127.0.0.2"])
    sims = []
    for host in ENGINES:
        sim = ManagedProcess(f"sim-{host}", SimSpec("deepseek-sim", ("--time-scale", "0.2")).command(host, port),
                             tmp_path / f"sim-{host}.log")
        sim.start()
        sims.append(sim)
    ports = StackPorts.random(primary=0)
    raw = e2e_config(discovery={"interval_s": 1, "nameserver": dns.nameserver})
    raw["pools"]["primary"].update(max_inflight=8, capacity={"backends": [f"dns://{NAME}:{port}"], "pick_backend": True})
    (tmp_path / "extproc.yaml").write_text(yaml.safe_dump(raw))
    stack = Stack(tmp_path, ports, tmp_path / "extproc.yaml")
    stack.clusters = {"vllm_primary": [(NAME, port)]}  # the template's STRICT_DNS cluster, on the same name
    stack.nameserver, stack.dns_refresh_s = dns.address, 1
    try:
        for sim, host in zip(sims, ENGINES, strict=True):
            wait_until(lambda host=host: http_get(f"http://{host}:{port}/health")[0] == 200, 20, sim.name, sim)
        stack.start()
        sidecar = stack.metrics_url

        def discovered() -> float:
            return metric_sum(parse_samples(http_get(sidecar)[1]), "extproc_discovered_engines", pool="primary")

        def envoy_hosts() -> str:
            return http_get(f"http://{LOOPBACK}:{ports.envoy_admin}/clusters")[1]

        assert batch(stack.url) == [200] * 6
        assert served("127.0.0.2", port) == 6 and served("127.0.0.3", port) == 0  # not in the name: nothing

        dns.set(NAME, list(ENGINES))
        statuses: list[int] = []

        def spread_to_the_new_engine() -> bool:
            statuses.extend(batch(stack.url))
            return served("127.0.0.3", port) > 0

        wait_until(spread_to_the_new_engine, 30, "the added engine to receive requests")
        assert set(statuses) == {200} and discovered() == 2
        assert f"vllm_primary::127.0.0.3:{port}::" in envoy_hosts()

        dns.set(NAME, ["127.0.0.3"])
        stop = threading.Event()
        during: list[int] = []

        def keep_sending() -> None:
            while not stop.is_set():
                during.extend(batch(stack.url, 3))

        sender = threading.Thread(target=keep_sending)
        sender.start()
        try:
            wait_until(lambda: discovered() == 1 and f"vllm_primary::127.0.0.2:{port}::" not in envoy_hosts(), 30,
                       "the sidecar and Envoy to drop the removed engine")
            wait_until(lambda: running("127.0.0.2", port) == 0, 30, "the removed engine's last requests to end")
            before = served("127.0.0.2", port), served("127.0.0.3", port)
            after_removal = len(during)
            wait_until(lambda: len(during) >= after_removal + 12, 60, "more requests")
        finally:
            stop.set()
            sender.join(60)
        assert served("127.0.0.2", port) == before[0]  # it runs still, and receives nothing
        assert served("127.0.0.3", port) >= before[1] + 12
        assert during and set(during) == {200}  # every request answered, through the change
        assert f"127.0.0.2:{port}" not in http_get(sidecar)[1]  # its series forgotten
        # while Envoy had not resolved the change yet, a pick it could not follow was no sign that it ignores them
        assert metric_sum(parse_samples(http_get(sidecar)[1]), "extproc_engine_picks_ignored", pool="primary") == 0
        assert "does not follow the sidecar's engine picks" not in (tmp_path / "sidecar.log").read_text()

        dns.set(NAME, [])  # no ready pod: NXDOMAIN, twice; the pool has no engine, Envoy's cluster no host
        wait_until(lambda: discovered() == 0 and f"vllm_primary::127.0.0.3:{port}::" not in envoy_hosts(), 30,
                   "the pool to have no engine")
        fallback = served(LOOPBACK, ports.fallback[0])
        assert batch(stack.url, 2) == [200, 200]  # answered by the fallback pool (the breaker, the failover)
        assert served(LOOPBACK, ports.fallback[0]) == fallback + 2
        assert served("127.0.0.2", port) == before[0]
    finally:
        stack.stop()
        for sim in sims:
            sim.stop()
