"""The operator API (proto/extproc/admin/v1/admin.proto) over the running server: read the
queues and breakers, force or reset a breaker, move the canary, set the shadow share, drain,
reload the configuration."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc

from ..admin.v1 import admin_pb2 as pb
from ..admin.v1 import admin_pb2_grpc as pb_grpc
from ..core.admission import tier_for
from .reload import Change, render

if TYPE_CHECKING:
    from ..server import SidecarServer


class TokenGuard(grpc.aio.ServerInterceptor):
    """Every call must carry `authorization: Bearer <token>` whose SHA-256 is configured."""

    def __init__(self, digests: tuple[str, ...]):
        self.digests = digests

    async def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        scheme, _, token = metadata.get("authorization", "").partition(" ")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        if scheme.lower() == "bearer" and any(hmac.compare_digest(digest, d) for d in self.digests):
            return await continuation(handler_call_details)

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid admin token is required")

        return grpc.unary_unary_rpc_method_handler(refuse)


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, server: SidecarServer, replica: str):
        self.server = server
        self.replica = replica

    async def _state(self) -> pb.State:
        server = self.server
        config = server.config
        control = server.control
        state = pb.State(replica=self.replica, shared=control.store.shared, draining=server.gate.draining,
                         shadow_share=control.shadow_share)
        for name, pool in config.pools.items():
            snapshot = await server.store.snapshot(name)
            breaker = control.snapshot(name)
            state.pools.append(pb.Pool(
                name=name, cluster=pool.cluster, fallback=pool.fallback or "", queue_depth=snapshot.depth,
                queue_depth_by_class=snapshot.depth_by_class, inflight=snapshot.inflight,
                max_inflight=snapshot.max_inflight, inflight_tokens=snapshot.inflight_tokens,
                token_budget=-1 if snapshot.budget_tokens is None else snapshot.budget_tokens,
                tier=tier_for(snapshot.depth, pool.tiers).name.lower(),
                breaker=pb.Breaker(
                    instant=breaker["instant"], open_for_s=breaker["open_for_s"], rerouting=breaker["rerouting"],
                    paged=breaker["paged"], paged_for_s=breaker["paged_for_s"], forced=breaker["forced"],
                    windows=[pb.Window(window=label, requests=r.requests, failures=r.failures,
                                       failure_ratio=r.ratio, tripped=r.tripped)
                             for label, r in breaker["windows"].items()],
                ),
            ))
        canary = control.controls.canary
        state.canary.CopyFrom(pb.Canary(
            pool=config.canary.pool or "", digits=list(canary.digits), batch=canary.batch, order=config.canary.order,
            rolled_back=canary.rolled_back_at is not None, rollback_reason=canary.reason or "",
        ))
        return state

    async def GetState(self, request, context) -> pb.State:
        return await self._state()

    async def SetBreaker(self, request, context) -> pb.State:
        if request.pool not in self.server.config.pools:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pool named {request.pool!r}")
        actions: dict[int, Callable[[], Awaitable[None]]] = {
            pb.SetBreakerRequest.FORCE_OPEN: lambda: self.server.control.force(request.pool, "open"),
            pb.SetBreakerRequest.FORCE_CLOSED: lambda: self.server.control.force(request.pool, "closed"),
            pb.SetBreakerRequest.RESET: lambda: self.server.control.reset(request.pool),
        }
        if request.action not in actions:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "action must be FORCE_OPEN, FORCE_CLOSED or RESET")
        await actions[request.action]()
        return await self._state()

    async def SetCanary(self, request, context) -> pb.State:
        if self.server.config.canary.pool is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no canary pool is configured (canary.pool)")
        if request.action == pb.SetCanaryRequest.ADVANCE:
            await self.server.control.canary_advance()
        elif request.action == pb.SetCanaryRequest.ROLL_BACK:
            await self.server.control.canary_roll_back()
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "action must be ADVANCE or ROLL_BACK")
        return await self._state()

    async def SetShadowShare(self, request, context) -> pb.State:
        if not 0.0 <= request.share <= 1.0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "share must be between 0 and 1")
        await self.server.control.set_shadow_share(request.share)
        return await self._state()

    async def Drain(self, request, context) -> pb.DrainResponse:
        await self.server.drain()
        return pb.DrainResponse(exchanges_in_flight=len(self.server.gate.holding))

    async def Reload(self, request, context) -> pb.ReloadResponse:
        # shielded: a client that gives up mid-reload must not leave it half applied
        plan = await asyncio.shield(self.server.reload("admin API"))

        def changes(items: tuple[Change, ...]) -> list[pb.ConfigChange]:
            return [pb.ConfigChange(key=c.key, old_value=render(c.old), new_value=render(c.new),
                                    restart_reason=c.restart_reason or "") for c in items]

        return pb.ReloadResponse(accepted=plan.accepted, version=plan.version, previous_version=plan.previous_version,
                                 changes=changes(plan.changes), needs_restart=changes(plan.needs_restart),
                                 refused_reason=plan.refused_reason)
