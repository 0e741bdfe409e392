"""The burst scenario's traffic and the client that sends it: the seed's mix of tickets (classes,
claims, prompt sizes), the offered load's phases (steady, burst, recovery), and clients that retry
like real ones (on 429, 503, 5xx or a reset, after `retry-after-ms` or `retry-after`, else 1, 2 s
with jitter, at most three attempts, one idempotency-key per request; never after
`x-should-retry: false`). Imports nothing else of the testbed: the
benchmark, its report and bench/locustfile.py share it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

CLASSES = ("loan_approval", "complaint", "archive_query")
SLO_CLASS, SLO_P99_S = "loan_approval", 2.0
# When each class's client must have its answer, retries included (the sidecar's shipped
# `deadline_s`): what attainment counts, for both setups alike.
DEADLINES_S = {"loan_approval": 2.0, "complaint": 30.0, "archive_query": 120.0}
# The load's clients claim their class without an API key (200 branches, not a tenant each):
# the testbed's sidecars let a caller without a key claim any class, with no boosts. The shipped
# defaults do not (a caller without a key gets the class served last).
ANONYMOUS_RIGHTS = {"ticket_types": "*"}


@dataclass(frozen=True)
class Traffic:
    """The offered load, in unscaled seconds and requests per unscaled second."""

    branches: int = 200
    steady_rps: float = 14.0
    burst_rps: float = 60.0
    steady_s: float = 30.0
    burst_s: float = 30.0
    recovery_s: float = 40.0
    long_share: float = 0.005  # 8.5k-12.8k tokens: one ticket in two hundred
    medium_share: float = 0.045  # 1k-4k tokens
    long_tokens: tuple[int, int] = (8500, 12800)
    long_classes: tuple[str, ...] = CLASSES  # the classes whose tickets may be medium or long
    seed: int = 7

    @classmethod
    def small_pool(cls) -> Traffic:
        """A platform team's first try on two engines: a 4x burst, and 5 % long prompts (4k-12k
        tokens) among complaints and archive queries."""
        return cls(steady_rps=4.0, burst_rps=16.0, long_share=0.05, medium_share=0.0, long_tokens=(4000, 12000),
                   long_classes=("complaint", "archive_query"))

    @property
    def duration_s(self) -> float:
        return self.steady_s + self.burst_s + self.recovery_s

    def rate_at(self, t: float) -> float:
        return self.burst_rps if self.steady_s <= t < self.steady_s + self.burst_s else self.steady_rps

    def phase_at(self, t: float) -> str:
        if t < self.steady_s:
            return "steady"
        return "burst" if t < self.steady_s + self.burst_s else "recovery"

    def scaled(self, factor: float) -> Traffic:
        """The same shape, `factor` times shorter (for a smoke run)."""
        return dataclasses.replace(self, steady_s=self.steady_s * factor, burst_s=self.burst_s * factor,
                                   recovery_s=self.recovery_s * factor)


def ticket(rng: random.Random, traffic: Traffic) -> dict:
    """One ticket of the seed's mix: its class, claims, prompt size and output budget."""
    class_name = rng.choices(CLASSES, (20, 30, 50))[0]
    headers = {"x-ticket-type": class_name, "x-branch-id": f"{rng.randrange(traffic.branches):04d}"}
    if class_name == "loan_approval":
        headers["x-urgent-level"] = str(rng.choice((0, 0, 1, 2, 3)))
    elif class_name == "complaint":
        headers["x-vip-level"] = str(rng.choice((0, 0, 1, 2)))
    elif rng.random() < 1 / 3:
        headers["x-bulk"] = "true"
    draw = rng.random() if class_name in traffic.long_classes else 1.0
    long = draw < traffic.long_share
    if long:  # the tail, up to the usable context (16k x 0.8 minus the answer)
        prompt_tokens = rng.randint(*traffic.long_tokens)
    elif draw < traffic.long_share + traffic.medium_share:
        prompt_tokens = rng.randint(1000, 4000)
    else:
        prompt_tokens = max(50, int(rng.lognormvariate(math.log(480), 0.35)))
    max_tokens = 256 if long else 64
    body = {"model": "deepseek-sim", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "x" * (4 * prompt_tokens)}]}  # 1/4 token per Latin character
    return {"class": class_name, "headers": headers, "body": body, "long": long}


@dataclass
class Outcome:
    """One logical request: every attempt, and how it ended."""

    class_name: str
    sent_at: float  # unscaled seconds since the start
    long: bool
    attempts: list[tuple[float, int | str]] = field(default_factory=list)  # (unscaled time, status or error)
    ok: bool = False
    latency_s: float | None = None  # unscaled, first attempt to answer
    queue_wait_s: float | None = None
    forecast_wait_s: float | None = None  # the sidecar's forecast of that wait, made at arrival
    completion_tokens: int = 0

    @property
    def in_time(self) -> bool:
        """Answered within its class's deadline, counted from its first attempt."""
        return self.ok and self.latency_s is not None and self.latency_s <= DEADLINES_S[self.class_name]


class Client:
    """Sends the tickets, retrying like an application does."""

    def __init__(self, url: str, time_scale: float, session: aiohttp.ClientSession, started: float):
        self.url = f"{url}/v1/chat/completions"
        self.scale = time_scale
        self.session = session
        self.started = started
        self.timeout_s = 120.0  # unscaled, per attempt

    def now(self) -> float:
        return (time.monotonic() - self.started) / self.scale

    async def send(self, item: dict, rng: random.Random) -> Outcome:
        outcome = Outcome(item["class"], self.now(), item["long"])
        headers = {"content-type": "application/json", "idempotency-key": uuid.uuid4().hex, **item["headers"]}
        for attempt in range(3):
            status: int | str
            retry_after = retry_after_ms = None
            final = False
            try:
                async with asyncio.timeout(self.timeout_s * self.scale):
                    async with self.session.post(self.url, json=item["body"], headers=headers) as response:
                        payload = await response.read()
                        status = response.status
                        retry_after = response.headers.get("retry-after")
                        retry_after_ms = response.headers.get("retry-after-ms")
                        final = response.headers.get("x-should-retry") == "false"
                        if status == 200:
                            outcome.ok = True
                            outcome.latency_s = self.now() - outcome.sent_at
                            wait = response.headers.get("x-queue-wait-ms")
                            outcome.queue_wait_s = int(wait) / 1000 / self.scale if wait and wait.isdigit() else None
                            forecast = response.headers.get("x-queue-wait-predicted-ms")
                            outcome.forecast_wait_s = (int(forecast) / 1000 / self.scale
                                                       if forecast and forecast.isdigit() else None)
                            try:
                                outcome.completion_tokens = json.loads(payload)["usage"]["completion_tokens"]
                            except (ValueError, KeyError, TypeError):
                                pass
            except (aiohttp.ClientError, TimeoutError) as error:
                status = type(error).__name__
            outcome.attempts.append((self.now(), status))
            if outcome.ok or final or (isinstance(status, int) and 400 <= status < 500 and status not in (409, 429)):
                break
            if attempt == 2:
                break
            if retry_after_ms and retry_after_ms.isdigit():  # as the OpenAI SDKs do: milliseconds first
                await asyncio.sleep(int(retry_after_ms) / 1000)
            elif retry_after and retry_after.replace(".", "", 1).isdigit():
                await asyncio.sleep(float(retry_after))  # the sidecar's clock: already scaled
            else:
                await asyncio.sleep((1.0, 2.0)[attempt] * rng.uniform(0.5, 1.5) * self.scale)
        return outcome


async def drive(url: str, traffic: Traffic, time_scale: float, on_progress) -> list[Outcome]:
    rng = random.Random(traffic.seed)
    started = time.monotonic()
    tasks: list[asyncio.Task] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = Client(url, time_scale, session, started)
        t = 0.0
        last_report = 0.0
        while t < traffic.duration_s:
            t += rng.expovariate(traffic.rate_at(t))
            delay = started + t * time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(client.send(ticket(rng, traffic), random.Random(rng.random()))))
            if t - last_report >= 10:
                last_report = t
                on_progress(traffic.phase_at(t), t, len(tasks))
        return await asyncio.gather(*tasks)
