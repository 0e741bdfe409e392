"""What bench/RESULTS.md says of where its figures came from: one provenance line under each
section (or that a results file was written before provenance was kept), the command as run, and
the burst's two engine behaviours side by side. Pure functions over the results' dicts."""

from __future__ import annotations

import json

from extproc_testbed.provenance import command_line, provenance_line
from extproc_testbed.report import write_results
from extproc_testbed.report_scenario import behaviour_runs, repeats_section, scenario_section

ORIGIN = {"commit": "abc1234def5678abc1234def5678abc1234def56", "clean": True, "checkout": "/src", "note": None,
          "machine": {"cpu": "AMD EPYC 7B13", "cores": 2, "memory_gib": 23.5, "kernel": "6.1.0", "system": "Linux",
                      "python": "3.11.7", "envoy": "1.40.0"},
          "command": "extproc bench scenario --kv-exhausted both", "date": "2026-12-03T10:15:02Z"}


def test_the_provenance_line_names_the_commit_its_state_the_date_the_machine_and_the_command():
    assert provenance_line({"provenance": ORIGIN}) == (
        "Provenance: commit abc1234 (clean), 2026-12-03, AMD EPYC 7B13, 2 cores, 23.5 GiB; "
        "`extproc bench scenario --kv-exhausted both`")
    dirty = {**ORIGIN, "clean": False}
    assert provenance_line({"provenance": dirty}).startswith("Provenance: commit abc1234 (uncommitted changes), ")
    nowhere = {**ORIGIN, "commit": None, "clean": None, "note": "not run from a git checkout"}
    assert provenance_line({"provenance": nowhere}, "- Provenance of repeat-1").startswith(
        "- Provenance of repeat-1: commit unknown (not run from a git checkout), 2026-12-03, AMD EPYC 7B13")
    # a note beside a commit (a later run that replaced part of the results) is said after the command
    amended = {**ORIGIN, "note": "the burst held by --peak-only at def5678"}
    assert provenance_line({"provenance": amended}).endswith(
        "`extproc bench scenario --kv-exhausted both`; the burst held by --peak-only at def5678")
    assert provenance_line({"setups": {}}) == "Provenance: recorded before provenance was kept (commit unknown)."
    assert provenance_line({"provenance": None}) == provenance_line(None) == provenance_line({})
    # the load when the run began says whether something else ran beside it
    assert provenance_line({"provenance": {**ORIGIN, "load_1m_at_start": 3.5}}) == (
        "Provenance: commit abc1234 (clean), 2026-12-03, AMD EPYC 7B13, 2 cores, 23.5 GiB, load 3.5 at start; "
        "`extproc bench scenario --kv-exhausted both`")


def test_the_command_is_recorded_as_run():
    assert command_line(["/venv/bin/extproc", "bench", "scenario", "--size", "0.05"]) == \
        "extproc bench scenario --size 0.05"
    assert command_line(["/src/extproc/__main__.py", "bench", "overhead", "--out", "/tmp/a b"]) == \
        "extproc bench overhead --out '/tmp/a b'"  # python -m extproc, quoted as a shell would need it
    assert command_line(["/venv/bin/pytest", "tests/e2e"]) == "pytest tests/e2e"  # called from elsewhere: said so
    assert command_line([]) == ""


def _setup(in_time: float, crashes: int, preemptions: int | None) -> dict:
    def figures(deadline: float) -> dict:
        return {"deadline_s": deadline, "in_time": in_time, "availability": 1.0, "p50_s": 0.5, "p95_s": 1.0,
                "p99_s": 1.5, "p99_with_failures_s": 1.5, "queue_wait_p50_s": 0.0, "queue_wait_p99_s": 0.1,
                "burst_p99_s": 1.9}

    setup = {"classes": {"loan_approval": figures(2.0), "complaint": figures(30.0), "archive_query": figures(120.0)},
             "oom_crashes": crashes, "in_time": in_time, "availability": 0.9, "failed_share": 0.1,
             "refused_attempts_share": 0.2, "goodput_tokens_per_s": 100.0, "goodput_in_time_tokens_per_s": 90.0}
    if preemptions is not None:
        setup["engine_preemptions"] = preemptions
    return setup


def _scenario(**extra) -> dict:
    return {"setups": {"envoy_only": _setup(0.42, 4, 0), "sidecar": _setup(0.997, 0, 0)},
            "traffic": {"branches": 200, "steady_rps": 14, "steady_s": 30, "burst_rps": 60, "burst_s": 30,
                        "recovery_s": 40},
            "time_scale": 0.5, "pool": "simulated vLLM, crash mode", "backends": 4, "min_backends_for_slo": {},
            "step_load": [], "ablation": [], "command": "extproc bench scenario", "machine": "2 cores",
            "seconds": 300, **extra}


def test_both_engine_behaviours_are_rendered_side_by_side_queue_first():
    queue = {"pool": "simulated vLLM, queue mode",
             "setups": {"envoy_only": _setup(0.61, 0, 37), "sidecar": _setup(0.95, 0, 2)}}
    summary = _scenario(kv_exhausted="crash", other_behaviours={"queue": queue}, provenance=ORIGIN)
    assert list(behaviour_runs(summary)) == ["queue", "crash"]
    lines = scenario_section(summary)
    header = next(line for line in lines if line.startswith("| | queue:"))
    assert header == ("| | queue: Envoy alone | queue: Envoy + sidecar | crash: Envoy alone | crash: Envoy + sidecar |")
    table = lines[lines.index(header):]
    table = table[:table.index("")]  # the side-by-side table, not the detailed one below it
    rows = {line.split(" | ")[0]: line for line in table[2:]}
    assert len(rows) == 9
    assert rows["| **answered in time, all requests**"].endswith("| 0.61 | 0.95 | 0.42 | 0.997 |")
    assert rows["| simulated OOM crashes"].endswith("| 0 | 0 | 4 | 0 |")
    assert rows["| engine preemptions"].endswith("| 37 | 2 | 0 | 0 |")
    assert rows["| loan_approval: in time (within 2 s)"].endswith("| 0.61 | 0.95 | 0.42 | 0.997 |")
    assert {"| complaint: in time (within 30 s)", "| archive_query: in time (within 120 s)",
            "| availability", "| goodput within the deadlines (tokens/s)",
            "| **loan_approval: p99 of those sent during the burst (failures counted)**"} <= set(rows)
    text = "\n".join(lines)
    assert "with `crash`" in text and "what admission buys" in text
    assert "with `queue`" in text and "priority and bounded waits buy" in text
    assert lines[-2] == provenance_line(summary) and lines[-2].startswith("Provenance: commit abc1234 (clean)")


def test_each_section_says_where_its_results_came_from_or_that_nobody_kept_it(tmp_path):
    new = _scenario(provenance=ORIGIN)
    assert scenario_section(new)[-2] == provenance_line(new)
    old = _scenario()  # written before provenance and `kv_exhausted` were kept: commit unknown, crash mode
    assert list(behaviour_runs(old)) == ["crash"]
    lines = scenario_section(old)
    assert not any(line.startswith("| | queue:") for line in lines)  # one behaviour: no side by side
    assert "Provenance: recorded before provenance was kept (commit unknown)." in lines
    results = tmp_path / "results"
    (results / "small-pool").mkdir(parents=True)
    (results / "scenario.json").write_text(json.dumps(new))
    (results / "small-pool" / "scenario.json").write_text(json.dumps(old))
    page = write_results(results).read_text()
    assert page.count("Provenance: commit abc1234 (clean), 2026-12-03") == 1
    assert page.count("Provenance: recorded before provenance was kept (commit unknown).") == 1
    assert "- Provenance of small-pool: recorded before provenance was kept" not in page  # small-pool: its own section


def test_each_further_run_names_its_own_provenance():
    lines = repeats_section({"repeat-1": _scenario(provenance=ORIGIN), "repeat-2": _scenario(), "broken": None,
                             "vllm-like": _scenario(kv_exhausted="queue", provenance=ORIGIN)})
    assert any(line.startswith("| vllm-like (queue mode) | 4 |") for line in lines)  # a run in queue mode says so
    assert "- Provenance of repeat-1: " + provenance_line({"provenance": ORIGIN}).removeprefix("Provenance: ") in lines
    assert "- Provenance of repeat-2: recorded before provenance was kept (commit unknown)." in lines
    assert not any("broken" in line for line in lines)
