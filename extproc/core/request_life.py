"""A request's life as one state machine, without I/O.

Theory of operation. An exchange (one request through Envoy) is in one `Phase` at a time. What
happens to it arrives as an event: what Envoy reports (the body, the response headers, the
stream's end), what the queue store answers (a slot, a place in line, a wait run out) and what
the gate decided over the pure core (routed, refused, held until an appointment). `step(phase,
event)` returns the next phase, the outcome decided by this step (if any), and the actions the
driver (lifecycle/request_driver.py) performs, in order: count, hold or release the slot, copy
it as shadow, withdraw from the line, settle the attempt. Nothing else changes an exchange's phase or its outcome, and an
event the table does not list for a phase is a programming error (`IllegalStep`), never a
silent change.

The table is the one place to read what ends a request and what its end does:

    arrived ──routed──> routed ──slot──────────> admitted ──response──> answered
       │                  │  ├──slot (long)──> awaiting_lane ──placed──┤   │  ↑
       │                  │  └──slot (paced)─> awaiting_pace ──placed──┤   │  │
       │                  ├──queued──> queued ──wait──> waiting ──slot──┘  failing_over
       │                  └──held──> held ──routed──> routed              (fallback asked)
       │                                    admitted ──yielded──> yielded (a long prompt gives its engine up)
       ├──no body──> passed_through
       └──listed──> listed  (GET /v1/models, answered from the configuration)
    any phase before an answer ──refused──> refused;  any phase ──ended──> closed

Every exchange ends with `Ended` (the stream is over, however it ended), which releases what it
holds exactly once: a place in line is withdrawn, a slot is released, a request that had no
decision yet is counted as its client's cancellation (where it was: arriving, queued, or
admitted before any response), and an admitted one is counted finished (a yielded one, as
yielded: core/yielding.py). A refusal is counted once, when it is decided; the reply of a refusal
already counted (or of an internal error after admission, counted as admitted, or of a yield)
changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .outcomes import Outcome


class Phase(str, Enum):
    ARRIVED = "arrived"  # headers read: identified and classified; no body yet
    ROUTED = "routed"  # the body parsed and routed to a pool; no slot, no place in line yet
    HELD = "held"  # back before its appointment: held until then, then routed again
    QUEUED = "queued"  # in the pool's line; the gate holds the place (withdrawn if the stream ends)
    WAITING = "waiting"  # in the pool's line; the store's wait answers for the place
    AWAITING_LANE = "awaiting_lane"  # a slot, and an engine to start on: a long prompt's own, or a turn beside loans
    AWAITING_PACE = "awaiting_pace"  # a slot, and a prompt waiting for its turn on the pool's prefill pace
    ADMITTED = "admitted"  # holds a slot; sent upstream
    FAILING_OVER = "failing_over"  # its upstream failed before the client saw it: the fallback is asked
    ANSWERED = "answered"  # response headers passed on to the client
    YIELDED = "yielded"  # admitted, then answered by the sidecar: a long prompt gave its engine up (core/yielding.py)
    REFUSED = "refused"  # answered by the sidecar
    PASSED_THROUGH = "passed_through"  # no body (GET /v1/models where no pool lists its models): nothing to admit
    LISTED = "listed"  # GET /v1/models answered from the configuration (core/catalog.py)
    CLOSED = "closed"  # over; nothing is held


# -- events: what is reported -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NoBody:
    """The request ended with its headers."""


@dataclass(frozen=True, slots=True)
class Listed:
    """The request ended with its headers, and the sidecar answers it: a model list."""


@dataclass(frozen=True, slots=True)
class Routed:
    """The body was parsed and routed to a pool."""


@dataclass(frozen=True, slots=True)
class Held:
    """Back before its appointment: held until then."""


@dataclass(frozen=True, slots=True)
class Queued:
    """The store put it in the pool's line."""


@dataclass(frozen=True, slots=True)
class WaitBegun:
    """The store's wait took over the place in line."""


@dataclass(frozen=True, slots=True)
class SlotGranted:
    """The store granted a slot; `lane_needed`: no engine it may start on yet (a long prompt's
    own, a turn beside latency-bound requests: Slots.lane_needed), and no turn to wait for on the
    pool's prefill pace first; `paced`: a prompt that waits for its turn on that pace (then for
    an engine, if it still needs one)."""

    lane_needed: bool = False
    paced: bool = False


@dataclass(frozen=True, slots=True)
class Placed:
    """It may start: the long prompt has an engine of its own, the paced prompt's turn came (or
    its wait for either is over)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The sidecar answers it with `outcome` (a rejection, or an internal error)."""

    outcome: Outcome


@dataclass(frozen=True, slots=True)
class ResponseStarted:
    """Response headers arrived; `fail_over`: a failure the fallback pool will answer instead."""

    fail_over: bool = False


@dataclass(frozen=True, slots=True)
class Yielded:
    """Admitted, it gives its engine up before its response: the sidecar answers it with a
    `retry-after` (core/yielding.py)."""


@dataclass(frozen=True, slots=True)
class FallbackDone:
    """The fallback pool answered, or could not: the client gets one or the other."""


@dataclass(frozen=True, slots=True)
class Ended:
    """The exchange is over, however it ended (a reply, an answer, the client or Envoy gone)."""


Event = NoBody | Listed | Routed | Held | Queued | WaitBegun | SlotGranted | Placed | Refused | ResponseStarted \
    | Yielded | FallbackDone | Ended
EVENTS: tuple[type, ...] = (NoBody, Listed, Routed, Held, Queued, WaitBegun, SlotGranted, Placed, Refused,
                            ResponseStarted, Yielded, FallbackDone, Ended)


# -- actions: what the driver does --------------------------------------------------------------

class Action(str, Enum):
    COUNT_PASSED = "count_passed"  # counted as passed through
    COUNT_LISTED = "count_listed"  # counted as a model list the sidecar answered
    COUNT_REJECTED = "count_rejected"  # the refusal counted and recorded
    COUNT_QUEUED = "count_queued"  # it joined a line
    ADMIT = "admit"  # hold the slot (and its engine), count and record the admission
    COPY_AS_SHADOW = "copy_as_shadow"  # a copy to the shadow pool, where the share draws it
    WITHDRAW = "withdraw"  # take its place out of the line
    CANCELLED_ARRIVING = "cancelled_arriving"  # its client left before it was routed
    CANCELLED_QUEUED = "cancelled_queued"  # its client left while it was routed, held or in line
    CANCELLED_BEFORE_RESPONSE = "cancelled_before_response"  # admitted, and left before any response
    FINISH_ADMITTED = "finish_admitted"  # an admitted request's end counted (and its service time)
    SETTLE = "settle"  # the shadow copy, the attempt ledger, an unused probe permit let go
    RELEASE = "release"  # its slot goes back (nothing where it holds none)


@dataclass(frozen=True, slots=True)
class Step:
    phase: Phase
    outcome: Outcome | None = None  # decided by this step
    actions: tuple[Action, ...] = ()


class IllegalStep(Exception):
    """An event the request's life does not allow in its phase: a defect of the caller."""


_END = (Action.SETTLE, Action.RELEASE)
_REFUSE = (Action.COUNT_REJECTED,)
_ADMIT = Step(Phase.ADMITTED, Outcome.ADMITTED, (Action.ADMIT, Action.COPY_AS_SHADOW))
_CANCEL = Outcome.CANCELLED_CLIENT_GONE

# (phase, event type) -> the step, for events that carry nothing the step depends on. Refused,
# SlotGranted and ResponseStarted carry it: `step` reads them below, over the phases listed here.
TABLE: dict[tuple[Phase, type], Step] = {
    (Phase.ARRIVED, NoBody): Step(Phase.PASSED_THROUGH, Outcome.PASSED_THROUGH, (Action.COUNT_PASSED,)),
    (Phase.ARRIVED, Listed): Step(Phase.LISTED, Outcome.MODELS_LISTED, (Action.COUNT_LISTED,)),
    (Phase.ARRIVED, Routed): Step(Phase.ROUTED),
    (Phase.ARRIVED, ResponseStarted): Step(Phase.ARRIVED),  # Envoy's own reply before the body (a 413)
    (Phase.ARRIVED, Ended): Step(Phase.CLOSED, _CANCEL, (Action.CANCELLED_ARRIVING, *_END)),
    (Phase.ROUTED, Held): Step(Phase.HELD),
    (Phase.ROUTED, Queued): Step(Phase.QUEUED, None, (Action.COUNT_QUEUED,)),
    (Phase.ROUTED, Ended): Step(Phase.CLOSED, _CANCEL, (Action.CANCELLED_QUEUED, *_END)),
    (Phase.HELD, Routed): Step(Phase.ROUTED),
    (Phase.HELD, Ended): Step(Phase.CLOSED, _CANCEL, (Action.CANCELLED_QUEUED, *_END)),
    (Phase.QUEUED, WaitBegun): Step(Phase.WAITING),
    (Phase.QUEUED, Ended): Step(Phase.CLOSED, _CANCEL, (Action.WITHDRAW, Action.CANCELLED_QUEUED, *_END)),
    (Phase.WAITING, Ended): Step(Phase.CLOSED, _CANCEL, (Action.CANCELLED_QUEUED, *_END)),
    (Phase.AWAITING_LANE, Placed): _ADMIT,
    (Phase.AWAITING_LANE, Ended): Step(Phase.CLOSED, _CANCEL, (Action.CANCELLED_QUEUED, *_END)),
    (Phase.AWAITING_PACE, Placed): _ADMIT,
    (Phase.AWAITING_PACE, Ended): Step(Phase.CLOSED, _CANCEL, (Action.CANCELLED_QUEUED, *_END)),
    (Phase.ADMITTED, Ended): Step(Phase.CLOSED, None,
                                  (Action.CANCELLED_BEFORE_RESPONSE, Action.FINISH_ADMITTED, *_END)),
    (Phase.ADMITTED, Yielded): Step(Phase.YIELDED),  # (counted admitted; its end is counted yielded)
    (Phase.YIELDED, ResponseStarted): Step(Phase.YIELDED),  # (its response came as it yielded: Envoy drops it)
    (Phase.YIELDED, Ended): Step(Phase.CLOSED, None, (Action.FINISH_ADMITTED, *_END)),
    (Phase.FAILING_OVER, FallbackDone): Step(Phase.ANSWERED),
    (Phase.FAILING_OVER, Ended): Step(Phase.CLOSED, None, (Action.FINISH_ADMITTED, *_END)),
    (Phase.ANSWERED, Ended): Step(Phase.CLOSED, None, (Action.FINISH_ADMITTED, *_END)),
    (Phase.REFUSED, ResponseStarted): Step(Phase.REFUSED),
    (Phase.REFUSED, Ended): Step(Phase.CLOSED, None, _END),
    (Phase.PASSED_THROUGH, ResponseStarted): Step(Phase.PASSED_THROUGH),
    (Phase.PASSED_THROUGH, Ended): Step(Phase.CLOSED, None, _END),
    (Phase.LISTED, Ended): Step(Phase.CLOSED, None, _END),
}
# Where a refusal is decided (counted then), and where its reply changes nothing: a refusal
# already counted, or an internal error after the request was counted admitted, passed through or
# answered with a model list.
REFUSABLE = frozenset({Phase.ARRIVED, Phase.ROUTED, Phase.HELD, Phase.QUEUED, Phase.WAITING, Phase.AWAITING_LANE,
                       Phase.AWAITING_PACE})
REFUSAL_CHANGES_NOTHING = frozenset({Phase.REFUSED, Phase.ADMITTED, Phase.FAILING_OVER, Phase.ANSWERED,
                                     Phase.PASSED_THROUGH, Phase.LISTED, Phase.YIELDED})
GRANTABLE = frozenset({Phase.ROUTED, Phase.WAITING})  # a slot comes straight from the line's enqueue, or its wait


def step(phase: Phase, event: Event) -> Step:
    """The next phase, the outcome it decides and what to do. Raises IllegalStep."""
    kind = type(event)
    if kind is Refused:
        if phase in REFUSABLE:
            # A place the gate still holds in line is withdrawn with the refusal.
            withdraw = (Action.WITHDRAW,) if phase is Phase.QUEUED else ()
            return Step(Phase.REFUSED, event.outcome, (*withdraw, *_REFUSE))
        if phase in REFUSAL_CHANGES_NOTHING:
            return Step(phase)
    elif kind is SlotGranted and phase in GRANTABLE:
        return Step(Phase.AWAITING_LANE) if event.lane_needed else Step(Phase.AWAITING_PACE) if event.paced \
            else _ADMIT
    elif kind is ResponseStarted and phase is Phase.ADMITTED:
        return Step(Phase.FAILING_OVER if event.fail_over else Phase.ANSWERED)
    else:
        found = TABLE.get((phase, kind))
        if found is not None:
            return found
    raise IllegalStep(f"{kind.__name__} in phase {phase.value}")
