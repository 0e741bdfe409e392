"""The soak, short (`extproc bench soak` runs it for 30 minutes): a mixed load through real
Envoy and one sidecar on a real Redis queue, with clients giving up, an engine crash and a
config reload on the way. It checks leaks, not speed: at every quiet moment the sidecar holds no
slot and no lease, every slot taken was given back once, and Redis holds only the pools' own
keys, none left by a request."""

from __future__ import annotations

from pathlib import Path

from extproc_testbed.soak import Schedule, run_soak


def warnings_of(summary: dict) -> list[str]:
    """The sidecar's warnings and errors in the soak, for a failure's message."""
    log = Path(summary["logs"]) / "sidecar.log"
    lines = log.read_text("utf-8", "replace").splitlines()
    return [line for line in lines if ("WARNING" in line or "ERROR" in line) and "object counts" not in line][-20:]


def test_a_short_soak_leaks_no_slot_no_lease_and_no_redis_key(tmp_path):
    summary = run_soak(Schedule(minutes=0.8, rate=10, cycle_s=12, quiet_s=3, reload_every_s=15, crash_every_s=20),
                       tmp_path)
    events = [e["event"] for e in summary["events"]]
    assert "reload" in events and any(e.startswith("engine") for e in events)  # the day's faults happened
    assert summary["endings"].get("gave up", 0) > 0 and summary["endings"].get("200", 0) > 0
    quiet = summary["samples"][1:]
    assert len(quiet) >= 3
    for moment in quiet:
        assert moment["inflight"] == 0 and moment["waiting"] == 0 and moment["leases"] == 0, (moment, warnings_of(summary))
        assert moment["slots_taken"] == moment["slots_given_back"], moment
        # Each key is one of a pool's own (its line, its leases, its breaker windows...), none a
        # request's: a waiting ticket's hash (P:tk:ID) is gone once nobody waits.
        kinds = {name.split("}:", 1)[1].split(":")[0] for name in moment["redis_key_names"]}
        assert "tk" not in kinds, moment["redis_key_names"]
        pools = {name.split("}:", 1)[0] for name in moment["redis_key_names"]}
        assert len(moment["redis_key_names"]) <= len(pools) * len(kinds) * 3, moment["redis_key_names"]
    assert quiet[-1]["slots_taken"] > quiet[0]["slots_taken"]  # the load went on between the moments
