"""The scale-out signal: a JSON POST to a webhook when a pool's queue turns yellow."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import aiohttp

from .admission import Tier

log = logging.getLogger("extproc")


class ScaleOutWebhook:
    def __init__(self, url: str, replica: str, timeout_s: float = 2.0):
        self.url = url
        self.replica = replica
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Task] = set()

    def tier_changed(self, pool: str, old: Tier, new: Tier, depth: int) -> None:
        """Signal when the pool leaves green for yellow or worse (once per episode)."""
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
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=self.timeout)
            async with self._session.post(self.url, json=payload) as response:
                if response.status >= 300:
                    log.warning("scale-out webhook answered %d", response.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            log.warning("scale-out webhook failed: %s", error or type(error).__name__)

    async def close(self) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=2)
        if self._session is not None:
            await self._session.close()
