"""A matrix cell run on several seeds (`extproc bench scenario --matrix --seeds`): one run's 119
loans allow a single miss under 99 %, so a cell's figures are those of every run's requests
together, and each run's are kept beside them."""

from __future__ import annotations

import pytest

from extproc_testbed.report_scenario import seeds_lines
from extproc_testbed.scenario_matrix import seeds_arg
from extproc_testbed.scenario_run import pooled, strip, summarize
from extproc_testbed.traffic import Outcome, Traffic


def _run(traffic: Traffic, seed: int, slow_loans: int, crashes: int = 0, loans: int = 100) -> dict:
    """A run of `loans` loans sent in the burst, `slow_loans` of them answered in 3 s on engine
    127.0.0.1:9000, the rest in 0.5 s; one retry each."""
    outcomes = [Outcome("loan_approval", traffic.steady_s + i * 0.1, False, ok=True, engine="127.0.0.1:9000",
                        attempts=[(traffic.steady_s, 429), (traffic.steady_s + 1, 200)],
                        latency_s=3.0 if i < slow_loans else 0.5) for i in range(loans)]
    series = [{"t": 0.0, "picks_ignored": float(seed == 11)}]
    return {**summarize(outcomes, series, crashes, traffic), "engines_on_kv_exhausted": ["crash"],
            "engine_preemptions": 1, "seed": seed, "outcomes": outcomes}


def test_runs_on_several_seeds_pool_their_requests_and_keep_each_runs_figures():
    traffic = Traffic.independent_burst()
    runs = [_run(traffic, 7, 0, crashes=1, loans=100), _run(traffic, 11, 3, crashes=2, loans=50),
            _run(traffic, 13, 1, loans=150)]
    whole = pooled(runs, traffic)
    loans = whole["classes"]["loan_approval"]
    # 296 of 300 in time: not the runs' mean of means (1, 0.94, 0.9933: 0.9778)
    assert loans["requests"] == 300 and loans["in_time"] == round(296 / 300, 4)
    assert loans["burst_p99_s"] == 3.0  # 4 slow of 300: the pooled p99 is a slow one; seed 7's alone was 0.5
    assert whole["oom_crashes"] == 3 and whole["engine_preemptions"] == 3  # counts: summed
    # a rate is per second of one run, not of the three laid end to end
    assert whole["goodput_in_time_rps"] == round(296 / traffic.duration_s / 3, 2)
    assert whole["retries_over_time"] == {int(traffic.steady_s // 5) * 5 + 0: 100.0}  # 300 retries, 3 runs
    assert [s["goodput_in_time_rps"] for s in whole["by_seed"]] == [round(n / traffic.duration_s, 2)
                                                                     for n in (100, 47, 149)]
    # the slow loans' engine is each run's own, though its address was the same
    assert whole["slow_loans"]["by_engine"] == {"seed 11 127.0.0.1:9000": 3, "seed 13 127.0.0.1:9000": 1}
    assert whole["engine_picks_ignored"] == 1.0  # seen in any run
    assert [(s["seed"], s["loans_in_time"], s["crashes"]) for s in whole["by_seed"]] == [
        (7, 1.0, 1), (11, 0.94, 2), (13, round(149 / 150, 4), 0)]
    assert whole["series"] == runs[0]["series"]  # the plots draw one run's series
    assert "outcomes" not in strip({**whole, "outcomes": []}) and "series" not in strip(whole)


def test_seeds_are_read_in_order_once_each_and_the_report_names_each_runs_loans():
    assert seeds_arg("7,11,7,13") == (7, 11, 13)
    with pytest.raises(ValueError):
        seeds_arg(",")
    traffic = Traffic.independent_burst()
    sidecar = pooled([_run(traffic, 7, 0), _run(traffic, 11, 3)], traffic)
    alone = pooled([_run(traffic, 7, 80), _run(traffic, 11, 90)], traffic)
    cells = {"plain-32-honour": {"seeds": [7, 11], "setups": {"sidecar": sidecar, "envoy_only": alone}},
             "template-8-honour": {"seeds": [7], "setups": {}}}
    text = "\n".join(seeds_lines(cells))
    assert "plain-32-honour: seed 7 1 / 0.2, seed 11 0.97 / 0.1." in text and "template-8-honour" not in text
    assert seeds_lines({"template-8-honour": cells["template-8-honour"]}) == []


def test_one_matrix_file_holds_one_kind_of_engine(tmp_path):
    """Cells whose engines ran with another --long-prefill-token-threshold are not mixed into a
    file: the run is refused before it starts anything."""
    import argparse
    import json

    from extproc_testbed.scenario_matrix import earlier_cells, run

    (tmp_path / "matrix").mkdir()
    path = tmp_path / "matrix" / "matrix.json"
    path.write_text(json.dumps({"cells": {"plain-32-ignore": {"seeds": [7]}}}))
    args = argparse.Namespace(out=str(tmp_path), size=1.0, cells="plain-32-ignore", seeds=(7,), time_scale=0.5,
                              long_prefill_token_threshold=512)
    with pytest.raises(SystemExit, match="--long-prefill-token-threshold 0; write this run elsewhere"):
        run(args)
    assert earlier_cells(path, 0)["cells"] == {"plain-32-ignore": {"seeds": [7]}}  # the same kind: kept
    assert earlier_cells(tmp_path / "none.json", 512) == {"cells": {}}
