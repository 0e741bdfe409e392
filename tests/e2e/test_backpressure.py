"""KV-cache backpressure end to end: the burst that crashes an unprotected engine does not crash
it behind the sidecar, and short tickets keep flowing during a burst of long ones."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import aiohttp
import yaml

from extproc_testbed.stack import LOOPBACK, SimSpec, Stack, StackPorts, http_get

from ..conftest import e2e_config
from ..helpers import chat, metric, sim_crashes

SIM_ARGS = ("--on-kv-exhausted", "crash", "--kv-tokens", "32768", "--max-num-seqs", "32",
            "--time-scale", "0.1", "--recovery-s", "60")
LONG_PROMPT_TOKENS = 12000  # "x" * 4 chars per token
SHORT_PROMPT_TOKENS = 500


def burst_bodies() -> list[tuple[str, bytes]]:
    """6 long and 30 short tickets, interleaved as they would arrive from many branches."""
    bodies = []
    for i in range(36):
        kind = "long" if i % 6 == 0 else "short"
        tokens = LONG_PROMPT_TOKENS if kind == "long" else SHORT_PROMPT_TOKENS
        bodies.append((kind, chat("x" * (4 * tokens), max_tokens=64, user=f"{kind}-{i}")))
    return bodies


async def fire(url: str, bodies: list[tuple[str, bytes]]) -> list[tuple[str, int | str, int | None]]:
    async def one(session, kind, body):
        try:
            async with session.post(f"{url}/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json", "x-ticket-type": "complaint"}) as r:
                await r.read()
                wait = r.headers.get("x-queue-wait-ms")
                return kind, r.status, int(wait) if wait else None
        except aiohttp.ClientError as error:
            return kind, type(error).__name__, None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, kind, body) for kind, body in bodies))


def sidecar_config(ports: StackPorts) -> dict:
    config = e2e_config()
    config["pools"]["primary"] = {
        "cluster": "vllm_primary", "max_inflight": 64, "fallback": "fallback",
        "tiers": {"yellow": 30, "orange": 50, "red": 80, "hard_max": 200},
        "capacity": {"backends": [f"http://{LOOPBACK}:{p}" for p in ports.primary], "long_request_tokens": 8192,
                     "long_share": 0.5},
    }
    config["probes"] = {"interval_s": 0.2, "stale_after_s": 2, "timeout_s": 0.5, "nvml": "off"}
    return config


async def test_burst_crashes_the_engine_without_the_sidecar_and_never_with_it(tmp_path):
    bodies = burst_bodies()
    sim = SimSpec("deepseek-sim", SIM_ARGS)

    with Stack(tmp_path / "bare", StackPorts.random(primary=1), primary=sim, with_sidecar=False) as bare:
        results = await fire(bare.url, bodies)
        crashes = sim_crashes(bare.sim_url(0))
    assert crashes >= 1, results
    assert sum(1 for _, status, _ in results if status != 200) > 0

    ports = StackPorts.random(primary=1)
    (tmp_path / "guarded").mkdir()
    config_path = tmp_path / "guarded" / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(sidecar_config(ports)))
    with Stack(tmp_path / "guarded", ports, config_path, primary=sim) as guarded:
        results = await fire(guarded.url, bodies)
        crashes = sim_crashes(guarded.sim_url(0))
        budget = metric(guarded.metrics_url, "extproc_token_budget", pool="primary")
        assert metric(guarded.metrics_url, "extproc_inflight_tokens", pool="primary") == 0
    assert crashes == 0
    assert [status for _, status, _ in results] == [200] * len(bodies)
    assert 0 < budget <= 32768 * 0.85

    short_waits = sorted(w for kind, _, w in results if kind == "short")
    long_waits = sorted(w for kind, _, w in results if kind == "long")
    # Long tickets may hold half the budget: one at a time here, so they queue behind each
    # other while short tickets pass them. Told by the order of the sidecar's decisions, not
    # by how long anything took: the log is written in the order things happened.
    events = admissions_and_releases(tmp_path / "guarded" / "sidecar.log")
    print(json.dumps({"short_wait_ms_p50": statistics.median(short_waits),
                      "long_wait_ms_p50": statistics.median(long_waits), "long_wait_ms_max": long_waits[-1],
                      "order": " ".join(f"{event[0]}{kind[0]}" for event, kind in events)}))
    kinds = [kind for event, kind in events if event == "admitted"]
    assert sorted(kinds) == sorted(kind for kind, _ in bodies)  # each ticket admitted once
    longs_held = max_held = 0
    for event, kind in events:
        if kind == "long":
            longs_held += 1 if event == "admitted" else -1
            max_held = max(max_held, longs_held)
    assert max_held == 1, events  # never two long tickets at once: each waited for the one before
    last_long = len(kinds) - 1 - kinds[::-1].index("long")
    assert kinds[:last_long].count("short") == kinds.count("short"), kinds  # every short ticket passed it


def admissions_and_releases(log_path: Path) -> list[tuple[str, str]]:
    """("admitted" | "released", "long" | "short") for each decision line of the primary pool,
    in the order the sidecar wrote them (a ticket is long by its cost: prompt + max_tokens)."""
    events = []
    for line in log_path.read_text("utf-8", "replace").splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("outcome") in ("admitted", "released") and record.get("pool") == "primary":
            kind = "long" if record["cost_tokens"] >= LONG_PROMPT_TOKENS else "short"
            events.append((record["outcome"], kind))
    return events


async def test_envoy_sends_each_request_to_the_backend_the_sidecar_picked_by_kv_tokens(tmp_path):
    # One long ticket holds far more KV cache than many short ones: Envoy's least-request
    # balancing (by count) would send the next requests to its backend; the sidecar, counting
    # tokens, keeps them on the other one, and Envoy's override_host follows it.
    ports = StackPorts.random(primary=2)
    config = sidecar_config(ports)
    config["pools"]["primary"]["capacity"]["pick_backend"] = True
    config_path = tmp_path / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(config))
    sim = SimSpec("deepseek-sim", ("--kv-tokens", "32768", "--max-num-seqs", "32", "--time-scale", "1"))
    with Stack(tmp_path, ports, config_path, primary=sim) as stack:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def send(tokens: int) -> int:
                body = chat("x" * (4 * tokens), max_tokens=1000)  # ~6 s of decoding: all run at once
                async with session.post(f"{stack.url}/v1/chat/completions", data=body,
                                        headers={"content-type": "application/json"}) as response:
                    await response.read()
                    return response.status

            sent = [asyncio.create_task(send(12000))]
            await asyncio.sleep(0.3)
            for _ in range(7):
                sent.append(asyncio.create_task(send(100)))
                await asyncio.sleep(0.2)
            statuses = await asyncio.gather(*sent)
        served = sorted(json.loads(http_get(f"{stack.sim_url(i)}/sim/stats")[1])["requests"] for i in range(2))
        assert metric(stack.metrics_url, "extproc_inflight_tokens", pool="primary") == 0
    assert statuses == [200] * 8
    assert served == [1, 7]  # the long ticket alone on its backend

