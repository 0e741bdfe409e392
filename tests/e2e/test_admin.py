"""The operator API: its generated code in step with proto/, its token guard, drain, bad input."""

from __future__ import annotations

import asyncio
import hashlib
import math
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.admin.v1 import admin_pb2 as pb
from extproc.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.core.config import ConfigError, parse_config
from extproc.server import SidecarServer

from ..conftest import e2e_config
from .test_servicer import Exchange, body_msg, headers_msg

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("admin_pb2.py", "admin_pb2_grpc.py", "admin_pb2.pyi")


def test_the_generated_code_is_in_step_with_the_proto(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    str(ROOT / "proto/extproc/admin/v1/admin.proto")], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "extproc/admin/v1" / name).read_text()
        committed = (ROOT / "extproc/admin/v1" / name).read_text()
        assert fresh == committed, f"extproc/admin/v1/{name} is out of step with proto/: run `make proto`"


def test_an_admin_api_beyond_loopback_needs_a_token():
    with pytest.raises(ConfigError, match="admin"):
        parse_config(e2e_config(admin={"host": "0.0.0.0"}))
    parse_config(e2e_config(admin={"host": "0.0.0.0", "token_sha256": [hashlib.sha256(b"t").hexdigest()]}))


@pytest.fixture
async def guarded():
    token = "admin-secret"
    config = parse_config(e2e_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0},
                                     admin={"port": 0, "token_sha256": [hashlib.sha256(token.encode()).hexdigest()]}))
    server = SidecarServer(config)
    await server.start()
    yield server, token
    await server.stop()


async def test_the_token_guard_and_bad_arguments(guarded, tmp_path):
    server, token = guarded
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.admin_port}") as channel:
        stub = pb_grpc.AdminStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetState(pb.GetStateRequest())
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as wrong:
            await stub.GetState(pb.GetStateRequest(), metadata=(("authorization", "Bearer nope"),))
        assert wrong.value.code() is grpc.StatusCode.UNAUTHENTICATED

        auth = (("authorization", f"Bearer {token}"),)
        state = await stub.GetState(pb.GetStateRequest(), metadata=auth)
        assert [p.name for p in state.pools] == ["primary", "fallback"]
        assert state.pools[0].breaker.instant == "closed" and [w.window for w in state.pools[0].breaker.windows] == [
            "1s", "60s", "300s"]
        for request, code in (
            (pb.SetBreakerRequest(pool="nowhere", action=pb.SetBreakerRequest.RESET), grpc.StatusCode.NOT_FOUND),
            (pb.SetBreakerRequest(pool="primary"), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.SetBreaker(request, metadata=auth)
            assert bad.value.code() is code
        with pytest.raises(grpc.aio.AioRpcError) as bad_share:
            await stub.SetShadowShare(pb.SetShadowShareRequest(share=1.5), metadata=auth)
        assert bad_share.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as no_canary:
            await stub.SetCanary(pb.SetCanaryRequest(action=pb.SetCanaryRequest.ADVANCE), metadata=auth)
        assert no_canary.value.code() is grpc.StatusCode.FAILED_PRECONDITION

        forced = await stub.SetBreaker(pb.SetBreakerRequest(pool="primary", action=pb.SetBreakerRequest.FORCE_OPEN),
                                       metadata=auth)
        assert forced.pools[0].breaker.forced == "open"

    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    cli = [sys.executable, "-m", "extproc", "admin", "--address", f"127.0.0.1:{server.admin_port}"]
    refused_cli = await asyncio.to_thread(subprocess.run, [*cli, "state"], capture_output=True, text=True, timeout=30)
    assert refused_cli.returncode == 2 and "UNAUTHENTICATED" in refused_cli.stderr
    shown = await asyncio.to_thread(subprocess.run, [*cli, "--token-file", str(token_file), "state", "--json"],
                                    capture_output=True, text=True, timeout=30)
    assert shown.returncode == 0 and '"forced": "open"' in shown.stdout


async def test_drain_through_the_admin_api(guarded):
    server, token = guarded
    auth = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.admin_port}") as admin_channel, \
            grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        drained = await pb_grpc.AdminStub(admin_channel).Drain(pb.DrainRequest(), metadata=auth)
        assert drained.exchanges_in_flight == 0
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

        exchange = Exchange(ext_grpc.ExternalProcessorStub(channel))
        await exchange.send(headers_msg())
        response = await exchange.receive()
        assert response.immediate_response.status.code == 503
        assert b"draining" in response.immediate_response.body
        await exchange.send(body_msg(b"{}"))


@pytest.mark.parametrize("deadline_s", ["nan", "inf", "0", "-5"])
def test_the_command_line_refuses_a_drain_deadline_that_is_no_finite_number_of_seconds(deadline_s):
    result = subprocess.run([sys.executable, "-m", "extproc", "admin", "--address", "127.0.0.1:1", "engine",
                             "drain", "primary", "10.0.0.1:8000", "--deadline-s", deadline_s],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "a finite number of seconds above 0" in result.stderr, result.stderr


async def test_draining_one_engine_through_the_admin_api():
    config = e2e_config(listen={"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0}, admin={"port": 0},
                        engine_drain={"deadline_s": 45})
    config["pools"]["primary"].update(max_inflight=8, capacity={
        "backends": ["http://127.0.0.2:9", "http://127.0.0.3:9"], "pick_backend": True})
    server = SidecarServer(parse_config(config))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.admin_port}") as channel:
            stub = pb_grpc.AdminStub(channel)
            for request, code, said in (
                (pb.DrainEngineRequest(pool="nowhere", engine="127.0.0.2:9"), grpc.StatusCode.NOT_FOUND, "no pool"),
                (pb.DrainEngineRequest(pool="primary", engine="127.0.0.9:9"), grpc.StatusCode.NOT_FOUND,
                 "has no engine 127.0.0.9:9 (its engines: 127.0.0.2:9, 127.0.0.3:9)"),
                (pb.DrainEngineRequest(pool="fallback", engine="127.0.0.2:9"), grpc.StatusCode.FAILED_PRECONDITION,
                 "does not pick its engines"),
                (pb.DrainEngineRequest(pool="primary", engine="vllm-0"), grpc.StatusCode.INVALID_ARGUMENT,
                 "IP:PORT"),
                (pb.DrainEngineRequest(pool="primary", engine="127.0.0.2:9", deadline_s=-1),
                 grpc.StatusCode.INVALID_ARGUMENT, "deadline_s"),
                (pb.DrainEngineRequest(pool="primary", engine="127.0.0.2:9", deadline_s=math.nan),
                 grpc.StatusCode.INVALID_ARGUMENT, "finite"),
                (pb.DrainEngineRequest(pool="primary", engine="127.0.0.2:9", deadline_s=math.inf),
                 grpc.StatusCode.INVALID_ARGUMENT, "finite"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.DrainEngine(request)
                assert refused.value.code() is code and said in refused.value.details()

            assert server.drains.views("primary") == ()  # none of those drained anything
            # (an IPv4-mapped address names the IPv4 engine, as the discovery reads it)
            state = await stub.DrainEngine(pb.DrainEngineRequest(pool="primary", engine="[::ffff:127.0.0.2]:9"))
            (drain,) = state.pools[0].draining_engines
            assert (drain.engine, drain.reason, drain.state, drain.requests, drain.gone, drain.landed) == (
                "127.0.0.2:9", "operator", "draining", 0, False, 0)  # idle once settled (engine_drain.settle_s)
            assert 40 < drain.deadline_in_s <= 45  # the configuration's engine_drain.deadline_s
            assert server.drains.serving("primary") == ("http://127.0.0.3:9",)
            assert [p.base_url for p in server.load.backends["primary"]] == ["http://127.0.0.3:9"]  # out of the budget
            with pytest.raises(grpc.aio.AioRpcError) as last:
                await stub.DrainEngine(pb.DrainEngineRequest(pool="primary", engine="127.0.0.3:9"))
            assert last.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "last engine" in last.value.details()
            again = await stub.DrainEngine(pb.DrainEngineRequest(pool="primary", engine="127.0.0.2:9", deadline_s=5))
            assert again.pools[0].draining_engines[0].deadline_in_s <= 5  # a new deadline

            state = await stub.UndrainEngine(pb.UndrainEngineRequest(pool="primary", engine="127.0.0.2:9"))
            assert list(state.pools[0].draining_engines) == []
            assert [p.base_url for p in server.load.backends["primary"]] == ["http://127.0.0.2:9", "http://127.0.0.3:9"]
            with pytest.raises(grpc.aio.AioRpcError) as not_draining:
                await stub.UndrainEngine(pb.UndrainEngineRequest(pool="primary", engine="127.0.0.2:9"))
            assert not_draining.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop()
