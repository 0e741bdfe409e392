"""What every fault run measures (testbed/extproc_testbed/faults.py): the clients, a steady mixed load
with each request's ending as its client saw it, and what the sidecar and Redis hold once idle."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable

import aiohttp

from .stack import Stack, http_get, metric_sum, parse_samples

POOL = "primary"
CLIENT_TIMEOUT_S = 60.0  # generous: above the longest class wait + the pause + a generation
ENDINGS = ("ok", "refused", "other", "hung")

# ---------------------------------------------------------------------------------------------
# The clients


def request_body(rng: random.Random, user: str) -> tuple[dict, dict]:
    stream = rng.random() < 0.4
    body = {
        "model": "deepseek-sim",
        "messages": [{"role": "user", "content": "ticket " + "x" * rng.randint(200, 2000)}],
        "max_tokens": rng.randint(32, 384),
        "stream": stream,
        "user": user,  # the backends record it: a request that reaches them twice is seen
    }
    headers = {"content-type": "application/json",
               "x-ticket-type": rng.choices(["loan_approval", "complaint", "archive_query"], [3, 4, 3])[0]}
    return body, headers


def classify_answer(status: int, headers, data: bytes, stream: bool) -> tuple[str, str]:
    """(ending, detail) of a request that got an HTTP answer."""
    if status == 200:
        if stream:
            return ("ok", "200") if b"data: [DONE]" in data else ("other", "200 stream without [DONE]")
        try:
            json.loads(data)["choices"]
        except (ValueError, KeyError, TypeError):
            return "other", "200 body not a completion"
        return "ok", "200"
    try:
        error = json.loads(data)["error"]
        shaped = bool(error.get("type")) and bool(error.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        error, shaped = None, False
    if status in (429, 503):
        if not shaped:
            return "other", f"{status} without an OpenAI-style error"
        told = headers.get("retry-after") is not None or headers.get("x-should-retry") == "false"
        if not told:
            return "other", f"{status} {error['code']} without retry-after"
        return "refused", f"{status} {error['code']}"
    return "other", f"{status} {error['code'] if shaped else 'non-JSON'}"


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, headers: dict,
                      timeout_s: float) -> dict:
    result = {"user": body["user"], "stream": body["stream"], "class": headers["x-ticket-type"],
              "ending": None, "detail": None, "started_at": time.monotonic()}
    status = None
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            async with session.post(url, json=body, headers=headers) as response:
                status = response.status
                data = await response.read()
                result["ending"], result["detail"] = classify_answer(status, response.headers, data, body["stream"])
    except TimeoutError as error:
        if deadline.expired():
            result["ending"], result["detail"] = "hung", f"no answer in {timeout_s:.0f}s"
        else:
            result["ending"], result["detail"] = "other", type(error).__name__
    except aiohttp.ClientError as error:
        where = "" if status is None else f" after {status} headers (answer cut)"
        result["ending"], result["detail"] = "other", f"{type(error).__name__}{where}"
    except OSError as error:
        result["ending"], result["detail"] = "other", type(error).__name__
    result["seconds"] = round(time.monotonic() - result.pop("started_at"), 3)
    return result


class Load:
    """Open-loop Poisson arrivals through Envoy, plus bursts on demand; every request kept."""

    def __init__(self, session: aiohttp.ClientSession, url: str, rng: random.Random, tag: str,
                 timeout_s: float = CLIENT_TIMEOUT_S):
        self.session, self.url, self.rng, self.tag, self.timeout_s = session, url, rng, tag, timeout_s
        self.tasks: list[asyncio.Task] = []

    def send(self) -> None:
        body, headers = request_body(self.rng, f"{self.tag}-{len(self.tasks)}")
        self.tasks.append(asyncio.create_task(one_request(self.session, self.url, body, headers, self.timeout_s)))

    def burst(self, n: int) -> None:
        for _ in range(n):
            self.send()

    async def steady(self, rate: float, until: Callable[[], bool]) -> None:
        while not until():
            self.send()
            await asyncio.sleep(self.rng.expovariate(rate))

    async def results(self) -> list[dict]:
        return list(await asyncio.gather(*self.tasks))  # each bounded by the client timeout


async def measure_capacity(stack: Stack, slots: int, seconds: float, seed: int) -> float:
    """Completions per second with twice the pool's `slots` in closed loop (the line stays full):
    the pool's capacity through the whole stack, on this machine as it is loaded now."""
    rng = random.Random(seed)
    url = f"{stack.url}/v1/chat/completions"
    done: list[float] = []
    start = time.monotonic()
    stop_at = start + seconds

    async def worker(session, k: int) -> None:
        n = 0
        while time.monotonic() < stop_at:
            body, headers = request_body(rng, f"calibrate-{k}-{n}")
            n += 1
            outcome = await one_request(session, url, body, headers, CLIENT_TIMEOUT_S)
            if outcome["ending"] == "ok":
                done.append(time.monotonic())

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(worker(session, k) for k in range(2 * slots)))
    warm = start + min(1.0, seconds / 4)  # leave out the ramp-up
    counted = [t for t in done if warm <= t <= stop_at]
    return len(counted) / max(0.1, stop_at - warm)


# ---------------------------------------------------------------------------------------------
# What the sidecar and Redis hold


def scrape(url: str) -> dict | None:
    try:
        status, text = http_get(url, timeout=2)
    except OSError:
        return None
    return parse_samples(text) if status == 200 else None


def sidecar_counts(stack: Stack, live: list[int]) -> dict:
    """Per live replica: the pools' in-flight and depth (global in shared mode), and its own
    slots admitted and released."""
    replicas = {}
    for i in live:
        samples = scrape(stack.replica_metrics_url(i))
        if samples is None:
            replicas[i] = None
            continue
        replicas[i] = {
            "inflight": int(sum(metric_sum(samples, "extproc_inflight", pool=p) for p in (POOL, "fallback"))),
            "depth": int(sum(metric_sum(samples, "extproc_queue_depth", pool=p) for p in (POOL, "fallback"))),
            "admitted": int(metric_sum(samples, "extproc_slots_admitted_total")),
            "released": int(metric_sum(samples, "extproc_slots_released_total")),
            "store_degraded": int(metric_sum(samples, "extproc_store_degraded")),
        }
    return replicas


def redis_counts(client) -> dict | None:
    if client is None:
        return None
    try:
        return {
            "inflight": sum(int(client.hget(f"{{extproc:{p}}}:st", "inflight") or 0) for p in (POOL, "fallback")),
            "waiting": sum(client.zcard(f"{{extproc:{p}}}:wait") for p in (POOL, "fallback")),
        }
    except Exception as error:  # noqa: BLE001 - a Redis that is down is a reading too
        return {"error": type(error).__name__}


def leaked(state: dict) -> int | None:
    """Slots still held at idle: the pools' in-flight + waiting (the larger of what the sidecar
    and Redis report), or a live replica's admitted - released if that is more."""
    replicas = [r for r in state["replicas"].values() if r is not None]
    if len(replicas) < len(state["replicas"]):
        return None  # a live replica did not answer: unknown
    held = max([r["inflight"] + r["depth"] for r in replicas], default=0)
    unreleased = sum(max(0, r["admitted"] - r["released"]) for r in replicas)
    redis = state.get("redis")
    if redis is not None:
        if "error" in redis:
            return None
        held = max(held, redis["inflight"] + redis["waiting"])
    return max(held, unreleased)


async def settle(read: Callable[[], dict], timeout_s: float) -> dict:
    """Read the state until nothing is held (or `timeout_s`): the reading at idle."""
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    while True:
        state = await asyncio.to_thread(read)
        if leaked(state) == 0 or time.monotonic() > deadline:
            state["leaked"] = leaked(state)
            state["idle_after_s"] = round(time.monotonic() - started, 2)
            return state
        await asyncio.sleep(0.25)


async def poll(predicate: Callable[[], bool], timeout_s: float, every_s: float = 0.1) -> float | None:
    """Seconds until `predicate` held, None if it did not within `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if await asyncio.to_thread(predicate):
                return round(time.monotonic() - started, 2)
        except Exception:  # noqa: BLE001 - a process that is down reads as "not yet"
            pass
        await asyncio.sleep(every_s)
    return None


def depth_of(stack: Stack, replica: int = 0) -> int:
    samples = scrape(stack.replica_metrics_url(replica))
    return -1 if samples is None else int(metric_sum(samples, "extproc_queue_depth", pool=POOL))


def backend_duplicates(stack: Stack, pools: tuple[str, ...] = (POOL,)) -> dict:
    """Requests (by user) that a backend of `pools` started more than once."""
    seen: Counter = Counter()
    for pool in pools:
        for i in range(len(stack.ports.pool_ports(pool))):
            status, text = http_get(f"{stack.sim_url(i, pool)}/sim/stats", timeout=5)
            if status == 200:
                seen.update(s["user"] for s in json.loads(text)["started"] if s.get("user"))
    return {user: n for user, n in seen.items() if n > 1 and not user.startswith("calibrate-")}
