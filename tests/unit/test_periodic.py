"""The control loops' shared shape (control/periodic.py), on a stepped sleep: a step every
interval, read again before each wait; a step that raises is logged and the next one comes."""

from __future__ import annotations

import asyncio

from extproc.control.periodic import Periodic


async def test_a_failing_step_is_logged_and_the_loop_goes_on_at_the_interval_in_force(caplog):
    waits: list[float] = []
    steps: list[int] = []
    interval = [1.0]

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)

    def step() -> None:  # a plain function, as the drains' is
        steps.append(len(steps))
        interval[0] = 2.0  # a reload changed it
        if len(steps) == 1:
            raise RuntimeError("first step broke")

    loop = Periodic(step, lambda: interval[0], "the step failed", sleep)
    loop.start()
    for _ in range(10):
        await asyncio.sleep(0)
    loop.stop()
    await asyncio.sleep(0)
    assert len(steps) >= 3 and waits[:3] == [1.0, 2.0, 2.0]
    assert "the step failed" in caplog.text and "first step broke" in caplog.text


async def test_a_coroutine_step_is_awaited_and_stop_ends_the_loop():
    steps = []

    async def step() -> None:
        steps.append(1)

    loop = Periodic(step, lambda: 0.0, "failed")
    loop.start()
    while len(steps) < 2:
        await asyncio.sleep(0)
    loop.stop()
    await asyncio.sleep(0)
    seen = len(steps)
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(steps) == seen
