"""The request path's metrics are written from its events (ops/request_metrics.py): each event
kind moves its family, and nothing else moves them."""

from __future__ import annotations

import pytest

from extproc.core.events import (AppointmentTold, ClaimsLowered, ClientLeft, DecisionTimed, DrainedEngineFailed,
                                 FailedOver, FirstByte, JoinedLine, LaneWaited, PaceWaited, Observers, PickRan, PicksJudged,
                                 RequestDecided, RequestFinished, Rerouted, RetryJudged, ShadowAnswered, ShadowCopied,
                                 ShadowTimed, ShadowTokens, SlotLeased, SlotReleased, UpstreamAnswered,
                                 UpstreamCounted)
from extproc.core.outcomes import Outcome
from extproc.ops.metrics import Metrics
from extproc.ops.request_metrics import RequestMetrics


def _wired() -> tuple[Observers, Metrics]:
    metrics, observers = Metrics(), Observers()
    for kind, handler in RequestMetrics(metrics).subscriptions():
        observers.subscribe(kind, handler)
    return observers, metrics


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_each_event_moves_its_family():
    observers, metrics = _wired()
    loan = {"class": "loan_approval"}
    observers.emit(RequestDecided("loan_approval", Outcome.ADMITTED, "primary", "primary", True, 0.5, {}))
    observers.emit(RequestDecided("loan_approval", Outcome.EXPIRED_IN_QUEUE, "primary", "primary", True, 2.0, {}))
    observers.emit(RequestDecided("unclassified", Outcome.REJECTED_UNAUTHENTICATED, None, None, True, 0.0, {}))
    observers.emit(JoinedLine("primary", "loan_approval"))
    observers.emit(Rerouted("complaint", "primary", "fallback", "degraded"))
    observers.emit(ClientLeft("primary", "complaint", "queued"))
    observers.emit(ClaimsLowered(("vip", "urgent")))
    observers.emit(DecisionTimed(0.0003))
    observers.emit(UpstreamAnswered("primary", 503))
    observers.emit(FirstByte("primary", "loan_approval", 0.75, 0.25, True))
    observers.emit(RequestFinished("primary", "loan_approval", "completed", 1.5, 1.0, 100, 200))

    assert _value(metrics, "extproc_admission_outcomes_total", outcome="admitted", **loan) == 1
    assert _value(metrics, "extproc_admission_outcomes_total", outcome="rejected_unauthenticated",
                  **{"class": "unclassified"}) == 1
    # the wait of who went through the line: admitted, or its wait ran out there
    assert _value(metrics, "extproc_queue_wait_seconds_count", pool="primary", **loan) == 2
    assert _value(metrics, "extproc_queue_wait_seconds_sum", pool="primary", **loan) == pytest.approx(2.5)
    assert _value(metrics, "extproc_queued_total", pool="primary", **loan) == 1
    assert _value(metrics, "extproc_rerouted_total", from_pool="primary", to_pool="fallback", reason="degraded") == 1
    assert _value(metrics, "extproc_degraded_total", pool="fallback", **{"class": "complaint"}) == 1
    assert _value(metrics, "extproc_client_cancelled_total", pool="primary", phase="queued",
                  **{"class": "complaint"}) == 1
    assert _value(metrics, "extproc_claims_lowered_total", claim="vip") == 1
    assert _value(metrics, "extproc_decision_seconds_count") == 1
    assert _value(metrics, "extproc_upstream_responses_total", pool="primary", status_class="5xx") == 1
    assert _value(metrics, "extproc_request_first_byte_seconds_sum", pool="primary", **loan) == pytest.approx(0.75)
    assert _value(metrics, "extproc_request_duration_seconds_sum", pool="primary", **loan) == pytest.approx(1.5)


def test_a_rerouting_that_is_not_a_degrade_is_no_degrade():
    observers, metrics = _wired()
    observers.emit(Rerouted("loan_approval", "primary", "fallback", "breaker"))
    assert _value(metrics, "extproc_rerouted_total", from_pool="primary", to_pool="fallback", reason="breaker") == 1
    assert _value(metrics, "extproc_degraded_total", pool="fallback", **{"class": "loan_approval"}) == 0


def test_what_the_gates_parts_tell_moves_their_families():
    """The slots, the breakers' counts, the picks, the failovers, the retries, the appointments and
    the shadow copies: told as events by the parts of the gate (lifecycle/), counted here alone."""
    observers, metrics = _wired()
    observers.emit(UpstreamCounted("primary", "http_5xx"))
    observers.emit(UpstreamCounted("primary", "success"))
    observers.emit(SlotLeased("fallback"))
    observers.emit(SlotReleased("primary", "failed_over"))
    observers.emit(LaneWaited("primary", "timed_out"))
    observers.emit(LaneWaited("primary", "placed", long=False))
    observers.emit(PaceWaited("primary", "cut_short"))
    observers.emit(PickRan("primary", False))
    observers.emit(PicksJudged("primary", True))
    observers.emit(DrainedEngineFailed("primary"))
    observers.emit(FailedOver("primary", "", "no_pool"))
    observers.emit(RetryJudged("over_budget"))
    observers.emit(AppointmentTold("primary", "complaint", "given", 4.0))
    observers.emit(AppointmentTold("primary", "complaint", "past_deadline"))
    observers.emit(ShadowCopied("mirror", "no_room"))
    observers.emit(ShadowAnswered("shadow", "none"))
    observers.emit(ShadowTokens("primary", 7))
    observers.emit(ShadowTimed("shadow", 0.25))

    assert _value(metrics, "extproc_upstream_outcomes_total", pool="primary", result="http_5xx") == 1
    assert _value(metrics, "extproc_upstream_outcomes_total", pool="primary", result="success") == 1
    assert _value(metrics, "extproc_slots_admitted_total", pool="fallback") == 1
    assert _value(metrics, "extproc_slots_released_total", pool="primary", end="failed_over") == 1
    assert _value(metrics, "extproc_long_lane_waits_total", pool="primary", result="timed_out") == 1
    assert _value(metrics, "extproc_spill_waits_total", pool="primary", result="placed") == 1
    assert _value(metrics, "extproc_prefill_paced_total", pool="primary", result="cut_short") == 1
    assert _value(metrics, "extproc_engine_picks_total", pool="primary", followed="false") == 1
    assert _value(metrics, "extproc_engine_picks_ignored", pool="primary") == 1
    assert _value(metrics, "extproc_drained_engine_failures_total", pool="primary") == 1
    assert _value(metrics, "extproc_failovers_total", from_pool="primary", to_pool="", result="no_pool") == 1
    assert _value(metrics, "extproc_retries_total", verdict="over_budget") == 1
    complaint = {"pool": "primary", "class": "complaint"}
    assert _value(metrics, "extproc_appointments_total", result="given", **complaint) == 1
    assert _value(metrics, "extproc_appointments_total", result="past_deadline", **complaint) == 1
    # the delay of the appointment given, not of the final answer
    assert _value(metrics, "extproc_appointment_delay_seconds_count", pool="primary") == 1
    assert _value(metrics, "extproc_appointment_delay_seconds_sum", pool="primary") == 4.0
    assert _value(metrics, "extproc_shadow_copies_total", pool="mirror", result="no_room") == 1
    assert _value(metrics, "extproc_shadow_responses_total", side="shadow", status_class="none") == 1
    assert _value(metrics, "extproc_shadow_completion_tokens_total", side="primary") == 7
    assert _value(metrics, "extproc_shadow_latency_seconds_sum", side="shadow") == 0.25
    observers.emit(PicksJudged("primary", False))  # Envoy follows them again
    assert _value(metrics, "extproc_engine_picks_ignored", pool="primary") == 0
