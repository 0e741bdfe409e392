"""Prometheus metrics of the sidecar, on a registry of their own (one per server instance): the
counters and histograms the request path updates are metric_types', the gauges prometheus_client's."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from ..core.breaker import UPSTREAM_RESULTS
from ..core.outcomes import Outcome
from .metric_types import Counter, Histogram


class _CachedLabels:
    """A labelled gauge whose children are looked up once: prometheus_client's `labels()`
    validates, converts and locks on every call. Labels are low cardinality, so the cache stays
    small. (Counters and histograms are metric_types', which need none.)"""

    __slots__ = ("metric", "_children")

    def __init__(self, metric):
        self.metric = metric
        self._children: dict[tuple, object] = {}

    def labels(self, *values):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values) -> None:
        """Drop a series, if there is one."""
        self._children.pop(values, None)
        try:
            self.metric.remove(*values)
        except KeyError:  # no such series
            pass

    def clear(self) -> None:
        """Drop every series."""
        self._children.clear()
        self.metric.clear()

# Every `_seconds` histogram resolves milliseconds (a request admitted at once, a fast first
# byte) and tens of seconds (a long wait in line, a long generation); 2 s is the loan SLO.
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 30, 60, 120)
# Decisions take well under a millisecond in-process, a Redis round trip or more when shared,
# up to the store's operation timeout when Redis hangs.
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                     5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "extproc_queue_depth", "Requests waiting for a slot", ["pool", "class"], registry=r
        )
        self.inflight = Gauge(
            "extproc_inflight", "Admitted requests not yet finished", ["pool"], registry=r
        )
        self.max_inflight = Gauge(
            "extproc_max_inflight", "Slots of the pool", ["pool"], registry=r
        )
        self.tier = Gauge(
            "extproc_tier",
            "Queue-depth tier of the pool: 0 green, 1 yellow (scale out), 2 orange (degrade), 3 red (shed)",
            ["pool"],
            registry=r,
        )
        self.outcomes = Counter(
            "extproc_admission_outcomes",
            "Admission decisions by class and outcome",
            ["class", "outcome"],
            registry=r,
        )
        self.queued = Counter(
            "extproc_queued", "Requests that joined a pool's line: no slot fitted them when they arrived",
            ["pool", "class"], registry=r,
        )
        self.queue_wait = Histogram(
            "extproc_queue_wait_seconds",
            "Time from arrival of the body to admission or rejection",
            ["pool", "class"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.first_byte = Histogram(
            "extproc_request_first_byte_seconds",
            "Time from the request's arrival at the sidecar (its headers) to its response headers, admitted requests",
            ["pool", "class"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.latency_target = Gauge(
            "extproc_latency_target_seconds", "latency_target_s of the class: extproc_request_first_byte_seconds "
            "should stay within it", ["class"], registry=r,
        )
        self.duration = Histogram(
            "extproc_request_duration_seconds",
            "Time from the request's arrival at the sidecar to the end of the exchange (its slot released), "
            "admitted requests",
            ["pool", "class"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            "extproc_decision_seconds",
            "Time to decide on a request, queue wait excluded",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.claims_lowered = Counter(
            "extproc_claims_lowered",
            "Priority claims cut down to what the caller may claim (the tenant is in the decision log)",
            ["claim"],
            registry=r,
        )
        self.degraded = Counter(
            "extproc_degraded", "Requests sent to a fallback pool by the orange tier", ["class", "pool"], registry=r
        )
        self.slots_admitted = Counter(
            "extproc_slots_admitted", "Slots taken (an admission, a failover attempt, a shadow copy)", ["pool"], registry=r
        )
        self.released = Counter(
            "extproc_slots_released", "Slots given back, by how the exchange ended", ["pool", "end"], registry=r
        )
        self.upstream_status = Counter(
            "extproc_upstream_responses", "Response status classes seen from upstream", ["pool", "status_class"], registry=r
        )
        self.inflight_tokens = Gauge(
            "extproc_inflight_tokens", "Admitted cost (prompt + max_tokens) not yet released", ["pool"], registry=r
        )
        self.token_budget = Gauge(
            "extproc_token_budget", "Token budget admission works against (-1: none, count limit only)", ["pool"], registry=r
        )
        self.aimd_factor = Gauge("extproc_aimd_factor", "Adaptive factor on the token budget (0..1)", ["pool"], registry=r)
        self.latency_limit = Gauge(
            "extproc_latency_limit", "Concurrency cap that keeps latency-bound classes inside their target (-1: none)",
            ["pool"], registry=r,
        )
        self.prefill_pace_rate = Gauge(
            "extproc_prefill_pace_rate", "Prompt tokens a second the classes without a latency target may start now "
            "(core/prefill_pace.py: the rate the latency-bound classes' latency set, or a surge spread while they run; "
            "-1: no pace)", ["pool"], registry=r,
        )
        self.prefill_paced = Counter(
            "extproc_prefill_paced", "Admitted requests whose prompt waited for its turn on the prefill pace, by how "
            "the wait ended: started, cut_short (its wait ran out, or the sidecar drains), cancelled", ["pool", "result"],
            registry=r,
        )
        self.engine_picks = Counter(
            "extproc_engine_picks", "Placed requests that answered, by whether they ran on the engine the sidecar "
            "named first (followed) or elsewhere (ignored)", ["pool", "followed"], registry=r,
        )
        self.engine_picks_ignored = Gauge(
            "extproc_engine_picks_ignored", "1 while Envoy does not follow the sidecar's engine picks for the pool "
            "(the cluster balances by a policy of its own), 0 while it does", ["pool"], registry=r,
        )
        self.long_lane_waits = Counter(
            "extproc_long_lane_waits", "Long prompts that waited, their slot taken, for an engine of their own (one "
            "running long prompts or no latency-bound request), by how the wait ended: placed, timed_out (placed "
            "anyway), refused (it ran out where the prompt would go beside latency-bound requests: answered as "
            "expired in line) or cancelled",
            ["pool", "result"], registry=r,
        )
        self.spill_waits = Counter(
            "extproc_spill_waits", "Prompts of classes without a latency target that waited, admitted, for their turn "
            "beside latency-bound requests (core/spill.py), by how the wait ended: placed, timed_out (placed anyway) "
            "or cancelled", ["pool", "result"],
            registry=r)
        self.backend_kv_usage = Gauge(
            "extproc_backend_kv_usage", "KV-cache usage read from a backend (1 when saturated)", ["pool", "backend"], registry=r
        )
        self.backend_saturated = Gauge(
            "extproc_backend_saturated", "1 when a backend's metrics are missing, stale, unparsable or NaN",
            ["pool", "backend"], registry=r,
        )
        self.backend_up = Gauge(
            "extproc_backend_up", "1 when the last scrape of a backend's /metrics succeeded, else 0",
            ["pool", "backend"], registry=r,
        )
        self.backend_metrics_age = Gauge(
            "extproc_backend_metrics_age_seconds",
            "Seconds since the last good scrape of a backend's /metrics (+Inf before the first)",
            ["pool", "backend"], registry=r,
        )
        self.backend_requests = Gauge(
            "extproc_backend_requests", "Requests a backend reports running or waiting", ["pool", "backend", "state"],
            registry=r,
        )
        self.discovered_engines = Gauge(
            "extproc_discovered_engines", "Engines a pool's backends stand for now, its dns:// names resolved (pools "
            "with a dns:// backend only)", ["pool"], registry=r,
        )
        self.discovery_resolutions = Counter(
            "extproc_discovery_resolutions", "Resolutions of a dns:// backend's host name, by result: ok (addresses), empty "
            "(no such name, or no address), failed (no answer in time, a server failure, an unreadable answer: the "
            "addresses known stay)", ["host", "result"], registry=r,
        )
        self.draining_engines = Gauge(
            "extproc_draining_engines", "Engines of the pool that get no new request, drained by an operator or gone "
            "from its engines, by state: draining (runs requests), idle (may be stopped), overdue (past its deadline, "
            "runs requests)", ["pool", "state"], registry=r,
        )
        self.draining_requests = Gauge(
            "extproc_draining_requests", "Requests this replica placed on draining engines that still run", ["pool"],
            registry=r,
        )
        self.engine_drains = Counter(
            "extproc_engine_drains", "Engine drains, each counted once by how it ended first: idle (its last request "
            "ended before its deadline), deadline (it still ran requests then), cancelled (undrained, or back)",
            ["pool", "reason", "result"], registry=r,
        )
        self.drained_engine_failures = Counter(
            "extproc_drained_engine_failures", "Failed responses from an engine being drained or removed (reset as it "
            "stopped): never counted by the pool's breaker", ["pool"], registry=r,
        )
        self.gpu_memory_used = Gauge("extproc_gpu_memory_used_ratio", "GPU memory in use (NVML)", ["gpu"], registry=r)
        self.gpu_sm_utilization = Gauge("extproc_gpu_sm_utilization", "GPU SM utilisation 0..1 (NVML)", ["gpu"], registry=r)
        self.gpu_memory_utilization = Gauge(
            "extproc_gpu_memory_utilization", "GPU memory-bandwidth utilisation 0..1 (NVML)", ["gpu"], registry=r
        )
        self.store_degraded = Gauge(
            "extproc_store_degraded", "1 while the shared queue (Redis) is unreachable and on_failure applies",
            registry=r,
        )
        self.serving = Gauge("extproc_serving", "1 while accepting requests, 0 while draining", registry=r)
        self.decision_log_dropped = Counter(
            "extproc_decision_log_dropped", "Decision log lines dropped because the log's stream fell behind "
            "(admission never waits for it)", registry=r,
        )
        self.config_reloads = Counter(
            "extproc_config_reloads", "Configuration reloads (SIGHUP, admin API) by result: accepted, refused",
            ["result"], registry=r,
        )
        self.clients_refused = Counter(
            "extproc_clients_refused", "ext_proc streams and admin calls refused: the client's certificate names none "
            "of the port's tls.allowed_client_names", ["port"], registry=r,
        )
        self.config_info = Gauge(
            "extproc_config_info", "1 for the version of the configuration in force (docs/configuration.md#reloading)",
            ["version"], registry=r,
        )

        # The third level: breakers, rerouting, failover, retries, canary, shadow.
        self.upstream_outcomes = Counter(
            "extproc_upstream_outcomes", "Upstream outcomes the breakers count: success, or the kind of failure "
            "(http_5xx, http_429, connect_failure, reset, timeout, no_healthy_upstream, overflow)",
            ["pool", "result"], registry=r,
        )
        self.breaker_state = Gauge(
            "extproc_breaker_state", "Breaker levels: instant 0 closed 1 open 2 half-open; sustained 1 rerouting; "
            "deep 1 paged (latched); forced 1 open 2 closed", ["pool", "level"], registry=r,
        )
        self.breaker_error_ratio = Gauge(
            "extproc_breaker_error_ratio", "Failure ratio of the pool's upstream outcomes in a breaker window",
            ["pool", "window"], registry=r,
        )
        self.breaker_window_requests = Gauge(
            "extproc_breaker_window_requests", "Upstream outcomes counted in a breaker window", ["pool", "window"],
            registry=r,
        )
        self.client_cancelled = Counter(
            "extproc_client_cancelled", "Clients that left before their response, by where they were: arriving "
            "(before the body was decided), queued (in line), before_response (admitted, no response yet); "
            "never counted as upstream failures", ["pool", "class", "phase"], registry=r,
        )
        self.appointments = Counter(
            "extproc_appointments", "Requests turned away by pool and class: given an appointment (when to come "
            "back, keeping their place), past_deadline (a final answer: none fits the class's deadline), or held "
            "(back before its appointment: held until then rather than refused again)",
            ["pool", "class", "result"], registry=r,
        )
        self.appointment_delay = Histogram(
            "extproc_appointment_delay_seconds", "How far ahead appointments are given", ["pool"], registry=r,
            buckets=_SECONDS_BUCKETS,
        )
        self.breaker_transitions = Counter(
            "extproc_breaker_transitions", "Breaker level changes this replica made", ["pool", "level", "to"], registry=r,
        )
        self.pages = Counter("extproc_breaker_pages", "Deep breaker level pages sent", ["pool"], registry=r)
        self.rerouted = Counter(
            "extproc_rerouted", "Requests served by another pool than their home pool, by reason "
            "(breaker, probe_denied, retry, degraded, failover)", ["from_pool", "to_pool", "reason"], registry=r,
        )
        self.failovers = Counter(
            "extproc_failovers", "Attempts that failed before their response started, tried once more on the "
            "fallback pool, by how that ended", ["from_pool", "to_pool", "result"], registry=r,
        )
        self.retries = Counter(
            "extproc_retries", "Client retries (a named request seen again, or an SDK retry count) by verdict",
            ["verdict"], registry=r,
        )
        self.canary_batch = Gauge("extproc_canary_batch", "Branch-id digits routed to the canary pool", ["pool"], registry=r)
        self.canary_rolled_back = Gauge(
            "extproc_canary_rolled_back", "1 after an automatic canary rollback, until the next advance", ["pool"],
            registry=r,
        )
        self.canary_rollbacks = Counter(
            "extproc_canary_rollbacks", "Canary rollbacks, automatic or by an operator", ["pool", "reason"], registry=r,
        )
        self.shadow_share = Gauge("extproc_shadow_share", "Share of the default pool's requests copied as shadow", registry=r)
        self.shadow_copies = Counter(
            "extproc_shadow_copies", "Shadow copies by what became of them (sent, no_room, unavailable)",
            ["pool", "result"], registry=r,
        )
        self.shadow_responses = Counter(
            "extproc_shadow_responses", "Status classes of shadowed requests (primary) and their copies (shadow)",
            ["side", "status_class"], registry=r,
        )
        self.shadow_latency = Histogram(
            "extproc_shadow_latency_seconds", "Latency of shadowed requests (primary) and their copies (shadow)",
            ["side"], buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.shadow_tokens = Counter(
            "extproc_shadow_completion_tokens", "Completion tokens of non-streamed shadowed requests and their copies",
            ["side"], registry=r,
        )

        # The capacity model (control/capacity_watch.py): what the autoscalers read.
        self.desired_backends = Gauge(
            "extproc_desired_backends", "Engines the pool should run for its classes' latency targets at the demand "
            "seen, now and on the trend ahead (scale-in held while above green and over the stabilization window)",
            ["pool"], registry=r,
        )
        self.capacity_rps = Gauge(
            "extproc_capacity_rps", "Requests per second of the class one engine carries inside the latency targets "
            "(-1: not measured yet)", ["pool", "class"], registry=r,
        )
        self.service_fit = Gauge(
            "extproc_service_fit_seconds", "The class's service time against per-engine concurrency n: base + "
            "per_request x n (-1: not measured yet)", ["pool", "class", "term"], registry=r,
        )
        self.demand_rps = Gauge(
            "extproc_demand_rps", "Requests per second reaching the pool (first attempts, queued, shed or degraded "
            "alike) plus the backlog to drain", ["pool", "class"], registry=r,
        )
        self.needed_backends = Gauge(
            "extproc_needed_backends", "Engines the demand needs, unrounded: now, and ahead on the trend (-1: unknown)",
            ["pool", "horizon"], registry=r,
        )
        self.per_engine_concurrency = Gauge(
            "extproc_per_engine_concurrency", "Requests one engine runs at once inside the latency targets",
            ["pool"], registry=r,
        )
        self.max_backends = Gauge(
            "extproc_max_backends", "autoscale.max_backends of the pool (-1: none)", ["pool"], registry=r,
        )
        self.capacity_beyond_max = Gauge(
            "extproc_capacity_beyond_max", "1 while the pool needs more engines than autoscale.max_backends",
            ["pool"], registry=r,
        )

        for name, value in list(vars(self).items()):
            if getattr(value, "_labelnames", ()):
                setattr(self, name, _CachedLabels(value))

        self._refreshers: list[Callable[[], None]] = []  # gauges kept up to date lazily, written on render

    def declare(self, classes, pools) -> None:
        """Create every (class, outcome) and (pool, result) series at zero, so a counter's first
        increment is a change Prometheus's rate() can see (a series born at 1 is not), and the
        pools' gauges at their values before the first request."""
        for result in ("accepted", "refused"):
            self.config_reloads.labels(result)
        self.serving.set(1)
        self.show_latency_targets(classes)
        for name, pool in pools.items():
            self.max_inflight.labels(name).set(pool.max_inflight)
            self.inflight.labels(name).set(0)
            self.tier.labels(name).set(0)
            for class_name in classes:
                self.queue_depth.labels(name, class_name).set(0)
        for class_name in classes:
            for outcome in (o for o in Outcome if o is not Outcome.YIELDED):  # (a yield decides no outcome)
                self.outcomes.labels(class_name, outcome.value)
        for pool in pools:
            for result in UPSTREAM_RESULTS:
                self.upstream_outcomes.labels(pool, result)
            self.drained_engine_failures.labels(pool)
            self.prefill_pace_rate.labels(pool).set(-1)
            for result in ("started", "cut_short", "cancelled"):
                self.prefill_paced.labels(pool, result)
            for class_name in classes:
                self.queued.labels(pool, class_name)
                for phase in ("queued", "before_response"):
                    self.client_cancelled.labels(pool, class_name, phase)
                for result in ("given", "past_deadline"):
                    self.appointments.labels(pool, class_name, result)

    def show_latency_targets(self, classes) -> None:
        """One series per class with a latency_target_s (a reload may add, change or drop one)."""
        self.latency_target.clear()
        for name, policy in classes.items():
            if policy.latency_target_s is not None:
                self.latency_target.labels(name).set(policy.latency_target_s)

    def forget_backend(self, pool: str, backend: str) -> None:
        """Remove a backend's series (it left the configuration)."""
        for gauge in (self.backend_kv_usage, self.backend_saturated, self.backend_up, self.backend_metrics_age):
            gauge.remove(pool, backend)
        for state in ("running", "waiting"):
            self.backend_requests.remove(pool, backend, state)

    def show_config_version(self, version: str) -> None:
        """`extproc_config_info{version}` is 1 for `version`; the previous version's series goes."""
        self.config_info.clear()
        self.config_info.labels(version).set(1)

    def refresh_before_render(self, refresh: Callable[[], None]) -> None:
        """`refresh` writes gauges kept lazily (a pool's depths): called each time metrics are read."""
        self._refreshers.append(refresh)

    def render(self) -> bytes:
        for refresh in self._refreshers:
            refresh()
        return generate_latest(self.registry)
