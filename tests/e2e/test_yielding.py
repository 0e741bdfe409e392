"""A long prompt yields its engine to a loan, through real Envoy (core/yielding.py,
lifecycle/yielding.py): where Envoy places the pool's requests, a long prompt of a class without a
latency target, admitted less than its prefill ago, is answered 503 with `retry-after` in Envoy's
place when a loan arrives; Envoy resets its upstream request and the engine aborts it, its slot is
released once (counted `yielded`), and it comes back under the same name to run to its end,
yielding no more. A long prompt the sidecar could not know again when it comes back never yields."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import yaml

from extproc_testbed.stack import SimSpec, Stack, StackPorts, wait_until

from ..conftest import e2e_config
from ..helpers import metric

LONG_PROMPT = "x" * 4 * 10_000  # 10k tokens: about 1.8 s of prefill on the simulator at time scale 1


def yielding_config(ports: StackPorts) -> dict:
    config = e2e_config()
    config["classes"]["loan_approval"]["latency_target_s"] = 2
    # Envoy places the pool's requests (no pick_backend): long prompts wait for quiet spells, none
    # here (long_quiet_s 0: as soon as no loan runs), and yield to a loan in their prefill
    config["pools"]["primary"].update(max_inflight=8, capacity={
        "backends": [f"http://127.0.0.1:{port}" for port in ports.primary], "long_quiet_s": 0})
    return config


@dataclass
class Answer:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self) -> dict:
        return json.loads(self.text)


def post(stack: Stack, ticket: str, content: str, max_tokens: int, key: str | None = None) -> Answer:
    headers = {"content-type": "application/json", "x-ticket-type": ticket,
               **({"idempotency-key": key} if key else {})}
    body = {"model": "deepseek-sim", "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]}
    request = urllib.request.Request(f"{stack.url}/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Answer(response.status, lowered(response.headers), response.read().decode())
    except urllib.error.HTTPError as error:
        return Answer(error.code, lowered(error.headers), error.read().decode())


def lowered(headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def engines(ports: StackPorts, name: str, **labels: str) -> float:
    return sum(metric(f"http://127.0.0.1:{port}/metrics", name, **labels) for port in ports.primary)


def long_then_loan(stack: Stack, ports: StackPorts, pool, key: str | None) -> tuple[Answer, Answer]:
    """A long archive query; once an engine runs it, a loan. Both answers."""
    running = engines(ports, "vllm:num_requests_running")
    long = pool.submit(post, stack, "archive_query", LONG_PROMPT, 64, key)
    wait_until(lambda: engines(ports, "vllm:num_requests_running") > running or long.done(), timeout=20,
               what="an engine running the long prompt")
    loan = post(stack, "loan_approval", "Approve this loan?", 8)
    return long.result(), loan


def test_a_long_prompt_yields_its_engine_to_a_loan_once_and_comes_back(tmp_path):
    ports = StackPorts.random(primary=2)
    config_path = tmp_path / "extproc.yaml"
    config_path.write_text(yaml.safe_dump(yielding_config(ports)))
    stack = Stack(tmp_path, ports, config_path, primary=SimSpec("deepseek-sim", ("--time-scale", "1.0")))
    with stack, ThreadPoolExecutor(2) as pool:
        aborted = lambda: engines(ports, "vllm:request_success_total", finished_reason="abort")  # noqa: E731
        released = lambda end: metric(stack.metrics_url, "extproc_slots_released_total",  # noqa: E731
                                      pool="primary", end=end)
        # a prompt its client does not name: the sidecar would not know it again, so it never yields
        long, loan = long_then_loan(stack, ports, pool, key=None)
        assert (long.status_code, loan.status_code) == (200, 200)
        assert aborted() == 0 and released("yielded") == 0

        key = uuid.uuid4().hex
        long, loan = long_then_loan(stack, ports, pool, key)
        assert loan.status_code == 200
        assert long.status_code == 503, long.text
        assert long.headers["x-extproc-outcome"] == "yielded"
        # long_quiet_s 0 here: retry_after_s.overloaded (2 s), up to half as much again
        comeback_s = int(long.headers["retry-after-ms"]) / 1000
        assert 2.0 <= comeback_s <= 3.0 and long.headers["retry-after"] in ("2", "3")
        error = long.json()["error"]
        assert error["code"] == "yielded_to_latency_bound" and error["type"] == "server_error"
        assert re.search(r"Come back in [23]\.\d s \(retry-after\)", error["message"]), error["message"]
        # Envoy reset the upstream request and the engine aborted it; its slot went back once, as yielded
        wait_until(lambda: aborted() == 1, timeout=10, what="the engine aborting the yielded prompt")
        wait_until(lambda: released("yielded") == 1, timeout=5, what="the yielded prompt's slot released")

        time.sleep(comeback_s)  # its retry-after
        long, loan = long_then_loan(stack, ports, pool, key)  # back under its name: it runs to its end
        assert (long.status_code, loan.status_code) == (200, 200), long.text
        assert aborted() == 1 and released("yielded") == 1
        wait_until(lambda: metric(stack.metrics_url, "extproc_inflight", pool="primary") == 0, timeout=5,
                   what="every slot back")
        assert released("completed") == 5
