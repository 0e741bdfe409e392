"""The burst scenario's traffic and the client that sends it: the seed's mix of tickets (classes,
claims, prompt sizes), the offered load's phases (steady, burst, recovery), and clients that retry
like real ones (on 429, 503, 5xx or a reset, after `retry-after-ms` or `retry-after`, else 1, 2 s
with jitter, at most three attempts, one idempotency-key per request; never after
`x-should-retry: false`), or, for the classes named `impatient`, like a hand-written retry loop
(the same failures retried 50-250 ms later whatever the answer said, up to ten retries). Each
answer's timings are kept: the sidecar's line (`x-queue-wait-ms`) and the simulated engine's
(`x-sim-*`: its line, prefill, decode, steps beside another's prefill, the engine). Imports nothing
else of the testbed: the benchmark, its report and bench/locustfile.py share it."""

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
    mix: tuple[int, int, int] = (20, 30, 50)  # weights of CLASSES
    seed: int = 7
    # every deadline (DEADLINES_S) and the latency SLO multiplied by this: engines slower than the
    # simulated ones (real vLLM-CPU engines: scenario_vllm.py), the same deadlines in their time
    latency_scale: float = 1.0

    @classmethod
    def small_pool(cls) -> Traffic:
        """A platform team's first try on two engines: a 4x burst, and 5 % long prompts (4k-12k
        tokens) among complaints and archive queries."""
        return cls(steady_rps=4.0, burst_rps=16.0, long_share=0.05, medium_share=0.0, long_tokens=(4000, 12000),
                   long_classes=("complaint", "archive_query"))

    @classmethod
    def independent_burst(cls) -> Traffic:
        """A burst nobody tuned for, on two engines: 4 req/s for 30 s, 16 req/s for 40 s, 4 req/s
        for 30 s; 15 % loans, 35 % complaints, 50 % archive queries; 5 % of complaints and archive
        queries with 4k-12k-token prompts."""
        return dataclasses.replace(cls.small_pool(), burst_s=40.0, recovery_s=30.0, mix=(15, 35, 50))

    @property
    def deadlines_s(self) -> dict[str, float]:
        return {name: deadline * self.latency_scale for name, deadline in DEADLINES_S.items()}

    @property
    def slo_p99_s(self) -> float:
        return SLO_P99_S * self.latency_scale

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
    class_name = rng.choices(CLASSES, traffic.mix)[0]
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
    deadline_s: float | None = None  # its class's deadline (None: DEADLINES_S's)
    answered_attempt_at: float | None = None  # unscaled, when the attempt that was answered was sent
    engine: str | None = None  # the simulated engine that answered (its address)
    # the simulated engine's view of the answered attempt (unscaled seconds): its line, prefill,
    # decode, and the part of its steps shared with another request's prefill (of a long prompt)
    engine_queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    beside_prefill_s: float | None = None
    beside_long_prefill_s: float | None = None

    @property
    def in_time(self) -> bool:
        """Answered within its class's deadline, counted from its first attempt."""
        deadline = DEADLINES_S[self.class_name] if self.deadline_s is None else self.deadline_s
        return self.ok and self.latency_s is not None and self.latency_s <= deadline


def in_time_by_class(outcomes: list[Outcome]) -> dict[str, float | None]:
    """Per class, the share answered within its deadline (None: none of that class was sent)."""
    shares = {}
    for name in CLASSES:
        mine = [o for o in outcomes if o.class_name == name]
        shares[name] = round(sum(o.in_time for o in mine) / len(mine), 4) if mine else None
    return shares


# A hand-written retry loop, as many internal clients have: whatever the answer said, the same
# failures again 50-250 ms later, up to ten times. The matrix gives it to these classes' clients
# (loans keep the SDK's).
IMPATIENT_CLASSES = ("complaint", "archive_query")
IMPATIENT_RETRIES = 10
IMPATIENT_PAUSE_S = (0.05, 0.25)


def _ms_as_s(value: str | None, divisor: float = 1.0) -> float | None:
    return int(value) / 1000 / divisor if value and value.isdigit() else None


@dataclass
class Answer:
    """One attempt's answer: its status (or the error that ended it) and what the retry reads."""

    status: int | str
    retry_after: str | None = None
    retry_after_ms: str | None = None
    final: bool = False  # x-should-retry: false

    @property
    def retryable(self) -> bool:
        """Anything but a 4xx, except 409 (the earlier attempt still running) and 429."""
        return not (isinstance(self.status, int) and 400 <= self.status < 500 and self.status not in (409, 429))


class Client:
    """Sends the tickets, retrying like an application does: as the OpenAI SDKs do, or, for the
    `impatient` classes, in a hand-written loop that ignores what the answer says."""

    def __init__(self, url: str, time_scale: float, session: aiohttp.ClientSession, started: float,
                 impatient: frozenset[str] = frozenset(), deadlines: dict[str, float] | None = None):
        self.url = f"{url}/v1/chat/completions"
        self.deadlines = deadlines or DEADLINES_S
        self.scale = time_scale
        self.session = session
        self.started = started
        self.impatient = impatient
        self.timeout_s = 120.0  # unscaled, per attempt

    def now(self) -> float:
        return (time.monotonic() - self.started) / self.scale

    async def send(self, item: dict, rng: random.Random) -> Outcome:
        outcome = Outcome(item["class"], self.now(), item["long"], deadline_s=self.deadlines.get(item["class"]))
        headers = {"content-type": "application/json", "idempotency-key": uuid.uuid4().hex, **item["headers"]}
        if item["class"] in self.impatient:
            for _ in range(1 + IMPATIENT_RETRIES):
                answer = await self._attempt(item, headers, outcome)
                if outcome.ok or not answer.retryable:
                    break
                await asyncio.sleep(rng.uniform(*IMPATIENT_PAUSE_S) * self.scale)
            return outcome
        for attempt in range(3):
            answer = await self._attempt(item, headers, outcome)
            if outcome.ok or answer.final or not answer.retryable or attempt == 2:
                break
            if answer.retry_after_ms and answer.retry_after_ms.isdigit():  # as the OpenAI SDKs do: milliseconds first
                await asyncio.sleep(int(answer.retry_after_ms) / 1000)
            elif answer.retry_after and answer.retry_after.replace(".", "", 1).isdigit():
                await asyncio.sleep(float(answer.retry_after))  # the sidecar's clock: already scaled
            else:
                await asyncio.sleep((1.0, 2.0)[attempt] * rng.uniform(0.5, 1.5) * self.scale)
        return outcome

    async def _attempt(self, item: dict, headers: dict[str, str], outcome: Outcome) -> Answer:
        """One attempt, recorded in `outcome` (and, answered, its latency and timings)."""
        sent_at = self.now()
        try:
            async with asyncio.timeout(self.timeout_s * self.scale):
                async with self.session.post(self.url, json=item["body"], headers=headers) as response:
                    payload = await response.read()
                    answer = Answer(response.status, response.headers.get("retry-after"),
                                    response.headers.get("retry-after-ms"),
                                    response.headers.get("x-should-retry") == "false")
                    if response.status == 200:
                        self._answered(outcome, response.headers, payload, sent_at)
        except (aiohttp.ClientError, TimeoutError) as error:
            answer = Answer(type(error).__name__)
        outcome.attempts.append((self.now(), answer.status))
        return answer

    def _answered(self, outcome: Outcome, headers, payload: bytes, sent_at: float) -> None:
        outcome.ok = True
        outcome.latency_s = self.now() - outcome.sent_at
        outcome.answered_attempt_at = sent_at
        outcome.queue_wait_s = _ms_as_s(headers.get("x-queue-wait-ms"), self.scale)  # the sidecar's: scaled
        outcome.forecast_wait_s = _ms_as_s(headers.get("x-queue-wait-predicted-ms"), self.scale)
        outcome.engine = headers.get("x-sim-engine")
        outcome.engine_queue_s = _ms_as_s(headers.get("x-sim-engine-queue-ms"))  # the engine's: unscaled
        outcome.prefill_s = _ms_as_s(headers.get("x-sim-prefill-ms"))
        outcome.decode_s = _ms_as_s(headers.get("x-sim-decode-ms"))
        outcome.beside_prefill_s = _ms_as_s(headers.get("x-sim-beside-prefill-ms"))
        outcome.beside_long_prefill_s = _ms_as_s(headers.get("x-sim-beside-long-prefill-ms"))
        try:
            outcome.completion_tokens = json.loads(payload)["usage"]["completion_tokens"]
        except (ValueError, KeyError, TypeError):
            pass


def arrivals(traffic: Traffic):
    """The trace: each request's arrival (unscaled seconds), its ticket, and the random source its
    client's retries draw from; the same for every run of the same traffic."""
    rng = random.Random(traffic.seed)
    t = 0.0
    while t < traffic.duration_s:
        t += rng.expovariate(traffic.rate_at(t))
        yield t, ticket(rng, traffic), random.Random(rng.random())


async def drive(url: str, traffic: Traffic, time_scale: float, on_progress,
                impatient: frozenset[str] = frozenset(), prepare=None) -> list[Outcome]:
    """Send the traffic, each request in a task of its own; `impatient`: the classes whose
    clients retry in a hand-written loop; `prepare`, when given, rewrites each ticket before it
    is sent (real engines' prompts: scenario_vllm.py)."""
    started = time.monotonic()
    tasks: list[asyncio.Task] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = Client(url, time_scale, session, started, impatient, traffic.deadlines_s)
        last_report = 0.0
        for t, item, retry_rng in arrivals(traffic):
            delay = started + t * time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(client.send(prepare(item) if prepare else item, retry_rng)))
            if t - last_report >= 10:
                last_report = t
                on_progress(traffic.phase_at(t), t, len(tasks))
        return await asyncio.gather(*tasks)
