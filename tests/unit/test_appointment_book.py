"""The appointment book through the gate (lifecycle/waiting_room.py over the store's book,
core/appointments.py): a burst of refusals stays within each class's horizon, a request turned
away again keeps its appointment, and no client is told to come back later than
`retry_after_s.max`."""

from __future__ import annotations

import asyncio

import pytest

from extproc.core.headers import RETRY_AFTER, RETRY_AFTER_MS
from extproc.core.outcomes import Outcome, reply_for
from extproc.lifecycle.waiting_room import Appointment

from ..conftest import e2e_config
from .test_gate import Rig


async def at_the_hard_maximum(rig: Rig) -> None:
    """One slot held, ten loans waiting: every class is turned away (429 queue_full)."""
    await rig.arrive()
    for _ in range(10):
        await rig.arrive("loan_approval")


async def test_a_burst_of_loans_turned_away_leaves_the_complaints_behind_them_their_deadline():
    classes = {**e2e_config()["classes"],
               "loan_approval": {"base": 0, "max_wait_s": 60, "protected": True, "deadline_s": 2},
               "complaint": {"base": 1, "max_wait_s": 60, "deadline_s": 30}}
    rig = Rig(classes=classes)
    await at_the_hard_maximum(rig)
    for _ in range(600):
        loan = await rig.refused("loan_approval")
        assert loan.outcome is Outcome.SHED_QUEUE_FULL and loan.retry_after_s <= 2  # within its horizon
    complaint = await rig.refused("complaint")
    assert complaint.outcome is Outcome.SHED_QUEUE_FULL and complaint.retry_after_s <= 30


async def test_a_request_turned_away_again_before_its_appointment_keeps_it():
    rig = Rig()  # no drain measured yet: appointments 2 s apart (core/appointments.MIN_RATE)
    await at_the_hard_maximum(rig)
    first = await rig.refused("complaint", **{"idempotency-key": "t-1"})
    due = rig.clock() + first.retry_after_s
    rig.clock.advance(1)
    for _ in range(2):  # back early, turned away again: held until the same time, no new slot
        exchange, held = await rig.arrive(**{"idempotency-key": "t-1"})
        assert isinstance(held, Appointment) and held.at == pytest.approx(due)
        await rig.gate.close(exchange)  # its client gives up meanwhile
        await asyncio.sleep(0)
    other = await rig.refused("complaint", **{"idempotency-key": "t-2"})
    assert other.retry_after_s == pytest.approx(first.retry_after_s + 2 - 1)  # the slot right after it


async def test_no_client_is_told_to_come_back_later_than_the_longest_retry_after():
    rig = Rig(retry_after_s={"max": 5})
    await at_the_hard_maximum(rig)
    for _ in range(10):  # complaints have no deadline here, and come 2 s apart: 20 s for ten...
        refused = await rig.refused("complaint")
        headers = dict(reply_for(refused).headers)
        assert refused.retry_after_s <= 5  # ...yet none is told more than the longest retry-after
        assert int(headers[RETRY_AFTER]) <= 5 and int(headers[RETRY_AFTER_MS]) <= 5000
