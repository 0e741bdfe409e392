"""Reloading the configuration at run time (SIGHUP, the admin API's Reload) on real servers,
in process and as processes: the next decision using the new file, a bad file or one changing a
restart-only key refused with the old one still enforced, what operators set at run time kept
through a reload, the change record read back from the log, and the metrics. What a reload makes
of a file without a server (the diff, the version, the keys only a restart applies, every key
accounted for) is tested in the unit layer: tests/unit/test_reload_plan.py."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from extproc.admin.v1 import admin_pb2 as pb
from extproc.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.core.breaker import Permit
from extproc.core.config import parse_config
from extproc.ops.reload import ConfigSource
from extproc.server import SidecarServer
from extproc_testbed.redis_server import RedisServer
from extproc_testbed.stack import LOOPBACK, ManagedProcess, free_port, http_get, wait_until

from ..conftest import CLERK_KEY, OFFICER_KEY
from ..helpers import async_wait_until, scrape
from ..unit.test_reload_plan import (CHANGE_LINE, LIVE_CHANGES, NEW_CLERK_KEY, base_config, canary_config, edited,
                                     key_sha, write)
from .test_servicer import Exchange, body_msg, chat_body, headers_msg, response_headers_msg, set_headers


# -- a server in this process, reloaded through the admin API -------------------------------


@pytest.fixture
async def serving(tmp_path):
    """start(data) -> (server, its file, an ext_proc stub, an admin stub): a sidecar served in this
    process from a file holding `data`."""
    started = []

    async def start(data: dict):
        path = write(tmp_path / "extproc.yaml", data)
        source = ConfigSource(str(path))
        server = SidecarServer(source.load(), source=source)
        await server.start()
        channels = [grpc.aio.insecure_channel(f"{LOOPBACK}:{port}") for port in (server.grpc_port, server.admin_port)]
        started.append((server, channels))
        return server, path, ext_grpc.ExternalProcessorStub(channels[0]), pb_grpc.AdminStub(channels[1])

    yield start
    for server, channels in started:
        for channel in channels:
            await channel.close()
        await server.stop()


@pytest.fixture
async def served(serving):
    return await serving(base_config())


async def ask(stub, key: str, ticket_type: str = "complaint") -> tuple[Exchange, object]:
    """Headers and body of one request; its first answer to the body (or to the headers if refused)."""
    exchange = Exchange(stub)
    await exchange.send(headers_msg(authorization=f"Bearer {key}", x_ticket_type=ticket_type))
    first = await exchange.receive()
    if first.HasField("immediate_response"):
        return exchange, first
    await exchange.send(body_msg(chat_body()))
    return exchange, await exchange.receive()


def admitted(answer) -> bool:
    return answer.HasField("request_body")


def hold_s(answer) -> int:
    """A request waiting in line: Envoy is asked to hold it this long (the class's wait + 2 s)."""
    assert answer.WhichOneof("response") is None, answer
    return answer.override_message_timeout.seconds


async def end(exchange: Exchange) -> None:
    await exchange.send(response_headers_msg(200))
    await exchange.receive()
    await exchange.finish()


async def inflight(server: SidecarServer) -> int:
    return sum([(await server.store.snapshot(pool)).inflight for pool in server.config.pools])


async def samples(server: SidecarServer, name: str) -> dict[frozenset, float]:
    """The samples of `name` on the server's /metrics (read from a thread: the server runs in this loop)."""
    scraped = await asyncio.to_thread(scrape, f"http://{LOOPBACK}:{server.metrics_port}/metrics")
    return {labels: value for (n, labels), value in scraped.items() if n == name}


def config_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "extproc.config"]


async def test_a_reload_through_the_admin_api_changes_the_next_decision(served, caplog):
    server, path, stub, admin = served
    first_version = server.config_version
    holder, answer = await ask(stub, OFFICER_KEY)
    assert admitted(answer)
    waiter, answer = await ask(stub, OFFICER_KEY)
    assert hold_s(answer) == 62  # one slot, taken: it waits, up to complaint's 60 s
    _, refused = await ask(stub, NEW_CLERK_KEY)
    assert refused.immediate_response.status.code == 401

    # A file that also moves the port is refused as a whole, saying which key and why.
    write(path, edited(base_config(), {**LIVE_CHANGES, "listen.grpc_port": 1}))
    with caplog.at_level(logging.WARNING, logger="extproc.config"):
        refused_port = await admin.Reload(pb.ReloadRequest())
    assert not refused_port.accepted and not refused_port.changes
    assert refused_port.version == refused_port.previous_version == server.config_version == first_version
    assert [(c.key, c.old_value, c.new_value, c.restart_reason) for c in refused_port.needs_restart] == [
        ("listen.grpc_port", "0", "1", "the ext_proc, health and metrics sockets are bound at start")]
    assert refused_port.refused_reason.startswith("listen.grpc_port (the ext_proc, health and metrics sockets are "
                                                  "bound at start) needs a restart: a restart applies it")
    assert config_lines(caplog) == [
        f"config reload (admin API) refused: {refused_port.refused_reason}; version {first_version} stays in force",
        f"config {first_version} needs a restart for listen.grpc_port: 0 → 1"]
    _, still_refused = await ask(stub, NEW_CLERK_KEY)
    assert still_refused.immediate_response.status.code == 401  # none of the file applies
    caplog.clear()

    write(path, edited(base_config(), LIVE_CHANGES))
    with caplog.at_level(logging.WARNING, logger="extproc.config"):
        result = await admin.Reload(pb.ReloadRequest())
    assert result.accepted and not result.refused_reason and not result.needs_restart
    assert result.previous_version == first_version != result.version == server.config_version
    assert [(c.key, c.new_value) for c in result.changes] == [
        ("classes.complaint.max_wait_s", "30.0"), ("tenants.1.api_key_sha256", json.dumps([key_sha(NEW_CLERK_KEY)])),
        ("pools.primary.max_inflight", "2")]

    # The change record, read back from the log lines, says what the response says.
    lines = config_lines(caplog)
    assert lines[0] == (f"config reload (admin API) accepted: version {result.version} (previous {first_version}), "
                        "3 changed")
    record = [CHANGE_LINE.search(line) for line in lines]
    assert [(m["version"], m["previous"], m["key"], m["old"], m["new"]) for m in record if m] == [
        (result.version, first_version, c.key, c.old_value, c.new_value) for c in result.changes]

    # The request already waiting is admitted by the second slot; the next one waits 30 s now.
    assert admitted(await waiter.receive())
    third, answer = await ask(stub, OFFICER_KEY)
    assert hold_s(answer) == 32
    _, old_key = await ask(stub, CLERK_KEY)
    assert old_key.immediate_response.status.code == 401
    rotated, answer = await ask(stub, NEW_CLERK_KEY, "archive_query")
    assert hold_s(answer) == 62  # known again: it got past the headers and waits in line

    await end(holder)  # every slot comes back: nothing leaked across the swap
    assert admitted(await third.receive())
    await end(waiter)
    assert admitted(await rotated.receive())
    await end(third)
    await end(rotated)
    assert await inflight(server) == 0

    assert await samples(server, "extproc_config_reloads_total") == {
        frozenset({("result", "accepted")}): 1.0, frozenset({("result", "refused")}): 1.0}
    assert await samples(server, "extproc_config_info") == {frozenset({("version", server.config_version)}): 1.0}

    # what is in force: nothing to change
    with caplog.at_level(logging.WARNING, logger="extproc.config"):
        unchanged = await admin.Reload(pb.ReloadRequest())
    assert unchanged.accepted and not unchanged.changes and not unchanged.needs_restart
    assert unchanged.version == unchanged.previous_version == server.config_version
    assert config_lines(caplog)[-1] == (f"config reload (admin API) accepted: no change; "
                                        f"version {server.config_version} stays in force")


async def test_a_refused_reload_keeps_the_running_config_enforced(served, caplog):
    server, path, stub, admin = served
    write(path, edited(base_config(), LIVE_CHANGES))
    assert (await admin.Reload(pb.ReloadRequest())).accepted
    in_force = server.config_version

    # A file that would rotate the key back and shorten the wait, with one bad value: none of it applies.
    bad = edited(base_config(), {"classes.complaint.max_wait_s": 10, "classes.quick_check.max_wait_s": -1})
    for text in (yaml.safe_dump(bad), "classes: [unclosed\n"):
        path.write_text(text)
        with caplog.at_level(logging.WARNING, logger="extproc.config"):
            result = await admin.Reload(pb.ReloadRequest())
        assert not result.accepted and not result.changes
        assert result.version == result.previous_version == server.config_version == in_force
        line = config_lines(caplog)[-1]
        assert line.startswith("config reload (admin API) refused: ") and line.endswith(f"version {in_force} stays in force")
    invalid, unparsable = config_lines(caplog)[-2:]
    assert "classes.quick_check.max_wait_s: Input should be greater than 0" in invalid
    assert "not valid YAML" in unparsable
    assert "not valid YAML" in result.refused_reason

    holder, answer = await ask(stub, OFFICER_KEY)
    second, _ = await ask(stub, OFFICER_KEY)
    waiter, answer = await ask(stub, OFFICER_KEY)
    assert hold_s(answer) == 32  # still the 30 s wait in force, two slots, not the refused file's 10 s
    _, old_key = await ask(stub, CLERK_KEY)
    assert old_key.immediate_response.status.code == 401
    for exchange in (holder, second):
        await end(exchange)
    assert admitted(await waiter.receive())
    await end(waiter)
    assert await inflight(server) == 0
    assert await samples(server, "extproc_config_reloads_total") == {
        frozenset({("result", "accepted")}): 1.0, frozenset({("result", "refused")}): 2.0}
    assert await samples(server, "extproc_config_info") == {frozenset({("version", in_force)}): 1.0}


async def test_without_a_file_a_reload_says_so_and_refuses():
    server = SidecarServer(parse_config(base_config()))
    await server.start()
    try:
        plan = await server.reload("admin API")
        assert not plan.accepted and "embedded defaults" in plan.refused_reason
        assert (await samples(server, "extproc_config_reloads_total"))[frozenset({("result", "refused")})] == 1.0
    finally:
        await server.stop()


# -- real processes, reloaded by SIGHUP -----------------------------------------------------


def change_record(log_path: Path) -> list[tuple[str, str, str, str, str]]:
    matches = [CHANGE_LINE.search(line) for line in log_path.read_text("utf-8").splitlines() if "extproc.config" in line]
    return [(m["version"], m["previous"], m["key"], m["old"], m["new"]) for m in matches if m]


async def test_sighup_reloads_a_serving_process(tmp_path):
    path = write(tmp_path / "extproc.yaml", base_config())
    grpc_port, metrics_port, admin_port = free_port(), free_port(), free_port()
    flags = {"listen": {"grpc_port": grpc_port, "metrics_port": metrics_port}, "admin": {"port": admin_port}}
    proc = ManagedProcess("sidecar", [sys.executable, "-m", "extproc", "serve", "--config", str(path),
                                      "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                                      "--admin-port", str(admin_port)], tmp_path / "sidecar.log")
    proc.start()
    metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"
    try:
        wait_until(lambda: http_get(metrics_url)[0] == 200, 30, "the sidecar", proc)
        source = ConfigSource(str(path), flags)  # what the command line makes of the file
        first_version = source.version(source.load())

        def reloads(result: str) -> float:
            return scrape(metrics_url).get(("extproc_config_reloads_total", frozenset({("result", result)})), 0.0)

        async with grpc.aio.insecure_channel(f"{LOOPBACK}:{grpc_port}") as channel:
            stub = ext_grpc.ExternalProcessorStub(channel)
            _, answer = await ask(stub, NEW_CLERK_KEY)
            assert answer.immediate_response.status.code == 401

            write(path, edited(base_config(), LIVE_CHANGES))
            proc.signal(signal.SIGHUP)
            await async_wait_until(lambda: reloads("accepted") == 1, 20, "the SIGHUP reload")
            version = source.version(source.load())
            assert ("extproc_config_info", frozenset({("version", version)})) in scrape(metrics_url)
            assert [name for name, _ in scrape(metrics_url) if name == "extproc_config_info"] == ["extproc_config_info"]
            assert change_record(tmp_path / "sidecar.log") == [
                (version, first_version, "classes.complaint.max_wait_s", "60.0", "30.0"),
                (version, first_version, "tenants.1.api_key_sha256", json.dumps([key_sha(CLERK_KEY)]),
                 json.dumps([key_sha(NEW_CLERK_KEY)])),
                (version, first_version, "pools.primary.max_inflight", "1", "2"),
            ]
            assert "accepted: version" in proc.log_tail() and "needs a restart" not in proc.log_tail()
            rotated, answer = await ask(stub, NEW_CLERK_KEY)
            assert admitted(answer)

            write(path, edited(base_config(), {"classes.complaint.max_wait_s": 10, "auth": "sometimes"}))
            proc.signal(signal.SIGHUP)
            await async_wait_until(lambda: reloads("refused") == 1, 20, "the refused SIGHUP reload")
            assert "refused: " in proc.log_tail() and "auth: Input should be 'optional' or 'required'" in proc.log_tail()
            assert ("extproc_config_info", frozenset({("version", version)})) in scrape(metrics_url)
            second, _ = await ask(stub, NEW_CLERK_KEY)
            waiter, answer = await ask(stub, OFFICER_KEY)
            assert hold_s(answer) == 32  # the version in force still decides: two slots, a 30 s wait

            async def reload_cli() -> subprocess.CompletedProcess:
                return await asyncio.to_thread(
                    subprocess.run, [sys.executable, "-m", "extproc", "admin", "--address", f"{LOOPBACK}:{admin_port}",
                                     "reload"], capture_output=True, text=True, timeout=30)

            cli = await reload_cli()
            assert cli.returncode == 1 and "refused: " in cli.stderr and "auth: Input should be" in cli.stderr
            assert reloads("refused") == 2
            write(path, edited(base_config(), {**LIVE_CHANGES, "probes.nvml": "off"}))
            cli = await reload_cli()
            assert cli.returncode == 1 and cli.stderr.splitlines() == [
                "refused: probes.nvml (NVML is opened (or not) at start) needs a restart: a restart applies it, "
                "or put its running value back to reload the rest", '  probes.nvml: "auto" → "off"',
                f"version {version} stays in force"]
            assert reloads("refused") == 3
            for exchange in (rotated, second):
                await end(exchange)
            assert admitted(await waiter.receive())
            await end(waiter)
        assert proc.stop() == 0  # still serving, and drains cleanly
    finally:
        proc.stop()


async def test_sighup_to_the_supervisor_reaches_every_worker(tmp_path):
    redis_server = RedisServer(tmp_path / "redis").start()
    path = write(tmp_path / "extproc.yaml", base_config())
    metrics_port = free_port()
    metrics_url = f"http://{LOOPBACK}:{metrics_port}/metrics"
    supervisor = ManagedProcess("supervisor", [
        sys.executable, "-m", "extproc", "serve", "--workers", "2", "--config", str(path),
        "--redis-url", redis_server.url, "--grpc-port", str(free_port()), "--metrics-port", str(metrics_port),
        "--admin-port", str(free_port())], tmp_path / "supervisor.log")
    supervisor.start()
    # What each worker is started with: the file, and flags for its ports, hosts and Redis.
    worker_source = ConfigSource(str(path), {"listen": {"grpc_port": 0, "metrics_port": 0, "host": LOOPBACK,
                                                        "metrics_host": LOOPBACK},
                                             "redis": {"url": redis_server.url}, "admin": {"port": 0}})
    try:
        wait_until(lambda: http_get(metrics_url)[0] == 200, 60, "the workers", supervisor)

        def versions() -> dict[str, str]:
            return {dict(ls)["worker"]: dict(ls)["version"] for (n, ls) in scrape(metrics_url) if n == "extproc_config_info"}

        def accepted() -> dict[str, float]:
            return {dict(ls)["worker"]: value for (n, ls), value in scrape(metrics_url).items()
                    if n == "extproc_config_reloads_total" and ("result", "accepted") in ls}

        assert versions() == {"0": worker_source.version(worker_source.load()), "1": worker_source.version(worker_source.load())}
        write(path, edited(base_config(), LIVE_CHANGES))
        supervisor.signal(signal.SIGHUP)
        await async_wait_until(lambda: accepted() == {"0": 1, "1": 1}, 30, "both workers to reload")
        new_version = worker_source.version(worker_source.load())
        assert versions() == {"0": new_version, "1": new_version}
        assert len(change_record(tmp_path / "supervisor.log")) == 2 * len(LIVE_CHANGES)
        assert supervisor.alive()
    finally:
        supervisor.stop(30)
        redis_server.kill()


# -- what operators set at run time ---------------------------------------------------------


@pytest.fixture
async def operated(serving):
    """A served sidecar with a canary pool: (server, its file, its admin API)."""
    server, path, _, admin = await serving(canary_config())
    return server, path, admin


async def test_an_operators_shadow_share_outlives_a_reload_that_changes_the_files(operated):
    server, path, admin = operated
    assert (await admin.SetShadowShare(pb.SetShadowShareRequest(share=0.5))).shadow_share == 0.5
    write(path, edited(canary_config(), {"shadow.share": 0.2, "classes.complaint.max_wait_s": 30}))
    result = await admin.Reload(pb.ReloadRequest())
    assert result.accepted and [c.key for c in result.changes] == ["classes.complaint.max_wait_s", "shadow.share"]
    assert (await admin.GetState(pb.GetStateRequest())).shadow_share == 0.5
    assert server.gate.shadow._share() == 0.5  # what the next decision copies by
    assert (await samples(server, "extproc_shadow_share")) == {frozenset(): 0.5}


async def test_a_forced_breaker_outlives_a_reload(operated):
    server, path, admin = operated
    force = pb.SetBreakerRequest(pool="fallback", action=pb.SetBreakerRequest.FORCE_OPEN)
    assert (await admin.SetBreaker(force)).pools[1].breaker.forced == "open"
    write(path, edited(canary_config(), {"pools.fallback.breaker.instant.threshold": 0.5,
                                         "pools.fallback.breaker.instant.open_s": 5}))
    assert (await admin.Reload(pb.ReloadRequest())).accepted
    assert server.control.breakers["fallback"].settings.instant.open_s == 5  # the file's thresholds and times apply
    assert (await admin.GetState(pb.GetStateRequest())).pools[1].breaker.forced == "open"
    assert server.control.permit("fallback")[0] is Permit.NO  # nothing is sent to it


async def test_the_canary_batch_outlives_a_reload(operated):
    server, path, admin = operated
    advance = pb.SetCanaryRequest(action=pb.SetCanaryRequest.ADVANCE)
    await admin.SetCanary(advance)
    assert list((await admin.SetCanary(advance)).canary.digits) == ["0", "1"]
    write(path, edited(canary_config(), {"canary.order": "0123456789"[::-1], "classes.complaint.max_wait_s": 30}))
    assert (await admin.Reload(pb.ReloadRequest())).accepted
    canary = (await admin.GetState(pb.GetStateRequest())).canary
    assert (list(canary.digits), canary.batch, canary.order) == (["0", "1"], 2, "9876543210")
    assert list((await admin.SetCanary(advance)).canary.digits) == ["0", "1", "9"]  # on, in the file's new order


async def test_an_operator_clears_their_shadow_share_and_the_files_applies_again(operated):
    server, path, admin = operated
    state = await admin.GetState(pb.GetStateRequest())
    assert state.shadow_share == 0.0 and not state.shadow_share_by_operator  # the file's
    cli = [sys.executable, "-m", "extproc", "admin", "--address", f"{LOOPBACK}:{server.admin_port}"]

    async def run(*args: str) -> str:
        done = await asyncio.to_thread(subprocess.run, [*cli, *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "shadow share 0.5  (set at run time: `extproc admin shadow clear` for the file's)" in await run("shadow", "0.5")
    write(path, edited(canary_config(), {"shadow.share": 0.2}))
    assert (await admin.Reload(pb.ReloadRequest())).accepted
    state = await admin.GetState(pb.GetStateRequest())
    assert state.shadow_share == 0.5 and state.shadow_share_by_operator

    assert (await run("shadow", "clear")).rstrip().endswith("shadow share 0.2")
    cleared = await admin.GetState(pb.GetStateRequest())
    assert cleared.shadow_share == 0.2 and not cleared.shadow_share_by_operator
    assert server.gate.shadow._share() == 0.2 and (await samples(server, "extproc_shadow_share")) == {frozenset(): 0.2}
    write(path, edited(canary_config(), {"shadow.share": 0.1}))  # from now on the file's share follows the file
    assert (await admin.Reload(pb.ReloadRequest())).accepted
    assert (await admin.GetState(pb.GetStateRequest())).shadow_share == 0.1


async def test_a_reload_reaches_the_capacity_model(serving):
    """The capacity model (the engines a pool needs) takes a reload's KV safety factor and latency
    targets, as admission does."""
    data = edited(base_config(), {"pools.primary.capacity": {"kv_tokens_per_backend": 10000}})
    server, path, _, admin = await serving(data)
    model = server.capacity.models["primary"]

    async def per_engine() -> float:
        await server.capacity.tick()
        return (await samples(server, "extproc_per_engine_concurrency"))[frozenset({("pool", "primary")})]

    now = server.capacity.clock()
    for _ in range(10):
        model.served(now, "complaint", 1.0, 1000)  # requests of 1000 KV tokens
    assert await per_engine() == 8  # 10000 tokens x 0.85 / 1000
    write(path, edited(data, {"pools.primary.capacity.safety_factor": 0.5, "classes.complaint.latency_target_s": 2}))
    assert (await admin.Reload(pb.ReloadRequest())).accepted
    assert await per_engine() == 5  # 10000 x 0.5 / 1000
    for concurrency, engine_s in ((1, 0.5), (4, 3.0)):  # complaints' first bytes: on time alone, late four at a time
        for _ in range(5):
            model.responded(now, "complaint", engine_s, concurrency)
    assert await per_engine() == 2  # within the new 2 s target (its engine's 75 %): at most two at once


async def test_a_reload_reaches_the_answer_while_redis_is_down(serving, tmp_path):
    dead = RedisServer(tmp_path / "redis")  # never started: its port refuses connections
    data = edited(base_config(), {"redis": {"url": dead.url, "on_failure": "closed"}})
    server, path, stub, admin = await serving(data)
    ttl_ms = server.store.shared.ticket_ttl_ms

    async def retry_after() -> str:
        exchange, answer = await ask(stub, OFFICER_KEY)
        await exchange.finish()
        assert answer.immediate_response.status.code == 503, answer
        return set_headers(answer.immediate_response.headers)["retry-after"]

    assert await retry_after() == "2"  # retry_after_s.overloaded
    write(path, edited(data, {"retry_after_s.overloaded": 7, "classes.complaint.max_wait_s": 90}))
    assert (await admin.Reload(pb.ReloadRequest())).accepted
    assert await retry_after() == "7"
    assert server.store.shared.ticket_ttl_ms == ttl_ms + 30_000  # a ticket in Redis outlives the longest wait
