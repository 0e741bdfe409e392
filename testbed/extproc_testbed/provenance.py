"""Where a results file's figures came from, kept in the file under `provenance`: the commit of
the checkout the testbed runs from and whether its tree was clean, the machine, the command as
run and the date (UTC). Taken when a run starts, before it writes anything.

    {"commit": "d734f4f...", "clean": true, "checkout": "/work/main", "note": null,
     "machine": {"cpu": "AMD EPYC 7B13", "cores": 2, "memory_gib": 23.5, "kernel": "6.1.0",
                 "system": "Linux", "python": "3.11.7", "envoy": "1.40.0"},
     "load_1m_at_start": 0.41, "command": "extproc bench scenario --backends 4",
     "date": "2026-12-03T10:15:02Z"}

`clean`: `git status --porcelain` shows nothing outside what the benchmarks themselves write
(bench/results/, bench/RESULTS.md), so a second benchmark run before the first one's results
are committed still reads as the code it ran. Outside a git checkout (the testbed installed
from a wheel, git missing, no commit yet) `commit` and `clean` are None and `note` says why;
nothing here raises. `provenance_line` renders it for bench/RESULTS.md."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from .machine import machine_facts

PACKAGE = Path(__file__).resolve().parent
# What the benchmarks write into the checkout: not a change to the code that ran.
BENCH_OUTPUT = ("bench/results", "bench/RESULTS.md")


def code_checkout() -> Path | None:
    """The checkout the testbed runs from: the folder holding testbed/extproc_testbed (this
    package), or None when the package lies elsewhere (installed into site-packages)."""
    return PACKAGE.parents[1] if PACKAGE.parent.name == "testbed" else None


def _git(checkout: Path, *args: str) -> tuple[int, str]:
    run = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, timeout=30)
    return run.returncode, (run.stdout if run.returncode == 0 else run.stderr).strip()


def git_state(checkout: Path | None) -> dict:
    """{"commit", "clean", "checkout", "note"} of `checkout`, the top of a git work tree."""
    unknown = {"commit": None, "clean": None, "checkout": None if checkout is None else str(checkout)}
    if checkout is None:
        return {**unknown, "note": f"not run from a git checkout (the testbed is installed at {PACKAGE})"}
    try:
        status, top = _git(checkout, "rev-parse", "--show-toplevel")
        if status != 0 or Path(top).resolve() != checkout.resolve():
            return {**unknown, "note": f"{checkout} is not the top of a git checkout"
                                       + (f" ({top.splitlines()[0]})" if status != 0 and top else "")}
        status, commit = _git(checkout, "rev-parse", "--verify", "HEAD")
        if status != 0:
            return {**unknown, "note": f"{checkout} has no commit yet"}
        status, changes = _git(checkout, "status", "--porcelain", "--", ".",
                               *(f":(exclude){path}" for path in BENCH_OUTPUT))
        return {"commit": commit, "clean": None if status != 0 else not changes, "checkout": str(checkout),
                "note": None if status == 0 else f"git status failed: {changes.splitlines()[0] if changes else ''}"}
    except (OSError, subprocess.SubprocessError) as error:  # no git, a hung one
        return {**unknown, "note": f"git could not be run: {type(error).__name__}: {error}"}


def command_line(argv: list[str]) -> str:
    """The command as run: `extproc bench ...` (through the console script or `python -m extproc`),
    else whatever program called the benchmark (a test runner)."""
    if not argv:
        return ""
    program = Path(argv[0])
    name = program.parent.name if program.name == "__main__.py" else program.name
    return shlex.join([name, *argv[1:]])


def provenance(command: str | None = None, envoy: bool = True, checkout: Path | None = None,
               now: datetime | None = None) -> dict:
    """The provenance of a run starting now: `command` (default: this process's argv), `envoy`:
    whether the benchmark runs Envoy (its version is recorded), `checkout`: the git work tree
    whose commit to record (default: the one this code runs from)."""
    when = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).replace(microsecond=0)
    return {**git_state(code_checkout() if checkout is None else checkout),
            "machine": machine_facts(envoy),
            # what else ran: a run beside another benchmark reads slower than the code is
            "load_1m_at_start": round(os.getloadavg()[0], 2),
            "command": command_line(sys.argv) if command is None else command,
            "date": when.isoformat().replace("+00:00", "Z")}


def provenance_line(results: dict | None, prefix: str = "Provenance") -> str:
    """One line for bench/RESULTS.md: commit (clean or not), date, machine, command; or that the
    results (a file, a matrix cell) were written before provenance was kept."""
    p = (results or {}).get("provenance")
    if not p:
        return f"{prefix}: recorded before provenance was kept (commit unknown)."
    if p.get("commit"):
        state = {True: "clean", False: "uncommitted changes"}.get(p.get("clean"), "tree state unknown")
        commit = f"commit {p['commit'][:7]} ({state})"
    else:
        commit = f"commit unknown ({p.get('note') or 'not recorded'})"
    m = p.get("machine") or {}
    machine = ", ".join(part for part in (m.get("cpu"), f"{m['cores']} cores" if m.get("cores") else None,
                                          f"{m['memory_gib']:g} GiB" if m.get("memory_gib") else None) if part)
    load = p.get("load_1m_at_start")
    line = ", ".join(part for part in (commit, (p.get("date") or "")[:10], machine,
                                       None if load is None else f"load {load:g} at start") if part)
    note = f"; {p['note']}" if p.get("commit") and p.get("note") else ""  # (without a commit it said why above)
    return f"{prefix}: {line}" + (f"; `{p['command']}`" if p.get("command") else "") + note
