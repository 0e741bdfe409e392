"""The chaos drill: a primary pool whose three backends fail three ways at once, a healthy
fallback pool, and clients that each send one request (some give up, half stream).

    extproc bench chaos [--requests 240] [--rate 20] [--seed 7] [--out DIR]

Faults, set before the first request: backend 0 answers 30 % of requests with 500, backend 1
has crashed (simulated GPU OOM: 503 while it recovers, for longer than the drill), backend 2 is
SIGKILLed. The fallback pool (one backend) is healthy.

Each request ends one way, as its client saw it: `200`, another status, `gave up` (the client
left before an answer), or `stream cut` (a streamed response had started when its backend
failed: nothing can retry that). The headline is the share of requests answered 200 among
those whose client did not give up and whose stream had not started when its backend failed.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import yaml

from .provenance import provenance
from .stack import SimSpec, Stack, StackPorts
from .traffic import ANONYMOUS_RIGHTS

TIME_SCALE = "0.2"


def post_json(url: str, payload: dict) -> None:
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"content-type": "application/json"})
    urllib.request.urlopen(request, timeout=5).read()


def drill_config(ports: StackPorts, primary_slots: int = 6, fallback_slots: int = 6) -> dict:
    """The drills' sidecar config (the chaos drill, the soak, faults under load): the seed's three
    classes, a primary pool with a fallback that serves the paired small model."""
    return {
        "classes": {
            "loan_approval": {"base": 0, "max_wait_s": 20, "protected": True},
            "complaint": {"base": 1, "max_wait_s": 15},
            "archive_query": {"base": 2, "max_wait_s": 10, "degradable": True},
        },
        "default_class": "archive_query",
        "anonymous": ANONYMOUS_RIGHTS,
        "pools": {
            "primary": {"cluster": "vllm_primary", "max_inflight": primary_slots, "fallback": "fallback",
                        "capacity": {"backends": [f"http://127.0.0.1:{p}" for p in ports.primary]}},
            "fallback": {"cluster": "vllm_fallback", "max_inflight": fallback_slots,
                         "models": {"deepseek-sim": "deepseek-sim-small"},
                         "capacity": {"backends": [f"http://127.0.0.1:{p}" for p in ports.fallback]}},
        },
        "default_pool": "primary",
    }


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random) -> dict:
    stream = rng.random() < 0.5
    give_up_after = rng.uniform(0.2, 2.0) if rng.random() < 0.15 else None
    body = {
        "model": "deepseek-sim",
        "messages": [{"role": "user", "content": "ticket " + "x" * rng.randint(200, 2000)}],
        "max_tokens": rng.randint(16, 256),
        "stream": stream,
    }
    headers = {"content-type": "application/json",
               "x-ticket-type": rng.choices(["loan_approval", "complaint", "archive_query"], [3, 4, 3])[0]}
    result = {"stream": stream, "ending": None, "fallback": False, "started": False}

    async def exchange() -> None:
        async with session.post(url, json=body, headers=headers) as response:
            result["ending"] = str(response.status)
            result["fallback"] = response.headers.get("x-llm-fallback") == "true"
            result["started"] = stream and response.status == 200
            async for _ in response.content.iter_any():
                pass

    try:
        async with asyncio.timeout(give_up_after):
            await exchange()
    except TimeoutError:
        result["ending"] = "gave up"
    except aiohttp.ClientError as error:
        result["ending"] = "stream cut" if result["started"] else type(error).__name__
    return result


async def drive(stack: Stack, requests: int, rate: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    url = f"{stack.url}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        for _ in range(requests):
            tasks.append(asyncio.create_task(one_request(session, url, rng)))
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def summarize(results: list[dict]) -> dict:
    endings = Counter(r["ending"] for r in results)
    counted = [r for r in results if r["ending"] not in ("gave up", "stream cut")]
    ok = sum(1 for r in counted if r["ending"] == "200")
    return {
        "requests": len(results),
        "endings": dict(endings.most_common()),
        "counted": len(counted),
        "answered_200": ok,
        "share_200": ok / len(counted) if counted else float("nan"),
        "by_fallback": sum(1 for r in counted if r["ending"] == "200" and r["fallback"]),
        "not_200_by_cause": dict(Counter(r["ending"] for r in counted if r["ending"] != "200").most_common()),
    }


def run_drill(requests: int = 240, rate: float = 20.0, seed: int = 7, workdir: Path | None = None) -> dict:
    work = workdir or Path(tempfile.mkdtemp(prefix="extproc-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    ports = StackPorts.random(primary=3)
    (work / "extproc.yaml").write_text(yaml.safe_dump(drill_config(ports)))
    sim_args = ("--time-scale", TIME_SCALE)
    stack = Stack(work, ports, work / "extproc.yaml", primary=SimSpec("deepseek-sim", sim_args),
                  fallback=SimSpec("deepseek-sim-small", sim_args))
    stack.start()
    try:
        post_json(f"{stack.sim_url(0)}/sim/faults", {"error_rate": 0.3})
        post_json(f"{stack.sim_url(1)}/sim/faults", {"crash": True})
        stack.sims[2].signal(signal.SIGKILL)
        started = time.monotonic()
        results = asyncio.run(drive(stack, requests, rate, seed))
        elapsed = time.monotonic() - started
    finally:
        stack.stop()
    return {**summarize(results), "seconds": round(elapsed, 1), "seed": seed, "logs": str(work)}


def main(args) -> int:
    origin = provenance()  # before anything is written
    summary = {**run_drill(args.requests, args.rate, args.seed), "provenance": origin}
    print(json.dumps(summary, indent=2))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "chaos.json").write_text(json.dumps(summary, indent=2))
    return 0


def add_parser(bench) -> None:
    chaos = bench.add_parser("chaos", help="the chaos drill: three failing primary backends, a healthy fallback")
    chaos.add_argument("--requests", type=int, default=240)
    chaos.add_argument("--rate", type=float, default=20.0, help="arrivals per second (Poisson)")
    chaos.add_argument("--seed", type=int, default=7)
    chaos.add_argument("--out", help="write chaos.json into this folder")
    chaos.set_defaults(func=main)
