"""`extproc serve --workers N`: processes sharing one gRPC port, one queue and one limit (through
Redis), one metrics endpoint; a worker that dies comes back."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import aiohttp
import psutil
import pytest
import yaml

from extproc_testbed.redis_server import RedisServer
from extproc_testbed.stack import SimSpec, Stack, StackPorts, free_port, http_get

from ..conftest import TIME_SCALE, e2e_config
from ..helpers import async_wait_until, chat, scrape, wait_until
from .test_security import beyond_loopback_address


def test_workers_need_redis():
    result = subprocess.run([sys.executable, "-m", "extproc", "serve", "--workers", "2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "redis" in result.stderr.lower()


async def test_two_workers_keep_one_limit_and_report_together(tmp_path):
    redis_server = RedisServer(tmp_path / "redis").start()
    config = e2e_config(redis={"url": redis_server.url})
    config["pools"]["primary"].update(max_inflight=1, tiers={"yellow": 30, "orange": 50, "red": 80, "hard_max": 200})
    path = tmp_path / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    sim = SimSpec("deepseek-sim", ("--time-scale", TIME_SCALE))
    stack = Stack(tmp_path, StackPorts.random(primary=1), path, primary=sim,
                  fallback=SimSpec("deepseek-sim-small", ("--time-scale", TIME_SCALE)), workers=2).start()
    try:
        supervisor = psutil.Process(stack.sidecar.pid)
        workers = supervisor.children()
        assert len(workers) == 2
        async with aiohttp.ClientSession() as session:

            async def ask(i: int) -> int:
                async with session.post(f"{stack.url}/v1/chat/completions", data=chat(user=f"w{i}", max_tokens=20),
                                        headers={"content-type": "application/json", "x-ticket-type": "complaint"}) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(ask(i) for i in range(24)))
        assert statuses == [200] * 24
        stats = json.loads(http_get(f"{stack.sim_url(0)}/sim/stats")[1])
        assert stats["max_running_seen"] == 1  # one limit across both workers
        samples = scrape(stack.metrics_url)
        admitted = {dict(labels)["worker"]: value for (name, labels), value in samples.items()
                    if name == "extproc_slots_admitted_total" and dict(labels).get("pool") == "primary"}
        assert set(admitted) <= {"0", "1"} and sum(admitted.values()) == 24

        workers[0].send_signal(signal.SIGKILL)  # a worker dies: the supervisor starts it again
        await async_wait_until(lambda: len([c for c in supervisor.children() if c.is_running()
                                            and c.status() != psutil.STATUS_ZOMBIE]) == 2
                               and workers[0].pid not in [c.pid for c in supervisor.children()], 20,
                               "the worker to be replaced")
        await async_wait_until(lambda: {dict(labels).get("worker") for (name, labels) in scrape(stack.metrics_url)
                                        if name == "extproc_serving"} == {"0", "1"}, 20, "both workers to report")
        running = supervisor.children()
        stack.sidecar.signal(signal.SIGTERM)  # every worker drains, then the supervisor exits
        stack.sidecar.process.wait(30)
        assert stack.sidecar.process.returncode == 0
        gone, alive = psutil.wait_procs(running, timeout=10)
        assert not alive
    finally:
        stack.stop()
        redis_server.kill()


def _answers(url: str) -> bool:
    try:
        return http_get(url)[0] == 200
    except OSError:
        return False


@pytest.mark.parametrize("metrics_host", ["the pod's address", "0.0.0.0"])
def test_the_workers_metrics_stay_on_loopback_and_the_supervisor_serves_them_on_metrics_host(tmp_path, metrics_host):
    pod_address = beyond_loopback_address()
    redis_server = RedisServer(tmp_path / "redis").start()
    metrics_port = free_port()
    host = pod_address if metrics_host == "the pod's address" else metrics_host
    config = e2e_config(redis={"url": redis_server.url}, admin={"port": free_port()},
                        listen={"grpc_port": free_port(), "metrics_port": metrics_port, "metrics_host": host})
    path = tmp_path / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    supervisor = subprocess.Popen([sys.executable, "-m", "extproc", "serve", "--config", str(path), "--workers", "2"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    aggregate = f"http://{pod_address}:{metrics_port}/metrics"
    try:
        # Prometheus, on the pod's address: every worker's samples, from the supervisor.
        wait_until(lambda: supervisor.poll() is not None or _answers(aggregate), 60, "the supervisor's metrics")
        assert supervisor.poll() is None, "the supervisor gave up on its workers"
        wait_until(lambda: {dict(labels).get("worker") for (name, labels) in scrape(aggregate)
                            if name == "extproc_serving"} == {"0", "1"}, 20, "both workers to report")
        workers = psutil.Process(supervisor.pid).children()
        ports = [int(w.cmdline()[w.cmdline().index("--metrics-port") + 1]) for w in workers]
        assert len(ports) == 2 and metrics_port not in ports
        for port in ports:  # each worker's own port: the supervisor's alone
            assert _answers(f"http://127.0.0.1:{port}/metrics")
            assert not _answers(f"http://{pod_address}:{port}/metrics")
    finally:
        supervisor.send_signal(signal.SIGTERM)
        try:
            supervisor.wait(30)
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
            redis_server.kill()
