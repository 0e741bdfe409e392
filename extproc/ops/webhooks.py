"""Signals to the outside, as JSON POSTs to webhooks: the scale-out signal when a pool's queue
turns yellow, and alerts for people (a deep breaker level, a canary rolled back).

Every replica sees the same shared state change; the one that claims the signal in the shared
store (or wins the state change) posts it, so a webhook hears each event once, however many
replicas there are. A failing webhook never reaches a request: it is logged and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp

from ..core.admission import Tier
from ..core.events import TierChanged

log = logging.getLogger("extproc")


class JsonPoster:
    """Posts JSON in the background. A post that must reach a person (`keep_trying`) is sent
    again, after 1, 2, 4 ... seconds (at most `max_backoff_s`), until the webhook takes it or it
    is no longer wanted (the level it reports was reset); `close` waits briefly for what is
    still on its way, then gives up on it."""

    def __init__(self, url: str, what: str, timeout_s: float = 2.0, max_backoff_s: float = 60.0):
        self.url = url
        self.what = what
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_backoff_s = max_backoff_s
        self._session: aiohttp.ClientSession | None = None
        self._pending: set[asyncio.Task] = set()

    def post(self, payload: dict[str, Any], claim: Callable[[], Awaitable[bool]] | None = None,
             keep_trying: Callable[[], bool] | None = None) -> None:
        """Send `payload` unless `claim` says another replica sends it; while `keep_trying()`
        holds, until it is delivered."""
        task = asyncio.get_running_loop().create_task(self._post(payload, claim, keep_trying))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _post(self, payload: dict[str, Any], claim, keep_trying) -> None:
        try:
            if claim is not None and not await claim():
                log.info("%s for %s already sent by another replica", self.what, payload.get("pool"))
                return
        except Exception as error:
            log.warning("%s: could not tell whether another replica sends it (%s); sending it", self.what, error)
        delay = 1.0
        while True:
            if await self._send(payload):
                return
            if keep_trying is None or not keep_trying():
                return
            log.warning("%s not delivered; trying again in %g s", self.what, delay)
            await asyncio.sleep(delay)
            if not keep_trying():
                log.info("%s no longer wanted (reset meanwhile): not sent", self.what)
                return
            delay = min(self.max_backoff_s, delay * 2)

    async def _send(self, payload: dict[str, Any]) -> bool:
        try:
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=self.timeout)
            async with self._session.post(self.url, json={**payload, "at": datetime.now(UTC).isoformat()}) as response:
                if response.status >= 300:
                    log.warning("%s webhook answered %d", self.what, response.status)
                    return False
                return True
        except Exception as error:
            log.warning("%s failed: %s", self.what, error or type(error).__name__)
            return False

    async def close(self) -> None:
        if self._pending:
            _, unsent = await asyncio.wait(self._pending, timeout=2)
            for task in unsent:
                task.cancel()
        if self._session is not None:
            await self._session.close()


class ScaleOutWebhook:
    def __init__(self, url: str, replica: str, claim: Callable[[str], Awaitable[bool]], timeout_s: float = 2.0,
                 capacity: Callable[[str], dict | None] = lambda pool: None):
        self.replica = replica
        self._capacity = capacity  # pool -> the capacity model's latest estimate (desired_backends...)
        self._claim = claim  # pool -> whether this replica is the one to signal now
        self._poster = JsonPoster(url, "scale-out signal", timeout_s)

    def tier_changed(self, event: TierChanged) -> None:
        """Signal when the pool leaves green for yellow or worse."""
        pool, old, new, depth = event.pool, event.old, event.new, event.depth
        if old is Tier.GREEN and new >= Tier.YELLOW:
            payload = {"event": "scale_out", "pool": pool, "tier": new.name.lower(), "queue_depth": depth,
                       "replica": self.replica}
            capacity = self._capacity(pool)
            if capacity is not None:
                payload["capacity"] = capacity
                payload["desired_backends"] = capacity["desired_backends"]
            self._poster.post(payload, lambda: self._claim(pool))

    async def close(self) -> None:
        await self._poster.close()
