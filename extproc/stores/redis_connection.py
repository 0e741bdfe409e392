"""Where a Redis store lives and how it is reached: a URL, a Cluster, or the master Sentinel
names; every client made here bounds each call, so nothing hangs on a stopped Redis, and sends
each call once: the client library's own retries (on by default) would send a script again
after a lost connection or a timeout, when Redis may have run it already. A failed call is the
stores' to handle (stores/degradable_queue.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.connection import parse_url


@dataclass(frozen=True)
class RedisAddress:
    """A Redis URL, a Cluster (any node's URL), or the master that Sentinel names (`url` then
    only gives the database and credentials)."""

    url: str | None = None
    cluster: bool = False
    sentinels: tuple[tuple[str, int], ...] = ()
    sentinel_master: str = "extproc"

    def connect(self, timeout_s: float, blocking: bool = False):
        """A client whose every call is bounded (a blocking one waits its BLPOP timeout more)."""
        socket_timeout = timeout_s + 2.0 if blocking else timeout_s
        options = dict(socket_timeout=socket_timeout, socket_connect_timeout=timeout_s, decode_responses=True,
                       retry=Retry(NoBackoff(), 0))
        if self.sentinels:
            # Asks the sentinels for the master on every new connection, so a failover is
            # followed once the old master's connections fail.
            from_url = parse_url(self.url) if self.url else {}
            credentials = {k: v for k, v in from_url.items() if k in ("db", "username", "password")}
            sentinel = Sentinel(
                list(self.sentinels), sentinel_kwargs=dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            )
            return sentinel.master_for(self.sentinel_master, retry_on_timeout=False, **credentials, **options)
        if self.url is None:
            raise ValueError("a Redis address needs a url or sentinels")
        if self.cluster:
            return RedisCluster.from_url(self.url, **options)
        return aioredis.from_url(self.url, retry_on_timeout=False, **options)


async def close_quietly(client) -> None:
    """Close a client, whatever state it (or Redis) is in."""
    try:
        await asyncio.wait_for(client.aclose(), 1)
    except (Exception, asyncio.CancelledError):
        pass


async def drop_idle_connections(client) -> None:
    """Close the pooled connections no call is using. Once Redis has gone away (or restarted),
    each of them is dead, and a client made here never retries, so the first call on one would
    fail even after Redis is back. The next calls open new ones. (A Cluster client keeps a pool
    per node and finds dead ones itself.)"""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        await pool.disconnect(inuse_connections=False)


def default_replica_id() -> str:
    """This replica's name in the shared store: unique across hosts and restarts."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
