"""Two parts of the testbed the real-engine tests lean on: a process whose children (a vLLM
server's engine core and worker) run at a lower CPU priority than itself, and the tests' Envoy
with another ext_proc message_timeout than the shipped one."""

from __future__ import annotations

import os
import time

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
