"""What the sidecar costs: the same load through Envoy with and without the ext_proc filter,
measured side by side in one run (alternating, so drift on a shared machine hits both).

    .venv/bin/python bench/overhead.py [--seconds 8] [--concurrency 32] [--rounds 2]

The backend is the simulated vLLM with a near-zero time scale and one output token, so what
is measured is the request path itself (Envoy, ext_proc round trips, the decision), not the
model. Everything shares this machine's cores with the load generator; read the ratio, not the
absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from extproc.testbed.stack import SimSpec, Stack, StackPorts, http_get

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extproc.testbed.redis_server import RedisServer  # noqa: E402  (a throwaway real redis-server)

BODY = json.dumps(
    {"model": "deepseek-sim", "messages": [{"role": "user", "content": "Is ticket 1234 resolved?"}], "max_tokens": 1}
).encode()


async def load(url: str, seconds: float, concurrency: int) -> tuple[int, int, list[float]]:
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds
    headers = {"content-type": "application/json", "x-ticket-type": "complaint"}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.monotonic() < stop_at:
            started = time.monotonic()
            async with session.post(f"{url}/v1/chat/completions", data=BODY, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    errors += 1
                    continue
            latencies.append(time.monotonic() - started)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return len(latencies), errors, latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else float("nan")


def decision_mean_ms(metrics_url: str) -> float:
    text = http_get(metrics_url)[1]
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("extproc_decision_seconds_sum"):
            total = float(line.split()[-1])
        elif line.startswith("extproc_decision_seconds_count"):
            count = float(line.split()[-1])
    return 1000 * total / count if count else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="extproc-bench-"))
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "extproc/default_config.yaml").read_text())
    config["pools"]["primary"]["max_inflight"] = 4 * args.concurrency  # measure the path, not queueing
    sim = SimSpec("deepseek-sim", ("--time-scale", "0.001", "--max-num-seqs", "256"))

    def sidecar_stack(name: str, redis_url: str | None = None) -> Stack:
        ports = StackPorts.random(primary=1)
        config["pools"]["primary"]["capacity"]["backends"] = [f"http://127.0.0.1:{ports.primary[0]}"]
        config["pools"]["fallback"]["capacity"]["backends"] = [f"http://127.0.0.1:{ports.fallback[0]}"]
        (work / name).mkdir(parents=True)
        (work / name / "config.yaml").write_text(yaml.safe_dump(config))
        return Stack(work / name, ports, work / name / "config.yaml", primary=sim, redis_url=redis_url)

    redis_server = RedisServer(work / "redis-server").start()
    stacks = {
        "envoy only": Stack(work / "plain", StackPorts.random(primary=1), primary=sim, with_sidecar=False),
        "envoy + sidecar": sidecar_stack("sidecar"),
        "  + redis queue": sidecar_stack("redis", redis_server.url),
    }
    results: dict[str, list[tuple[int, int, list[float]]]] = {name: [] for name in stacks}
    try:
        for stack in stacks.values():
            stack.start()
        for stack in stacks.values():  # warm-up
            asyncio.run(load(stack.url, 1, args.concurrency))
        for _ in range(args.rounds):
            for name, stack in stacks.items():
                results[name].append(asyncio.run(load(stack.url, args.seconds, args.concurrency)))
        decision_ms = {name: decision_mean_ms(stacks[name].metrics_url) for name in list(stacks)[1:]}
    finally:
        for stack in stacks.values():
            stack.stop()
        redis_server.kill()

    print(f"{args.rounds} rounds x {args.seconds:g} s, {args.concurrency} concurrent clients, 1-token completions")
    print(f"{'path':<18}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}{'decision ms':>13}")
    rates = {}
    for name, runs in results.items():
        done = sum(r[0] for r in runs)
        errors = sum(r[1] for r in runs)
        latencies = [x for r in runs for x in r[2]]
        rates[name] = done / (args.rounds * args.seconds)
        decision = f"{decision_ms[name]:.3f}" if name in decision_ms else "-"
        print(f"{name:<18}{rates[name]:>9.0f}{1000 * percentile(latencies, 50):>9.1f}"
              f"{1000 * percentile(latencies, 99):>9.1f}{errors:>8}{decision:>13}")
    print(f"throughput ratio (sidecar / envoy only): {rates['envoy + sidecar'] / rates['envoy only']:.2f}")
    print(f"throughput ratio (redis queue / in-process queue): {rates['  + redis queue'] / rates['envoy + sidecar']:.2f}")


if __name__ == "__main__":
    main()
