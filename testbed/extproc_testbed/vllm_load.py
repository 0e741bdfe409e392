"""The real engines' side of `extproc bench scenario --engine vllm` (scenario_vllm.py): prompts that
a real tokenizer counts as the sidecar estimates them, the capacity probe that the trace is scaled
by, and the engines' own counts read from their /metrics.

Prompts. The simulated scenario's tickets carry "x" four times per prompt token: the simulator
counts characters / 4, and so does the sidecar's estimate; the tiny model's byte-level tokenizer
makes one token of each "x" (four times the tokens), and every prompt would share its prefix with
every other (vLLM's prefix cache would compute each once). `Prompts` writes each ticket's prompt as
random words instead, each one token of the tiny model's tokenizer, 3 letters on average: with
their spaces, 4 characters a token, the sidecar's estimate; no two prompts share a KV block.

The probe (`probe`): N engines of one kind started for it alone; the time a typical loan (a 480-token
prompt, 64 tokens out) takes alone on an idle engine, one at a time; then the mix's tickets sent
by `N x max_num_seqs` clients at once, each sending its next as its last is answered, straight to
the engines (no Envoy, no sidecar): the requests per second they carry, counted from the first
quarter of the probe on (the ramp left out)."""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import random
import statistics
import time
from pathlib import Path

import aiohttp

from .stack import SimSpec, Stack, StackPorts, http_get, parse_samples
from .traffic import Traffic, arrivals

# One token each for the tiny model's tokenizer, after a space (tiny_model.py: a BPE trained on
# Python's standard library); 3.0 letters on average.
WORDS = ("a", "to", "of", "in", "is", "or", "as", "at", "by", "if", "on", "be", "it", "no", "and", "not", "for",
         "def", "get", "set", "new", "key", "len", "str", "int", "the", "any", "all", "add", "end", "self", "list",
         "dict", "name", "type", "with", "true", "value", "class", "index", "yield")
ALONE_PROMPT_TOKENS, ALONE_MAX_TOKENS = 480, 64  # a typical loan: the mix's median prompt, its answer


class Prompts:
    """Rewrites each ticket's prompt (`drive`'s `prepare`) into random words, as many as the
    ticket's prompt tokens; seeded, so two runs of the same trace send the same texts."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def text(self, tokens: int) -> str:
        return " ".join(self.rng.choices(WORDS, k=tokens))

    def __call__(self, item: dict) -> dict:
        tokens = len(item["body"]["messages"][0]["content"]) // 4  # traffic.ticket: 4 characters a token
        body = {**item["body"], "messages": [{"role": "user", "content": self.text(tokens)}]}
        return {**item, "body": body}


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    started = time.monotonic()
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status} to the probe")
    return time.monotonic() - started


async def _alone(urls: list[str], prompts: Prompts, rounds: int) -> list[float]:
    """A typical loan alone on an idle engine, `rounds` times on each engine, one at a time."""
    async with aiohttp.ClientSession() as session:
        return [await _post(session, url, {"model": "deepseek-sim", "max_tokens": ALONE_MAX_TOKENS, "messages": [
                    {"role": "user", "content": prompts.text(ALONE_PROMPT_TOKENS)}]})
                for url in urls for _ in range(rounds)]


async def _loaded(urls: list[str], traffic: Traffic, prompts: Prompts, clients: int, seconds: float) -> float:
    """Requests answered per wall second while `clients` clients each send the mix's next ticket
    as their last is answered, round robin over `urls`; from the first quarter of `seconds` on."""
    tickets = (item for _, item, _ in arrivals(traffic))
    done: list[float] = []
    started = time.monotonic()
    end = started + seconds
    timeout = aiohttp.ClientTimeout(total=max(60.0, seconds * 4))

    async def client(i: int, session: aiohttp.ClientSession) -> None:
        n = i
        while time.monotonic() < end:
            await _post(session, urls[n % len(urls)], prompts(next(tickets))["body"])
            done.append(time.monotonic() - started)
            n += clients

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*[client(i, session) for i in range(clients)])
    counted = [t for t in done if seconds / 4 <= t <= seconds]
    return len(counted) / (seconds * 3 / 4)


def probe(spec: SimSpec, engines: int, max_num_seqs: int, seconds: float, time_scale: float, work: Path,
          progress) -> dict:
    """What `engines` engines of `spec` carry (see the module's docstring); durations and rates in
    the engines' unscaled seconds (`time_scale`: the simulated engines' own)."""
    ports = StackPorts.random(primary=engines, fallback=0)
    stack = Stack(work, ports, primary=spec, with_sidecar=False)
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        stack.start_sims()
        up_s = time.monotonic() - started
        urls = [stack.sim_url(i) for i in range(engines)]
        prompts = Prompts(1)
        asyncio.run(_alone(urls, prompts, 1))  # each engine's first request, not counted
        pages = [read_engines(urls)]
        alone = asyncio.run(_alone(urls, prompts, 3))
        pages.append(read_engines(urls))
        # a trace of its own (another seed): the mix, not the scenario's requests
        rate = asyncio.run(_loaded(urls, Traffic(seed=99), prompts, engines * max_num_seqs, seconds * time_scale))
        pages.append(read_engines(urls))
    finally:
        stack.stop()
    result = {"engines": engines, "alone_s": round(statistics.median(alone) / time_scale, 3),
              "rps": round(rate * time_scale, 3), "rps_per_engine": round(rate * time_scale / engines, 3),
              "seconds": round(seconds, 1), "clients": engines * max_num_seqs, "start_s": round(up_s, 1),
              # a decode step as the engines report it (the mean time between two tokens of a request,
              # the simulator's histograms in its unscaled seconds), alone and under the probe's load
              "step_alone_s": _mean_s(pages[0], pages[1], "vllm:inter_token_latency_seconds"),
              "step_loaded_s": _mean_s(pages[1], pages[2], "vllm:inter_token_latency_seconds")}
    progress(f"probe {spec.engine}: {result}")
    return result


# -- the engines' own counts ----------------------------------------------------------------

def read_engines(urls: list[str], timeout: float = 15.0) -> list[dict]:
    """Each engine's /metrics as samples, read slowly (a real engine's API server on a busy
    2-core machine can take seconds); an engine that does not answer reads as empty."""
    pages = []
    for url in urls:
        try:
            status, text = http_get(f"{url}/metrics", timeout)
        except OSError:
            status, text = 0, ""
        pages.append(parse_samples(text) if status == 200 else {})
    return pages


def identify(url: str) -> dict:
    """What answers at `url`: vLLM's own /version (the simulator has none) and its cache's size."""
    try:
        status, text = http_get(f"{url}/version", 15.0)
    except OSError:
        status, text = 0, ""
    version = json.loads(text).get("version") if status == 200 else None
    info = next((dict(labels) for (name, labels) in read_engines([url])[0] if name == "vllm:cache_config_info"), {})
    return {"url": url, "vllm_version": version, "kv_cache_size_tokens": _int(info.get("kv_cache_size_tokens")),
            "block_size": _int(info.get("block_size")), "prefix_caching": info.get("enable_prefix_caching")}


def _int(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def _delta(before: list[dict], after: list[dict], name: str, **labels: str) -> float:
    """`name` summed over the engines (and the labels not named), after minus before."""
    wanted = set(labels.items())

    def total(pages: list[dict]) -> float:
        return sum(v for page in pages for (n, ls), v in page.items() if n == name and wanted <= ls)

    return total(after) - total(before)


def _mean_s(before: list[dict], after: list[dict], name: str) -> float | None:
    count = _delta(before, after, f"{name}_count")
    return round(_delta(before, after, f"{name}_sum") / count, 4) if count else None


def _buckets(before: list[dict], after: list[dict], name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets (upper bound, count), summed over the engines, after minus before."""
    bounds: dict[float, float] = {}
    for sign, pages in ((-1, before), (1, after)):
        for page in pages:
            for (n, ls), v in page.items():
                if n == f"{name}_bucket":
                    le = float(dict(ls)["le"])
                    bounds[le] = bounds.get(le, 0.0) + sign * v
    return sorted(bounds.items())


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's histogram_quantile: linear within the bucket holding the q-th observation
    (the last finite bound where that is the +Inf bucket); None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    i = bisect.bisect_left([count for _, count in buckets], rank)
    upper, count = buckets[i]
    if math.isinf(upper):
        return buckets[i - 1][0] if i else None
    lower, below = (buckets[i - 1] if i else (0.0, 0.0))
    return lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 1.0)


def engine_counts(before: list[dict], after: list[dict], series: list[dict]) -> dict:
    """What the engines themselves counted during a run (after minus before, over all engines),
    and the peaks the sampler read (every half second) while it ran."""
    def histogram(name: str) -> dict:
        buckets = _buckets(before, after, name)
        count = _delta(before, after, f"{name}_count")
        total = _delta(before, after, f"{name}_sum")
        return {"count": int(count), "sum_s": round(total, 3), "mean_s": round(total / count, 3) if count else None,
                "p50_s": _round(histogram_quantile(buckets, 0.5)), "p99_s": _round(histogram_quantile(buckets, 0.99))}

    finished = {reason: int(_delta(before, after, "vllm:request_success_total", finished_reason=reason))
                for reason in ("length", "stop", "abort", "error")}
    hits, queries = (_delta(before, after, f"vllm:prefix_cache_{k}_total") for k in ("hits", "queries"))
    return {
        "preemptions": int(_delta(before, after, "vllm:num_preemptions_total")),
        "finished": finished,
        "queue_time": histogram("vllm:request_queue_time_seconds"),
        "e2e_latency": histogram("vllm:e2e_request_latency_seconds"),
        "time_to_first_token": histogram("vllm:time_to_first_token_seconds"),
        "inter_token_latency": histogram("vllm:inter_token_latency_seconds"),
        "prompt_tokens": int(_delta(before, after, "vllm:prompt_tokens_total")),
        "generation_tokens": int(_delta(before, after, "vllm:generation_tokens_total")),
        "prefix_cache_hit_share": round(hits / queries, 4) if queries else None,
        "kv_usage_peak": round(max((p.get("kv_usage", 0.0) for p in series), default=0.0), 4),
        "waiting_peak": int(max((p.get("engine_waiting", 0.0) for p in series), default=0.0)),
        "running_peak": int(max((p.get("engine_running", 0.0) for p in series), default=0.0)),
        "samples": len(series),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
