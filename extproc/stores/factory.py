"""The stores a configuration asks for, built in one place: the queue store (in-process, or
Redis first with the in-process store for when Redis fails) and the control store."""

from __future__ import annotations

from collections.abc import Callable

from ..core.capacity import long_lane_share
from ..core.config import Config
from .control import ControlStore, LocalControlStore
from .degradable_queue import DegradableQueueStore
from .local_queue import LocalQueueStore
from .queue import PoolSnapshot, QueueStore
from .redis_connection import RedisAddress
from .redis_control import RedisControlStore
from .redis_queue import RedisQueueStore


def redis_address(config: Config) -> RedisAddress:
    settings = config.redis
    return RedisAddress(
        settings.url, settings.cluster,
        tuple((host, int(port)) for host, port in (s.rsplit(":", 1) for s in settings.sentinels)),
        settings.sentinel_master,
    )


def build_control_store(config: Config) -> ControlStore:
    """Breaker state, canary, shadow share and named attempts: in Redis when the queue is."""
    if not config.redis.shared:
        return LocalControlStore(config.retries, lease_s=config.redis.lease_s)
    levels = {
        name: {level: (getattr(pool.breaker, level).window_s / getattr(pool.breaker, level).buckets,
                       getattr(pool.breaker, level).buckets) for level in ("instant", "sustained", "deep")}
        for name, pool in config.pools.items()
    }
    return RedisControlStore(redis_address(config), list(config.pools), levels, config.retries,
                             config.redis.key_prefix, config.redis.op_timeout_s, config.redis.lease_s)


def build_queue_store(config: Config, on_change: Callable[[str, PoolSnapshot], None],
                      on_mode_change: Callable[[bool], None]) -> QueueStore:
    """The in-process store, or Redis first with the in-process store for when it fails."""
    shares = {name: long_lane_share(pool.capacity) for name, pool in config.pools.items()}
    promote = config.queue.promote_after_s
    settings = config.redis
    degradable: DegradableQueueStore | None = None

    def local_changed(pool: str, snapshot: PoolSnapshot) -> None:
        # With Redis answering, the shared line is the pool's state; the in-process line (idle,
        # its limits still set at every tick) speaks only while it is the one in use.
        if degradable is None or degradable.degraded:
            on_change(pool, snapshot)

    local = LocalQueueStore(  # (with Redis, the degradable store gives it this replica's share as it starts)
        {name: pool.max_inflight for name, pool in config.pools.items()},
        on_change=local_changed if settings.shared else on_change, long_share=shares, promote_after_s=promote,
    )
    if not settings.shared:
        return local

    def redis_failed(error: BaseException) -> None:  # a background call of the Redis store failed
        if degradable is not None:
            degradable.trip(error)

    shared = RedisQueueStore(
        redis_address(config),
        {name: pool.max_inflight for name, pool in config.pools.items()},
        key_prefix=settings.key_prefix,
        lease_s=settings.lease_s,
        op_timeout_s=settings.op_timeout_s,
        max_wait_s=max(c.max_wait_s for c in config.classes.values()),
        long_share=shares,
        promote_after_s=promote,
        on_change=on_change,
        on_error=redis_failed,
    )
    degradable = DegradableQueueStore(shared, local, settings.on_failure, settings.local_share, settings.recheck_s,
                                      config.retry_after_s.overloaded, on_mode_change, replicas=settings.replicas)
    return degradable
