"""Two sidecar replicas behind real Envoy, sharing one real Redis: global limits and order, and
the faults a shared queue must survive (a replica killed, Redis stopped, paused, restarted)."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest
import yaml

from extproc_testbed.redis_server import RedisServer
from extproc_testbed.stack import SimSpec, Stack, StackPorts

from ..conftest import TIME_SCALE, e2e_config
from ..helpers import async_wait_until, chat, metric, webhook_receiver
from .test_e2e import pause_sims, send, sim_stats

PREFIX = "{extproc:primary}"


def shared_config(max_inflight: int, **redis_settings) -> dict:
    config = e2e_config()
    config["pools"]["primary"]["max_inflight"] = max_inflight
    config["pools"]["primary"]["tiers"] = {"yellow": 30, "orange": 50, "red": 80, "hard_max": 200}
    config["redis"] = {"lease_s": 2, "op_timeout_s": 0.25, "recheck_s": 0.5, **redis_settings}
    return config


def start_shared_stack(tmp, redis_url: str, config: dict, replicas: int = 2) -> Stack:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    sim_args = ("--time-scale", TIME_SCALE)
    return Stack(
        tmp, StackPorts.random(primary=1, replicas=replicas), path,
        primary=SimSpec("deepseek-sim", sim_args), fallback=SimSpec("deepseek-sim-small", sim_args),
        redis_url=redis_url,
    )  # started and stopped by `with`


def leases_that_expired(redis_server: RedisServer) -> int:
    """Leases Redis had to reap because their owner never released them (0: every release landed)."""
    return redis_server.client().zcard(f"{PREFIX}:reaped")


def shared_state(redis_server: RedisServer) -> tuple[int, int]:
    """(admitted, waiting) of the primary pool, read from Redis itself."""
    client = redis_server.client()
    inflight = int(client.hget(f"{PREFIX}:st", "inflight") or 0)
    return inflight, client.zcard(f"{PREFIX}:wait")


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


async def test_two_replicas_keep_the_global_limit_and_the_global_order(tmp_path, redis_server):
    with start_shared_stack(tmp_path / "stack", redis_server.url, shared_config(max_inflight=1)) as stack:
        async with aiohttp.ClientSession() as session:
            pause_sims(stack, True, ("primary",))
            blocker = asyncio.create_task(send(session, stack, chat(user="blocker"), x_ticket_type="complaint"))
            await async_wait_until(lambda: shared_state(redis_server)[0] == 1)
            arrivals = [("archive", "archive_query"), ("complaint", "complaint"), ("loan", "loan_approval"),
                        ("archive-2", "archive_query"), ("loan-2", "loan_approval")]
            tasks = []
            for n, (user, ticket_type) in enumerate(arrivals, start=1):
                tasks.append(asyncio.create_task(send(session, stack, chat(user=user), x_ticket_type=ticket_type)))
                await async_wait_until(lambda n=n: shared_state(redis_server)[1] == n)
            # tickets from both replicas wait in the one line, and each replica reports its depth
            client = redis_server.client()
            owners = {client.hget(key, "o") for key in client.keys(f"{PREFIX}:tk:*")}
            assert len(owners) == 2
            await async_wait_until(lambda: all(
                metric(stack.replica_metrics_url(i), "extproc_queue_depth", pool="primary") == 5 for i in (0, 1)))
            pause_sims(stack, False, ("primary",))
            results = await asyncio.gather(blocker, *tasks)
        assert [status for status, _, _ in results] == [200] * 6
        served = [s["user"] for s in sim_stats(stack)["started"]]
        assert served == ["blocker", "loan", "loan-2", "complaint", "archive", "archive-2"]
        assert sim_stats(stack)["max_running_seen"] == 1  # never more than the pool's one slot
        await async_wait_until(lambda: shared_state(redis_server) == (0, 0), what="every slot released")
        assert leases_that_expired(redis_server) == 0


async def test_concurrent_burst_through_two_replicas_never_exceeds_the_limit(tmp_path, redis_server):
    with start_shared_stack(tmp_path / "stack", redis_server.url, shared_config(max_inflight=3)) as stack:
        async with aiohttp.ClientSession() as session:
            results = await asyncio.gather(*(
                send(session, stack, chat(max_tokens=8, user=f"u{i}"), x_ticket_type="complaint") for i in range(24)
            ))
        assert [status for status, _, _ in results] == [200] * 24
        # counted at the backend: never more than the limit, and the capacity was used
        assert sim_stats(stack)["max_running_seen"] == 3
        await async_wait_until(lambda: shared_state(redis_server) == (0, 0), what="every slot released")
        assert leases_that_expired(redis_server) == 0


async def test_a_killed_replica_gives_its_slots_back_within_one_lease(tmp_path, redis_server):
    with start_shared_stack(tmp_path / "stack", redis_server.url, shared_config(max_inflight=4)) as stack:
        async with aiohttp.ClientSession() as session:
            pause_sims(stack, True, ("primary",))
            tasks = [asyncio.create_task(send(session, stack, chat(user=f"u{i}"), x_ticket_type="complaint"))
                     for i in range(4)]
            await async_wait_until(lambda: shared_state(redis_server)[0] == 4)
            client = redis_server.client()
            owner_of = {i: v.split("|")[0] for i, v in client.hgetall(f"{PREFIX}:li").items()}
            victim_owner = next(iter(owner_of.values()))
            victim = next(p for p in stack.sidecars if f"-{p.pid}-" in victim_owner)
            victim_leases = [i for i, owner in owner_of.items() if owner == victim_owner]
            victim.signal(signal.SIGKILL)
            # By Redis's clock, no lease outlives one lease (2 s) from now: nobody renews them
            seconds, micros = client.time()
            redis_now_ms = seconds * 1000 + micros // 1000
            assert all(client.zscore(f"{PREFIX}:lease", i) <= redis_now_ms + 2000 for i in victim_leases)
            await async_wait_until(lambda: shared_state(redis_server)[0] == 4 - len(victim_leases), timeout=10,
                                   what="the dead replica's leases to be reaped")
            assert set(client.hkeys(f"{PREFIX}:li")) == set(owner_of) - set(victim_leases)  # only the dead one's
            pause_sims(stack, False, ("primary",))
            await asyncio.gather(*tasks, return_exceptions=True)
        await async_wait_until(lambda: shared_state(redis_server) == (0, 0), what="every slot back")


@pytest.mark.parametrize("fault", ["sigstop", "client_pause"])
async def test_redis_stalled_every_request_is_answered_in_local_mode(tmp_path, redis_server, fault):
    with start_shared_stack(tmp_path / "stack", redis_server.url, shared_config(max_inflight=2), replicas=1) as stack:
        async with aiohttp.ClientSession() as session:
            pause_sims(stack, True, ("primary",))
            held = [asyncio.create_task(send(session, stack, chat(user=f"h{i}"), x_ticket_type="complaint"))
                    for i in range(2)]
            await async_wait_until(lambda: shared_state(redis_server)[0] == 2)
            queued = asyncio.create_task(send(session, stack, chat(user="queued"), x_ticket_type="complaint"))
            await async_wait_until(lambda: shared_state(redis_server)[1] == 1)
            if fault == "sigstop":
                redis_server.pause()
            else:
                redis_server.client().execute_command("CLIENT", "PAUSE", "4000", "ALL")
            fresh = [asyncio.create_task(send(session, stack, chat(user=f"f{i}"), x_ticket_type="loan_approval"))
                     for i in range(2)]
            await async_wait_until(lambda: metric(stack.metrics_url, "extproc_store_degraded") == 1,
                                   what="the replica to notice")
            pause_sims(stack, False, ("primary",))
            results = await asyncio.gather(*held, queued, *fresh)
            # every request got an answer, none of them Envoy's message-timeout 504 or a 500
            assert [status for status, _, _ in results] == [200] * 5
            if fault == "sigstop":
                redis_server.resume()
            await async_wait_until(lambda: metric(stack.metrics_url, "extproc_store_degraded") == 0, timeout=15,
                                   what="recovery")
            status, _, _ = await send(session, stack, chat(user="after"), x_ticket_type="complaint")
            assert status == 200
        await async_wait_until(lambda: shared_state(redis_server) == (0, 0), what="no leaked slot in Redis")
        await async_wait_until(lambda: metric(stack.metrics_url, "extproc_inflight", pool="primary") == 0)


async def test_redis_killed_and_restarted_service_resumes_without_leaks(tmp_path, redis_server):
    with start_shared_stack(tmp_path / "stack", redis_server.url, shared_config(max_inflight=2), replicas=1) as stack:
        async with aiohttp.ClientSession() as session:
            status, _, _ = await send(session, stack, chat(), x_ticket_type="complaint")
            assert status == 200
            redis_server.kill()
            results = await asyncio.gather(*(send(session, stack, chat(), x_ticket_type="complaint") for _ in range(4)))
            assert [s for s, _, _ in results] == [200] * 4  # served in local mode
            assert metric(stack.metrics_url, "extproc_store_degraded") == 1
            redis_server.start()  # same port, empty
            await async_wait_until(lambda: metric(stack.metrics_url, "extproc_store_degraded") == 0, timeout=15)
            results = await asyncio.gather(*(send(session, stack, chat(), x_ticket_type="complaint") for _ in range(4)))
            assert [s for s, _, _ in results] == [200] * 4
        assert int(redis_server.client().get(f"{PREFIX}:seq") or 0) >= 4  # went through Redis again
        await async_wait_until(lambda: shared_state(redis_server) == (0, 0))
        await async_wait_until(lambda: metric(stack.metrics_url, "extproc_inflight", pool="primary") == 0)


async def test_client_gone_while_queued_leaves_no_ticket_in_redis(tmp_path, redis_server):
    with start_shared_stack(tmp_path / "stack", redis_server.url, shared_config(max_inflight=1), replicas=1) as stack:
        async with aiohttp.ClientSession() as session:
            pause_sims(stack, True, ("primary",))
            blocker = asyncio.create_task(send(session, stack, chat(), x_ticket_type="complaint"))
            await async_wait_until(lambda: shared_state(redis_server)[0] == 1)
            waiting = asyncio.create_task(send(session, stack, chat(user="gone"), x_ticket_type="complaint"))
            await async_wait_until(lambda: shared_state(redis_server)[1] == 1)
            waiting.cancel()
            await async_wait_until(lambda: shared_state(redis_server)[1] == 0, what="the ticket to leave Redis")
            assert redis_server.client().keys(f"{PREFIX}:tk:*") == []
            pause_sims(stack, False, ("primary",))
            await blocker
        await async_wait_until(lambda: shared_state(redis_server) == (0, 0))
        assert "gone" not in [s["user"] for s in sim_stats(stack)["started"]]


async def test_the_scale_out_signal_is_posted_once_however_many_replicas_see_yellow(tmp_path, redis_server):
    config = shared_config(max_inflight=1)
    config["pools"]["primary"]["tiers"] = {"yellow": 2, "orange": 50, "red": 80, "hard_max": 200}
    async with webhook_receiver() as (url, received):
        config["queue"] = {"scale_out_webhook": url}
        with start_shared_stack(tmp_path / "stack", redis_server.url, config) as stack:
            async with aiohttp.ClientSession() as session:
                pause_sims(stack, True, ("primary",))
                sent = [asyncio.create_task(send(session, stack, chat(), x_ticket_type="complaint")) for _ in range(5)]
                await async_wait_until(lambda: shared_state(redis_server) == (1, 4))  # depth 4 > yellow 2
                for replica in range(2):  # every replica sees the shared queue turn yellow...
                    await async_wait_until(
                        lambda r=replica: metric(stack.replica_metrics_url(r), "extproc_tier", pool="primary") == 1
                    )
                await async_wait_until(lambda: received)
                pause_sims(stack, False, ("primary",))
                assert [status for status, _, _ in await asyncio.gather(*sent)] == [200] * 5
        assert len(received) == 1  # ...and the webhook heard it once
        assert received[0]["pool"] == "primary" and received[0]["tier"] == "yellow"


async def test_a_draining_replica_waits_for_its_own_exchanges_only(tmp_path, redis_server):
    config = shared_config(max_inflight=1)  # drain_timeout_s: 20
    with start_shared_stack(tmp_path / "stack", redis_server.url, config) as stack:
        async with aiohttp.ClientSession() as session:
            pause_sims(stack, True, ("primary",))
            held = asyncio.create_task(send(session, stack, chat(user="held"), x_ticket_type="complaint"))
            await async_wait_until(lambda: shared_state(redis_server)[0] == 1)
            owner = next(iter(redis_server.client().hvals(f"{PREFIX}:li"))).split("|")[0]
            holder = next(p for p in stack.sidecars if f"-{p.pid}-" in owner)
            other = next(p for p in stack.sidecars if p is not holder)
            other.signal(signal.SIGTERM)
            # it exits without waiting out its drain timeout for an exchange another replica holds
            assert await asyncio.to_thread(other.process.wait, 10) == 0
            assert holder.alive() and shared_state(redis_server)[0] == 1
            pause_sims(stack, False, ("primary",))
            status, _, _ = await held
        assert status == 200
        await async_wait_until(lambda: shared_state(redis_server) == (0, 0))


async def test_with_redis_answering_the_idle_in_process_line_never_reports_itself_as_the_pool(redis_server):
    """The in-process line stands by for when Redis fails; its limits are set at every tick.
    While Redis answers, the pool's state the replica reports (tiers, forecasts, drain rates,
    gauges) is the shared line's, never the idle local one's."""
    from extproc.core.admission import PoolLimits, Ticket
    from extproc.core.config import Config
    from extproc.stores.factory import build_queue_store

    redis_server.client().flushall()
    config = Config.model_validate({
        "classes": {"c": {"base": 0}}, "default_class": "c",
        "pools": {"p": {"cluster": "x", "max_inflight": 2}}, "default_pool": "p",
        "redis": {"url": redis_server.url, "lease_s": 2}})
    seen = []
    store = build_queue_store(config, lambda pool, snapshot: seen.append((snapshot.depth, snapshot.inflight)),
                              lambda degraded: None)
    await store.start()
    try:
        for i in range(5):  # 2 admitted, 3 waiting, in Redis
            await store.enqueue("p", Ticket(1.0, i, f"t{i}", "c", "b"))
        assert seen[-1] == (3, 2)
        await store.set_limits("p", PoolLimits(2))  # what load control does at every tick
        assert seen[-1] == (3, 2) and (0, 0) not in seen
    finally:
        await store.stop()
