"""The scale-out signal: a JSON POST to a webhook when a pool's queue turns yellow.

Every replica sees the shared queue turn yellow; the first to claim the signal in the queue
store posts it, so the webhook hears once per pool per `queue.scale_out_every_s`, however
many replicas there are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import aiohttp

from .admission import Tier

log = logging.getLogger("extproc")


class ScaleOutWebhook:
    def __init__(self, url: str, replica: str, claim: Callable[[str], Awaitable[bool]], timeout_s: float = 2.0):
        self.url = url
        self.replica = replica
        self._claim = claim  # pool -> whether this replica is the one to signal now
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Task] = set()

    def tier_changed(self, pool: str, old: Tier, new: Tier, depth: int) -> None:
        """Signal when the pool leaves green for yellow or worse."""
        if old is Tier.GREEN and new >= Tier.YELLOW:
            task = asyncio.get_running_loop().create_task(self._post(pool, new, depth))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _post(self, pool: str, tier: Tier, depth: int) -> None:
        payload = {
            "event": "scale_out",
            "pool": pool,
            "tier": tier.name.lower(),
            "queue_depth": depth,
            "replica": self.replica,
            "at": datetime.now(UTC).isoformat(),
        }
        try:
            if not await self._claim(pool):
                log.info("scale-out signal for pool %s already sent", pool)
                return
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=self.timeout)
            async with self._session.post(self.url, json=payload) as response:
                if response.status >= 300:
                    log.warning("scale-out webhook answered %d", response.status)
        except Exception as error:  # a webhook or store failure never reaches a request
            log.warning("scale-out signal failed: %s", error or type(error).__name__)

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=2)
        if self._session is not None:
            await self._session.close()
