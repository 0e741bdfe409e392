"""The two setups the burst scenario compares, as configuration: (a) Envoy alone, the production
template with circuit breakers sized to the pool; (b) Envoy + the sidecar, its configuration with
a long pool, backends picked by KV tokens, and every duration scaled like the backends'. The
sidecar's mechanisms can be left out one at a time (`MECHANISMS`, the ablation).

The matrix's cells (`Cell`) vary what users vary: the Envoy (the template, which follows the
sidecar's engine picks, or a platform team's own with plain least request), the engines (8 or
32 sequences), and the clients (honouring `retry-after`, or ignoring it); the sidecar runs on
its shipped defaults with the pool sized at the engines' real slot count (`shipped_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from extproc.core.config import ClassPolicy, RetryAfter, default_config_text
from extproc.core.pool_config import AimdSettings, BreakerSettings, Capacity
from .envoy_config import plain_least_request, template_path
from .stack import StackPorts
from .traffic import ANONYMOUS_RIGHTS, IMPATIENT_CLASSES

MAX_NUM_SEQS, KV_TOKENS = 8, 24576
ENGINES = {8: 24576, 32: 65536}  # the matrix's engines: sequences -> KV tokens


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: which Envoy, which engines, which clients."""

    envoy: str  # "template" (follows the sidecar's picks) or "plain" (plain least request)
    max_num_seqs: int  # per engine, a key of ENGINES
    clients: str  # "honour" retry-after as the OpenAI SDKs do, or "ignore" it (complaints and archive queries)
    backends: int = 2
    long_prefill_token_threshold: int = 0  # the engines' --long-prefill-token-threshold (0: vLLM's default, none)

    @property
    def name(self) -> str:
        return f"{self.envoy}-{self.max_num_seqs}-{self.clients}"

    @property
    def kv_tokens(self) -> int:
        return ENGINES[self.max_num_seqs]

    @property
    def impatient(self) -> frozenset[str]:
        """The classes whose clients retry in a hand-written loop, ignoring retry-after."""
        return frozenset(IMPATIENT_CLASSES) if self.clients == "ignore" else frozenset()


CELLS = tuple(Cell(envoy, seqs, clients) for envoy in ("template", "plain") for seqs in ENGINES
              for clients in ("honour", "ignore"))


def envoy_template(work: Path, plain: bool) -> Path | None:
    """The Envoy the sidecar setup runs: the template (None), or a platform team's own."""
    if not plain:
        return None
    path = work / "envoy-plain-template.yaml"
    path.write_text(yaml.safe_dump(plain_least_request(yaml.safe_load(template_path().read_text())), sort_keys=False))
    return path
OFFLOAD_REQUEST_TOKENS = 1000  # the medium prompts (1k-4k) of classes without a latency target: to the long pool


def envoy_alone_template(work: Path, backends: int, max_num_seqs: int = MAX_NUM_SEQS, plain: bool = False) -> Path:
    """The production template (`plain`: a platform team's own, plain least request) with the
    primary cluster's circuit breakers sized to the pool."""
    config = yaml.safe_load(template_path().read_text())
    if plain:
        config = plain_least_request(config)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "vllm_primary":
            threshold = cluster["circuit_breakers"]["thresholds"][0]
            threshold.update(max_requests=backends * max_num_seqs, max_pending_requests=backends * max_num_seqs,
                             max_connections=backends * max_num_seqs * 2)
    path = work / "envoy-alone-template.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def scale_durations(config: dict, time_scale: float, latency_scale: float = 1.0) -> dict:
    """The sidecar's own durations scaled like the backends' (waits, retry-after, probe and
    breaker intervals, latency targets), so the whole system runs `time_scale` times faster,
    consistently. Values the file leaves out are scaled from the configuration's defaults. The
    classes' waits, latency targets and deadlines are also multiplied by `latency_scale`: engines
    that answer that many times slower than the simulated ones (the traffic's `latency_scale`)."""
    for policy in config["classes"].values():
        policy["max_wait_s"] = policy.get("max_wait_s", ClassPolicy.model_fields["max_wait_s"].default) \
            * time_scale * latency_scale
        for key in ("latency_target_s", "deadline_s"):
            if policy.get(key):
                policy[key] = policy[key] * time_scale * latency_scale
    retry_after = {**RetryAfter().model_dump(), **config.get("retry_after_s", {})}
    config["retry_after_s"] = {key: value if key == "jitter" else max(1, round(value * time_scale))  # jitter: a share
                               for key, value in retry_after.items()}
    for key in ("interval_s", "stale_after_s"):
        config["probes"][key] = config["probes"][key] * time_scale
    for pool in config["pools"].values():
        capacity = pool["capacity"]
        capacity.setdefault("aimd", {})["interval_s"] = AimdSettings().interval_s * time_scale
        capacity["latency_window_s"] = capacity.get("latency_window_s", Capacity().latency_window_s) * time_scale
        # about one latency target, and a rate: the engines take as many tokens in a second made
        # shorter, and fewer where they answer `latency_scale` times slower
        capacity["bound_lately_s"] = capacity.get("bound_lately_s", Capacity().bound_lately_s) \
            * time_scale * latency_scale
        capacity["long_quiet_s"] = capacity.get("long_quiet_s", Capacity().long_quiet_s) * time_scale * latency_scale
        capacity["spill_tokens_per_s"] = capacity.get("spill_tokens_per_s", Capacity().spill_tokens_per_s) \
            / (time_scale * latency_scale)
        breaker = BreakerSettings(**pool.get("breaker", {})).model_dump()
        pool["breaker"] = {level: {key: value * time_scale if key.endswith("_s") else value
                                   for key, value in settings.items()} for level, settings in breaker.items()}
    return config


def long_backends(backends: int) -> int:
    """How many of the sidecar setup's backends are kept for long prompts."""
    return max(1, round(backends / 4)) if backends > 1 else 0


MECHANISMS = ("latency_target", "long_pool", "offload", "engine_priority", "pick_backend", "appointments",
              "decide_at_arrival", "keep_long_apart")


def shipped_config(work: Path, ports: StackPorts, time_scale: float, max_num_seqs: int | None = None) -> Path:
    """The sidecar's shipped defaults, as a platform team starts: only the backends' addresses
    written in (and the durations scaled). The primary pool's fallback link is dropped so both
    setups run on the same engines (Envoy alone has no fallback pool to send to). With
    `max_num_seqs`, the pool sized as a platform team sizes it: `max_inflight` at the engines'
    real slot count, their `max_num_seqs`, the sidecar picking each request's engine, and, as
    the engines run `--scheduling-policy priority`, telling them each request's priority."""
    config = yaml.safe_load(default_config_text())
    config["anonymous"] = ANONYMOUS_RIGHTS
    primary = config["pools"]["primary"]
    primary.pop("fallback", None)
    primary["capacity"]["backends"] = [f"http://127.0.0.1:{p}" for p in ports.primary]
    if max_num_seqs is not None:
        primary["max_inflight"] = len(ports.primary) * max_num_seqs
        primary["capacity"].update(max_num_seqs=max_num_seqs, pick_backend=True)
        # the engines run vLLM's priority policy: the sidecar tells them each request's priority
        config.setdefault("queue", {})["engine_priority"] = True
    config["pools"]["fallback"]["capacity"]["backends"] = [f"http://127.0.0.1:{p}" for p in ports.fallback]
    path = work / "extproc.yaml"
    path.write_text(yaml.safe_dump(scale_durations(config, time_scale)))
    return path


def sidecar_config(work: Path, ports: StackPorts, time_scale: float, off: frozenset[str] = frozenset(),
                   latency_scale: float = 1.0) -> Path:
    config = yaml.safe_load(default_config_text())
    config["anonymous"] = ANONYMOUS_RIGHTS
    if "latency_target" in off:
        for policy in config["classes"].values():
            policy.pop("latency_target_s", None)
    queue = config.setdefault("queue", {})
    queue["engine_priority"] = "engine_priority" not in off
    queue["appointments"] = "appointments" not in off
    queue["decide_at_arrival"] = "decide_at_arrival" not in off
    primary = config["pools"]["primary"]
    primary.pop("fallback", None)
    primary["max_inflight"] = len(ports.primary) * MAX_NUM_SEQS
    primary["capacity"]["backends"] = [f"http://127.0.0.1:{p}" for p in ports.primary]
    primary["capacity"]["max_num_seqs"] = MAX_NUM_SEQS
    primary["capacity"]["pick_backend"] = "pick_backend" not in off
    primary["capacity"]["keep_long_apart"] = "keep_long_apart" not in off
    if ports.long and "long_pool" not in off:
        primary["long_pool"] = "long"
        if "offload" not in off:
            primary["capacity"]["offload_request_tokens"] = OFFLOAD_REQUEST_TOKENS
        config["pools"]["long"] = {
            "cluster": "vllm_long", "max_inflight": len(ports.long) * MAX_NUM_SEQS,
            "capacity": {"backends": [f"http://127.0.0.1:{p}" for p in ports.long], "max_num_seqs": MAX_NUM_SEQS,
                         "pick_backend": "pick_backend" not in off, "keep_long_apart": "keep_long_apart" not in off},
        }
    config["pools"]["fallback"]["capacity"]["backends"] = [f"http://127.0.0.1:{p}" for p in ports.fallback]
    config["probes"]["nvml"] = "off"
    config["shadow"]["share"] = 0.0
    path = work / "extproc.yaml"
    path.write_text(yaml.safe_dump(scale_durations(config, time_scale, latency_scale)))
    return path
