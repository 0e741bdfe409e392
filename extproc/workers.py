"""`extproc serve --workers N`: N server processes on one gRPC port, one metrics endpoint.

One Python process decides about a thousand or two requests a second on one core; a host with
more cores runs more. The workers are ordinary `extproc serve` processes started by this
supervisor with the same configuration:

- they share the gRPC port (`SO_REUSEPORT`: the kernel spreads Envoy's connections over them);
- they share one queue, one set of limits and one set of breakers through Redis, so there is
  still one limit and one order per pool (the supervisor refuses to start without Redis);
- each serves its own metrics on a loopback port the supervisor picks (loopback whatever
  `listen.metrics_host` says); the supervisor serves `/metrics` on `listen.metrics_host` and
  `listen.metrics_port`, every sample labelled `worker`;
- worker i serves the admin API on `admin.port + i`;
- a worker that dies is started again; SIGTERM (or SIGINT) drains every worker, then exits;
- SIGHUP is passed on to every worker: each reads the configuration file again (a reload).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .core.config import Config

log = logging.getLogger("extproc.workers")

_RESTART_PAUSE_S = 1.0


# Each worker's own metrics (and queue page) are for the supervisor alone, whatever
# listen.metrics_host says: the supervisor serves their aggregate there.
_WORKER_METRICS_HOST = "127.0.0.1"


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind((_WORKER_METRICS_HOST, 0))
        return s.getsockname()[1]


@dataclass
class Worker:
    index: int
    argv: list[str]
    metrics_port: int
    process: subprocess.Popen | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://{_WORKER_METRICS_HOST}:{self.metrics_port}/metrics"

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class MergedMetrics:
    """A collector that yields what it was last given: every worker's families, merged."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self):
        return self.families


def merge(texts: dict[int, str]) -> list[Metric]:
    """Every worker's metric families as one set, each sample labelled with its worker."""
    merged: dict[str, Metric] = {}
    for index, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                target.add_sample(sample.name, {**sample.labels, "worker": str(index)}, sample.value,
                                  sample.timestamp, sample.exemplar)
    return list(merged.values())


class Supervisor:
    def __init__(self, config: Config, worker_argv: list[str], workers: int):
        self.config = config
        self.workers = [
            Worker(i, [sys.executable, "-m", "extproc", *worker_argv, "--metrics-host", _WORKER_METRICS_HOST,
                       "--metrics-port", str(port), "--host", config.listen.host,
                       "--admin-port", str(config.admin.port + i), "--reuse-port"],
                   port)
            for i, port in enumerate(_free_loopback_port() for _ in range(workers))
        ]
        self._stopping = False
        self._collector = MergedMetrics()
        self._registry = CollectorRegistry()
        self._registry.register(self._collector)

    async def _metrics(self, request: web.Request) -> web.Response:
        async def scrape(worker: Worker) -> tuple[int, str | None]:
            try:
                async with self._session.get(worker.metrics_url) as response:
                    return worker.index, await response.text() if response.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return worker.index, None  # restarting: its samples are missing from this scrape

        texts = dict(await asyncio.gather(*(scrape(w) for w in self.workers)))
        self._collector.families = merge({i: t for i, t in texts.items() if t is not None})
        return web.Response(body=generate_latest(self._registry), content_type="text/plain", charset="utf-8")

    async def _ready(self, worker: Worker) -> bool:
        try:
            async with self._session.get(worker.metrics_url) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    def _reload_workers(self) -> None:
        """SIGHUP: every worker reads the configuration file again and logs its change record."""
        alive = [worker for worker in self.workers if worker.alive()]
        log.warning("SIGHUP: passed on to %d workers (each reloads its configuration)", len(alive))
        for worker in alive:
            worker.process.send_signal(signal.SIGHUP)

    async def run(self) -> int:
        listen = self.config.listen
        # Before the workers start: unhandled, SIGHUP would end the supervisor.
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload_workers)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        for worker in self.workers:
            worker.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not all(await asyncio.gather(*(self._ready(w) for w in self.workers))):
            if loop.time() > deadline or any(not w.alive() for w in self.workers):
                log.error("the workers did not start")
                for worker in self.workers:
                    if worker.alive():
                        worker.process.kill()
                await self._session.close()
                return 2
            await asyncio.sleep(0.1)
        app = web.Application()  # served once the workers are: its answering means they are up
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, listen.metrics_address, listen.metrics_port).start()
        print(f"extproc: {len(self.workers)} workers on {listen.host}:{listen.grpc_port} (gRPC, shared), "
              f"metrics on http://{listen.metrics_address}:{listen.metrics_port}/metrics, admin API on "
              f"{self.config.admin.host}:{self.config.admin.port}..{self.config.admin.port + len(self.workers) - 1}",
              flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set():
            for worker in self.workers:
                if not worker.alive():
                    code = worker.process.returncode if worker.process else None
                    log.error("worker %d exited (%s); starting it again", worker.index, code)
                    worker.start()
            try:
                await asyncio.wait_for(stop.wait(), _RESTART_PAUSE_S)
            except TimeoutError:
                pass
        log.warning("stopping %d workers (each drains first)", len(self.workers))
        for worker in self.workers:
            if worker.alive():
                worker.process.send_signal(signal.SIGTERM)
        deadline = loop.time() + self.config.drain_timeout_s + 5
        while any(w.alive() for w in self.workers) and loop.time() < deadline:
            await asyncio.sleep(0.1)
        for worker in self.workers:
            if worker.alive():
                worker.process.kill()
        await self._session.close()
        await runner.cleanup()
        return 0
