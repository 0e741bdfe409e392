"""Process-level behaviour: health and drain on SIGTERM, the demo command, the Envoy template."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc_testbed.envoy_config import template_path
from extproc_testbed.stack import StackPorts, envoy_binary, http_get, port_is_free

from ..conftest import e2e_config, start_stack
from ..helpers import async_wait_until, chat, metric, scrape, wait_until
from .test_e2e import depth, inflight, pause_sims, send

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def health_status(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status


def test_envoy_template_validates():
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(template_path())], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_rendered_demo_config_validates(tmp_path):
    from extproc_testbed.envoy_config import EnvoyLayout, render_file

    layout = EnvoyLayout(("127.0.0.1", 10000), ("127.0.0.1", 9901), [("127.0.0.1", 50051), ("127.0.0.1", 50052)],
                         {"vllm_primary": [("127.0.0.1", 8001)], "vllm_fallback": [("127.0.0.1", 8003)]})
    for without_sidecar in (False, True):
        path = render_file(layout.__class__(**{**layout.__dict__, "without_sidecar": without_sidecar}), tmp_path / "e.yaml")
        result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        config = yaml.safe_load(path.read_text())
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        filters = [f["name"] for f in manager["http_filters"]]
        clusters = [c["name"] for c in config["static_resources"]["clusters"]]
        assert ("envoy.filters.http.ext_proc" in filters) is not without_sidecar
        assert ("extproc" in clusters) is not without_sidecar


async def test_sigterm_drains_answers_everyone_and_exits(tmp_path):
    stack = start_stack(tmp_path, e2e_config(drain_timeout_s=30))
    try:
        grpc_port = stack.ports.grpc
        assert health_status(grpc_port, "") == health_pb2.HealthCheckResponse.SERVING
        assert health_status(grpc_port, EXT_PROC_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        async with aiohttp.ClientSession() as session:
            pause_sims(stack, True, ("primary",))
            admitted = asyncio.create_task(send(session, stack, chat(user="admitted"), x_ticket_type="complaint"))
            await async_wait_until(lambda: inflight(stack) == 1)
            queued = asyncio.create_task(send(session, stack, chat(user="queued"), x_ticket_type="complaint"))
            await async_wait_until(lambda: depth(stack) == 1)

            stack.sidecar.signal(signal.SIGTERM)
            status, headers, body = await queued  # everyone in line is answered at once
            assert status == 503 and body["error"]["code"] == "draining"
            assert int(headers["retry-after"]) >= 0
            assert health_status(grpc_port, "") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert health_status(grpc_port, EXT_PROC_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert metric(stack.metrics_url, "extproc_serving") == 0
            # no new admissions while draining
            status, _, body = await send(session, stack, chat(), x_ticket_type="loan_approval")
            assert status == 503 and body["error"]["code"] == "draining"
            # the admitted exchange finishes normally, then the server exits
            assert stack.sidecar.alive()
            pause_sims(stack, False, ("primary",))
            status, _, body = await admitted
            assert status == 200 and body["choices"][0]["message"]["content"]
        await asyncio.to_thread(stack.sidecar.process.wait, 20)
        assert stack.sidecar.process.returncode == 0
    finally:
        stack.stop()


def test_envoy_own_errors_reach_clients_as_openai_errors(tmp_path):
    """Sidecar hung or down, backends down: Envoy answers, in the same JSON shape as the sidecar."""
    stack = start_stack(tmp_path, e2e_config())
    try:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-anything", max_retries=0)

        def failed_completion() -> openai.APIStatusError:
            try:
                client.chat.completions.create(model="deepseek-sim", messages=[{"role": "user", "content": "hi"}])
            except openai.APIStatusError as error:
                return error
            raise AssertionError("the completion succeeded")

        with pytest.raises(openai.BadRequestError) as ours:  # the sidecar's own reply is left as it is
            client.chat.completions.create(model="deepseek-sim", messages="not a list")
        assert ours.value.code == "invalid_request"

        stack.sidecar.signal(signal.SIGSTOP)  # hung: Envoy's message timeout answers
        try:
            error = failed_completion()
        finally:
            stack.sidecar.signal(signal.SIGCONT)
        assert error.status_code == 504 and error.code == "admission_unavailable" and error.type == "server_error"
        assert error.response.headers["retry-after"] == "1"

        for sim in stack.sims:
            sim.stop()
        error = failed_completion()
        assert error.status_code == 503 and error.code == "upstream_unavailable"
        assert "upstream connect error" in error.message
        assert error.response.headers["retry-after"] == "1"

        stack.sidecar.stop()  # fail closed: 503, not a bare 500
        error = failed_completion()
        assert error.status_code == 503 and error.code == "admission_unavailable"
        assert error.response.headers["content-type"] == "application/json"
    finally:
        stack.stop()


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} not printed; got:\n{''.join(seen)}")


def free_demo_ports(replicas: int = 1) -> tuple[int, StackPorts]:
    """A `--port-offset` whose demo ports are all free: the tests run beside a `make demo`."""
    rng = random.Random()
    for _ in range(200):
        offset = rng.randrange(100, 15000)
        ports = StackPorts.shifted(offset, replicas)
        if all(port_is_free(port) for port, _ in ports.named()):
            return offset, ports
    raise AssertionError("no free set of demo ports")


def start_demo(*args: str, replicas: int = 1) -> tuple[subprocess.Popen, StackPorts, str]:
    """`extproc demo` started on free ports; returns it once its banner is printed. Ports checked
    free can be taken before the demo binds them (its gRPC and admin ports lie in the kernel's
    ephemeral range, where every outgoing connection on the machine draws one), so a start that
    says a port is in use is tried again on another offset."""
    for _ in range(3):
        offset, ports = free_demo_ports(replicas)
        extra = ["--replicas", str(replicas)] if replicas > 1 else []
        proc = subprocess.Popen(
            [sys.executable, "-m", "extproc", "demo", *args, *extra, "--port-offset", str(offset)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        try:
            return proc, ports, _wait_for_line(proc, "Ctrl-C stops everything", 60)
        except AssertionError as error:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if "(port in use?)" not in str(error):
                raise
    raise AssertionError("the demo found a port in use on three offsets")


def test_demo_answers_a_chat_completion_and_stops_everything():
    proc, ports, banner = start_demo()
    metrics = f"http://127.0.0.1:{ports.metrics}/metrics"
    try:
        assert "sk-demo-loans-0001" in banner and f"curl -s http://127.0.0.1:{ports.envoy}/" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports.envoy}/v1", api_key="sk-demo-loans-0001",
                               max_retries=0)
        reply = client.chat.completions.create(
            model="deepseek-sim", messages=[{"role": "user", "content": "Approve loan #42?"}], max_tokens=4,
            extra_headers={"x-ticket-type": "loan_approval", "x-urgent-level": "2"},
        )
        assert reply.choices[0].message.content.split() == ["ok"] * 4
        # the demo's sidecar reads its simulated backends' KV capacity (at their shifted ports): 2 x 65536 x 0.85
        wait_until(lambda: metric(metrics, "extproc_backend_up", pool="primary") == 2, 10, "both engines read")
        assert 0 < metric(metrics, "extproc_token_budget", pool="primary") <= 2 * 65536 * 0.85
        assert metric(metrics, "extproc_backend_saturated", pool="primary") == 0
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does in a terminal
        assert proc.wait(30) == 0
        # The demo waits for each of its processes before it exits, and a process's sockets close
        # as it exits: every port is free the moment the demo is gone, or a child outlived it.
        assert [name for p, name in ports.named() if not port_is_free(p)] == [], "a child process outlived the demo"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_demo_serves_two_models_each_on_its_own_engines():
    """`extproc demo` routes by model through its real Envoy: the large model to the primary
    pool's engines, the small one to the archive pool's; /v1/models lists what a key may use."""
    from extproc_testbed.demo import LARGE_MODEL, SMALL_MODEL

    proc, ports, banner = start_demo()

    def served(pool: str) -> int:  # the completions the pool's engines were sent (their own count)
        return sum(json.loads(http_get(f"http://127.0.0.1:{port}/sim/stats")[1])["requests"]
                   for port in ports.pool_ports(pool))

    try:
        assert f'"model": "{SMALL_MODEL}"' in banner and f"127.0.0.1:{ports.envoy}/v1/models" in banner

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"http://127.0.0.1:{ports.envoy}/v1", api_key=key, max_retries=0)

        officer, clerk = client("sk-demo-loans-0001"), client("sk-demo-archive-0003")
        before = {pool: served(pool) for pool in ("primary", "archive")}
        for who, model, ticket in ((officer, LARGE_MODEL, "loan_approval"), (clerk, SMALL_MODEL, "archive_query")):
            reply = who.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2, extra_headers={"x-ticket-type": ticket})
            assert reply.model == model
        assert {pool: served(pool) - count for pool, count in before.items()} == {"primary": 1, "archive": 1}
        assert sorted(m.id for m in officer.models.list()) == [LARGE_MODEL, SMALL_MODEL]
        assert [m.id for m in clerk.models.list()] == [SMALL_MODEL]
        with pytest.raises(openai.PermissionDeniedError):
            clerk.chat.completions.create(model=LARGE_MODEL, messages=[{"role": "user", "content": "hi"}])
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_demo_names_a_taken_port_instead_of_a_traceback():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "extproc", "demo", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 2
    assert f"{port} (Envoy listener)" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_names_a_taken_port(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "extproc", "serve", "--grpc-port", str(port), "--metrics-port", "0"],
            capture_output=True, text=True, timeout=30,
        )
    assert result.returncode == 2
    assert f"127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


def test_check_config_names_the_offending_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes:\n  loan_approval: {base: zero}\ndefault_class: loan_approval\n"
                   "pools: {primary: {cluster: vllm_primary, max_inflight: 4}}\ndefault_pool: primary\nbogus: 1\n")
    result = subprocess.run([sys.executable, "-m", "extproc", "check-config", str(bad)], capture_output=True, text=True)
    assert result.returncode == 2
    assert "classes.loan_approval.base" in result.stderr
    assert "bogus" in result.stderr
    good = Path(__file__).resolve().parents[2] / "extproc" / "core" / "default_config.yaml"
    result = subprocess.run([sys.executable, "-m", "extproc", "check-config", str(good)], capture_output=True, text=True)
    assert result.returncode == 0 and "OK" in result.stdout


def test_demo_with_two_replicas_sharing_redis(tmp_path):
    from extproc_testbed.redis_server import RedisServer

    from .test_shared_queue import leases_that_expired

    redis_server = RedisServer(tmp_path / "redis").start()
    proc, ports, banner = start_demo("--redis-url", redis_server.url, replicas=2)
    try:
        assert f"127.0.0.1:{ports.grpc + 1} (gRPC" in banner and "sharing one queue in Redis" in banner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports.envoy}/v1", api_key="sk-demo-service-0002",
                               max_retries=0)
        for _ in range(4):
            client.chat.completions.create(model="deepseek-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        replicas = {port: scrape(f"http://127.0.0.1:{port}/metrics") for _, port, _ in ports.replicas}
        seen = {port: {k: v for k, v in samples.items() if "outcomes" in k[0] or "degraded" in k[0]}
                for port, samples in replicas.items()}
        assert redis_server.client().get("{extproc:primary}:seq") == "4", seen  # every request went through Redis
        assert all(metric(f"http://127.0.0.1:{port}/metrics", "extproc_store_degraded") == 0 for port in replicas), seen
        # every lease released by its replica: none left to expire (a lease lasts 10 s here)
        wait_until(lambda: redis_server.client().hlen("{extproc:primary}:li") == 0, 5, "the leases to be released")
        assert leases_that_expired(redis_server) == 0
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        redis_server.kill()


def test_demo_refuses_replicas_without_redis():
    result = subprocess.run([sys.executable, "-m", "extproc", "demo", "--replicas", "2"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "--redis-url" in result.stderr


def test_free_ports_stay_out_of_the_ephemeral_range_and_are_never_repeated():
    from extproc_testbed.stack import free_port

    ephemeral_start = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(port < ephemeral_start for port in ports)
    paired = free_port(paired_offset=10000)
    assert paired + 10000 < ephemeral_start
    assert paired not in ports and paired + 10000 not in ports


def test_parallel_test_workers_draw_ports_from_shares_that_never_meet(monkeypatch):
    from extproc_testbed.stack import PORT_SHARE_ENV, free_port

    for index in (0, 1, 2):  # (2 of 2: a worker started again in a run, whose index passed the count)
        monkeypatch.setenv(PORT_SHARE_ENV, f"{index}/2")
        ports = [free_port() for _ in range(50)]
        paired = [free_port(paired_offset=10000) for _ in range(5)]
        assert {port % 2 for port in ports + paired + [p + 10000 for p in paired]} == {index % 2}
