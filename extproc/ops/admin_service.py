"""The operator API (proto/extproc/admin/v1/admin.proto): read the queues and breakers (the read
model, state.py), force or reset a breaker, move the canary, set the shadow share, drain, drain
one engine and take it back, reload the configuration (`AdminActions`)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

import grpc

from ..admin.v1 import admin_pb2 as pb
from ..admin.v1 import admin_pb2_grpc as pb_grpc
from ..core.engine_drain import DrainRefused
from .reload import Change, ReloadPlan, render
from .state import SidecarState


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


@dataclass(frozen=True)
class AdminActions:
    """What an operator may change, as callables into the running parts (server.py wires them)."""

    pools: Callable[[], Collection[str]]
    canary_configured: Callable[[], bool]
    force_breaker: Callable[[str, str], Awaitable[None]]  # pool, "open" or "closed"
    reset_breaker: Callable[[str], Awaitable[None]]
    advance_canary: Callable[[], Awaitable[object]]
    roll_back_canary: Callable[[], Awaitable[object]]
    set_shadow_share: Callable[[float | None], Awaitable[object]]  # None: the file's applies again
    drain: Callable[[], Awaitable[int]]  # answers the exchanges still in flight
    # pool, engine (IP:PORT), deadline_s (None: the configuration's); both raise DrainRefused
    drain_engine: Callable[[str, str, float | None], Awaitable[None]]
    undrain_engine: Callable[[str, str], Awaitable[None]]
    reload: Callable[[str], Awaitable[ReloadPlan]]  # the trigger's name


def state_message(state: SidecarState) -> pb.State:
    """The read model as the API's State message."""
    message = pb.State(replica=state.replica, shared=state.shared, draining=state.draining,
                       shadow_share=state.shadow_share, shadow_share_by_operator=state.shadow_share_by_operator)
    for pool in state.pools:
        b = pool.breaker
        message.pools.append(pb.Pool(
            name=pool.name, cluster=pool.cluster, fallback=pool.fallback or "", queue_depth=pool.waiting,
            queue_depth_by_class=pool.waiting_by_class, inflight=pool.inflight, max_inflight=pool.max_inflight,
            inflight_tokens=pool.inflight_tokens, token_budget=-1 if pool.token_budget is None else pool.token_budget,
            tier=pool.tier, engine_picks=pool.engine_picks or "",
            long_prompts=pool.long_prompts or "", long_quiet_s=pool.long_quiet_s,
            draining_engines=[pb.DrainingEngine(engine=d.engine, reason=d.reason, state=d.state, requests=d.requests,
                                                tokens=d.tokens, for_s=d.for_s, deadline_in_s=d.deadline_in_s,
                                                gone=d.gone, landed=d.landed) for d in pool.draining_engines],
            breaker=pb.Breaker(
                instant=b.instant, open_for_s=b.open_for_s, rerouting=b.rerouting, paged=b.paged,
                paged_for_s=b.paged_for_s, forced=b.forced or "",
                windows=[pb.Window(window=label, requests=w.requests, failures=w.failures,
                                   failure_ratio=math.nan if w.failure_ratio is None else w.failure_ratio,
                                   tripped=w.tripped)
                         for label, w in b.windows.items()],
            ),
        ))
    canary = state.canary
    message.canary.CopyFrom(pb.Canary(
        pool=canary.pool or "", digits=list(canary.digits), batch=canary.batch, order=canary.order,
        rolled_back=canary.rolled_back, rollback_reason=canary.rollback_reason or "",
    ))
    return message


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, read: Callable[[], Awaitable[SidecarState]], actions: AdminActions):
        self._read = read
        self.actions = actions

    async def _state(self) -> pb.State:
        return state_message(await self._read())

    async def GetState(self, request, context) -> pb.State:
        return await self._state()

    async def SetBreaker(self, request, context) -> pb.State:
        if request.pool not in self.actions.pools():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pool named {request.pool!r}")
        actions: dict[int, Callable[[], Awaitable[None]]] = {
            pb.SetBreakerRequest.FORCE_OPEN: lambda: self.actions.force_breaker(request.pool, "open"),
            pb.SetBreakerRequest.FORCE_CLOSED: lambda: self.actions.force_breaker(request.pool, "closed"),
            pb.SetBreakerRequest.RESET: lambda: self.actions.reset_breaker(request.pool),
        }
        if request.action not in actions:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "action must be FORCE_OPEN, FORCE_CLOSED or RESET")
        await actions[request.action]()
        return await self._state()

    async def SetCanary(self, request, context) -> pb.State:
        if not self.actions.canary_configured():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no canary pool is configured (canary.pool)")
        if request.action == pb.SetCanaryRequest.ADVANCE:
            await self.actions.advance_canary()
        elif request.action == pb.SetCanaryRequest.ROLL_BACK:
            await self.actions.roll_back_canary()
        else:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "action must be ADVANCE or ROLL_BACK")
        return await self._state()

    async def SetShadowShare(self, request, context) -> pb.State:
        if not request.clear and not 0.0 <= request.share <= 1.0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "share must be between 0 and 1")
        await self.actions.set_shadow_share(None if request.clear else request.share)
        return await self._state()

    async def Drain(self, request, context) -> pb.DrainResponse:
        return pb.DrainResponse(exchanges_in_flight=await self.actions.drain())

    async def DrainEngine(self, request, context) -> pb.State:
        if not math.isfinite(request.deadline_s) or request.deadline_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "deadline_s is 0 (the configuration's) or a finite number of seconds above it")
        await self._on_engine(context, self.actions.drain_engine(request.pool, request.engine, request.deadline_s or None))
        return await self._state()

    async def UndrainEngine(self, request, context) -> pb.State:
        await self._on_engine(context, self.actions.undrain_engine(request.pool, request.engine))
        return await self._state()

    @staticmethod
    async def _on_engine(context, action: Awaitable[None]) -> None:
        try:
            await action
        except DrainRefused as refused:
            code = grpc.StatusCode.NOT_FOUND if refused.missing else \
                grpc.StatusCode.INVALID_ARGUMENT if refused.invalid else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, str(refused))

    async def Reload(self, request, context) -> pb.ReloadResponse:
        # shielded: a client that gives up mid-reload must not leave it half applied
        plan = await asyncio.shield(self.actions.reload("admin API"))

        def changes(items: tuple[Change, ...]) -> list[pb.ConfigChange]:
            return [pb.ConfigChange(key=c.key, old_value=render(c.old), new_value=render(c.new),
                                    restart_reason=c.restart_reason or "") for c in items]

        return pb.ReloadResponse(accepted=plan.accepted, version=plan.version, previous_version=plan.previous_version,
                                 changes=changes(plan.changes), needs_restart=changes(plan.needs_restart),
                                 refused_reason=plan.refused_reason)
