"""Starting one engine, simulated or real, for the tests that talk to it directly."""

from __future__ import annotations

from extproc.testbed.stack import SimSpec, start_engine  # noqa: F401 (the tests start engines with it)
from extproc.testbed.vllm_engine import VllmSettings


def real_vllm(model: str = "deepseek-sim", **settings) -> SimSpec:
    return SimSpec(model, engine="vllm", vllm=VllmSettings(**settings))
