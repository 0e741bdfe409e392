"""Capacity math (pure, injected clock) and the load probes against misbehaving endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from extproc.control.load_control import aimd_usage
from extproc.control.probes import NvmlProbe, VllmMetricsProbe, parse_vllm_metrics
from extproc.core.admission import PoolLimits, PoolLine, Ticket
from extproc.core.capacity import (
    Aimd,
    BackendLoad,
    BackendReading,
    Placing,
    backend_order,
    check_context,
    dynamic_batch,
    pool_limits,
    recommend_vllm_args,
    request_cost,
)
from extproc.core.events import FirstByte
from extproc.core.outcomes import Outcome, Rejection
from extproc.core.tokens import estimate_prompt_tokens, estimate_text_tokens
from extproc_testbed.stack import free_port
from extproc.lifecycle.placement import BackendPicker

# -- costs and context -----------------------------------------------------------------------


def test_token_estimate_counts_chinese_characters_as_tokens():
    assert estimate_text_tokens("a" * 400) == 100
    assert estimate_text_tokens("贷款审批请求" * 10) == 60  # one token a character
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": "a" * 40}]}) == 4 + 10
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3


def test_cost_is_prompt_plus_max_tokens_or_the_default():
    assert request_cost(500, 64, 512) == 564
    assert request_cost(500, None, 512) == 1012


def test_requests_beyond_the_usable_context_are_a_400():
    check_context(12000, 1000, 512, 16384, 0.2)  # 13000 <= 13107
    with pytest.raises(Rejection) as error:
        check_context(13000, 200, 512, 16384, 0.2)
    assert error.value.outcome is Outcome.REJECTED_CONTEXT_LENGTH
    assert "13107" in error.value.message


# -- pool limits: budget, blend, saturation ----------------------------------------------------


def limits(readings, ledger=0, **kw):
    args = dict(static_capacity_per_backend=None, backends=len(readings) or 1, safety_factor=0.85,
                aimd_factor=1.0, ledger_tokens=ledger, max_inflight=100, max_num_seqs=32)
    args.update(kw)
    return pool_limits(readings, **args)


def test_budget_is_capacity_times_safety_times_factor():
    idle = [BackendReading(0.0, 10000, False), BackendReading(0.0, 10000, False)]
    assert limits(idle).budget_tokens == 17000
    assert limits(idle, aimd_factor=0.5).budget_tokens == 8500
    assert limits(idle).max_inflight == 64  # 2 backends x 32 sequences
    assert limits(idle, max_inflight=10).max_inflight == 10
    assert limits(idle, dynamic_batch=5).max_inflight == 5


def test_telemetry_above_the_ledger_shrinks_the_budget_and_below_it_does_not():
    busy = [BackendReading(0.5, 10000, False)]  # 5000 tokens in use seen by vLLM
    assert limits(busy, ledger=1000).budget_tokens == 8500 - 4000  # load the sidecar did not admit
    assert limits(busy, ledger=6000).budget_tokens == 8500  # gauges lag the ledger: the ledger rules


def test_a_saturated_backend_counts_as_full_never_idle():
    readings = [BackendReading(1.0, 10000, True), BackendReading(0.0, 10000, False)]
    assert limits(readings).budget_tokens == 8500  # the idle one's room, none of the saturated one's
    assert limits(readings, aimd_factor=0.5).budget_tokens == 4250
    unknown_capacity = [BackendReading(1.0, None, True)]
    assert limits(unknown_capacity).budget_tokens is None  # count limit only...
    assert limits(unknown_capacity, static_capacity_per_backend=8000).budget_tokens == 0  # ...or full


def test_engines_that_are_down_leave_the_live_engines_budget_whole():
    """A pool listing eight engines, six of them stopped (an autoscaler's, or crashed): the two
    that answer keep their whole budget. (Counted full to their whole cache, the six took 15 %
    of theirs each from the live two: a budget under half of theirs, and one long prompt
    stopped every admission.)"""
    live = [BackendReading(0.0, 24576, False)] * 2
    down = [BackendReading(1.0, 24576, True)] * 6
    assert limits(live + down).budget_tokens == limits(live).budget_tokens == int(2 * 24576 * 0.85)


# -- placement ---------------------------------------------------------------------------------


def test_backends_are_tried_answering_first_then_where_it_fits_then_with_a_free_slot_then_least_loaded():
    loads = [BackendLoad("10.0.0.1:8000", 24576, 20000, 3, False),  # 5000 more would overfill it
             BackendLoad("10.0.0.2:8000", 24576, 5000, 8, False),  # every sequence taken: it would wait there
             BackendLoad("10.0.0.3:8000", 24576, 0, 0, True),  # metrics gone: may be down
             BackendLoad("10.0.0.4:8000", 24576, 9000, 2, False)]
    assert backend_order(loads, Placing(5000), max_num_seqs=8) == [
        "10.0.0.4:8000", "10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.3:8000"]
    # a long one fits only on the backend whose sequences are all taken: waiting there beats overfilling
    assert backend_order(loads, Placing(16000, long=True), max_num_seqs=8)[0] == "10.0.0.2:8000"
    even = [BackendLoad(f"10.0.0.{i}:8000", 24576, 0, 0, False) for i in (1, 2)]
    assert backend_order(even, Placing(100), 8) == ["10.0.0.1:8000", "10.0.0.2:8000"]  # ties keep the configured order


def test_long_prompts_are_kept_apart_from_the_latency_bound_requests():
    # 10.0.0.1 runs a long prompt (its prefill fills whole steps); 10.0.0.2 runs two loans
    loads = [BackendLoad("10.0.0.1:8000", 24576, 12000, 3, False, long_running=1),
             BackendLoad("10.0.0.2:8000", 24576, 2000, 4, False, bound_running=2)]
    # a loan goes where no long prompt runs, though the other engine has more room
    assert backend_order(loads, Placing(600, bound=True), 8)[0] == "10.0.0.2:8000"
    # a long prompt goes beside the other long one while it fits there
    assert backend_order(loads, Placing(8000, long=True), 8)[0] == "10.0.0.1:8000"
    # ...and where the fewest loans run when it does not
    assert backend_order(loads, Placing(14000, long=True), 8)[0] == "10.0.0.2:8000"
    # a short request of another class leaves the loans' engine the room it has
    assert backend_order(loads, Placing(600), 8)[0] == "10.0.0.1:8000"
    # but never waits in vLLM's line on a full engine while another has a free slot
    full = [BackendLoad("10.0.0.1:8000", 24576, 12000, 8, False, long_running=1), loads[1]]
    assert backend_order(full, Placing(600), 8)[0] == "10.0.0.2:8000"
    # without keep_long_apart, KV tokens alone: the loan goes to the emptier engine
    assert backend_order(loads, Placing(600, bound=True), 8, keep_long_apart=False)[0] == "10.0.0.2:8000"
    assert backend_order(loads, Placing(600), 8, keep_long_apart=False)[0] == "10.0.0.2:8000"


def test_the_picker_counts_what_other_replicas_placed_though_the_engines_metrics_lag():
    config = SimpleNamespace(pools={"p": SimpleNamespace(capacity=SimpleNamespace(
        picks_backend=True, backends=["http://10.0.0.1:8000", "http://10.0.0.2:8000"], kv_tokens_per_backend=20000,
        max_num_seqs=8, safety_factor=1.0, keep_long_apart=False, spill_tokens_per_s=2048.0, bound_lately_s=0.0))})
    picker = BackendPicker(lambda: config)
    idle = BackendReading(0.0, 20000, False)  # the engines have not started the others' prompts yet
    # Another replica placed 15000 tokens (prompt + max_tokens) on the first backend.
    picker.observe("p", {"http://10.0.0.1:8000": idle, "http://10.0.0.2:8000": idle}, {"10.0.0.1:8000": 15000})
    assert picker.pick("p", "t1", Placing(8000, False, True)).split(",")[0] == "10.0.0.2:8000"
    # This replica's own placement is in the shared ledger too: not counted twice.
    picker.observe("p", {"http://10.0.0.1:8000": idle, "http://10.0.0.2:8000": idle},
                   {"10.0.0.1:8000": 15000, "10.0.0.2:8000": 8000})
    assert picker.pick("p", "t2", Placing(1000, False, True)).split(",")[0] == "10.0.0.2:8000"  # 8000+1000 < 15000


def test_the_picker_places_by_its_own_ledger_and_counts_what_others_placed_as_of_the_last_poll():
    config = SimpleNamespace(pools={"p": SimpleNamespace(capacity=SimpleNamespace(
        picks_backend=True, backends=("http://10.0.0.1:8000", "http://10.0.0.2:8000"), kv_tokens_per_backend=None,
        max_num_seqs=8, safety_factor=1.0, keep_long_apart=True, spill_tokens_per_s=2048.0, bound_lately_s=0.0))})
    picker = BackendPicker(lambda: config)
    idle = {url: BackendReading(0.0, 20000, False) for url in config.pools["p"].capacity.backends}
    picker.observe("p", idle)
    assert picker.pick("p", "long", Placing(12000, long=True)) == "10.0.0.1:8000,10.0.0.2:8000"
    # the metrics do not show it yet; the ledger does: the next ones go to the other backend...
    assert picker.pick("p", "a", Placing(3000)).startswith("10.0.0.2:8000")
    assert picker.pick("p", "b", Placing(3000)).startswith("10.0.0.2:8000")
    assert picker.running("p") == {"10.0.0.1:8000": (1, 12000), "10.0.0.2:8000": (2, 6000)}
    # the poll shows what this replica placed (no more): nothing changes
    picker.observe("p", {"http://10.0.0.1:8000": BackendReading(0.5, 20000, False),
                         "http://10.0.0.2:8000": BackendReading(0.2, 20000, False)})
    assert picker.pick("p", "c", Placing(100)).startswith("10.0.0.2:8000")
    picker.release("c")
    picker.release("long")
    picker.release("long")  # once only
    assert picker.running("p") == {"10.0.0.2:8000": (2, 6000)}
    # the long one ended a moment ago; the metrics still show it: the ledger is believed
    assert picker.pick("p", "d", Placing(3000)).startswith("10.0.0.1:8000")
    picker.release("d")
    # what another replica placed shows at the next poll beyond this replica's ledger: 90 % of
    # 10.0.0.1 is 18000 tokens that are not this replica's
    picker.observe("p", {"http://10.0.0.1:8000": BackendReading(0.9, 20000, False),
                         "http://10.0.0.2:8000": BackendReading(0.3, 20000, False)})
    assert picker.pick("p", "e", Placing(100)).startswith("10.0.0.2:8000")
    picker.observe("p", {"http://10.0.0.1:8000": BackendReading(0.0, 20000, False),
                         "http://10.0.0.2:8000": BackendReading(1.0, 20000, True)})  # its metrics went missing
    assert picker.pick("p", "f", Placing(100)).startswith("10.0.0.1:8000")
    config.pools["p"].capacity.picks_backend = False
    assert picker.pick("p", "g", Placing(100)) is None


def test_seed_dynamic_batch():
    gib = 1024**3
    assert dynamic_batch(10 * gib, 256 * 1024**2) == 32  # int(34.0) capped at 32
    assert dynamic_batch(2 * gib, 256 * 1024**2) == int(2 * gib * 0.85 / (256 * 1024**2))  # 6
    assert dynamic_batch(0, 1) == 0


# -- AIMD with an injected clock ---------------------------------------------------------------


def test_aimd_decreases_multiplicatively_and_recovers_step_by_step():
    aimd = Aimd(high=0.85, low=0.6, decrease=0.5, increase_step=0.1, min_factor=0.1, interval_s=1.0)
    assert aimd.update(0.95, now=0.0) == 0.5
    assert aimd.update(0.95, now=0.5) == 0.5  # at most once per interval
    assert aimd.update(0.95, now=1.0) == 0.25
    assert aimd.update(0.95, now=2.0) == 0.125
    assert aimd.update(0.95, now=3.0) == 0.1  # floor: never starves
    assert aimd.update(0.70, now=4.0) == 0.1  # between the marks: holds still
    factors = [aimd.update(0.3, now=5.0 + i) for i in range(12)]
    assert factors[:3] == pytest.approx([0.2, 0.3, 0.4])
    assert factors[-1] == 1.0 and max(factors) == 1.0


def test_one_engine_full_of_long_prompts_does_not_hold_back_the_work_the_others_could_run():
    # Five engines: the long-prompt one full (the sidecar packed it on purpose), four at 20 %.
    usages = [0.97, 0.2, 0.2, 0.2, 0.2]
    placed, by_envoy = Aimd(), Aimd()
    placed_factors = [placed.update(aimd_usage(usages, picks_backend=True), now=float(t)) for t in range(10)]
    envoy_factors = [by_envoy.update(aimd_usage(usages, picks_backend=False), now=float(t)) for t in range(10)]
    assert set(placed_factors) == {1.0}  # the budget stays whole: the idle engines get the line's work
    assert envoy_factors[-1] < 0.2  # where Envoy places, the hottest engine is the pool's risk
    readings = [BackendReading(u, 24576, False) for u in usages]

    def budget(factor: float) -> int:
        return pool_limits(readings, static_capacity_per_backend=24576, backends=5, safety_factor=0.9,
                           aimd_factor=factor, ledger_tokens=0, max_inflight=64, max_num_seqs=8).budget_tokens

    assert budget(placed_factors[-1]) > 4 * budget(envoy_factors[-1])
    assert aimd_usage([], picks_backend=True) == 0.0


def test_aimd_does_not_oscillate_under_steady_load():
    aimd = Aimd()
    history = [aimd.update(0.7, now=float(t)) for t in range(50)]
    assert set(history) == {1.0}


# -- the line with a token budget and a long-request share -------------------------------------


def t(i, cost, long=False, score=1.0):
    return Ticket(score, i, f"t{i}", "c", cost=cost, long=long)


def test_budget_and_long_share_let_short_requests_pass_a_long_burst():
    line = PoolLine(100, budget_tokens=20000, long_share=0.5)
    assert line.offer(t(0, 9000, long=True))  # the long lane holds 10000
    assert line.offer(t(1, 9000, long=True)) == []  # lane full: waits...
    assert line.offer(t(2, 500)) == [t(2, 500)]  # ...but does not block a short one behind it
    assert line.offer(t(3, 11000)) == []  # over the budget: waits, and keeps its place
    assert line.offer(t(4, 100, score=1.5)) == []  # behind it in order
    admitted = line.release("t0")
    assert admitted == [t(1, 9000, True)]  # the lane frees first
    assert line.inflight_cost == 9500 and line.long_cost == 9000


def test_a_lone_request_always_runs_and_growth_admits():
    line = PoolLine(10, budget_tokens=100)
    assert line.offer(t(0, 5000))  # bigger than the whole budget, but the pool is empty
    assert line.offer(t(1, 50)) == []
    assert line.set_limits(PoolLimits(10, 10000)) == [t(1, 50)]


# -- probes ------------------------------------------------------------------------------------

VLLM_TEXT = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048"} 1.0
"""


def test_parse_vllm_metrics_and_the_old_name():
    sample = parse_vllm_metrics(VLLM_TEXT)
    assert (sample.kv_usage, sample.running, sample.waiting, sample.kv_capacity_tokens) == (0.42, 3, 1, 32768)
    old = VLLM_TEXT.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_vllm_metrics(old).kv_usage == 0.42
    for bad in (VLLM_TEXT.replace("kv_cache_usage_perc", "kv_cache_use"), VLLM_TEXT.replace("0.42", "NaN"),
                "garbage {{{ 1", ""):
        with pytest.raises(ValueError):
            parse_vllm_metrics(bad)


def test_the_capacity_is_kv_cache_size_tokens_where_the_server_says_it():
    # a hybrid model's blocks only approximate its capacity (seen: block_size 832)
    hybrid = VLLM_TEXT.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="40",kv_cache_size_tokens="30000"')
    hybrid = hybrid.replace('block_size="16"', 'block_size="832"')
    assert parse_vllm_metrics(hybrid).kv_capacity_tokens == 30000
    unknown = VLLM_TEXT.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="2048",kv_cache_size_tokens="None"')
    assert parse_vllm_metrics(unknown).kv_capacity_tokens == 32768  # "None": the blocks say it


class MetricsEndpoint:
    """A served /metrics whose behaviour the test switches: ok, renamed, 500, hang, NaN."""

    def __init__(self):
        self.mode = "ok"

    async def handle(self, request):
        if self.mode == "hang":
            await asyncio.sleep(2)  # far beyond the probe's timeout
        if self.mode == "500":
            return web.Response(status=500, text="boom")
        text = {"ok": VLLM_TEXT, "nan": VLLM_TEXT.replace("0.42", "NaN"), "hot": VLLM_TEXT.replace("0.42", "0.95"),
                "renamed": VLLM_TEXT.replace("vllm:kv_cache_usage_perc", "vllm:kv_usage_ratio")}[self.mode]
        return web.Response(text=text)


@pytest.fixture
async def endpoint():
    served = MetricsEndpoint()
    app = web.Application()
    app.router.add_get("/metrics", served.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield served, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_misbehaving_metrics_read_as_saturated(endpoint):
    served, url = endpoint
    now = [100.0]
    probe = VllmMetricsProbe(url, timeout_s=0.3, stale_after_s=5, clock=lambda: now[0])
    assert probe.reading(now[0]).saturated  # never polled
    async with aiohttp.ClientSession() as session:
        await probe.poll(session)
        assert probe.reading(now[0]) == BackendReading(0.42, 32768, False)
        now[0] += 6  # no fresh sample for longer than stale_after_s
        assert probe.reading(now[0]).saturated
        for mode in ("renamed", "500", "hang", "nan"):
            served.mode = "ok"
            await probe.poll(session)
            assert not probe.reading(now[0]).saturated
            served.mode = mode
            await probe.poll(session)
            reading = probe.reading(now[0])
            assert reading.saturated and reading.kv_usage == 1.0, mode
            assert reading.kv_capacity_tokens == 32768  # the last known capacity is kept


async def test_unreachable_backend_reads_as_saturated():
    probe = VllmMetricsProbe("http://127.0.0.1:9", timeout_s=0.3, stale_after_s=5)
    async with aiohttp.ClientSession() as session:
        await probe.poll(session)
    assert probe.reading(0.0) == BackendReading(1.0, None, True)


class FakeNvml:
    """Behaves like pynvml: module-level functions, NVMLError raised from any of them."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus=((80 * 1024**3, 10 * 1024**3, 55, 30),), fail_init=False, fail_read=False):
        self.gpus, self.fail_init, self.fail_read = gpus, fail_init, fail_read

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if self.fail_read:
            raise self.NVMLError("GPU is lost")
        return index

    def nvmlDeviceGetMemoryInfo(self, handle):
        total, free, _, _ = self.gpus[handle]
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetUtilizationRates(self, handle):
        _, _, sm, mem = self.gpus[handle]
        return SimpleNamespace(gpu=sm, memory=mem)


def test_nvml_readings():
    probe = NvmlProbe(FakeNvml())
    assert probe.enabled
    (gpu,) = probe.read()
    assert gpu.free_bytes == 10 * 1024**3 and gpu.sm_utilization == 0.55 and gpu.memory_utilization == 0.30


def test_nvml_raising_disables_or_reads_as_unknown():
    assert not NvmlProbe(FakeNvml(fail_init=True)).enabled
    assert NvmlProbe(FakeNvml(fail_init=True)).read() is None
    assert NvmlProbe(FakeNvml(fail_read=True)).read() == []  # unknown: no free memory assumed


def test_real_nvml_without_a_gpu_disables_itself(caplog):
    """On a machine without an NVIDIA driver the real pynvml fails to initialise."""
    with caplog.at_level("WARNING", logger="extproc.probes"):
        probe = NvmlProbe()
    if probe.enabled:  # a machine with a GPU: the probe must read it
        assert all(g.total_bytes > 0 for g in probe.read())
    else:
        assert "nvml" in probe.reason.lower() and probe.read() is None
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # said once


# -- vllm-args ---------------------------------------------------------------------------------


def test_vllm_args_follow_the_seed():
    args = {a.flag: a for a in recommend_vllm_args(gpus=4, gpu_memory_gib=80)}
    assert args["--max-num-seqs"].value == "16"  # min(4 x 4, 32)
    assert args["--max-model-len"].value == "16384"
    assert args["--scheduling-policy"].value == "priority"
    assert {a.value for a in recommend_vllm_args(gpus=16, gpu_memory_gib=80) if a.flag == "--max-num-seqs"} == {"32"}
    assert all(a.reason for a in args.values())


def test_vllm_args_command():
    result = subprocess.run([sys.executable, "-m", "extproc", "vllm-args", "--gpus", "2", "--gpu-memory-gib", "80"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "--max-num-seqs 8" in result.stdout and "--tensor-parallel-size 2" in result.stdout
    assert result.stdout.count("#") >= 5  # a reason for each flag


@contextlib.asynccontextmanager
async def load_controller(capacity: dict, max_inflight: int | None = None):
    """A started LoadController over the primary pool with `capacity`, on a clock the test
    moves (`clock[0]`), feeding a local store: yields (controller, store, clock)."""
    from extproc.control.load_control import LoadController
    from extproc.core.config import parse_config
    from extproc.ops.metrics import Metrics
    from extproc.stores.local_queue import LocalQueueStore

    from ..conftest import e2e_config

    raw = e2e_config()
    raw["pools"]["primary"]["capacity"] = capacity
    if max_inflight is not None:
        raw["pools"]["primary"]["max_inflight"] = max_inflight
    raw["probes"] = {"nvml": "off", "stale_after_s": 5}
    store = LocalQueueStore({"primary": 1, "fallback": 4})
    clock = [0.0]
    controller = LoadController(parse_config(raw), store, Metrics(), nvml=None, clock=lambda: clock[0])
    await controller.start()
    try:
        yield controller, store, clock
    finally:
        await controller.stop()


async def test_load_controller_shrinks_the_budget_when_the_cache_runs_hot(endpoint):
    served, url = endpoint
    async with load_controller({"backends": [url], "aimd": {"interval_s": 1.0, "decrease": 0.5}}) \
            as (controller, store, now):
        seen = 0.42 * 32768  # tokens vLLM reports in use that the sidecar did not admit
        assert (await store.snapshot("primary")).budget_tokens == int(32768 * 0.85 - seen)
        served.mode = "hot"
        now[0] += 1
        await controller.tick()
        assert controller.aimd["primary"].factor == 0.5  # 0.95 > 0.85: multiplicative decrease
        assert (await store.snapshot("primary")).budget_tokens == 0  # 0.5 x 27852 - 0.95 x 32768 < 0
        served.mode = "ok"
        now[0] += 1
        await controller.tick()
        assert controller.aimd["primary"].factor == pytest.approx(0.55)  # below the low mark: one step up
        assert (await store.snapshot("primary")).budget_tokens == int(32768 * 0.85 * 0.55 - seen)
        served.mode = "500"
        now[0] += 1
        await controller.tick()
        assert (await store.snapshot("primary")).budget_tokens == 0  # unreadable: full, never idle


async def test_engines_that_are_down_add_no_room_no_slot_and_no_spread(endpoint):
    """One engine answers, three listed beside it are stopped (an autoscaler's scale-in, a crash):
    the pool's budget, count and spread are the live engine's, and the AIMD factor follows its
    cache, not the stopped engines' (read as full). Before, each stopped engine took 15 % of its
    cache from the budget, added its slots to the count, and multiplied every request's charge
    under the spread rule: one long prompt stopped every admission."""
    _, url = endpoint
    stopped = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    capacity = {"backends": [url, *stopped], "pick_backend": True, "max_num_seqs": 4,
                "kv_tokens_per_backend": 32768,  # the stopped ones' caches are known
                "aimd": {"interval_s": 1.0, "decrease": 0.5}}
    async with load_controller(capacity, max_inflight=16) as (controller, store, now):
        for _ in range(3):
            now[0] += 1
            await controller.tick()
        snapshot = await store.snapshot("primary")
        assert snapshot.budget_tokens == int(32768 * 0.85 - 0.42 * 32768)  # the live engine's room, all of it
        assert snapshot.max_inflight == 4  # its sequences, not the four engines'
        line = store._lines["primary"]  # (the line's own settings: no accessor outside the store)
        assert line.spread == 1
        assert line.long_share == 0.5  # long_share, no longer a fourth of it: one engine holds them all
        assert line.engines == 1  # and a long one alone may take the live engine's whole part
        assert controller.aimd["primary"].factor == 1.0  # 0.42 used: no cut


async def test_engines_never_read_are_not_known_to_be_down():
    """Where no listed engine was ever read (its /metrics unreachable from the sidecar), nothing
    says they are down: the count is the listed engines' slots, as the configuration says."""
    capacity = {"backends": [f"http://127.0.0.1:{free_port()}" for _ in range(3)], "max_num_seqs": 4}
    async with load_controller(capacity, max_inflight=64) as (controller, store, now):
        now[0] += 10
        await controller.tick()
        assert (await store.snapshot("primary")).max_inflight == 12  # 3 x 4, not one engine's
        assert store._lines["primary"].engines == 3  # a long one alone may take a third of the budget


def test_the_latency_limiter_shrinks_while_the_target_is_missed_and_grows_back():
    from extproc.core.capacity import LatencyLimiter

    limiter = LatencyLimiter(window_s=5, interval_s=1, min_samples=5)

    def second(t: int, service_s: float, ceiling: int = 32) -> int | None:
        for j in range(10):  # ten samples during the second before t, then the decision
            limiter.observe(t - 1 + j / 10, service_s, 2.0)
        return limiter.update(t, ceiling)

    assert limiter.update(0, 32) is None  # no samples: no cap
    # 1.5x the target: cut in proportion, at most halved per second, down to a quarter of the pool
    assert [second(t, 3.0) for t in range(1, 5)] == [16, 8, 8, 8]
    assert limiter.update(4.5, 32) == 8  # once per interval
    limiter.limit = 20
    assert [second(t, 1.4) for t in range(10, 13)] == [17, 14, 12]  # 0.7 of the target: x 0.6 / 0.7
    assert [second(t, 1.2) for t in range(20, 23)] == [12, 12, 12]  # 0.6 of it, on the upper mark: holds
    assert [second(t, 0.5) for t in range(30, 34)] == [16, 20, 24, 28]  # 0.25 of it: an eighth at a time
    limiter.limit = 29
    assert second(34, 0.5) is None  # back at the ceiling: no cap
    assert second(41, 3.0) == 16  # cut at 41...
    assert limiter.update(45, 32) == 16  # ...no samples since, but not yet a whole window: holds
    assert limiter.update(46, 32) == 20  # a whole window (5 s) without news: grows
    assert limiter.update(60, 4) is None  # no samples for a while: no cap
    assert [second(t, 40.0, ceiling=4) for t in range(61, 65)] == [2, 1, 1, 1]  # within the ceiling, never below 1
    limiter.limit = 22
    assert limiter.update(64.5, 8) is None  # a cap above a pool limit that shrank since is no cap

    # with headroom, the classes without a target never hold the whole pool, even unhurried
    reserved = LatencyLimiter(window_s=5, interval_s=1, min_samples=5, headroom_share=0.25)
    assert reserved.update(0, 32) == 24
    assert reserved.update(10, 8) == 6


def test_the_latency_limiter_settles_under_a_steady_load_and_never_starves_the_pool():
    from extproc.core.capacity import LatencyLimiter

    # a pool where the latency-bound class's service time grows with what the cap lets in
    limiter = LatencyLimiter(window_s=5, interval_s=1, min_samples=5)
    history = []
    for t in range(1, 200):
        service_s = 0.5 + 0.06 * (40 if limiter.limit is None else limiter.limit)
        for j in range(10):
            limiter.observe(t - 1 + j / 10, service_s, 2.0)
        history.append(limiter.update(t, 40))
    settled = history[60:]
    assert len(set(settled)) == 1  # no oscillation: one value for the last 140 intervals
    assert 0.5 + 0.06 * settled[0] <= 0.6 * 2.0  # inside the target's upper mark
    assert settled[0] > 5  # and not needlessly low: (0.4 x 2 - 0.5) / 0.06 is the lower mark

    # a latency that does not come from load (one long prompt alone) cannot shut the pool
    stuck = LatencyLimiter(window_s=5, interval_s=1, min_samples=5)
    for t in range(1, 100):
        for j in range(10):
            stuck.observe(t - 1 + j / 10, 9.0, 2.0)
        assert stuck.update(t, 40) >= 10  # a quarter of the pool stays for the other classes


async def test_the_capacity_loop_caps_a_pool_whose_latency_bound_class_is_slow():
    from extproc.control.load_control import LoadController
    from extproc.core.admission import Ticket
    from extproc.core.config import parse_config
    from extproc.ops.metrics import Metrics
    from extproc.stores.local_queue import LocalQueueStore
    from extproc.stores.queue import Lease, Waiter

    from ..conftest import e2e_config

    raw = e2e_config()
    raw["classes"]["loan_approval"]["latency_target_s"] = 2
    raw["pools"]["primary"]["max_inflight"] = 20
    # (Envoy places this pool's requests: its floor is the quarter only when told so)
    raw["pools"]["primary"].setdefault("capacity", {})["latency_floor_share_envoy_placed"] = 0.25
    config = parse_config(raw)
    store = LocalQueueStore({name: pool.max_inflight for name, pool in config.pools.items()})
    now = [100.0]
    load = LoadController(config, store, Metrics(), None, clock=lambda: now[0])
    numbers = iter(range(1000))

    def cap(pool: str = "primary") -> float:
        return load.metrics.latency_limit.labels(pool)._value.get()

    async def fill() -> list[Lease]:
        """Archive queries take every slot the cap allows (the one that must wait leaves)."""
        taken = []
        while isinstance(got := await store.enqueue("primary", Ticket(2, (n := next(numbers)), f"a{n}",
                                                                     "archive_query", bounded=False)), Lease):
            taken.append(got)
        assert isinstance(got, Waiter)
        store.withdraw(got)
        return taken

    await load.start()
    try:
        assert cap() == 5  # nothing runs yet: the cap follows what runs, within a quarter of the pool
        fallback_limit = config.pools["fallback"].max_inflight
        assert cap("fallback") == 1 and fallback_limit == 4  # idle too: its floor
        running = await fill()
        for _ in range(3):  # the classes without a target use all it allows; no loan yet: a step a tick
            now[0] += 1
            await load.tick()
            running += await fill()
        assert cap() == len(running) == 11
        for _ in range(20):
            load.first_byte(FirstByte("primary", "loan_approval", 1.4, 1.0, True))  # 0.7 of the target: just over the mark
            load.first_byte(FirstByte("primary", "complaint", 50.0, 1.0, True))  # no target: not counted
            load.first_byte(FirstByte("primary", "loan_approval", 9.0, 1.0, False))  # a failure: not the limiter's
        now[0] += 1
        await load.tick()
        assert cap() == 9  # 11 x 0.6 / 0.7
        for lease in running[:2]:
            await store.release(lease)
        assert isinstance(await store.enqueue("primary", Ticket(2, 999, "a999", "archive_query", bounded=False)),
                          Waiter)  # 9 run: the cap holds the next one
        loans = [await store.enqueue("primary", Ticket(0, 100 + i, f"loan{i}", "loan_approval")) for i in range(12)]
        assert [isinstance(lease, Lease) for lease in loans] == [True] * 11 + [False]  # the other 11 slots are theirs
    finally:
        await load.stop()


def test_the_ledger_follows_the_backend_envoy_really_sent_the_request_to():
    config = SimpleNamespace(pools={"p": SimpleNamespace(capacity=SimpleNamespace(
        picks_backend=True, backends=("http://10.0.0.1:8000", "http://10.0.0.2:8000"), kv_tokens_per_backend=None,
        max_num_seqs=8, safety_factor=1.0, keep_long_apart=True, spill_tokens_per_s=2048.0, bound_lately_s=0.0))})
    picker = BackendPicker(lambda: config)
    picker.observe("p", {url: BackendReading(0.0, 20000, False) for url in config.pools["p"].capacity.backends})
    assert picker.pick("p", "a", Placing(9000)).startswith("10.0.0.1:8000")
    picker.moved("a", "10.0.0.2:8000")  # its pick was ejected: Envoy sent it to the next one
    assert picker.running("p") == {"10.0.0.2:8000": (1, 9000)}
    assert picker.pick("p", "b", Placing(9000)).startswith("10.0.0.1:8000")  # so the next goes where there is room
    picker.moved("b", "10.0.0.9:8000")  # not one of the pool's backends: nothing to follow
    picker.release("a")
    picker.release("b")
    assert picker.running("p") == {}


def _loan_latency_s(params, per_engine: float, prompt_tokens: int = 500, output_tokens: int = 64) -> float:
    """A loan's whole answer on an engine running `per_engine` sequences, each replaced as it ends
    by another of the same shape (the simulator's step model: every step decodes one token of
    each, and the prompts that join spread their prefill over the steps)."""
    from extproc_testbed.sim_engine import step_seconds

    prefill_s = prompt_tokens * params.prefill_s_per_token
    step_s = step_seconds(params, 0, max(1, round(per_engine))) + per_engine * prefill_s / output_tokens
    return prefill_s + output_tokens * step_s


def _burst(limiter, params, ceiling: int, seconds: int, light_until: int = 0, loans_in_flight: int = 3,
           loans_per_s: int = 3) -> list[tuple[int, int, float]]:
    """Each second: the classes without a target use what the cap lets them (every slot of it in
    the burst; 4 before `light_until`), the loans' latency follows from the concurrency per engine,
    then the cap is updated. Returns (second, cap in force, loan latency) per second."""
    history = []
    cap = limiter.update(0, ceiling, 0)
    for t in range(1, seconds + 1):
        allowed = ceiling - loans_in_flight if cap is None else cap
        in_use = min(4, allowed) if t <= light_until else allowed
        latency = _loan_latency_s(params, (in_use + loans_in_flight) / 2)
        for j in range(loans_per_s):
            limiter.observe(t - 1 + j / loans_per_s, latency, 2.0)
        history.append((t, allowed, latency))
        cap = limiter.update(t, ceiling, in_use)
    return history


@pytest.mark.parametrize("sequences", [8, 32])
def test_the_latency_limiter_finds_the_concurrency_that_keeps_loans_in_target_from_the_full_slot_count(sequences):
    """Two engines of `sequences`, max_inflight at their slot count, the shipped limiter settings,
    and a burst that fills whatever the cap allows: from the engines' full slot count, the cap
    comes down within seconds to where the loans' latency is inside their target, and stays."""
    from extproc.core.capacity import LatencyLimiter
    from extproc_testbed.sim_engine import SimParams

    params, ceiling = SimParams(max_num_seqs=sequences), 2 * sequences
    limiter = LatencyLimiter().configure(window_s=10, interval_s=1, floor_share=0.25, headroom_share=0.25)
    limiter.limit = None  # as after a quiet spell under the old rule: no cap at all
    history = _burst(limiter, params, ceiling, 60)
    settled_at = next(t for t, _, latency in history if all(later <= 2.0 for _, _, later in history[t - 1:]))
    assert settled_at <= 12, history
    caps = {cap for t, cap, _ in history[settled_at + 5:]}
    assert len(caps) == 1 and caps.pop() >= limiter.floor(ceiling)  # settled, within the floor


def test_a_burst_after_a_light_spell_grows_from_what_ran_and_never_overshoots_the_target():
    """While the load is light the cap follows what runs, a step above it; the burst then grows
    it a step at a time while the loans stay inside their target, instead of every slot at once."""
    from extproc.core.capacity import LatencyLimiter
    from extproc_testbed.sim_engine import SimParams

    params, ceiling = SimParams(max_num_seqs=32), 64
    limiter = LatencyLimiter().configure(window_s=10, interval_s=1, floor_share=0.25, headroom_share=0.25)
    history = _burst(limiter, params, ceiling, 60, light_until=20)
    light = [cap for t, cap, _ in history if 5 < t <= 20]
    assert max(light) <= limiter.floor(ceiling) + ceiling // 8  # it followed the light load
    assert all(latency <= 2.0 for _, _, latency in history), history
    assert all(cap >= limiter.floor(ceiling) for _, cap, _ in history)  # the floor stays the others' all along


@pytest.mark.parametrize("picks, followed, alone, lower", [
    (False, None, True, True),  # Envoy places every request: nothing keeps long prompts apart in space
    (True, None, False, False),  # nothing says yet that Envoy follows, but fewer than two engines answer
    (True, True, False, False),
    (True, False, True, True),  # Envoy ignores the picks
])
async def test_where_envoy_places_requests_long_prompts_wait_and_the_latency_cap_goes_lower(picks, followed, alone,
                                                                                             lower):
    """Long prompts wait for the latency-bound requests wherever Envoy is not known to follow the
    sidecar's picks (its own policy places the requests, or no verdict yet), and the latency
    cap's floor is the lower `latency_floor_share_envoy_placed` where Envoy's own policy does."""
    from extproc.control.load_control import LoadController
    from extproc.core.config import parse_config
    from extproc.ops.metrics import Metrics
    from extproc.stores.local_queue import LocalQueueStore

    from ..conftest import e2e_config

    raw = e2e_config()
    raw["classes"]["loan_approval"]["latency_target_s"] = 2
    if picks:  # (nothing listens there: the engines read as saturated, which changes nothing here)
        raw["pools"]["primary"]["capacity"] = {"backends": ["http://127.0.0.1:9"], "pick_backend": True}
    config = parse_config(raw)
    store = LocalQueueStore({name: pool.max_inflight for name, pool in config.pools.items()})
    load = LoadController(config, store, Metrics(), None)
    load.picks_followed = lambda pool: followed
    await load.start()
    try:
        assert store._lines["primary"].long_alone is alone
        # where two engines or more answer, the sidecar places long prompts apart only once it knows
        # that Envoy follows its picks; until then it keeps them apart in time too
        assert load.long_rule("primary", 2) == ("placed_apart" if picks and followed else "wait_for_quiet")
        # and the operator is told which rule holds the long prompts (queue page, admin state): where
        # the sidecar places them, its one listed engine does not answer, so one starts beside anything
        assert load.long_prompts("primary") == ("wait_for_quiet" if alone else "one_engine")
        capacity = config.pools["primary"].capacity
        assert store._lines["primary"].long_quiet_s == capacity.long_quiet_s == 2.0  # the shipped default
        assert capacity.latency_floor_share_envoy_placed < capacity.latency_floor_share
        floor = capacity.latency_floor_share_envoy_placed if lower else capacity.latency_floor_share
        assert load.latency["primary"].floor_share == floor
        if picks:  # the verdict turns (followed where it was ignored or unknown, and back): the tick the
            load.picks_followed = lambda pool: alone  # server asks for at once (on PicksJudged) follows it
            task = load.tick_soon()
            assert task is not None and load.tick_soon() is task  # (asked twice: one tick)
            await task
            assert store._lines["primary"].long_alone is not alone
            assert load.long_prompts("primary") == ("one_engine" if alone else "wait_for_quiet")
            floor = capacity.latency_floor_share if alone else capacity.latency_floor_share_envoy_placed
            assert load.latency["primary"].floor_share == floor
    finally:
        await load.stop()
    assert load.tick_soon() is None  # stopped (a reload replaced it): no tick runs


def test_the_server_asks_for_a_tick_when_the_picks_verdict_turns(tmp_path):
    """The sidecar hears PicksJudged and asks its capacity loop (the one in force: a reload
    replaces it) for a tick at once, so the long prompts' rule follows the verdict."""
    from extproc.core.events import PicksJudged

    from ..conftest import e2e_config
    from ..helpers import sidecar_from_file

    server = sidecar_from_file(tmp_path / "extproc.yaml", e2e_config())
    asked: list[str] = []
    server.load.tick_soon = lambda: asked.append("tick")
    server.observers.emit(PicksJudged("primary", True))
    server.observers.emit(PicksJudged("primary", False))
    assert asked == ["tick", "tick"]


async def test_a_pool_that_picks_without_keeping_prompts_apart_gets_the_lower_floor_and_holds_no_long_prompt():
    """`keep_long_apart: false`: the sidecar places by KV tokens alone, nothing keeps the other
    classes' prompts off the loans' engines, so the cap's floor is the lower one; long prompts are
    not held either (that rule is part of keeping apart)."""
    from extproc.control.load_control import LoadController
    from extproc.core.config import parse_config
    from extproc.ops.metrics import Metrics
    from extproc.stores.local_queue import LocalQueueStore

    from ..conftest import e2e_config

    raw = e2e_config()
    raw["classes"]["loan_approval"]["latency_target_s"] = 2
    raw["pools"]["primary"]["capacity"] = {"backends": ["http://127.0.0.1:9"], "pick_backend": True,
                                           "keep_long_apart": False}
    config = parse_config(raw)
    store = LocalQueueStore({name: pool.max_inflight for name, pool in config.pools.items()})
    load = LoadController(config, store, Metrics(), None, picks_followed=lambda pool: True)
    await load.start()
    try:
        assert store._lines["primary"].long_alone is False
        assert load.long_prompts("primary") == "not_kept_apart"
        capacity = config.pools["primary"].capacity
        assert load.latency["primary"].floor_share == capacity.latency_floor_share_envoy_placed
    finally:
        await load.stop()
