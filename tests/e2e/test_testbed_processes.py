"""Parts of the testbed the real-engine tests lean on: a process whose children (a vLLM server's
engine core and worker) run at a lower CPU priority than itself, processes (and Redis) that die
with the process that started them, and the tests' Envoy with another ext_proc message_timeout
than the shipped one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from extproc_testbed.envoy_config import EnvoyLayout, _ext_proc, render, template_path
from extproc_testbed.stack import ManagedProcess, _descendants


def nice_of(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def test_only_the_children_of_a_process_are_niced(tmp_path):
    proc = ManagedProcess("tree", ["sh", "-c", "sleep 30 & sleep 30 & wait"], tmp_path / "tree.log",
                          group=True, children_nice=7)
    proc.start()
    try:
        deadline = time.monotonic() + 10
        while len(_descendants(proc.pid)) < 2:
            assert time.monotonic() < deadline, "the children never started"
            time.sleep(0.05)
        proc.nice_children()
        children = _descendants(proc.pid)
        assert [nice_of(child) for child in children] == [7, 7]
        assert nice_of(proc.pid) == nice_of(os.getpid())  # the parent keeps its own
    finally:
        proc.stop()


def ext_proc_timeout(layout: EnvoyLayout) -> str:
    config = render(yaml.safe_load(template_path().read_text("utf-8")), layout)
    return _ext_proc(config)["typed_config"]["message_timeout"]


def test_the_tests_envoy_may_wait_longer_for_the_sidecar_than_the_shipped_second():
    layout = dict(listen=("127.0.0.1", 1), admin=("127.0.0.1", 2), extproc=[("127.0.0.1", 3)],
                  clusters={"vllm_primary": [("127.0.0.1", 4)], "vllm_fallback": [("127.0.0.1", 5)]})
    assert ext_proc_timeout(EnvoyLayout(**layout)) == "1s"
    assert ext_proc_timeout(EnvoyLayout(**layout, message_timeout_s=5)) == "5s"


CHILDREN = {  # what the parent starts, and the program its child runs
    "managed process": ("from extproc_testbed.stack import ManagedProcess; "
                        "p = ManagedProcess('orphan', ['sleep', '60'], Path(sys.argv[1])); p.start(); "
                        "pid = p.pid", "sleep"),
    "redis-server": ("from extproc_testbed.redis_server import RedisServer; "
                     "pid = RedisServer(Path(sys.argv[1])).start().process.pid", "redis-server"),
}


@pytest.mark.parametrize("kind", CHILDREN)
def test_a_process_is_stopped_when_the_process_that_started_it_dies(tmp_path, kind):
    """The death signal survives the exec: a parent killed with SIGKILL (no cleanup of its own)
    still takes its child with it (a benchmark or a test worker killed leaves no Redis behind)."""
    start, program = CHILDREN[kind]
    code = f"import sys, time; from pathlib import Path; {start}; print(pid, flush=True); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "orphan")], stdout=subprocess.PIPE)
    child = int(parent.stdout.readline())
    # setpriv sets the death signal and then execs the program: a parent killed before that (a
    # loaded machine) would leave no signal to deliver, which is not what is tested here
    try:
        ready = time.monotonic() + 10
        while _comm(child) != program:
            assert time.monotonic() < ready, f"the child never ran {program} ({_comm(child)!r})"
            time.sleep(0.01)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:  # (failing, it leaves nothing running either)
        parent.kill()
        parent.wait()
        parent.stdout.close()
        if _comm(child) == program:
            os.kill(child, 9)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_no_python_runs_in_a_child_between_fork_and_exec(tmp_path):
    """Python code in the child before exec (a preexec_fn) makes subprocess fork() rather than vfork(),
    and fork() runs gRPC's fork handlers in the child: with gRPC serving in the parent (every
    end-to-end test), its poller aborted a simulated engine as it started ("epoll_wait error: Bad
    file descriptor"). An at-fork hook in the parent's interpreter shows whether the child ran any."""
    marker = tmp_path / "forked"
    code = ("import os, sys, subprocess; from pathlib import Path; from extproc_testbed.stack import ManagedProcess; "
            f"os.register_at_fork(after_in_child=lambda: os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_WRONLY))); "
            "p = ManagedProcess('true', ['true'], Path(sys.argv[1])); p.start(); sys.exit(p.process.wait())")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "true.log")], check=True, timeout=30)
    assert not marker.exists()
