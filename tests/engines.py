"""A real vLLM engine spec, for the tests that talk to one directly (started with testbed.stack.start_engine)."""

from __future__ import annotations

from extproc_testbed.stack import SimSpec
from extproc_testbed.vllm_engine import VllmSettings


def real_vllm(model: str = "deepseek-sim", **settings) -> SimSpec:
    return SimSpec(model, engine="vllm", vllm=VllmSettings(**settings))
