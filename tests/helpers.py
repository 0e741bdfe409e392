"""Shared helpers for the tests: reading Prometheus text, waiting for conditions, bodies."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from extproc_testbed.stack import http_get, metric_sum, parse_samples


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    status, text = http_get(url)
    assert status == 200, f"{url} answered {status}"
    return parse_samples(text)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none)."""
    return metric_sum(scrape(url), name, **labels)


def sim_crashes(sim_url: str) -> int:
    """Simulated OOM crashes of a simulated backend (readable while it is down, unlike /metrics)."""
    status, text = http_get(f"{sim_url}/sim/stats")
    assert status == 200, f"{sim_url}/sim/stats answered {status}"
    return json.loads(text)["crashes"]


def json_lines(path: Path) -> list[dict]:
    """The JSON objects among a process's output lines (its other log lines are skipped); only
    the lines ended: the process may still be writing the last one."""
    text = path.read_text("utf-8", "replace")
    whole = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in whole.splitlines() if line.startswith("{")]


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def async_wait_until(predicate: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def chat(content: str = "hello", model: str = "deepseek-sim", **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": content}], **extra}).encode()


@contextlib.asynccontextmanager
async def webhook_receiver(fail_first: int = 0) -> AsyncIterator[tuple[str, list[dict]]]:
    """A real HTTP endpoint on loopback: its URL, and the JSON bodies POSTed to it so far (it
    answers the first `fail_first` posts 503, taking nothing, as a pager that is down would)."""
    received: list[dict] = []
    refused = [0]

    async def hook(request: web.Request) -> web.Response:
        if refused[0] < fail_first:
            refused[0] += 1
            return web.Response(status=503)
        received.append(await request.json())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/scale", hook)
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}/scale", received


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """`app` served on a free loopback port for the block: the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()


def sidecar_from_file(path: Path, config: dict[str, Any]):
    """A sidecar server, not started, reading `config` from the file `path` (written here): a
    reload reads that file again."""
    import yaml

    from extproc.ops.reload import ConfigSource
    from extproc.server import SidecarServer

    path.write_text(yaml.safe_dump(config))
    source = ConfigSource(str(path))
    return SidecarServer(source.load(), source=source)
