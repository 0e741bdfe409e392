"""Drain before scale-in, through real Envoy: two simulated engines on 127.0.0.2 and 127.0.0.3 behind
one name that a real DNS server on loopback answers (dnsmasq, tests/dns_server.py), Envoy's
STRICT_DNS cluster and the sidecar's dns:// backend on that name, and clients sending one request
after another all along. One engine is taken out (through `extproc admin engine drain`, or by
removing its record, as a Kubernetes pod that terminates leaves its headless Service's answer),
then killed: once the drain says it is idle, or while it still runs requests past its deadline.
Every request's ending is counted: each is answered 200 (those the killed engine still ran, by the
other engine, through Envoy's retry), none is lost, the pool's in-flight returns to 0, and the
breaker counts no failure."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf.json_format import ParseDict

from extproc.admin.v1 import admin_pb2 as pb
from extproc.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc_testbed.stack import (LOOPBACK, ManagedProcess, SimSpec, Stack, StackPorts, http_get, metric_sum,
                                   parse_samples, wait_until)

from ..conftest import TIME_SCALE, e2e_config
from ..dns_server import Dnsmasq
from .test_discovery import engine_port, served

ROOT = Path(__file__).resolve().parents[2]
NAME = "engines.svc.test"
LEAVING, STAYING = "127.0.0.2", "127.0.0.3"
CLIENTS = 4  # two requests on each engine at most times
STEADY_TOKENS = 1500  # about 1.5 s on an engine (the simulator's 5 ms a token, x0.2)


def post_chat(url: str, i: int, max_tokens: int) -> int | str:
    body = json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": f"q{i}"}],
                       "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except Exception as error:  # the connection itself failed: an ending too, never a lost one
        return f"{type(error).__name__}: {error}"


class SteadyLoad:
    """`clients` clients, each sending one request after another until stopped; every request's
    ending (its status, or why it has none) is kept."""

    def __init__(self, url: str, clients: int = CLIENTS, max_tokens: int = STEADY_TOKENS):
        self.url, self.max_tokens = url, max_tokens
        self.started = 0
        self.endings: list[int | str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            with self._lock:
                self.started += 1
            status = post_chat(self.url, n * 100_000 + i, self.max_tokens)
            with self._lock:
                self.endings.append(status)
            i += 1

    def ended(self) -> int:
        with self._lock:
            return len(self.endings)

    def stop(self) -> list[int | str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
        assert not any(t.is_alive() for t in self._threads), "a client is still waiting for its answer"
        assert len(self.endings) == self.started, "a request without an ending"
        return self.endings


@dataclass
class Rig:
    stack: Stack
    sims: dict[str, ManagedProcess]
    port: int
    dns: Dnsmasq
    admin: str  # the sidecar's admin API, host:port

    def endpoint(self, host: str) -> str:
        return f"{host}:{self.port}"

    def state(self) -> pb.State:
        with grpc.insecure_channel(self.admin) as channel:
            return pb_grpc.AdminStub(channel).GetState(pb.GetStateRequest(), timeout=5)

    def primary(self) -> pb.Pool:
        return next(p for p in self.state().pools if p.name == "primary")

    def draining(self, host: str) -> pb.DrainingEngine | None:
        return next((d for d in self.primary().draining_engines if d.engine == self.endpoint(host)), None)

    def admin_cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "extproc", "admin", "--address", self.admin, *args],
                              capture_output=True, text=True, timeout=30)

    def queue_state(self) -> dict:
        """The primary pool as the queue page reads it (/queue/state)."""
        text = http_get(self.stack.metrics_url.removesuffix("/metrics") + "/queue/state")[1]
        return next(p for p in json.loads(text)["pools"] if p["name"] == "primary")

    def placed_on(self, host: str) -> int:
        """Requests this replica placed on the engine that still run."""
        return self.queue_state()["placed"].get(self.endpoint(host), {}).get("requests", 0)

    def sidecar_metrics(self) -> dict:
        return parse_samples(http_get(self.stack.metrics_url)[1])

    def envoy_stat(self, name: str) -> int:
        text = http_get(f"http://{LOOPBACK}:{self.stack.ports.envoy_admin}/stats?filter=^{name}$")[1]
        return sum(int(line.split(":")[1]) for line in text.splitlines() if line.startswith(f"{name}:"))

    def busy(self, host: str) -> float:
        """Requests an engine has answered, runs, or holds in its line (its own count)."""
        samples = parse_samples(http_get(f"http://{host}:{self.port}/metrics")[1])
        return sum(metric_sum(samples, name) for name in ("vllm:request_success_total", "vllm:num_requests_running",
                                                          "vllm:num_requests_waiting"))


@pytest.fixture
def rig(tmp_path):
    with running_rig(tmp_path) as rig:
        yield rig


@pytest.fixture
def rig_without_envoy_retries(tmp_path):
    """Envoy's routes retry nothing: what a stopped engine ran comes back to the sidecar as 503."""
    envoy = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    listener = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for route in listener["route_config"]["virtual_hosts"][0]["routes"]:
        route["route"]["retry_policy"]["num_retries"] = 0  # (one policy, named twice in the file)
    (tmp_path / "template.yaml").write_text(yaml.safe_dump(envoy))
    with running_rig(tmp_path, tmp_path / "template.yaml") as rig:
        yield rig


@contextlib.contextmanager
def running_rig(tmp_path: Path, envoy_template: Path | None = None) -> Iterator[Rig]:
    dns = Dnsmasq(tmp_path / "dns").start()
    port = engine_port()
    dns.set(NAME, [LEAVING, STAYING])
    sims = {}
    for host in (LEAVING, STAYING):
        sim = ManagedProcess(f"sim-{host}", SimSpec("deepseek-sim", ("--time-scale", TIME_SCALE)).command(host, port),
                             tmp_path / f"sim-{host}.log")
        sim.start()
        sims[host] = sim
    ports = StackPorts.random(primary=0)
    raw = e2e_config(discovery={"interval_s": 0.5, "nameserver": dns.nameserver}, engine_drain={"deadline_s": 60})
    raw["pools"]["primary"].update(max_inflight=16, tiers={"yellow": 30, "orange": 50, "red": 80, "hard_max": 200},
                                   capacity={"backends": [f"dns://{NAME}:{port}"], "pick_backend": True,
                                             "max_num_seqs": 8})
    (tmp_path / "extproc.yaml").write_text(yaml.safe_dump(raw))
    stack = Stack(tmp_path, ports, tmp_path / "extproc.yaml",
                  fallback=SimSpec("deepseek-sim-small", ("--time-scale", TIME_SCALE)))
    stack.envoy_template = envoy_template
    stack.clusters = {"vllm_primary": [(NAME, port)]}  # the template's STRICT_DNS cluster, on the same name
    stack.nameserver, stack.dns_refresh_s = dns.address, 1
    try:
        for host, sim in sims.items():
            wait_until(lambda host=host: http_get(f"http://{host}:{port}/health")[0] == 200, 20, sim.name, sim)
        stack.start()
        rig = Rig(stack, sims, port, dns, f"{LOOPBACK}:{ports.replicas[0][2]}")
        envoy_hosts = f"http://{LOOPBACK}:{ports.envoy_admin}/clusters"
        wait_until(lambda: all(f"vllm_primary::{rig.endpoint(h)}::" in http_get(envoy_hosts)[1] for h in sims)
                   and len(rig.primary().draining_engines) == 0
                   and metric_sum(rig.sidecar_metrics(), "extproc_discovered_engines", pool="primary") == 2,
                   30, "both engines known to Envoy and the sidecar")
        yield rig
    finally:
        stack.stop()
        for sim in sims.values():
            sim.stop()
        dns.stop()


def settled(rig: Rig, endings: list[int | str], fallback_before: float) -> None:
    """What every drain leaves: every request answered 200 by the primary pool's engines, no
    slot held, no failure counted by the breaker."""
    assert endings and set(endings) == {200}, sorted(map(str, set(endings)))
    wait_until(lambda: rig.primary().inflight == 0, 15, "the pool's in-flight back to 0")
    pool = rig.primary()
    assert pool.inflight_tokens == 0
    assert [w.failures for w in pool.breaker.windows] == [0, 0, 0] and pool.breaker.instant == "closed"
    samples = rig.sidecar_metrics()
    assert metric_sum(samples, "extproc_upstream_outcomes_total", pool="primary") == \
        metric_sum(samples, "extproc_upstream_outcomes_total", pool="primary", result="success")
    assert served(LOOPBACK, rig.stack.ports.fallback[0]) == fallback_before  # nothing went to the fallback pool


def drain_until_idle_then_kill(rig: Rig, load: SteadyLoad, first_seen) -> tuple[pb.DrainingEngine, float]:
    """With the drain begun (`first_seen`: the leaving engine's first listing), wait for it to say
    idle, then kill the engine; more requests after that. The first listing and the engine's own
    count just after it."""
    first = first_seen()
    before = rig.busy(LEAVING)  # (read after the listing: a request released since is in this count)
    assert first.requests >= 1, "the engine ran nothing when its drain began: nothing was drained"
    wait_until(lambda: (d := rig.draining(LEAVING)) is not None and d.state == "idle", 30, "the drain to say idle")
    idle_at = load.ended()
    wait_until(lambda: load.ended() >= idle_at + 8, 30, "requests while it is idle")
    assert rig.busy(LEAVING) <= before + first.requests  # no new request since the drain began
    rig.sims[LEAVING].kill()
    killed_at = load.ended()
    wait_until(lambda: load.ended() >= killed_at + 12, 30, "requests after the kill")
    return first, before


def test_an_engine_drained_through_the_admin_api_under_load_loses_no_request(rig):
    fallback_before = served(LOOPBACK, rig.stack.ports.fallback[0])
    load = SteadyLoad(rig.stack.url)
    try:
        wait_until(lambda: rig.placed_on(LEAVING) >= 1, 30, "requests running on the engine")
        drained = rig.admin_cli("engine", "drain", "primary", rig.endpoint(LEAVING), "--json")
        assert drained.returncode == 0, drained.stderr
        state = ParseDict(json.loads(drained.stdout), pb.State())  # as the drain left it
        shown = next(p for p in state.pools if p.name == "primary").draining_engines
        assert [(d.engine, d.reason) for d in shown] == [(rig.endpoint(LEAVING), "operator")]
        drain, _ = drain_until_idle_then_kill(rig, load, lambda: shown[0])
        assert drain.reason == "operator" and not drain.gone
        shown = rig.queue_state()["draining_engines"]  # the queue page's
        assert [(d["engine"], d["reason"], d["state"]) for d in shown] == [(rig.endpoint(LEAVING), "operator", "idle")]
    finally:
        endings = load.stop()
    settled(rig, endings, fallback_before)
    samples = rig.sidecar_metrics()
    assert metric_sum(samples, "extproc_engine_drains_total", pool="primary", reason="operator", result="idle") == 1
    assert metric_sum(samples, "extproc_engine_drains_total", pool="primary") == 1
    assert metric_sum(samples, "extproc_drained_engine_failures_total", pool="primary") == 0
    assert metric_sum(samples, "extproc_draining_engines", pool="primary", state="idle") == 1
    assert f"draining {rig.endpoint(LEAVING)} (drained by an operator, for " in rig.admin_cli("state").stdout
    assert "IDLE: runs nothing, may be stopped" in rig.admin_cli("state").stdout
    # taken back (started again first: it was killed), it gets requests again
    rig.sims[LEAVING].start()
    wait_until(lambda: http_get(f"http://{LEAVING}:{rig.port}/health")[0] == 200, 20, "the engine back")
    assert rig.admin_cli("engine", "undrain", "primary", rig.endpoint(LEAVING)).returncode == 0
    assert rig.draining(LEAVING) is None
    again = rig.admin_cli("engine", "undrain", "primary", rig.endpoint(LEAVING))
    assert again.returncode == 2 and "NOT_FOUND" in again.stderr and "is not draining" in again.stderr
    before = served(LEAVING, rig.port)
    load = SteadyLoad(rig.stack.url)
    try:
        wait_until(lambda: served(LEAVING, rig.port) > before, 30, "requests on the engine taken back")
    finally:
        assert set(load.stop()) == {200}


def test_an_engine_removed_from_its_name_under_load_loses_no_request(rig):
    """As a Kubernetes pod that terminates: its address leaves the headless Service's answer, every
    sidecar and Envoy stop sending it requests, it finishes what it runs, and is stopped."""
    fallback_before = served(LOOPBACK, rig.stack.ports.fallback[0])
    load = SteadyLoad(rig.stack.url)
    try:
        wait_until(lambda: rig.placed_on(LEAVING) >= 1, 30, "requests running on the engine")
        rig.dns.set(NAME, [STAYING])

        def listed() -> pb.DrainingEngine:
            wait_until(lambda: rig.draining(LEAVING) is not None, 30, "the sidecar to see the engine go")
            return rig.draining(LEAVING)

        drain, _ = drain_until_idle_then_kill(rig, load, listed)
        assert drain.reason == "removed" and drain.gone
    finally:
        endings = load.stop()
    settled(rig, endings, fallback_before)
    samples = rig.sidecar_metrics()
    assert metric_sum(samples, "extproc_engine_drains_total", pool="primary", reason="removed", result="idle") == 1
    assert metric_sum(samples, "extproc_engine_drains_total", pool="primary") == 1
    assert metric_sum(samples, "extproc_drained_engine_failures_total", pool="primary") == 0
    assert metric_sum(samples, "extproc_discovered_engines", pool="primary") == 1


def test_an_engine_killed_past_its_deadline_hands_what_it_ran_to_the_other_engine(rig):
    """The deadline case: the engine still runs requests when it is stopped (a pod past its grace
    period). Each is reset before its response started; Envoy retries it on the other engine the
    sidecar named, and the client gets 200 from there."""
    fallback_before = served(LOOPBACK, rig.stack.ports.fallback[0])
    retries_before = rig.envoy_stat("cluster.vllm_primary.upstream_rq_retry")
    load = SteadyLoad(rig.stack.url, max_tokens=8000)  # about 8 s each: still running at the deadline
    try:
        wait_until(lambda: rig.placed_on(LEAVING) >= 1, 30, "requests running on the engine")
        drained = rig.admin_cli("engine", "drain", "primary", rig.endpoint(LEAVING), "--deadline-s", "0.5")
        assert drained.returncode == 0, drained.stderr
        wait_until(lambda: (d := rig.draining(LEAVING)) is not None and d.state == "overdue", 30, "the deadline")
        assert "OVERDUE" in rig.admin_cli("state").stdout
        overdue = rig.draining(LEAVING)
        assert overdue.requests >= 1 and overdue.deadline_in_s < 0
        rig.sims[LEAVING].kill()  # what it runs is reset
        wait_until(lambda: rig.placed_on(LEAVING) == 0, 60, "its requests to answer from the other engine")
        wait_until(lambda: rig.draining(LEAVING).state == "idle", 30, "the drain to settle")
        # each was retried by Envoy on the other engine (the sidecar named it second), within the budget
        assert rig.envoy_stat("cluster.vllm_primary.upstream_rq_retry") > retries_before
        assert rig.envoy_stat("cluster.vllm_primary.upstream_rq_retry_overflow") == 0
    finally:
        endings = load.stop()
    settled(rig, endings, fallback_before)
    samples = rig.sidecar_metrics()
    assert metric_sum(samples, "extproc_engine_drains_total", pool="primary", reason="operator", result="deadline") == 1
    assert metric_sum(samples, "extproc_engine_drains_total", pool="primary") == 1


def test_what_envoy_cannot_retry_off_a_stopped_engine_the_sidecar_fails_over_outside_the_breaker(
        rig_without_envoy_retries):
    """Envoy retries nothing here: each request the killed engine ran comes back as Envoy's 503
    (reset before its response started). The sidecar knows it ran on an engine being drained: the
    breaker counts nothing, and it fails the request over to the fallback pool; the client gets 200."""
    rig = rig_without_envoy_retries
    fallback_before = served(LOOPBACK, rig.stack.ports.fallback[0])
    load = SteadyLoad(rig.stack.url, max_tokens=3000)  # about 3 s each
    try:
        wait_until(lambda: rig.placed_on(LEAVING) >= 1, 30, "requests running on the engine")
        assert rig.admin_cli("engine", "drain", "primary", rig.endpoint(LEAVING), "--deadline-s", "0.5").returncode == 0
        wait_until(lambda: (d := rig.draining(LEAVING)) is not None and d.state == "overdue", 30, "the deadline")
        rig.sims[LEAVING].kill()
        wait_until(lambda: rig.placed_on(LEAVING) == 0, 60, "its requests to end")
        reset = metric_sum(rig.sidecar_metrics(), "extproc_drained_engine_failures_total", pool="primary")
        assert reset >= 1
        wait_until(lambda: served(LOOPBACK, rig.stack.ports.fallback[0]) >= fallback_before + reset, 60,
                   "the fallback pool to answer them")
    finally:
        endings = load.stop()
    assert endings and set(endings) == {200}, sorted(map(str, set(endings)))
    wait_until(lambda: rig.primary().inflight == 0, 15, "the pool's in-flight back to 0")
    pool = rig.primary()
    assert [w.failures for w in pool.breaker.windows] == [0, 0, 0] and pool.breaker.instant == "closed"
    samples = rig.sidecar_metrics()
    assert metric_sum(samples, "extproc_drained_engine_failures_total", pool="primary") == reset
    assert metric_sum(samples, "extproc_upstream_outcomes_total", pool="primary") == \
        metric_sum(samples, "extproc_upstream_outcomes_total", pool="primary", result="success")
    assert metric_sum(samples, "extproc_failovers_total", from_pool="primary", to_pool="fallback",
                      result="answered") == reset
    assert served(LOOPBACK, rig.stack.ports.fallback[0]) == fallback_before + reset


def test_a_retry_envoy_runs_on_a_drained_engine_is_counted_in_its_drain(rig):
    """Envoy keeps a drained engine among its cluster's hosts: once the engines the sidecar named
    for a request failed (here the only one that serves, killed under its requests), override_host
    balances its retry over every host, the drained one included. The response says where it ran:
    the drain counts it and does not read idle meanwhile."""
    assert rig.admin_cli("engine", "drain", "primary", rig.endpoint(LEAVING)).returncode == 0
    load = SteadyLoad(rig.stack.url, max_tokens=3000)  # about 3 s each
    try:
        wait_until(lambda: rig.placed_on(STAYING) >= 2, 30, "requests on the engine that serves")
        busy_before = rig.busy(LEAVING)
        rig.sims[STAYING].kill()  # what it runs is reset: Envoy retries it past the engines named
        wait_until(lambda: rig.busy(LEAVING) > busy_before, 30, "a retry on the drained engine")
        wait_until(lambda: rig.draining(LEAVING).landed >= 1, 30, "the drain to count it")
        assert rig.draining(LEAVING).state == "draining"  # it ran a request less than settle_s ago
        assert "ran there unplaced" in rig.admin_cli("state").stdout
    finally:
        load._stop.set()
        rig.sims[STAYING].start()
        load.stop()


# -- the budget while an engine drains, over the capacity loop -------------------------------------------

@pytest.fixture
async def two_engines_metrics():
    """Two engines' /metrics (tests/e2e/test_capacity.py's), each on a port of its own."""
    from aiohttp import web

    from .test_capacity import MetricsEndpoint

    runners, urls = [], []
    for _ in range(2):
        app = web.Application()
        app.router.add_get("/metrics", MetricsEndpoint().handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    yield urls
    for runner in runners:
        await runner.cleanup()


async def test_the_engines_that_serve_keep_their_room_while_a_drained_one_finishes(two_engines_metrics):
    """Two engines of 4 sequences each, 4 requests on each; one drains. Its 4 still count in the
    pool's in-flight, and are given back to the count and the budget until they end: once the
    other engine's requests end, it takes 4 new ones; as the drained engine's end, the pool
    shrinks to the one engine."""
    from extproc.control.engine_drains import EngineDrainWatch
    from extproc.control.load_control import LoadController
    from extproc.lifecycle.placement import BackendPicker

    from ..unit.test_engine_drain import Listed
    from ..unit.test_gate import Rig

    url_a, url_b = two_engines_metrics
    a, b = (url.removeprefix("http://") for url in (url_a, url_b))
    pools = e2e_config()["pools"]
    pools["primary"].update(max_inflight=64, capacity={"backends": [url_a, url_b], "pick_backend": True,
                                                       "max_num_seqs": 4})
    rig = Rig(pools=pools, probes={"nvml": "off"})
    watch = EngineDrainWatch(lambda: rig.config, Listed(lambda: rig.config), rig.metrics, clock=rig.clock)
    picker = BackendPicker(lambda: rig.config, watch)
    watch.running = picker.running
    rig.build_gate(picker=picker)
    load = LoadController(rig.config, rig.store, rig.metrics, None, clock=rig.clock, on_readings=picker.observe,
                          engines=watch.serving, held=watch.held)
    watch.on_change = load.tick
    await load.start()
    try:
        assert (await rig.store.snapshot("primary")).max_inflight == 8  # two engines of 4
        placed = [(await rig.arrive())[0] for _ in range(8)]
        on = {e: [x for x in placed if x.endpoints.split(",")[0] == e] for e in (a, b)}
        assert [len(on[a]), len(on[b])] == [4, 4]
        await watch.drain("primary", a)  # the capacity loop ticks at once
        held_tokens = sum(x.lease.ticket.cost for x in on[a])
        snapshot = await rig.store.snapshot("primary")
        assert snapshot.max_inflight == 4 + 4  # the engine that serves, and what the drained one still runs
        b_tokens = sum(x.lease.ticket.cost for x in on[b])
        seen = 0.42 * 32768  # what engine b's /metrics says it holds
        assert snapshot.budget_tokens == int(32768 * 0.85 - (seen - b_tokens)) + held_tokens
        for exchange in on[b]:
            await rig.gate.close(exchange)
        new = []
        for _ in range(4):  # engine b's room, whole
            exchange, waiter = await rig.arrive()
            assert waiter is None and exchange.endpoints == b
            new.append(exchange)
        for exchange in on[a]:
            await rig.gate.close(exchange)
        await load.tick()
        assert (await rig.store.snapshot("primary")).max_inflight == 4  # the drained engine's requests ended
        for exchange in new:
            await rig.gate.close(exchange)
    finally:
        await load.stop()
