"""The one validated configuration object, built once at start.

Unknown keys are errors, and every error names the key it is about, so a platform team's
typo fails at start (or in `extproc check-config`) instead of silently running on a default.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from .discovery import DiscoverySettings
from .engine_drain import EngineDrainSettings
from .listen_config import SHA256_HEX, Admin, Listen
from .pool_config import Pool
from .pool_config import StrictModel as _Strict
from .restart_only import FixedEntries, RestartOnly


class ClassPolicy(_Strict):
    base: float
    max_wait_s: float = Field(20.0, gt=0)
    protected: bool = False
    degradable: bool = False
    # A latency target: each pool's concurrency is bounded so requests of this class get their
    # first byte (their whole answer, when not streamed) within it (capacity.LatencyLimiter).
    latency_target_s: float | None = Field(None, gt=0)
    # When its client must have the answer, retries included, from the first attempt: a refused
    # request gets an appointment within it (core/appointments.py), or a final answer at once.
    deadline_s: float | None = Field(None, gt=0)


class PriorityFactors(_Strict):
    urgent_per_level: float = Field(0.1, ge=0)
    vip_per_level: float = Field(0.05, ge=0)
    bulk_penalty: float = Field(0.2, ge=0)
    max_adjustment: float = Field(0.45, ge=0)


class CallerRights(_Strict):
    """What a caller may claim: ticket types ("*" for all) and its highest boost levels; and the
    models it may use ("*" for all; a list needs pools that list their `served_models`)."""

    ticket_types: Literal["*"] | tuple[str, ...] = "*"
    max_urgent_level: int = Field(0, ge=0)
    max_vip_level: int = Field(0, ge=0)
    models: Literal["*"] | tuple[str, ...] = "*"

    def may_claim(self, ticket_type: str) -> bool:
        return self.ticket_types == "*" or ticket_type in self.ticket_types

    def may_use(self, model: str) -> bool:
        return self.models == "*" or model in self.models


class Tenant(CallerRights):
    name: str
    branch_id: str | None = None
    api_key_sha256: tuple[str, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _hex_digests(self) -> Tenant:
        for i, digest in enumerate(self.api_key_sha256):
            if not SHA256_HEX.match(digest):
                # Never the value: a key pasted here by mistake would end up in a log.
                raise ValueError(
                    f"api_key_sha256 entry {i} is not a SHA-256 digest (64 lowercase hex characters): "
                    "write the digest of the key, never the key itself"
                )
        return self


class Requests(_Strict):
    default_max_tokens: int = Field(512, ge=1)  # cost of a request without max_tokens
    max_model_len: int = Field(16384, ge=1)
    context_reserve: float = Field(0.2, ge=0, lt=1)  # usable context = max_model_len x (1 - reserve)


class Probes(_Strict):
    interval_s: float = Field(1.0, gt=0)
    stale_after_s: float = Field(5.0, gt=0)
    timeout_s: float = Field(1.0, gt=0)
    nvml: Annotated[Literal["auto", "off"], RestartOnly("NVML is opened (or not) at start")] = "auto"
    kv_bytes_per_token: int = Field(131072, ge=1)  # for the NVML dynamic batch


class Limits(_Strict):
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    max_message_timeout_s: float = Field(300.0, gt=0)


class RetryAfter(_Strict):
    """`retry-after` seconds: at least these, or the time the pool needs to drain its line at
    the measured rate, at most `max`; spread by +/- `jitter` so refused clients do not return
    in the same second."""

    overloaded: int = Field(2, ge=0)
    wait_expired: int = Field(5, ge=0)
    draining: int = Field(1, ge=0)
    unavailable: int = Field(5, ge=0)  # no healthy pool for the request
    max: int = Field(60, ge=1)
    jitter: float = Field(0.5, ge=0, lt=1)


class RedisSettings(_Strict):
    """The shared queue. Without `url` or `sentinels` each replica keeps its own in-process queue."""

    url: str | None = None  # with sentinels: only the database and credentials are read from it
    cluster: bool = False
    sentinels: list[Annotated[str, Field(pattern=r"^[^\s:]+:\d{1,5}$")]] = []  # "host:port" of each sentinel
    sentinel_master: str = "extproc"  # the name the sentinels monitor
    key_prefix: str = Field("extproc", pattern=r"^[A-Za-z0-9_.\-]+$")
    op_timeout_s: float = Field(0.25, gt=0)  # every Redis call; keep well under Envoy's message_timeout
    lease_s: float = Field(10.0, gt=0)  # an admitted request's lease, renewed every lease_s / 3
    on_failure: Literal["local", "open", "closed"] = "local"
    # In `local` mode each replica takes 1 / `replicas` of each pool's capacity (none: as many as
    # Redis counted live before it failed), or `local_share` of it when that is set.
    replicas: int | None = Field(None, ge=1)
    local_share: float | None = Field(None, gt=0, le=1)
    recheck_s: float = Field(1.0, gt=0)  # how often a degraded replica tries Redis again

    @property
    def shared(self) -> bool:
        return self.url is not None or bool(self.sentinels)

    @model_validator(mode="after")
    def _one_topology(self) -> RedisSettings:
        if self.cluster and self.sentinels:
            raise ValueError("redis.cluster and redis.sentinels exclude each other")
        return self


class QueueSettings(_Strict):
    # aging: waited this long, served next
    promote_after_s: Annotated[float | None, RestartOnly("the queue lines take it at start")] = Field(None, gt=0)
    # POSTed a JSON signal when a pool turns yellow
    scale_out_webhook: Annotated[str | None, RestartOnly("the scale-out webhook client is created at start")] = None
    scale_out_every_s: float = Field(60, gt=0)  # at most one signal per pool this often, all replicas
    engine_priority: bool = False  # write the priority into the body (vLLM --scheduling-policy priority)
    # A request turned away gets an appointment and keeps its place when it comes back
    # (core/appointments.py); off: a retry-after of the drain time, and no place kept.
    appointments: bool = True
    # A request whose forecast wait is longer than it may wait is turned away at arrival; off:
    # it waits until its wait runs out.
    decide_at_arrival: bool = True


class Retries(_Strict):
    """Client retries: a request whose `idempotency-key` or `x-request-id` was seen within
    `window_s` is a retry of it; so is one with `x-stainless-retry-count` above 0."""

    window_s: Annotated[float, RestartOnly("the attempt ledger takes it at start")] = Field(300.0, gt=0)
    # attempts per key within the window
    max_attempts: Annotated[int, RestartOnly("the attempt ledger takes it at start")] = Field(3, ge=1)
    budget_ratio: float = Field(0.2, ge=0)  # a branch's retries <= ratio x its first attempts...
    budget_min: int = Field(10, ge=0)  # ...or this many, whichever is more...
    budget_window_s: float = Field(10.0, gt=0)  # ...within this window
    failover: bool = True  # a primary attempt that failed before its response started is retried once on the fallback


class RelaySettings(_Strict):
    """Envoy's relay listener: requests the sidecar itself sends (failover attempts, shadow
    copies), already admitted, so the listener has no ext_proc filter. Keep it on loopback."""

    url: str | None = "http://127.0.0.1:10001"
    timeout_s: float = Field(300.0, gt=0)


class Canary(_Strict):
    """Branches whose id ends in one of `digits` go to `pool` instead of the pool `of` (default:
    the default pool), for the models that pool serves.
    `order` is the rollout: advancing a batch adds its next digit, rolling back removes the
    last. If the canary pool's breaker opens or reroutes, every digit is rolled back."""

    pool: str | None = None
    of: str | None = None
    digits: Annotated[tuple[Annotated[str, Field(pattern=r"^[0-9]$")], ...], RestartOnly(
        "the starting batch, taken at start where no replica stored the canary's state yet; at run time the "
        "batch moves with `extproc admin canary advance|rollback`")] = ()
    order: str = Field("0123456789", pattern=r"^[0-9]{1,10}$")

    @model_validator(mode="after")
    def _digits_in_order(self) -> Canary:
        if len(set(self.order)) != len(self.order):
            raise ValueError("order must not repeat a digit")
        for digit in self.digits:
            if digit not in self.order:
                raise ValueError(f"digit {digit!r} is not in order {self.order!r}")
        return self


class Shadow(_Strict):
    """A share of the default pool's admitted requests is copied to `pool` (default: its
    fallback) to keep it warm and compare the two; copies run only in free capacity."""

    share: float = Field(0.0, ge=0, le=1)  # a runtime setting: `extproc admin shadow SHARE`
    pool: str | None = None
    max_share: float = Field(0.25, gt=0, le=1)  # of the shadow pool's slots, at most


class Alerts(_Strict):
    webhook: str | None = None  # POSTed JSON on a deep breaker page and a canary rollback


class LogSettings(_Strict):
    """The sidecar's own logs (docs/logs.md)."""

    decisions: bool = True  # one JSON line per decision on the `extproc.decisions` logger, at INFO


class Config(_Strict):
    listen: Annotated[Listen, RestartOnly("the ext_proc, health and metrics sockets are bound at start")] = Listen()
    classes: Annotated[dict[str, ClassPolicy], FixedEntries(
        "the set of classes is fixed at start (requests in line hold their class)")] = Field(min_length=1)
    default_class: str
    priority: PriorityFactors = PriorityFactors()
    auth: Literal["optional", "required"] = "optional"
    # Callers without a known key. Not given: the class served last, no boosts (a client that
    # drops its key must not gain what its tenant may not claim).
    anonymous: CallerRights = None  # type: ignore[assignment]  # set by _consistent
    tenants: tuple[Tenant, ...] = ()
    pools: Annotated[dict[str, Pool], FixedEntries(
        "the set of pools is fixed at start (queue lines, breakers, metrics per pool)")] = Field(min_length=1)
    default_pool: str
    limits: Limits = Limits()
    requests: Requests = Requests()
    probes: Probes = Probes()
    discovery: DiscoverySettings = DiscoverySettings()  # how dns:// backends are resolved
    engine_drain: EngineDrainSettings = EngineDrainSettings()  # engines drained, or gone from a pool
    redis: Annotated[RedisSettings, RestartOnly("the queue and control stores connect at start")] = RedisSettings()
    queue: QueueSettings = QueueSettings()
    retry_after_s: RetryAfter = RetryAfter()
    retries: Retries = Retries()
    relay: Annotated[RelaySettings, RestartOnly("the relay client is created at start")] = RelaySettings()
    canary: Canary = Canary()
    shadow: Shadow = Shadow()
    alerts: Annotated[Alerts, RestartOnly("the pager client is created at start")] = Alerts()
    admin: Annotated[Admin, RestartOnly("the admin API's socket and token guard are set up at start")] = Admin()
    logging: LogSettings = LogSettings()
    drain_timeout_s: float = Field(30.0, ge=0)

    @functools.cached_property  # (read on every request: a plain attribute once built)
    def model_pools(self) -> dict[str, str]:
        """Each model a pool lists in `served_models` -> that pool, in the configuration's order
        (empty: no pool lists any, and requests go to the default pool whatever their model)."""
        return {model: name for name, pool in self.pools.items() for model in pool.served_models or ()}

    def pool_serving(self, model: str | None) -> str | None:
        """The pool a request for `model` goes to: the one that serves it; the default pool where
        no pool lists its models (None: no pool serves it)."""
        served = self.model_pools
        if not served:
            return self.default_pool
        return None if model is None else served.get(model)

    @property
    def canary_of(self) -> str:
        """The pool whose branches in the canary go to the canary pool."""
        return self.canary.of or self.default_pool

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        # names are keys of the dotted change record a reload logs (classes.NAME.max_wait_s)
        for section, names in (("class", self.classes), ("pool", self.pools)):
            for name in names:
                if not re.match(r"^[A-Za-z][A-Za-z0-9_\-]*$", name):
                    raise ValueError(f"{section} name {name!r} must start with a letter and hold only letters, "
                                     "digits, '_', '-'")
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of classes")
        if self.default_pool not in self.pools:
            raise ValueError(f"default_pool {self.default_pool!r} is not one of pools")
        for name, pool in self.pools.items():
            if pool.fallback is not None and pool.fallback not in self.pools:
                raise ValueError(f"pools.{name}.fallback {pool.fallback!r} is not one of pools")
            if pool.fallback == name:
                raise ValueError(f"pools.{name}.fallback names the pool itself")
            if pool.long_pool is not None and pool.long_pool not in self.pools:
                raise ValueError(f"pools.{name}.long_pool {pool.long_pool!r} is not one of pools")
            if pool.long_pool == name:
                raise ValueError(f"pools.{name}.long_pool names the pool itself")
        for key, target in (("canary.pool", self.canary.pool), ("canary.of", self.canary.of),
                            ("shadow.pool", self.shadow.pool)):
            if target is not None and target not in self.pools:
                raise ValueError(f"{key} {target!r} is not one of pools")
        if self.canary.pool == self.default_pool:
            raise ValueError("canary.pool must not be the default pool")
        if self.canary.pool is not None and self.canary.pool == self.canary_of:
            raise ValueError("canary.pool must not be the pool it is the canary of (canary.of)")
        self._by_model()
        if self.shadow.pool == self.default_pool:
            raise ValueError("shadow.pool must not be the default pool")
        clusters = [pool.cluster for pool in self.pools.values()]
        if len(set(clusters)) != len(clusters):
            raise ValueError("two pools name the same cluster")
        seen_digests: set[str] = set()
        for i, tenant in enumerate(self.tenants):
            if tenant.ticket_types != "*":
                for ticket_type in tenant.ticket_types:
                    if ticket_type not in self.classes:
                        raise ValueError(
                            f"tenants.{i}.ticket_types: {ticket_type!r} is not one of classes"
                        )
            for digest in tenant.api_key_sha256:
                if digest in seen_digests:
                    raise ValueError(f"tenants.{i}.api_key_sha256: key listed twice")
                seen_digests.add(digest)
            self._check_models(f"tenants.{i}.models", tenant)
        if self.anonymous is None or "ticket_types" not in self.anonymous.model_fields_set:
            # (also for a block that sets only the boosts: "*" is said, never assumed)
            served_last = max(self.classes, key=lambda name: self.classes[name].base)
            rights = {} if self.anonymous is None else self.anonymous.model_dump(exclude={"ticket_types"})
            object.__setattr__(self, "anonymous", CallerRights(ticket_types=(served_last,), **rights))
        if self.anonymous.ticket_types != "*":
            for ticket_type in self.anonymous.ticket_types:
                if ticket_type not in self.classes:
                    raise ValueError(f"anonymous.ticket_types: {ticket_type!r} is not one of classes")
        self._check_models("anonymous.models", self.anonymous)
        bases = sorted({c.base for c in self.classes.values()})
        gaps = [b - a for a, b in zip(bases, bases[1:], strict=False)]
        if gaps and 2 * self.priority.max_adjustment >= min(gaps):
            raise ValueError(
                "priority.max_adjustment must be below half the smallest gap between class "
                f"bases ({min(gaps)}), or a boost could cross a class boundary"
            )
        return self

    def _by_model(self) -> None:
        """Each model is served by one pool; where pools list theirs, the default pool serves
        some, and so does the pool a canary is of."""
        served: dict[str, str] = {}
        for name, pool in self.pools.items():
            for model in pool.served_models or ():
                if model in served:
                    raise ValueError(f"model {model!r} is in the served_models of two pools, {served[model]} and "
                                     f"{name}: each model is served by one pool (its fallback pairs it: "
                                     "pools.NAME.models)")
                served[model] = name
        if not served and self.canary.of not in (None, self.default_pool):
            raise ValueError("canary.of names another pool than the default while no pool lists served_models: "
                             "every request goes to the default pool, so that canary would take none")
        if served:
            for key, name in (("default_pool", self.default_pool), ("canary.of", self.canary_of)):
                if self.pools[name].served_models is None and (key == "default_pool" or self.canary.pool):
                    raise ValueError(f"{key} {name!r} lists no served_models, while pools "
                                     f"{', '.join(sorted(set(served.values())))} do: requests go by model, "
                                     "so it would serve none")

    def _check_models(self, key: str, rights: CallerRights) -> None:
        if rights.models == "*":
            return
        if not self.model_pools:
            raise ValueError(f"{key}: a list of models needs pools that list their served_models")
        for model in rights.models:
            if model not in self.model_pools:
                raise ValueError(f"{key}: {model!r} is in no pool's served_models")


class ConfigError(Exception):
    """A configuration that cannot be used; the message names the key."""


def _format_validation_error(source: str, error: ValidationError) -> str:
    lines = [f"{source}: invalid configuration"]
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "config") -> Config:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys")
    try:
        return Config.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(source, error)) from None


def default_config_text() -> str:
    return resources.files("extproc.core").joinpath("default_config.yaml").read_text("utf-8")


def load_config(path: str | Path | None = None) -> Config:
    """Load and validate `path`, or the embedded defaults when `path` is None."""
    if path is None:
        return parse_config(yaml.safe_load(default_config_text()), "default_config.yaml")
    source = str(path)
    try:
        text = Path(path).read_text("utf-8")
    except OSError as error:
        raise ConfigError(f"{source}: cannot read: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from None
    return parse_config(data, source)
