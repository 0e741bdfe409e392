"""Shadow copies decided through the gate, on the in-process stores, with a stand-in relay
(tests/relays.py): which admitted requests are copied, and where."""

from __future__ import annotations

import asyncio
import json

import pytest

from extproc.core.events import ShadowAnswered, ShadowCopied, ShadowTimed, ShadowTokens, SlotReleased

from ..relays import StandInRelay, engine_answer
from .test_gate import Rig


def two_models() -> dict:
    """`primary` (the default pool) serves big-model and is the fallback of `small`, which serves
    small-model; a request for small-model that lands in primary runs there as big-model. Every
    request of the default pool is copied to `mirror`."""
    pools = {
        "primary": {"cluster": "vllm_primary", "max_inflight": 4, "served_models": ["big-model"],
                    "models": {"small-model": "big-model"}},
        "small": {"cluster": "vllm_small", "max_inflight": 4, "served_models": ["small-model"], "fallback": "primary"},
        "mirror": {"cluster": "vllm_mirror", "max_inflight": 4},
    }
    return {"pools": pools, "shadow": {"pool": "mirror", "share": 1.0}, "default_pool": "primary"}


async def test_only_the_default_pools_own_requests_are_copied_never_one_rerouted_into_it():
    relay = StandInRelay(200)
    rig = Rig(relay, **two_models())
    own, _ = await rig.arrive(body=json.dumps({"model": "big-model", "max_tokens": 8,
                                               "messages": [{"role": "user", "content": "hi"}]}).encode())
    for _ in range(5):  # its copy answered
        await asyncio.sleep(0)
    await rig.control.force("small", "open")  # small's requests go to its fallback, the default pool
    rerouted, _ = await rig.arrive(body=json.dumps({"model": "small-model", "max_tokens": 8,
                                                    "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert (own.pool, rerouted.pool) == ("primary", "primary") and rerouted.route.rerouted
    for _ in range(5):
        await asyncio.sleep(0)
    # one copy, of the default pool's own request, as it was asked: the rerouted one runs there
    # under the pool's own model, and a copy of its body would carry small-model to the mirror
    assert [(sent.cluster, sent.body["model"]) for sent in relay.sent] == [("vllm_mirror", "big-model")]
    assert own.shadowed and not rerouted.shadowed
    for exchange in (own, rerouted):
        await rig.gate.close(exchange)
    assert await rig.inflight("primary") == 0



class HeldRelay(StandInRelay):
    """Answers only once `answering` is set: the copies sent stay running until then."""

    def __init__(self, *answers: str | int) -> None:
        super().__init__(*answers)
        self.answering = asyncio.Event()

    async def send(self, *args, **kwargs):
        await self.answering.wait()
        return await super().send(*args, **kwargs)


async def settle() -> None:
    for _ in range(10):  # the copies' tasks run
        await asyncio.sleep(0)


async def test_each_copy_and_each_response_it_compares_is_told():
    relay = HeldRelay(200)
    rig = Rig(relay, **two_models())  # the mirror runs one copy at a time (shadow.max_share: a quarter of 4 slots)
    big = json.dumps({"model": "big-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode()
    first, _ = await rig.arrive(body=big)
    second, _ = await rig.arrive(body=big)  # while the first's copy runs: no room for its own
    await settle()
    assert sorted(rig.heard.of(ShadowCopied)) == [ShadowCopied("mirror", "no_room"), ShadowCopied("mirror", "sent")]
    assert first.shadowed and not second.shadowed
    # the primary side of the comparison: its status, its tokens, its time since arrival
    rig.clock.advance(0.5)
    plan = rig.gate.response_started(first, 200)
    assert plan.read_body
    rig.gate.response_body(first, engine_answer("big-model", completion_tokens=7))
    await rig.gate.close(first)
    assert rig.heard.of(ShadowAnswered) == [ShadowAnswered("primary", "2xx")]
    assert rig.heard.of(ShadowTokens) == [ShadowTokens("primary", 7)]
    assert rig.heard.of(ShadowTimed) == [ShadowTimed("primary", pytest.approx(0.5))]
    # the copy's side, once it is answered; its slot goes back
    relay.answering.set()
    await settle()
    assert rig.told(ShadowAnswered, side="shadow") == [ShadowAnswered("shadow", "2xx")]
    assert rig.told(ShadowTokens, side="shadow") == [ShadowTokens("shadow", 4)]
    assert len(rig.told(ShadowTimed, side="shadow")) == 1
    assert rig.told(SlotReleased, pool="mirror") == [SlotReleased("mirror", "shadow")]
    await rig.gate.close(second)
    assert len(rig.heard.of(ShadowAnswered)) == 2  # the request not copied is not compared
