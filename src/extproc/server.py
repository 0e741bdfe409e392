"""`extproc serve`: the gRPC server (ext_proc + grpc.health.v1), the metrics endpoint, and drain."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import disable_created_metrics

from .config import Config
from .gate import AdmissionGate
from .load_control import LoadController
from .metrics import Metrics
from .probes import NvmlProbe
from .queue_store import LocalQueueStore
from .servicer import SERVICE_NAME, ExtProcServicer

log = logging.getLogger("extproc")


class PortInUse(Exception):
    pass


class SidecarServer:
    """Everything `extproc serve` runs, startable and stoppable from one place (and tests)."""

    def __init__(self, config: Config):
        disable_created_metrics()  # no *_created series: they double every counter's output
        self.config = config
        self.metrics = Metrics()
        self.store = LocalQueueStore(
            {name: pool.max_inflight for name, pool in config.pools.items()},
            on_change=lambda pool, snapshot: self.gate.pool_changed(pool, snapshot),
            long_share={name: pool.capacity.long_share for name, pool in config.pools.items()},
        )
        self.gate = AdmissionGate(config, self.store, self.metrics)
        nvml = NvmlProbe() if config.probes.nvml == "auto" else None
        self.load = LoadController(config, self.store, self.metrics, nvml)
        self.health = HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.grpc_port = 0
        self.metrics_port = 0

    async def start(self) -> None:
        listen = self.config.listen
        # A held request is one open stream: never cap concurrent RPCs below the largest queue.
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(self.gate), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        try:
            self.grpc_port = self._grpc.add_insecure_port(f"{listen.host}:{listen.grpc_port}")
        except RuntimeError:
            raise PortInUse(f"cannot listen for gRPC on {listen.host}:{listen.grpc_port} (port in use?)") from None

        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, listen.host, listen.metrics_port)
        try:
            await site.start()
        except OSError as error:
            await self._grpc.stop(0)
            raise PortInUse(
                f"cannot listen for metrics on {listen.host}:{listen.metrics_port}: {error.strerror}"
            ) from None
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        await self.load.start()
        await self._grpc.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def inflight(self) -> int:
        return sum([(await self.store.snapshot(pool)).inflight for pool in self.config.pools])

    async def drain_and_stop(self) -> None:
        """NOT_SERVING, refuse new work, answer everyone in line, let admitted exchanges finish."""
        log.warning("draining: health NOT_SERVING, no new admissions")
        await self.health.enter_graceful_shutdown()
        await self.gate.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while await self.inflight() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if remaining := await self.inflight():
            log.warning("drain timeout: %d exchanges still in flight", remaining)
        await self.stop(grace=1.0)

    async def stop(self, grace: float = 0.0) -> None:
        await self.load.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()


async def run_server(config: Config) -> None:
    server = SidecarServer(config)
    await server.start()
    print(
        f"extproc: ext_proc + grpc.health on {config.listen.host}:{server.grpc_port}, "
        f"metrics on http://{config.listen.host}:{server.metrics_port}/metrics",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.drain_and_stop()
    log.warning("stopped")
