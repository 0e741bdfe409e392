"""`extproc serve`: the gRPC server (ext_proc + grpc.health.v1), the metrics endpoint, and drain.

Who may reach which port (docs/deploy.md#who-reaches-the-sidecar): ext_proc on loopback beside
Envoy, or with mutual TLS (listen.tls, and Envoy's name in its allowed_client_names when the CA
signs other clients too) beyond; grpc.health.v1 alone on listen.health_port for
probes from outside the pod; the admin API on loopback, or with a token (and admin.tls) beyond.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
from collections.abc import Callable

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import disable_created_metrics

from . import event_loop
from .admin.v1 import admin_pb2_grpc
from .control.capacity_watch import CapacityWatch
from .control.discovery import EngineDiscovery
from .control.engine_drains import EngineDrainWatch
from .control.load_control import LoadController
from .control.plane import ControlPlane
from .control.probes import NvmlProbe
from .core.config import Config
from .core.events import FirstByte, Observers, PicksJudged, RequestDecided, RequestFinished, TierChanged
from .envoy.servicer import SERVICE_NAME, ExtProcServicer
from .envoy.servicer import add_to_server as add_ext_proc_to_server
from .lifecycle.gate import AdmissionGate
from .lifecycle.placement import BackendPicker
from .lifecycle.relay import HttpRelay
from .ops import queue_page
from .ops.admin_service import AdminActions, AdminService, TokenGuard
from .ops.allowed_clients import AllowedClientsGuard, allowed_clients
from .ops.diagnostics import log_object_counts
from .ops.decision_log import DecisionLog
from .ops.metrics import Metrics
from .ops.ports import CannotListen, PortInUse, bind, tls_credentials
from .ops.reload import ConfigSource, ReloadPlan, prepare_reload, record_lines, version_of
from .ops.request_metrics import RequestMetrics
from .ops.state import RecentDecisions, SidecarState, StateSources, read_state
from .ops.webhooks import ScaleOutWebhook
from .stores.degradable_queue import DegradableQueueStore
from .stores.factory import build_control_store, build_queue_store
from .stores.redis_connection import default_replica_id

log = logging.getLogger("extproc")
reload_log = logging.getLogger("extproc.config")  # the change record


STORE_HEALTH_SERVICE = "extproc.queue_store"


class SidecarServer:
    """Everything `extproc serve` runs, startable and stoppable from one place (and tests)."""

    def __init__(self, config: Config, reuse_port: bool = False, source: ConfigSource | None = None):
        disable_created_metrics()  # no *_created series: they double every counter's output
        self.config = config
        self.reuse_port = reuse_port  # a worker of `serve --workers N`: the gRPC port is shared
        self.source = source  # what a reload reads again (None: nothing to reload)
        # The version in force (extproc_config_info), the command line's flags left out.
        self.config_version = source.version(config) if source is not None else version_of(config)
        self._reload_lock = asyncio.Lock()
        self._started = asyncio.Event()
        self.metrics = Metrics()
        self.observers = Observers()
        self.metrics.show_config_version(self.config_version)
        self.metrics.declare(config.classes, config.pools)
        self.replica = default_replica_id()
        self.store = build_queue_store(
            config,
            on_change=lambda pool, snapshot: self.gate.pool_changed(pool, snapshot),
            on_mode_change=self._store_mode_changed,
        )
        self.webhook = (
            ScaleOutWebhook(
                config.queue.scale_out_webhook, self.replica,
                lambda pool: self.control.claim_signal(pool, "scale_out", self.config.queue.scale_out_every_s),
                capacity=lambda pool: self.capacity.capacity_of(pool),
            )
            if config.queue.scale_out_webhook else None
        )
        self.control = ControlPlane(config, build_control_store(config), self.metrics, observers=self.observers)
        self.relay = HttpRelay(config.relay.url, config.relay.timeout_s) if config.relay.url else None
        self.discovery = EngineDiscovery(lambda: self.config, self.metrics, on_change=lambda: self.load.tick())
        self.drains = EngineDrainWatch(lambda: self.config, self.discovery, self.metrics,  # engines drained, or gone
                                       lambda pool: self.gate.picker.running(pool), on_change=lambda: self.load.tick())
        self.gate = AdmissionGate(
            config, self.store, self.metrics, self.control, self.relay,
            observers=self.observers, picker=BackendPicker(lambda: self.config, self.drains),
            long_rule=lambda pool: self.load.long_prompts(pool),  # (the controller a reload put in)
        )
        self.load = self._load_controller(config, NvmlProbe() if config.probes.nvml == "auto" else None)
        self.capacity = self._capacity_watch()
        self.decision_log = DecisionLog(config.logging.decisions, on_drop=self.metrics.decision_log_dropped.inc)
        self.recent = RecentDecisions()  # the queue page's
        # Who hears what the request path reports (core/events.py), the one list (a reload rebuilds self.load)
        for kind, handler in (*RequestMetrics(self.metrics).subscriptions(), *self.decision_log.subscriptions(),
                              *self.recent.subscriptions(),
                              (RequestDecided, self.capacity.decided), (FirstByte, self.capacity.first_byte),
                              (FirstByte, lambda event: self.load.first_byte(event)),
                              (PicksJudged, lambda event: self.load.tick_soon()),  # its rules follow at once
                              (FirstByte, self.gate.pacing.first_byte),
                              (RequestFinished, self.capacity.finished),
                              *([(TierChanged, self.webhook.tier_changed)] if self.webhook else [])):
            self.observers.subscribe(kind, handler)
        self.metrics.refresh_before_render(self.gate.pools.publish_gauges)  # the pools' gauges, as metrics are read
        self.metrics.refresh_before_render(self.gate.pacing.publish_gauges)  # the prefill pace in force
        # What follows a reload, registered once: given the new configuration and the old.
        self._follow_reloads: list[Callable[[Config, Config], None]] = [
            lambda new, old: self.gate.reconfigure(new), lambda new, old: self.control.reconfigure(new),
            lambda new, old: self.metrics.show_latency_targets(new.classes),
            lambda new, old: self.decision_log.reconfigure(new),
            lambda new, old: self.drains.follow(),  # a pool that no longer picks: its drains end
            *([self.store.reconfigure] if isinstance(self.store, DegradableQueueStore) else [])]  # Redis first
        self.health = HealthServicer()
        self._sources = self._state_sources()
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._admin: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.grpc_port = 0
        self.health_port = 0
        self.metrics_port = 0
        self.admin_port = 0

    async def start(self) -> None:
        try:
            await self._listen()
        except CannotListen:
            for server in (self._grpc, self._health, self._admin):
                if server is not None:
                    await server.stop(0)
            if self._metrics_runner is not None:
                await self._metrics_runner.cleanup()
            raise

        await self.store.start()
        await self.control.start()
        await self.discovery.start()  # the engines its dns:// names stand for, before the limits' first tick
        await self.drains.start()
        await self.load.start()
        await self.capacity.start()
        await self._grpc.start()
        if self._health is not None:
            await self._health.start()
        await self._admin.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        degraded = isinstance(self.store, DegradableQueueStore) and self.store.degraded
        await self._set_store_health(degraded)
        self._started.set()

    async def _listen(self) -> None:
        """Bind every port (the servers start later, once the parts behind them have)."""
        listen = self.config.listen
        # A held request is one open stream: never cap concurrent RPCs below the largest queue.
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", int(self.reuse_port))])
        clients = allowed_clients(listen.tls, self.metrics.clients_refused.labels("ext_proc"))
        add_ext_proc_to_server(ExtProcServicer(self.gate, clients.admit if clients else None), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.grpc_port = bind(self._grpc, listen.host, listen.grpc_port, "gRPC", tls_credentials(listen.tls, "listen.tls"))

        if listen.health_port is not None:  # the same health, nothing else: draining shows here too
            self._health = grpc.aio.server(options=[("grpc.so_reuseport", int(self.reuse_port))])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health)
            self.health_port = bind(self._health, listen.health_address, listen.health_port, "gRPC health")

        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        queue_page.add_routes(app, self.read_state)  # GET /queue and /queue/state, loopback clients only
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, listen.metrics_address, listen.metrics_port)
        try:
            await site.start()
        except OSError as error:
            where = f"{listen.metrics_address}:{listen.metrics_port}"
            raise PortInUse(f"cannot listen for metrics on {where}: {error.strerror}") from None
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        admin = self.config.admin
        clients = allowed_clients(admin.tls, self.metrics.clients_refused.labels("admin"))
        guards = [AllowedClientsGuard(clients)] if clients else []
        guards += [TokenGuard(admin.token_sha256)] if admin.token_sha256 else []
        self._admin = grpc.aio.server(interceptors=guards, options=[("grpc.so_reuseport", 0)])
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(self.read_state, self._admin_actions()), self._admin)
        self.admin_port = bind(self._admin, admin.host, admin.port, "the admin API", tls_credentials(admin.tls, "admin.tls"))

    def _capacity_watch(self) -> CapacityWatch:
        """The capacity model, fed by the gate's decisions, reading the probes' engines."""
        def backends_up(pool: str) -> int:
            # read at least once, and well: before its first scrape a probe has no failure but
            # says nothing of its engine (counted up, every listed engine would be serving)
            return sum(probe.up and probe.sampled_at is not None for probe in self.load.backends.get(pool, ()))

        def kv_tokens(pool: str) -> int | None:
            now = self.load.clock()
            known = [r.kv_capacity_tokens for r in (p.reading(now) for p in self.load.backends.get(pool, ()))
                     if r.kv_capacity_tokens]
            return round(sum(known) / len(known)) if known else None

        hearing = self.store.replicas_hearing if isinstance(self.store, DegradableQueueStore) else lambda pool: 1
        return CapacityWatch(lambda: self.config, self.store, self.metrics, backends_up, kv_tokens,
                             self.control.pager, self.control.claim_signal, replicas_hearing=hearing)

    def _state_sources(self) -> StateSources:
        control = self.control
        return StateSources(
            config=lambda: self.config, config_version=lambda: self.config_version, replica=self.replica,
            shared=control.store.shared, draining=lambda: self.gate.draining,
            snapshot=self.store.snapshot, waiting_by_branch=self.store.waiting_by_branch,
            breaker=control.snapshot, canary=lambda: control.controls.canary, shadow_share=lambda: control.shadow_share,
            shadow_share_by_operator=lambda: control.controls.shadow_share is not None,
            latency_cap=lambda pool, max_inflight: (self.load.latency[pool].applied(max_inflight)
                                                    if self.load.has_targets and pool in self.load.latency else None),
            placed=lambda pool: self.gate.picker.running(pool) if self.gate.picker is not None else {},
            cancelled=self.recent.cancelled_in, decisions=lambda: self.recent.records,
            capacity=lambda pool: self.capacity.capacity_of(pool),
            engine_picks=self.gate.slots.engine_picks, engine_drains=self.drains.views,
            long_prompts=lambda pool: self.load.long_prompts(pool),  # (the controller a reload put in)
        )

    async def read_state(self, decisions_shown: int | None = None) -> SidecarState:
        """The read model the operator API and the queue page render (ops/state.py)."""
        return await read_state(self._sources, decisions_shown)

    def _admin_actions(self) -> AdminActions:
        control = self.control

        async def drain() -> int:
            await self.drain()
            return len(self.gate.holding)

        return AdminActions(
            pools=lambda: self.config.pools, canary_configured=lambda: self.config.canary.pool is not None,
            force_breaker=control.force, reset_breaker=control.reset, advance_canary=control.canary_advance,
            roll_back_canary=control.canary_roll_back, set_shadow_share=control.set_shadow_share,
            drain=drain, drain_engine=self.drains.drain, undrain_engine=self.drains.undrain, reload=self.reload,
        )

    async def reload(self, trigger: str) -> ReloadPlan:
        """Read the configuration file again and put it in force for the next decision
        (docs/configuration.md#reloading); refused as a whole, the running configuration staying
        in force, when the file cannot be used or changes a key only a restart applies. What
        operators set at run time (breakers, canary, shadow share) stays as they set it."""
        await self._started.wait()
        async with self._reload_lock:
            if self.gate.draining:
                plan = ReloadPlan(False, self.config_version, self.config_version,
                                  refused_reason="the server is draining")
            else:
                plan = prepare_reload(self.config, self.source)
            if plan.accepted and plan.config is not None and plan.version != self.config_version:
                try:
                    await self._apply(plan.config)
                except Exception:
                    reload_log.exception("config reload (%s): applying version %s failed", trigger, plan.version)
                    raise
                self.config_version = plan.version
                self.metrics.show_config_version(plan.version)
            self.metrics.config_reloads.labels("accepted" if plan.accepted else "refused").inc()
            for line in record_lines(plan, trigger):
                reload_log.warning(line)
            return plan

    async def _apply(self, config: Config) -> None:
        """Swap in a configuration whose restart-only keys are the running ones (core/restart_only.py):
        what reads the config on each decision sees it at once; what was built from it at start
        is rebuilt or given the new settings, keeping its state."""
        old = self.config
        if config.pools.keys() != old.pools.keys() or config.classes.keys() != old.classes.keys():
            raise ValueError("a reload cannot change the set of pools or classes")  # checked before any change
        await self.discovery.resolve(config)  # its dns:// names, resolved before anything follows it
        self.config = config
        for follow in self._follow_reloads:
            follow(config, old)
        # The capacity loop: new probes (polled at once), the AIMD factors and latency caps kept.
        load = self._load_controller(config, self.load.nvml)
        for name, pool in config.pools.items():
            load.aimd[name] = dataclasses.replace(self.load.aimd[name], **pool.capacity.aimd.model_dump())
            load.latency[name] = load.configured(self.load.latency[name], name)  # its cap and samples kept
            for url in {p.url for p in self.load.backends[name]} - {p.url for p in load.backends[name]}:
                self.metrics.forget_backend(name, url)  # a backend no longer listed leaves no stale series
        load.long_rules.update(self.load.long_rules)  # shown until its first tick says otherwise
        await self.load.stop()
        self.load = load
        await load.start()  # its first tick sets every pool's limits (max_inflight) before this returns

    def _load_controller(self, config: Config, nvml: NvmlProbe | None) -> LoadController:
        """The capacity loop, telling the engine picker what it reads of the engines."""
        return LoadController(config, self.store, self.metrics, nvml, on_readings=self.gate.picker.observe,
                              picks_followed=self.gate.slots.picks_followed, engines=self.drains.serving,
                              held=self.drains.held)

    def _store_mode_changed(self, degraded: bool) -> None:
        asyncio.get_running_loop().create_task(self._set_store_health(degraded))

    async def _set_store_health(self, degraded: bool) -> None:
        """Readiness of the queue store: NOT_SERVING while Redis is unreachable."""
        self.metrics.store_degraded.set(int(degraded))
        status = health_pb2.HealthCheckResponse.NOT_SERVING if degraded else health_pb2.HealthCheckResponse.SERVING
        if not self.gate.draining:
            await self.health.set(STORE_HEALTH_SERVICE, status)

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def drain(self) -> None:
        """NOT_SERVING, refuse new work, answer everyone in line (idempotent)."""
        if self.gate.draining:
            return
        log.warning("draining: health NOT_SERVING, no new admissions")
        await self.health.enter_graceful_shutdown()
        await self.gate.drain()

    async def drain_and_stop(self) -> None:
        """Drain, let this replica's admitted exchanges finish (not the other replicas' that
        share its queue), stop."""
        await self.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while self.gate.holding and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.gate.holding:
            log.warning("drain timeout: %d exchanges still in flight", len(self.gate.holding))
        await self.stop(grace=1.0)

    async def stop(self, grace: float = 0.0) -> None:
        await self.discovery.stop()
        await self.drains.stop()
        async with self._reload_lock:  # a reload under way finishes its swap first
            await self.load.stop()
        await self.capacity.stop()
        await self.control.stop()
        if self.relay is not None:
            await self.relay.close()
        await self.store.stop()
        if self.webhook is not None:
            await self.webhook.close()
        if self._admin is not None:
            await self._admin.stop(0)
        if self._health is not None:
            await self._health.stop(grace)
        if self._grpc is not None:
            await self._grpc.stop(grace)
        self.decision_log.close()  # the last decision lines are written before the process ends
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()


async def run_server(config: Config, reuse_port: bool = False, source: ConfigSource | None = None) -> None:
    server = SidecarServer(config, reuse_port, source)
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Task] = set()

    def reload_on_sighup() -> None:  # installed first: SIGHUP's default action ends the process
        task = loop.create_task(server.reload("SIGHUP"))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, reload_on_sighup)
    loop.add_signal_handler(signal.SIGUSR2, log_object_counts)
    await server.start()
    # What the start made (modules, configuration, protobuf descriptors: most of the process's
    # objects) is left out of the cyclic collector's walks from now on, so a full collection
    # walks only what requests make: measured under load, 4 ms a collection instead of 40 ms,
    # and half the collector's time.
    gc.collect()
    gc.freeze()
    listen = config.listen
    health = f"grpc.health alone on {listen.health_address}:{server.health_port}, " if listen.health_port is not None else ""
    print(
        f"extproc: ext_proc + grpc.health on {listen.host}:{server.grpc_port}{' (TLS)' if listen.tls else ''}, "
        f"{health}metrics on http://{listen.metrics_address}:{server.metrics_port}/metrics, "
        f"admin API on {config.admin.host}:{server.admin_port}{' (TLS)' if config.admin.tls else ''} "
        f"({event_loop.name()} event loop)",
        flush=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.drain_and_stop()
    log.warning("stopped")
