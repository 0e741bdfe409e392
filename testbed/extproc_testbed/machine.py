"""What a benchmark ran on, in words: CPU, cores, memory, kernel, Python, Envoy."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

from .stack import envoy_binary


def _cpu_model() -> str:
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return match.group(1).strip() if match else platform.processor() or platform.machine()
    except OSError:
        return platform.machine()


def _memory_gib() -> float | None:
    try:
        match = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        return round(int(match.group(1)) / 1024**2, 1) if match else None
    except OSError:
        return None


def _envoy_version() -> str:
    try:
        out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
        match = re.search(r"version: \S+/([\d.]+)/", out)
        return match.group(1) if match else out.strip()[:60]
    except Exception:
        return "unknown"


def describe_machine() -> str:
    memory = _memory_gib()
    return (f"{os.cpu_count()} cores ({_cpu_model()}), {memory} GiB, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, Envoy {_envoy_version()}")
