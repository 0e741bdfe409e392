"""The compressed day (`extproc bench scenario --day`, testbed/extproc_testbed/day.py): its load
curve, the settings each policy runs with (the day's clock compressed, the requests' not), the
engine-hours it bills, and the model's error per phase."""

from __future__ import annotations

import dataclasses

import pytest

from extproc_testbed.day import (
    BURST,
    BURST_PHASE,
    DEPLOYED,
    PHASES,
    REQUEST_CLOCK,
    DayTraffic,
    compression,
    engine_hours,
    model_error,
    setup_for,
)


def test_the_night_runs_at_a_fifth_of_the_peak_and_the_burst_at_twice_it():
    day = DayTraffic(hour_s=10.0, peak_rps=20.0)
    assert day.duration_s == 240.0
    assert day.rate_at(3 * 10.0) == pytest.approx(4.0)  # 03:00
    assert day.rate_at(15 * 10.0) == pytest.approx(20.0)  # 15:00, the second peak
    assert day.rate_at((BURST[0] + 0.1) * 10.0) == pytest.approx(40.0)
    assert day.rate_at(BURST[1] * 10.0) < 25.0  # the burst ends from one second to the next
    assert day.rate_at(8 * 10.0) == pytest.approx(20.0 * 0.6)  # halfway up the morning ramp (0.3 -> 0.9)


def test_the_phases_cover_the_day_and_the_burst_lies_inside_the_first_peak():
    day = DayTraffic(hour_s=10.0)
    seen = {day.phase_at(t / 10) for t in range(0, 2400)}
    assert seen == set(day.phases()) == {name for name, _, _ in PHASES} | {BURST_PHASE}
    first_peak = next((start, end) for name, start, end in PHASES if name == "first peak")
    assert first_peak[0] <= BURST[0] < BURST[1] <= first_peak[1]
    assert day.phase_at(BURST[0] * 10.0 - 0.01) == "first peak" and day.phase_at(BURST[0] * 10.0) == BURST_PHASE
    assert day.mean_rate("night") == pytest.approx(0.2 * day.peak_rps, rel=0.05)


def test_the_day_clock_is_compressed_and_the_requests_clock_is_not():
    day = DayTraffic(hour_s=50.0)
    k = compression(day)
    assert k == 72.0
    predicted = setup_for("predicted", day, 0.5, 4.0)
    assert predicted.cold_start_s == pytest.approx(DEPLOYED["cold_start_s"] / k)
    assert predicted.model["horizon_s"] == pytest.approx(DEPLOYED["cold_start_s"] / k)
    assert predicted.model["scale_in_hold_s"] == pytest.approx(DEPLOYED["scale_in_hold_s"] / k)
    assert predicted.scale_in_every_s == pytest.approx(DEPLOYED["scale_in_every_s"] / k)
    for key, value in REQUEST_CLOCK.items():
        assert predicted.model[key] == value
    assert predicted.max_num_seqs == DEPLOYED["max_num_seqs"] and predicted.drains
    assert predicted.base == DEPLOYED["min_backends"] and predicted.maximum == DEPLOYED["max_backends"]


def test_one_stabilization_window_per_policy():
    day = DayTraffic(hour_s=50.0)
    k = compression(day)
    # the model's own hold is the window; the HPA's minute covers a restarted replica's first readings
    assert setup_for("predicted", day, 0.5, 4.0).hold_s == pytest.approx(DEPLOYED["hpa_scale_down_window_s"] / k)
    assert DEPLOYED["hpa_scale_down_window_s"] < DEPLOYED["scale_in_hold_s"]
    assert setup_for("queue", day, 0.5, 4.0).hold_s == pytest.approx(DEPLOYED["queue_rule_window_s"] / k)
    fixed = setup_for("fixed:5", day, 0.5, 4.0)
    assert (fixed.base, fixed.maximum, fixed.drains, fixed.scale_in_every_s) == (5, DEPLOYED["max_backends"], False, 0.0)


def test_engine_hours_bill_every_engine_asked_for_in_hours_of_the_day():
    day = DayTraffic(hour_s=10.0)
    series = [{"t": 0.0, "billed": 2}, {"t": 50.0, "billed": 4}, {"t": 60.0, "billed": 2}, {"t": 240.0, "billed": 2},
              {"t": 250.0, "billed": 9}]  # past the day's end: not billed
    assert engine_hours(series, day) == pytest.approx((2 * 50 + 4 * 10 + 2 * 180) / 10.0)
    assert engine_hours(series, day, "night") == pytest.approx(2 * 50 / 10.0 + 4 * 10 / 10.0 + 2 * 10 / 10.0)


def _row(policy: str, held_by_phase: dict[str, bool], needed: dict[str, int] | None = None) -> dict:
    return {"policy": policy, "by_phase": {phase: {"held": held, "model_needed_now": (needed or {}).get(phase)}
                                           for phase, held in held_by_phase.items()}}


def test_the_models_error_is_against_the_smallest_fixed_pool_that_held_the_phase():
    day = DayTraffic()
    phases = day.phases()
    everywhere = dict.fromkeys(phases, True)
    rows = [_row("fixed:6", everywhere),
            _row("fixed:5", {**everywhere, BURST_PHASE: False}),
            _row("predicted", everywhere, {**dict.fromkeys(phases, 2), BURST_PHASE: 7, "night": 1})]
    errors = model_error(rows, day)
    assert errors[BURST_PHASE] == {"model_needed_now": 7, "smallest_fixed_held": 6, "smallest_fixed_run": 5,
                                   "largest_fixed_run": 6, "error_engines": 1}
    assert errors["night"]["error_engines"] == 1 - 5  # 5 held it: fewer may have (the table says "at most 5")
    none_held = model_error([_row("fixed:5", dict.fromkeys(phases, False)), rows[2]], day)
    assert none_held["lunch"]["smallest_fixed_held"] is None and none_held["lunch"]["error_engines"] is None


def test_the_table_gives_a_bound_where_the_smallest_fixed_pool_run_held():
    from extproc_testbed.day_report import tables

    day = DayTraffic()
    phases = day.phases()

    def row(policy, held_day, by_phase_held, needed=None):
        return {"policy": policy, "held_slo": held_day, "in_time_by_class": dict.fromkeys(("loan_approval", "complaint",
                                                                                          "archive_query"), 1.0),
                "loan_p99_s": 1.0, "availability": 1.0, "max_billed": 5, "engine_hours": 60.0,
                "engine_hours_vs_fixed_peak": 0.5, "drains": 0, "drain_s_max": None,
                "by_phase": {p: {"held": by_phase_held.get(p, True), "offered_rps": 1.0, "engines_billed_mean": 2.0,
                                 "model_needed_now": (needed or {}).get(p)} for p in phases}}

    rows = [row("fixed:5", False, {BURST_PHASE: False}), row("fixed:6", True, {}),
            row("predicted", True, {}, {**dict.fromkeys(phases, 2), BURST_PHASE: 7})]
    summary = {"fixed_peak_backends": 6, "fixed_peak_is_smallest_run": False, "fixed_one_fewer_run": True,
               "policies": rows, "model_error_by_phase": model_error(rows, day)}
    text = "\n".join(tables(summary))
    assert "The smallest fixed pool that held every class over the day: 6 engines (5 did not)." in text
    assert "- predicted: 60.0 engine-hours, 100% of fixed:5's (the day), 100% of fixed:6's (the day)." in text
    assert "The pool sized for the peak was not searched" in text
    assert f"| {BURST_PHASE} |" in text and "| 7 | 6 | +1 |" in text  # 5 failed the burst: 6 is the smallest
    assert "| 2 | ≤ 5 | ≥ -3 |" in text  # elsewhere 5 held: fewer may have too, the error is a bound
    rows[0]["by_phase"]["lunch"]["held"] = rows[1]["by_phase"]["lunch"]["held"] = False
    summary["model_error_by_phase"] = model_error(rows, day)
    assert "| 2 | more than 6 | – |" in "\n".join(tables(summary))


def test_the_burst_is_held_after_a_lead_in_at_the_rate_before_it():
    from extproc_testbed.day_peak import LEAD_S, held_s, held_traffic
    from extproc_testbed.traffic import DEADLINES_S, arrivals

    day = DayTraffic(hour_s=50.0, peak_rps=14.0)
    held = held_traffic(day)
    assert held_s(day) == 2 * max(DEADLINES_S.values())
    assert held.duration_s == pytest.approx(LEAD_S + held_s(day))
    before = day.rate_at(BURST[0] * 50.0 - 0.01)
    assert [held.rate_at(t) for t in (0.0, LEAD_S - 0.01)] == pytest.approx([before] * 2, rel=1e-3)
    assert [held.rate_at(t) for t in (LEAD_S, LEAD_S + 100.0, held.duration_s - 0.01)] == pytest.approx([28.0] * 3)
    assert (held.phase_at(LEAD_S - 0.01), held.phase_at(LEAD_S)) == ("lead-in", BURST_PHASE)
    sent = [t for t, _, _ in arrivals(held) if t >= LEAD_S]
    assert len(sent) == pytest.approx(28.0 * held_s(day), rel=0.05)
    assert (held.mix, held.long_share, held.seed) == (day.mix, day.long_share, day.seed)  # the day's tickets
    slow = dataclasses.replace(day, latency_scale=2.0)  # the traffic's own deadlines
    assert held_s(slow) == 2 * held_s(day)


def _outcome(sent_at, latency_s, ok=True, class_name="complaint"):
    from extproc_testbed.traffic import Outcome

    return Outcome(class_name, sent_at, False, ok=ok, latency_s=latency_s)


def test_a_pool_that_falls_behind_in_the_second_half_did_not_keep_up():
    from extproc_testbed.day_peak import kept_up

    # two arrivals a second for 100 s; a pool that answers each within a second keeps up
    steady = [_outcome(t / 2, 0.5) for t in range(200)]
    assert kept_up(steady, 50.0, 100.0) == pytest.approx(1.0, abs=0.01)
    # one whose line grows: each waits longer than the last, so the second half answers fewer
    behind = [_outcome(t / 2, t * 0.1) for t in range(200)]
    assert kept_up(behind, 50.0, 100.0) < 0.9
    # failures are not answers
    failing = [_outcome(t / 2, 0.5, ok=t % 10 != 0) for t in range(200)]
    assert kept_up(failing, 50.0, 100.0) == pytest.approx(0.9, abs=0.02)


def _held_run(traffic, in_time: bool, keeps_up: bool):
    """A run of `traffic`: 20 requests a second of each class, in time or not, keeping up or not
    (a line that grows behind the loans, which go first: each other request waits 4 % of its
    arrival time in the burst longer than the last)."""
    outcomes = []
    for i in range(int(20 * traffic.duration_s)):
        t = i / 20
        wait = 0.5 if keeps_up else 0.5 + 0.04 * max(0.0, t - traffic.lead_s)
        for name in ("loan_approval", "complaint", "archive_query"):
            latency = 0.5 if name == "loan_approval" else wait if in_time or name != "complaint" else 60.0
            outcomes.append(_outcome(t, latency, class_name=name))
    series = [{"t": float(t), "billed": 6, "queue_depth": 3.0} for t in range(int(traffic.duration_s))]
    return outcomes, series


def test_a_held_burst_is_carried_only_in_time_and_keeping_up():
    from extproc_testbed.day_peak import held_traffic, judge

    traffic = held_traffic(DayTraffic(hour_s=50.0))
    assert judge(*_held_run(traffic, True, True), traffic)["carried"]
    late = judge(*_held_run(traffic, False, True), traffic)
    assert not late["held_slo"] and not late["carried"]
    # every class in time (the deadlines are long enough to hide the line), but falling behind
    behind = judge(*_held_run(traffic, True, False), traffic)
    assert behind["held_slo"] and behind["kept_up"] < 0.985 and not behind["carried"]
    # only what was sent from the burst's start counts: a lead-in's late complaints do not
    outcomes, series = _held_run(traffic, True, True)
    outcomes += [_outcome(1.0, 60.0) for _ in range(1000)]
    assert judge(outcomes, series, traffic)["held_slo"]


def _search(monkeypatch, tmp_path, carries_from: int, sizes, max_backends=8):
    from extproc_testbed import day_peak

    seen = []

    def run_policy(setup, traffic, work, progress):  # the n-engine pool keeps up from `carries_from` on
        seen.append((int(setup.policy.split(":")[1]), traffic.duration_s))
        return (*_held_run(traffic, True, seen[-1][0] >= carries_from), None)

    monkeypatch.setattr(day_peak, "run_policy", run_policy)
    day = DayTraffic(hour_s=50.0)
    found = day_peak.size_for_peak(lambda policy: setup_for(policy, day, 0.5, 4.0), day, sizes, tmp_path,
                                   lambda message: None, max_backends)
    return found, seen


def test_the_search_stops_at_the_first_pool_that_carries_the_held_burst(monkeypatch, tmp_path):
    from extproc_testbed.day_peak import LEAD_S, held_s

    found, seen = _search(monkeypatch, tmp_path, 6, (8, 4, 5, 6, 7, 6))
    assert [n for n, _ in seen] == [4, 5, 6]  # ascending, once each, up to the first that carries
    assert {d for _, d in seen} == {LEAD_S + held_s(DayTraffic())}  # each on the burst held
    assert found["engines"] == 6 and found["engine_hours"] == 6 * 24.0 and not found["is_bound"]
    assert [t["carried"] for t in found["tried"]] == [False, False, True]
    assert [t["held_slo"] for t in found["tried"]] == [True, True, True]  # in time, yet 4 and 5 fell behind
    bound, _ = _search(monkeypatch, tmp_path, 6, (7, 8))
    assert bound["engines"] == 7 and bound["is_bound"]  # fewer were not tried
    gap, _ = _search(monkeypatch, tmp_path, 6, (5, 7))
    assert gap["engines"] == 7 and gap["is_bound"]  # 6 was not tried: 7 is only a bound
    beyond, _ = _search(monkeypatch, tmp_path, 9, (8, 9), max_backends=8)
    assert beyond["engines"] == 9 and beyond["beyond_max_backends"]
    none, _ = _search(monkeypatch, tmp_path, 99, (5, 6))
    assert none["engines"] is None and none["engine_hours"] is None


def _peak(engines, is_bound=False, tried=(5, 6)):
    return {"lead_s": 60.0, "held_s": 240.0, "rate_rps": 28.0, "day_burst_s": 33.3, "kept_up_at_least": 0.985,
            "engines": engines, "engine_hours": None if engines is None else engines * 24.0, "is_bound": is_bound,
            "beyond_max_backends": False, "provenance": None, "policies": [],
            "tried": [{"engines": n, "in_time_by_class": dict.fromkeys(("loan_approval", "complaint", "archive_query"),
                                                                         1.0),
                       "held_slo": True, "kept_up": 1.0 if n == engines else 0.9, "carried": n == engines,
                       "engines_billed_second_half": n, "loan_p99_s": 1.0, "queue_depth_max": 10} for n in tried]}


def test_the_report_bills_the_policies_against_the_pool_sized_for_the_peak():
    from extproc_testbed.day_report import tables
    from extproc_testbed.day_run import with_peak

    day = DayTraffic()
    phases = day.phases()

    def row(policy, hours):
        return {"policy": policy, "held_slo": True, "engine_hours": hours, "loan_p99_s": 1.0, "availability": 1.0,
                "max_billed": 5, "engine_hours_vs_fixed_peak": round(hours / 96.0, 3), "drains": 0, "drain_s_max": None,
                "in_time_by_class": dict.fromkeys(("loan_approval", "complaint", "archive_query"), 1.0),
                "by_phase": {p: {"held": True, "offered_rps": 1.0, "engines_billed_mean": 2.0,
                                 "model_needed_now": 7 if p == BURST_PHASE else 2} for p in phases}}

    summary = {"fixed_peak_backends": 4, "fixed_peak_is_smallest_run": False, "fixed_one_fewer_run": True,
               "policies": [row("predicted", 72.0), row("fixed:4", 96.0), row("fixed:3", 72.0)]}
    summary["policies"][2]["held_slo"] = False
    summary = with_peak(summary, _peak(6), day)
    assert [r["engine_hours_vs_sized_for_peak"] for r in summary["policies"]] == [0.5, round(96 / 144, 3), 0.5]
    assert summary["model_error_by_phase"][BURST_PHASE]["error_engines"] == 7 - 6  # against the burst held
    assert summary["model_error_by_phase"]["lunch"]["smallest_fixed_held"] == 3  # elsewhere, the day's pools (3 held lunch)
    text = "\n".join(tables(summary))
    assert "| predicted | 1 / 1 / 1 | yes | 1.0 | 1.0 | 5 | 72.0 | 50% | 75% |" in text
    assert "The pool sized for the peak: 6 engines, 144 engine-hours over the day (5 did not carry it: every class " \
           "in time, but it answered 90.0% of the second half's arrivals)." in text
    assert "- predicted: 72.0 engine-hours, 50% of the pool sized for the peak's (6 engines), 100% of fixed:3's " \
           "(the day), 75% of fixed:4's (the day)." in text
    assert "| 7 (the burst held, second half) | 6 (the burst held) | +1 |" in text
    bound = "\n".join(tables(with_peak(summary, _peak(6, is_bound=True, tried=(6,)), day)))
    assert "The pool sized for the peak: at most 6 engines, 144 engine-hours over the day (5 were not tried)." \
        in bound and "| 7 (the burst held, second half) | ≤ 6 (the burst held) | ≥ +1 |" in bound
    # the model's need on the burst held, where its predicted run said one, is the one set against the pool
    peak = _peak(6)
    peak["policies"] = [{**peak["tried"][-1], "policy": "predicted", "engines_at_most": 8, "model_needed_second_half": 8}]
    held = with_peak(summary, peak, day)["model_error_by_phase"][BURST_PHASE]
    assert held["model_needed_now"] == 8 and held["error_engines"] == 8 - 6
    none = "\n".join(tables(with_peak(summary, _peak(None), day)))
    assert "The pool sized for the peak: more than 6 engines (none tried carried it)." in none
    assert "| predicted | 1 / 1 / 1 | yes | 1.0 | 1.0 | 5 | 72.0 | – | 75% |" in none


def test_the_sizes_to_try_are_read_ascending_once_each():
    from extproc_testbed.day_run import _sizes

    assert _sizes("8,6,6,7") == (6, 7, 8)
    assert _sizes("") == ()
    with pytest.raises(ValueError):
        _sizes("0,5")


def test_the_models_need_on_the_burst_held_is_its_median_over_the_second_half_rounded_up():
    from extproc_testbed.day_peak import held_traffic, judge, model_need

    assert model_need([{"needed_now": n} for n in (5.1, 6.2, 7.3)]) == 7
    assert model_need([{"needed_now": 6.0}, {"needed_now": -1.0}, {}]) == 6  # -1: not known yet; absent: not said
    assert model_need([]) is None
    traffic = held_traffic(DayTraffic(hour_s=50.0))
    outcomes, series = _held_run(traffic, True, True)
    half = traffic.lead_s + (traffic.duration_s - traffic.lead_s) / 2
    series = [{**p, "needed_now": 3.0 if p["t"] < half else 6.5, "billed": 4 if p["t"] < half else 7} for p in series]
    judged = judge(outcomes, series, traffic)
    assert judged["model_needed_second_half"] == 7 and judged["engines_billed_second_half"] == 7.0


def test_a_peak_only_run_adds_to_the_same_day_alone(tmp_path):
    import argparse

    from extproc_testbed.day import HOUR_S
    from extproc_testbed.day_run import same_day

    day = DayTraffic(hour_s=HOUR_S, peak_rps=14.0, seed=17)
    summary = {"traffic": dataclasses.asdict(day), "time_scale": 0.5, "queue_per_engine": 4.0}
    assert same_day(summary, day, argparse.Namespace(time_scale=0.5, queue_per_engine=4.0)) is summary
    with pytest.raises(SystemExit, match="time_scale"):
        same_day(summary, day, argparse.Namespace(time_scale=0.25, queue_per_engine=4.0))
    with pytest.raises(SystemExit, match="traffic"):
        same_day(summary, dataclasses.replace(day, peak_rps=20.0), argparse.Namespace(time_scale=0.5,
                                                                                      queue_per_engine=4.0))


def test_the_published_day_ran_the_settings_the_manifests_are_held_to():
    """bench/results/day.json ran what DEPLOYED says (tests/e2e/test_autoscaling.py holds the
    manifests to DEPLOYED): a change to either without a new run fails here."""
    import json
    from pathlib import Path

    published = json.loads((Path(__file__).parents[2] / "bench" / "results" / "day.json").read_text())
    assert published["deployed"] == json.loads(json.dumps(DEPLOYED))
    day = DayTraffic(**{k: tuple(map(tuple, v)) if k == "curve" else tuple(v) if isinstance(v, list) else v
                        for k, v in published["traffic"].items()})
    ran = setup_for("predicted", day, published["time_scale"], published["queue_per_engine"])
    assert published["run_settings"] == json.loads(json.dumps(dataclasses.asdict(ran)))
