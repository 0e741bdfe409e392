"""`extproc bench faults`, short: real Envoy, sidecar and simulated backends under a steady mixed
load, with a fault inside the run. Every request ends one counted way, none hangs, and once idle
no slot is held."""

from __future__ import annotations

import json

from multidict import CIMultiDict

from extproc_testbed.fault_load import ENDINGS, classify_answer
from extproc_testbed.faults import markdown, run_fault

RATE = 4.0  # requests/s: about 70 % of the pool's ~6 per second here (run_fault measures it when None)
CONNECTION_ERRORS = ("ServerDisconnectedError", "ClientConnectorError", "ClientOSError", "ClientPayloadError")


def assert_nothing_lost(summary: dict) -> None:
    assert summary["requests"] > 0
    assert summary["uncounted"] == 0, summary
    assert sum(summary[e] for e in ENDINGS) == summary["requests"], summary
    assert summary["hung"] == 0, summary["hung_by"]
    assert summary["leaked"] == 0, summary["idle"]
    assert summary["slots_admitted"] == summary["slots_released"] > 0, summary["idle"]
    assert summary["ok"] > 0
    assert all(alive for alive in summary["processes_alive"].values()), summary["processes_alive"]
    assert summary["duplicates_at_backends"] == {}
    assert "fault_error" not in summary, summary["fault_error"]


def test_envoy_restarted_while_requests_wait_releases_every_slot(tmp_path):
    summary = run_fault("envoy_restart", seconds=6, workdir=tmp_path, rate=RATE, timeout_s=30)
    assert_nothing_lost(summary)
    restarts = summary["restarts"]
    assert [r["signal"] for r in restarts] == ["SIGTERM", "SIGKILL"]
    for restart in restarts:
        assert restart["line_at_fault"] >= 1  # requests were waiting in the sidecar's line...
        assert restart["sidecar_idle_after_s"] is not None  # ...and all were let go while Envoy was down
    # what the clients saw of it: a connection refused or cut, or a clean refusal
    assert all(detail.startswith(CONNECTION_ERRORS) for detail in summary["other_by"]), summary["other_by"]
    assert all(detail.startswith(("429 ", "503 ")) for detail in summary["refused_by"]), summary["refused_by"]
    assert "envoy_restart" in markdown([summary], "test")


def test_backend_paused_then_resumed_answers_or_refuses_cleanly(tmp_path):
    summary = run_fault("backend_pause", seconds=6, workdir=tmp_path, rate=RATE, pause_s=3, timeout_s=30)
    assert_nothing_lost(summary)
    assert summary["pause_s"] == 3
    assert summary["other"] == 0, summary["other_by"]  # a stalled backend only delays: no errors


def test_endings_are_classified_by_what_the_client_got():
    def headers(**pairs: str) -> CIMultiDict:
        return CIMultiDict({k.replace("_", "-"): v for k, v in pairs.items()})

    error = json.dumps({"error": {"message": "m", "type": "rate_limit_error", "param": None, "code": "overloaded"}})
    assert classify_answer(429, headers(retry_after="2"), error.encode(), False) == ("refused", "429 overloaded")
    assert classify_answer(429, headers(x_should_retry="false"), error.encode(), False)[0] == "refused"
    assert classify_answer(429, headers(), error.encode(), False) == ("other", "429 overloaded without retry-after")
    assert classify_answer(503, headers(retry_after="1"), b"upstream connect error", False)[0] == "other"
    assert classify_answer(504, headers(), error.encode(), False) == ("other", "504 overloaded")
    assert classify_answer(200, headers(), b"data: {}\n\ndata: [DONE]\n\n", True) == ("ok", "200")
    assert classify_answer(200, headers(), b"data: {}\n\n", True)[0] == "other"
    assert classify_answer(200, headers(), b'{"choices": []}', False) == ("ok", "200")
    assert classify_answer(200, headers(), b"{", False)[0] == "other"
