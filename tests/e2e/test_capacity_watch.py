"""The capacity model inside a running sidecar (control/capacity_watch.py), driven over a real
gRPC channel like test_servicer.py: what the gate decides feeds it, its estimate is exported on
/metrics, shown in the queue page's state, sent with the yellow-tier webhook, and a need beyond
`autoscale.max_backends` goes to the alerts webhook."""

from __future__ import annotations

import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.core.config import parse_config
from extproc.ops.queue_page import state_json
from extproc.server import SidecarServer
from extproc_testbed.stack import metric_sum, parse_samples

from ..conftest import e2e_config
from ..helpers import async_wait_until, webhook_receiver
from .test_servicer import open_exchange, response_headers_msg

CHAT = json.dumps({"model": "deepseek-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()


def config(**overrides):
    return parse_config(e2e_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0}, admin={"port": 0},
                                   **overrides))


@pytest.fixture
async def running():
    servers, channels = [], []

    async def start(**overrides):
        server = SidecarServer(config(**overrides))
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        servers.append(server)
        channels.append(channel)
        return server, pb_grpc.ExternalProcessorStub(channel)

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop()


async def serve_one(stub, ticket: str) -> None:
    ex, _ = await open_exchange(stub, CHAT, x_ticket_type=ticket)
    await ex.send(response_headers_msg(200))
    await ex.receive()
    await ex.finish()


def sample(server: SidecarServer, name: str, **labels) -> float:
    return metric_sum(parse_samples(server.metrics.render().decode()), name, **labels)


async def test_served_requests_give_the_pool_a_capacity_and_a_demand(running):
    server, stub = await running()
    assert sample(server, "extproc_capacity_rps", pool="primary", **{"class": "complaint"}) == -1  # not measured
    for _ in range(10):  # a service time needs ten completions
        await serve_one(stub, "complaint")
    await server.capacity.tick()
    assert sample(server, "extproc_capacity_rps", pool="primary", **{"class": "complaint"}) > 0
    assert sample(server, "extproc_demand_rps", pool="primary", **{"class": "complaint"}) > 0
    assert sample(server, "extproc_desired_backends", pool="primary") == 1  # min_backends: the demand is tiny
    assert sample(server, "extproc_needed_backends", pool="primary", horizon="now") > 0
    pool = json.loads(state_json(await server.read_state()))["pools"][0]
    assert pool["name"] == "primary"
    assert pool["capacity"]["desired_backends"] == 1
    assert pool["capacity"]["capacity_rps"]["complaint"] > 0


async def test_a_retry_is_not_demand_twice(running):
    server, stub = await running()
    model = server.capacity.models["primary"]
    await serve_one(stub, "complaint")
    ex, _ = await open_exchange(stub, CHAT, x_ticket_type="complaint", idempotency_key="k1")
    await ex.send(response_headers_msg(200))
    await ex.receive()
    await ex.finish()
    retry, _ = await open_exchange(stub, CHAT, x_ticket_type="complaint", idempotency_key="k1")
    await retry.send(response_headers_msg(200))
    await retry.receive()
    await retry.finish()
    assert len(model._samples("complaint").arrivals) == 2


async def test_the_yellow_webhook_carries_the_estimate(running):
    async with webhook_receiver() as (url, received):
        server, stub = await running(queue={"scale_out_webhook": url})
        blocker, _ = await open_exchange(stub, CHAT, x_ticket_type="loan_approval")  # the one slot
        queued = [await open_exchange(stub, CHAT, x_ticket_type="complaint") for _ in range(3)]
        await async_wait_until(lambda: received)  # depth 3 > yellow (2)
        assert received[0]["event"] == "scale_out"
        assert received[0]["desired_backends"] >= 1
        assert set(received[0]["capacity"]) >= {"capacity_rps", "demand_rps", "needed_now", "needed_ahead", "beyond_max"}
        for ex, _ in [(blocker, None), *queued]:
            ex.call.cancel()


async def test_a_need_beyond_the_maximum_pages_once_and_sets_the_alert_gauge(running):
    async with webhook_receiver() as (url, received):
        pools = e2e_config()["pools"]
        pools["primary"]["autoscale"] = {"max_backends": 2}
        server, _ = await running(alerts={"webhook": url}, pools=pools)
        model = server.capacity.models["primary"]
        now = server.capacity.clock()
        model._since = now - 30  # demand counted for a whole window (the model trusts no shorter one)
        for i in range(300):  # 10 req/s of 10 s requests on a one-slot engine: far beyond two engines
            model.arrived(now - 29 + i * 0.1, "complaint")
            model.served(now - 29 + i * 0.1, "complaint", 10.0)
        await server.capacity.tick()
        await server.capacity.tick()
        await async_wait_until(lambda: received)
        assert len(received) == 1 and received[0]["event"] == "capacity_beyond_max"
        assert received[0]["pool"] == "primary" and received[0]["max_backends"] == 2
        assert received[0]["desired_backends"] == 2 and received[0]["beyond_max"] is True
        assert sample(server, "extproc_capacity_beyond_max", pool="primary") == 1
        assert sample(server, "extproc_max_backends", pool="primary") == 2


async def test_an_engine_counts_as_serving_only_once_its_probe_has_read_it(running):
    """Engines listed but never read (not started yet, as an autoscaler's are) are not serving:
    counted before their first scrape, every listed engine would be, and the first estimate,
    held by the stabilization window, would want them all for minutes."""
    pools = e2e_config()["pools"]
    pools["primary"].setdefault("capacity", {})["backends"] = [f"http://127.0.0.1:{port}" for port in (9, 19, 29)]
    server, _ = await running(pools=pools)
    for probe in server.load.backends["primary"]:
        probe.sample = probe.sampled_at = probe.failure = None  # as before the first scrape
    await server.capacity.tick()
    estimate = server.capacity.estimates["primary"]
    assert estimate.backends == 0 and estimate.desired == 1  # autoscale.min_backends


async def test_replicas_sharing_a_line_count_the_pools_demand_not_their_share(running, redis_server):
    """Two replicas on one Redis line, each hearing half the arrivals: each one's demand is the
    pool's (what it heard, over its share: one over the replicas Redis counts live), so the
    autoscaler's max() over the replicas asks for the pool, not for half of it."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server.url)
    await client.flushall()
    await client.aclose()
    shared = {"redis": {"url": redis_server.url, "lease_s": 0.6}}
    (a, stub_a), (b, stub_b) = await running(**shared), await running(**shared)
    await async_wait_until(lambda: a.store.shared.replicas("primary") == 2 == b.store.shared.replicas("primary"),
                           10, "Redis to count both replicas")
    for _ in range(6):
        await serve_one(stub_a, "complaint")
        await serve_one(stub_b, "complaint")
    demands = []
    for server in (a, b):
        await server.capacity.tick()
        heard = server.capacity.models["primary"]._samples("complaint")
        assert [weight for _, weight in heard.arrivals] == [2.0] * 6  # each heard stands for two
        demands.append(sample(server, "extproc_demand_rps", pool="primary", **{"class": "complaint"}))
    assert demands[0] == pytest.approx(demands[1], rel=0.2) and demands[0] > 0
