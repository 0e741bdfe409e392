"""The compressed day (`extproc bench scenario --day`, testbed/extproc_testbed/day.py): its load
curve, the settings each policy runs with (the day's clock compressed, the requests' not), the
engine-hours it bills, and the model's error per phase."""

from __future__ import annotations

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
    assert "- predicted: 60.0 engine-hours, 100% of 5 engines', 100% of 6 engines'." in text
    assert "The pool sized for the peak was not searched" in text
    assert f"| {BURST_PHASE} |" in text and "| 7 | 6 | +1 |" in text  # 5 failed the burst: 6 is the smallest
    assert "| 2 | ≤ 5 | ≥ -3 |" in text  # elsewhere 5 held: fewer may have too, the error is a bound
    rows[0]["by_phase"]["lunch"]["held"] = rows[1]["by_phase"]["lunch"]["held"] = False
    summary["model_error_by_phase"] = model_error(rows, day)
    assert "| 2 | more than 6 | – |" in "\n".join(tables(summary))


def test_the_burst_is_held_at_its_rate_for_twice_the_longest_deadline():
    from extproc_testbed.day_peak import HELD_S, held_traffic
    from extproc_testbed.traffic import DEADLINES_S, arrivals

    day = DayTraffic(hour_s=50.0, peak_rps=14.0)
    held = held_traffic(day)
    assert held.duration_s == pytest.approx(HELD_S) == pytest.approx(2 * max(DEADLINES_S.values()))
    assert [held.rate_at(t) for t in (0.0, HELD_S / 3, HELD_S - 0.01)] == pytest.approx([28.0] * 3)
    sent = [t for t, _, _ in arrivals(held)]
    assert len(sent) == pytest.approx(28.0 * HELD_S, rel=0.05)
    assert (held.mix, held.long_share, held.seed) == (day.mix, day.long_share, day.seed)  # the day's tickets


def _outcome(sent_at, latency_s, ok=True):
    from extproc_testbed.traffic import Outcome

    return Outcome("complaint", sent_at, False, ok=ok, latency_s=latency_s)


def test_a_pool_that_falls_behind_in_the_second_half_did_not_keep_up():
    from extproc_testbed.day_peak import kept_up

    # 100 s: two arrivals a second; a pool that answers each within a second keeps up
    steady = [_outcome(t / 2, 0.5) for t in range(200)]
    assert kept_up(steady, 100.0) == pytest.approx(1.0, abs=0.01)
    # one whose line grows: each waits longer than the last, so the second half answers fewer
    behind = [_outcome(t / 2, t * 0.1) for t in range(200)]
    assert kept_up(behind, 100.0) < 0.97
    # failures are not answers
    failing = [_outcome(t / 2, 0.5, ok=t % 10 != 0) for t in range(200)]
    assert kept_up(failing, 100.0) == pytest.approx(0.9, abs=0.02)


def test_the_search_stops_at_the_first_pool_that_carries_the_held_burst(monkeypatch, tmp_path):
    from extproc_testbed import day_peak

    tried = []

    def run_policy(setup, traffic, work, progress):  # the n-engine pool: in time from 6 engines on
        n = int(setup.policy.split(":")[1])
        tried.append(n)
        return [_outcome(t / 20, 0.5 if n >= 6 else t * 0.02) for t in range(int(20 * traffic.duration_s))], \
            [{"queue_depth": 0.0}], None

    monkeypatch.setattr(day_peak, "run_policy", run_policy)
    day = DayTraffic(hour_s=50.0)
    found = day_peak.size_for_peak(lambda policy: setup_for(policy, day, 0.5, 4.0), day, (4, 5, 6, 7, 8),
                                   tmp_path, lambda message: None)
    assert tried == [4, 5, 6]
    assert found["engines"] == 6 and found["engine_hours"] == 6 * 24.0
    assert [t["carried"] for t in found["tried"]] == [False, False, True]
