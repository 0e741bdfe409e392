"""Starting one engine, simulated or real, for the tests that talk to it directly."""

from __future__ import annotations

from pathlib import Path

from extproc.testbed.stack import (
    LOOPBACK,
    SIM_START_S,
    VLLM_NICE,
    VLLM_START_S,
    ManagedProcess,
    SimSpec,
    free_port,
    http_get,
    wait_until,
)
from extproc.testbed.vllm_engine import VllmSettings, vllm_env


def start_engine(workdir: Path, spec: SimSpec, core: int = 0) -> tuple[ManagedProcess, str]:
    """An engine on a free port, up (answering /health); a missing vLLM raises, it never skips."""
    port = free_port()
    real = spec.engine == "vllm"
    proc = ManagedProcess(f"{spec.engine}-{port}", spec.command(LOOPBACK, port), workdir / f"{spec.engine}-{port}.log",
                          env=vllm_env(core) if real else None, group=real,
                          children_nice=VLLM_NICE if real else 0)
    proc.start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_until(lambda: http_get(f"{url}/health")[0] == 200, VLLM_START_S if real else SIM_START_S, proc.name, proc)
        proc.nice_children()
    except BaseException:
        proc.stop()
        raise
    return proc, url


def real_vllm(model: str = "deepseek-sim", **settings) -> SimSpec:
    return SimSpec(model, engine="vllm", vllm=VllmSettings(**settings))
