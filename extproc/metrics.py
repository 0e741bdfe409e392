"""Prometheus metrics of the sidecar, on a registry of their own (one per server instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)
_DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


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
        self.queue_wait = Histogram(
            "extproc_queue_wait_seconds",
            "Time from arrival of the body to admission or rejection",
            ["pool", "class"],
            buckets=_WAIT_BUCKETS,
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
            "Priority claims cut down to what the caller may claim",
            ["tenant", "claim"],
            registry=r,
        )
        self.degraded = Counter(
            "extproc_degraded", "Requests sent to a fallback pool by the orange tier", ["class", "pool"], registry=r
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
        self.backend_kv_usage = Gauge(
            "extproc_backend_kv_usage", "KV-cache usage read from a backend (1 when saturated)", ["pool", "backend"], registry=r
        )
        self.backend_saturated = Gauge(
            "extproc_backend_saturated", "1 when a backend's metrics are missing, stale, unparsable or NaN",
            ["pool", "backend"], registry=r,
        )
        self.backend_requests = Gauge(
            "extproc_backend_requests", "Requests a backend reports running or waiting", ["pool", "backend", "state"],
            registry=r,
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
