"""Shadow copies decided through the gate, on the in-process stores, with a stand-in relay
(tests/relays.py): which admitted requests are copied, and where."""

from __future__ import annotations

import asyncio
import json

from ..relays import StandInRelay
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

