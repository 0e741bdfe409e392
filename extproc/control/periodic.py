"""A background task that runs one step of a control loop every interval, until stopped: the
shape every loop of the sidecar's control level shares (the capacity model, engine discovery,
the drains). A step that raises is logged and the next one comes on time; a cancellation ends
the loop."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("extproc")


class Periodic:
    def __init__(self, step: Callable[[], Any], interval_s: Callable[[], float], failed: str,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        self._step = step  # a function or a coroutine function
        self._interval_s = interval_s  # read before each wait: a reload may change it
        self._failed = failed  # what the log says when a step raises
        self._sleep = sleep
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await self._sleep(self._interval_s())
            try:
                done = self._step()
                if inspect.isawaitable(done):
                    await done
            except Exception:  # (a cancellation is no Exception: it ends the loop)
                log.exception(self._failed)
