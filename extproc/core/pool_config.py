"""A pool's part of the configuration: its queue-depth tiers, its capacity (KV tokens, AIMD,
the latency limiter's settings, backend placement) and its breaker's three levels."""

from __future__ import annotations

import functools
import ipaddress
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .restart_only import RestartOnly


class StrictModel(BaseModel):
    """Unknown keys are errors; a parsed section never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Tiers(StrictModel):
    """Queue-depth thresholds: depth above `yellow` signals scale-out, above `orange` degrades,
    above `red` rejects unprotected classes; nobody queues beyond `hard_max`."""

    yellow: int = Field(30, ge=0)
    orange: int = Field(50, ge=0)
    red: int = Field(80, ge=0)
    hard_max: int = Field(200, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Tiers:
        if not self.yellow <= self.orange <= self.red < self.hard_max:
            raise ValueError("tiers must satisfy yellow <= orange <= red < hard_max")
        return self


class AimdSettings(StrictModel):
    """The AIMD factor's marks and steps (its running state: capacity.Aimd)."""

    high: float = Field(0.85, gt=0, le=1)
    low: float = Field(0.6, ge=0, lt=1)
    decrease: float = Field(0.7, gt=0, lt=1)
    increase_step: float = Field(0.05, gt=0, le=1)
    min_factor: float = Field(0.1, gt=0, le=1)
    interval_s: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _marks(self) -> AimdSettings:
        if self.low >= self.high:
            raise ValueError("aimd.low must be below aimd.high")
        return self


class Capacity(StrictModel):
    """How much a pool may hold, by KV-cache tokens (see capacity.py)."""

    # base URLs whose vLLM /metrics are polled; "dns://NAME:PORT" stands for every address NAME
    # resolves to, re-resolved every discovery.interval_s (core/discovery.py)
    backends: tuple[str, ...] = ()
    kv_tokens_per_backend: int | None = Field(None, ge=1)  # when /metrics does not say
    safety_factor: float = Field(0.85, gt=0, le=1)
    max_num_seqs: int = Field(32, ge=1)  # per backend (the seed: min(4 x GPUs, 32))
    long_request_tokens: int = Field(4096, ge=1)
    # with a long_pool: requests of classes without a latency target go there above this cost
    offload_request_tokens: int | None = Field(None, ge=1)
    long_share: Annotated[float, RestartOnly(
        "the queue lines take the long lane's share at start")] = Field(0.5, gt=0, le=1)
    aimd: AimdSettings = AimdSettings()
    nvml_dynamic_batch: bool = True  # apply the seed's dynamic batch when NVML sees GPUs
    latency_window_s: float = Field(10.0, gt=0)  # the latency limiter's window of samples
    latency_floor_share: float = Field(0.25, gt=0, le=1)  # the latency cap never goes below this share of max_inflight
    # ...where Envoy places the pool's requests by its own policy (the sidecar does not pick or keep
    # prompts apart, or Envoy does not follow its picks): every engine then takes an even share of
    # the other classes' prefill, and the cap must go lower for the same latency (docs/admission.md)
    latency_floor_share_envoy_placed: float = Field(0.125, gt=0, le=1)
    # ...nor above max_inflight less this share (slots only latency-bound classes may take)
    latency_headroom_share: float = Field(0.25, ge=0, lt=1)
    # the prompts of classes without a latency target start at a pace that follows the latency-bound
    # classes' latency (core/prefill_pace.py), so that their prefill leaves those inside their target
    prefill_pace: bool = True
    # the sidecar names each request's backend, the least loaded by KV tokens first (Envoy's
    # override_host policy on the pool's cluster reads it); the backends must be IP:port URLs
    pick_backend: bool = False
    # with pick_backend: long prompts on engines of their own while possible, latency-bound
    # requests on engines running none (capacity.backend_order); off: by KV tokens alone
    keep_long_apart: bool = True
    # ...and the prompts of classes without a latency target start on an engine running
    # latency-bound requests at this pace, KV tokens a second, one at a time (core/spill.py)
    spill_tokens_per_s: float = Field(2048.0, gt=0)
    # ...where a latency-bound request started within this many seconds, an engine still serves them:
    # the others keep off it, and no long prompt takes it for a lane (about one latency target)
    bound_lately_s: float = Field(2.0, ge=0)
    # where Envoy places the pool's requests by its own policy: a long prompt of a class without a
    # latency target starts only once latency-bound requests arrive no oftener than one per this long
    # (and none runs), so long prompts wait out their bursts (PoolLimits.long_quiet_s; 0: when none runs)
    long_quiet_s: float = Field(2.0, ge=0)
    # ...and one that started less than its prefill ago (its prompt tokens at this many a second, what
    # one engine prefills) yields when a latency-bound request arrives: answered 503 with a
    # `retry-after`, it comes back then, and yields no more (core/yielding.py; 0: never)
    long_prefill_tokens_per_s: float = Field(5000.0, ge=0)

    @property
    def picks_backend(self) -> bool:
        """The sidecar names each request's backend (it has backends to name)."""
        return self.pick_backend and bool(self.backends)

    @model_validator(mode="after")
    def _pickable(self) -> Capacity:
        addresses: dict[tuple[str, int], str] = {}
        for url in self.backends:
            if (address := engine_address(url)) is not None:
                if address in addresses:
                    raise ValueError(f"{addresses[address]!r} and {url!r} are the same engine (address {address[0]}, "
                                     f"port {address[1]}): list it once")
                addresses[address] = url
            if url.startswith(DNS_SCHEME) and dns_backend(url) is None:
                raise ValueError(f"a discovered backend is dns://NAME:PORT (a host name and a port, nothing "
                                 f"more): {url!r}")
            if self.pick_backend and backend_endpoint(url) is None and dns_backend(url) is None:
                raise ValueError(f"pick_backend needs backends given as http://IP:PORT or dns://NAME:PORT "
                                 f"(Envoy's override_host takes addresses, not names): {url!r}")
        return self


@functools.cache
def backend_endpoint(url: str) -> str | None:
    """The IP:PORT a backend's base URL names, as Envoy's override_host takes it (None: a
    host name, or no port)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
        if host is None or port is None:
            return None
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


@functools.cache
def engine_address(url: str) -> tuple[str, int] | None:
    """(ADDRESS, PORT) of the engine a backend's base URL names, an IPv4-mapped IPv6 address as
    the IPv4 one, so that two URLs of one engine compare equal (None: a host name, or no port)."""
    endpoint = backend_endpoint(url)
    if endpoint is None:
        return None
    host, _, port = endpoint.rpartition(":")
    address = ipaddress.ip_address(host.strip("[]"))
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address), int(port)


DNS_SCHEME = "dns://"


@functools.cache
def dns_backend(url: str) -> tuple[str, int] | None:
    """(NAME, PORT) of a discovered backend "dns://NAME:PORT" (None: not one, or malformed)."""
    if not url.startswith(DNS_SCHEME):
        return None
    try:
        parts = urlsplit(url)
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not name or port is None or parts.path not in ("", "/") or parts.query or parts.fragment \
            or parts.username is not None or parts.password is not None:
        return None
    return name, port


# A breaker level's window is a ring of buckets, in memory and in Redis: its length and its
# buckets are fixed at start (its thresholds and times apply live).
WINDOW_SHAPE = RestartOnly("a breaker window's shape is fixed at start (thresholds and times apply live)")


class InstantLevel(StrictModel):
    """1 s window: stop sending to the pool for `open_s`, then let exactly `probes` through."""

    window_s: Annotated[float, WINDOW_SHAPE] = Field(1.0, gt=0)
    buckets: Annotated[int, WINDOW_SHAPE] = Field(10, ge=1, le=600)
    threshold: float = Field(0.3, gt=0, le=1)  # failure ratio at or above which it trips
    min_requests: int = Field(10, ge=1)  # below this many outcomes in the window it never trips
    open_s: float = Field(30.0, gt=0)
    probes: int = Field(3, ge=1)  # half-open: requests let through; all must succeed to close
    backoff: float = Field(2.0, ge=1)  # each re-opening in a row lasts this much longer...
    max_open_s: float = Field(300.0, gt=0)  # ...up to this; closed this long, it starts over


class SustainedLevel(StrictModel):
    """60 s window: reroute to the fallback pool until the window stays healthy for `hold_s`."""

    window_s: Annotated[float, WINDOW_SHAPE] = Field(60.0, gt=0)
    buckets: Annotated[int, WINDOW_SHAPE] = Field(60, ge=1, le=600)
    threshold: float = Field(0.2, gt=0, le=1)
    min_requests: int = Field(20, ge=1)
    recover_below: float = Field(0.1, ge=0, le=1)  # hysteresis: healthy means at or below this
    hold_s: float = Field(30.0, ge=0)
    probe_interval_s: float = Field(1.0, gt=0)  # one request this often still measures the pool

    @model_validator(mode="after")
    def _hysteresis(self) -> SustainedLevel:
        if self.recover_below >= self.threshold:
            raise ValueError("recover_below must be below threshold, or rerouting would flap")
        return self


class DeepLevel(StrictModel):
    """300 s window: page a person; latched until an operator resets it."""

    window_s: Annotated[float, WINDOW_SHAPE] = Field(300.0, gt=0)
    buckets: Annotated[int, WINDOW_SHAPE] = Field(60, ge=1, le=600)
    threshold: float = Field(0.15, gt=0, le=1)
    min_requests: int = Field(50, ge=1)


class BreakerSettings(StrictModel):
    instant: InstantLevel = InstantLevel()
    sustained: SustainedLevel = SustainedLevel()
    deep: DeepLevel = DeepLevel()


class Autoscale(StrictModel):
    """The capacity model's settings (capacity_model.py): how many engines the pool needs."""

    min_backends: int = Field(1, ge=0)
    max_backends: int | None = Field(None, ge=1)  # a need beyond: a webhook alert and a Prometheus alert
    target_utilisation: float = Field(0.8, gt=0, le=1)  # engines run at most this busy
    window_s: float = Field(30.0, gt=0)  # demand measured over this
    trend_s: float = Field(120.0, gt=0)  # the trend fitted over this
    horizon_s: float = Field(120.0, ge=0)  # and followed this far ahead (an engine's cold start, and margin)
    drain_s: float = Field(30.0, gt=0)  # what waits in line should be served within this
    scale_in_hold_s: float = Field(300.0, ge=0)  # the stabilization window: the most wanted over it
    engine_latency_share: float = Field(0.75, gt=0, le=1)  # of a latency target, the engine's part


class Pool(StrictModel):
    cluster: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    max_inflight: int = Field(ge=1)
    fallback: str | None = None
    # The models clients may ask this pool for by name: a request goes to the pool that lists its
    # `model`. None (every pool): requests go to the default pool whatever their model.
    served_models: tuple[Annotated[str, Field(min_length=1)], ...] | None = Field(None, min_length=1)
    # Requests that reach this pool from another one (rerouted, degraded, failed over, canary,
    # shadow) get their `model` rewritten through this map; a model missing from it is never
    # sent here. Without a map the model passes unchanged (the pools serve the same models),
    # unless the pool lists `served_models`: then only those would pass, and they are its own.
    models: dict[str, str] | None = None
    # Requests costing more than capacity.long_request_tokens go to this pool instead: on
    # engines of their own, a long prompt's prefill never stalls the short requests' steps.
    long_pool: str | None = None
    tiers: Tiers = Tiers()
    capacity: Capacity = Capacity()
    breaker: BreakerSettings = BreakerSettings()
    autoscale: Autoscale = Autoscale()

    @model_validator(mode="after")
    def _served_once(self) -> Pool:
        if self.served_models is not None and len(set(self.served_models)) != len(self.served_models):
            raise ValueError("served_models lists a model twice")
        return self
