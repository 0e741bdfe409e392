"""The request path's metrics, written from its events (core/events.py): what was decided, who
joined a line, was rerouted or left, how long a decision, a first byte and an exchange took; the
upstream outcomes the breakers counted, the slots taken and given back, the long prompts' lane
waits, the engine picks, the failovers, the retries, the appointments and the shadow copies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.events import (AppointmentTold, ClaimsLowered, ClientLeft, DecisionTimed, DrainedEngineFailed, FailedOver,
                           FirstByte, JoinedLine, LaneWaited, PaceWaited, PickRan, PicksJudged, RequestDecided, RequestFinished,
                           Rerouted, RetryJudged, ShadowAnswered, ShadowCopied, ShadowTimed, ShadowTokens,
                           SlotLeased, SlotReleased, UpstreamAnswered, UpstreamCounted)
from ..core.outcomes import Outcome
from .metrics import Metrics


class RequestMetrics:
    """Subscribes to the request path's events and counts them (ops/metrics.py's families)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def subscriptions(self) -> list[tuple[type, Callable[[Any], None]]]:
        return [(RequestDecided, self.decided), (JoinedLine, self.joined_line), (Rerouted, self.rerouted),
                (ClientLeft, self.client_left), (ClaimsLowered, self.claims_lowered),
                (DecisionTimed, self.decision_timed), (UpstreamAnswered, self.answered),
                (FirstByte, self.first_byte), (RequestFinished, self.finished),
                (UpstreamCounted, self.upstream_counted), (SlotLeased, self.slot_leased),
                (SlotReleased, self.slot_released), (LaneWaited, self.lane_waited), (PaceWaited, self.pace_waited), (PickRan, self.pick_ran),
                (PicksJudged, self.picks_judged), (DrainedEngineFailed, self.drained_engine_failed),
                (FailedOver, self.failed_over), (RetryJudged, self.retry_judged),
                (AppointmentTold, self.appointment_told), (ShadowCopied, self.shadow_copied),
                (ShadowAnswered, self.shadow_answered), (ShadowTokens, self.shadow_tokens),
                (ShadowTimed, self.shadow_timed)]

    def decided(self, event: RequestDecided) -> None:
        outcome = event.outcome
        self.metrics.outcomes.labels(event.class_name, outcome._value_).inc()  # (`value` is a descriptor)
        # the wait of a request that went through the line: admitted, or its wait ran out there
        if outcome is Outcome.ADMITTED or (outcome is Outcome.EXPIRED_IN_QUEUE and event.pool is not None):
            self.metrics.queue_wait.labels(event.pool, event.class_name).observe(event.queue_wait_s)

    def joined_line(self, event: JoinedLine) -> None:
        self.metrics.queued.labels(event.pool, event.class_name).inc()

    def rerouted(self, event: Rerouted) -> None:
        self.metrics.rerouted.labels(event.home, event.pool, event.reason).inc()
        if event.reason == "degraded":
            self.metrics.degraded.labels(event.class_name, event.pool).inc()

    def client_left(self, event: ClientLeft) -> None:
        self.metrics.client_cancelled.labels(event.pool, event.class_name, event.phase).inc()

    def claims_lowered(self, event: ClaimsLowered) -> None:
        for claim in event.claims:
            self.metrics.claims_lowered.labels(claim).inc()

    def decision_timed(self, event: DecisionTimed) -> None:
        self.metrics.decision.observe(event.seconds)

    def answered(self, event: UpstreamAnswered) -> None:
        self.metrics.upstream_status.labels(event.pool, f"{event.status // 100}xx").inc()

    def first_byte(self, event: FirstByte) -> None:
        self.metrics.first_byte.labels(event.pool, event.class_name).observe(event.since_arrival_s)

    def finished(self, event: RequestFinished) -> None:
        self.metrics.duration.labels(event.pool, event.class_name).observe(event.since_arrival_s)

    def upstream_counted(self, event: UpstreamCounted) -> None:
        self.metrics.upstream_outcomes.labels(event.pool, event.result).inc()

    def slot_leased(self, event: SlotLeased) -> None:
        self.metrics.slots_admitted.labels(event.pool).inc()

    def slot_released(self, event: SlotReleased) -> None:
        self.metrics.released.labels(event.pool, event.end).inc()

    def lane_waited(self, event: LaneWaited) -> None:
        (self.metrics.long_lane_waits if event.long else self.metrics.spill_waits).labels(event.pool, event.result).inc()

    def pace_waited(self, event: PaceWaited) -> None:
        self.metrics.prefill_paced.labels(event.pool, event.result).inc()

    def pick_ran(self, event: PickRan) -> None:
        self.metrics.engine_picks.labels(event.pool, "true" if event.followed else "false").inc()

    def picks_judged(self, event: PicksJudged) -> None:
        self.metrics.engine_picks_ignored.labels(event.pool).set(int(event.ignored))

    def drained_engine_failed(self, event: DrainedEngineFailed) -> None:
        self.metrics.drained_engine_failures.labels(event.pool).inc()

    def failed_over(self, event: FailedOver) -> None:
        self.metrics.failovers.labels(event.home, event.pool, event.result).inc()

    def retry_judged(self, event: RetryJudged) -> None:
        self.metrics.retries.labels(event.verdict).inc()

    def appointment_told(self, event: AppointmentTold) -> None:
        self.metrics.appointments.labels(event.pool, event.class_name, event.result).inc()
        if event.delay_s is not None:
            self.metrics.appointment_delay.labels(event.pool).observe(event.delay_s)

    def shadow_copied(self, event: ShadowCopied) -> None:
        self.metrics.shadow_copies.labels(event.pool, event.result).inc()

    def shadow_answered(self, event: ShadowAnswered) -> None:
        self.metrics.shadow_responses.labels(event.side, event.status_class).inc()

    def shadow_tokens(self, event: ShadowTokens) -> None:
        self.metrics.shadow_tokens.labels(event.side).inc(event.tokens)

    def shadow_timed(self, event: ShadowTimed) -> None:
        self.metrics.shadow_latency.labels(event.side).observe(event.seconds)
