"""Client retries (pure): the attempt ledger, the per-branch budget, retry-after from the drain."""

from __future__ import annotations

import random

import pytest

from extproc.core.appointments import DrainMeter
from extproc.core.config import Retries, RetryAfter
from extproc.core.outcomes import Rejection
from extproc.core.retries import (
    AttemptLedger,
    RetryBudget,
    Verdict,
    attempt_key,
    body_key,
    declared_retry,
    named_key,
    request_digest,
    retry_after_s,
)


def test_which_requests_name_themselves():
    assert attempt_key({"idempotency-key": " k1 ", "x-request-id": "r1"}) == "k1"
    assert attempt_key({"x-request-id": "r1"}) == "r1"
    assert attempt_key({}) is None
    with pytest.raises(Rejection):
        attempt_key({"idempotency-key": "x" * 300})
    assert declared_retry({"x-stainless-retry-count": "1"})
    assert not declared_retry({"x-stainless-retry-count": "0"})
    assert not declared_retry({"x-stainless-retry-count": "lots"})


def test_the_ledger_refuses_duplicates_in_flight_and_counts_attempts():
    ledger = AttemptLedger(Retries(max_attempts=3, window_s=60), lease_s=10)
    assert ledger.begin("k", 0.0).verdict is Verdict.FIRST
    assert ledger.begin("k", 1.0).verdict is Verdict.IN_PROGRESS  # the first still runs
    ledger.finish("k", "primary", 2.0)
    second = ledger.begin("k", 3.0)
    assert (second.verdict, second.attempt, second.failed_in) == (Verdict.RETRY, 2, "primary")
    ledger.finish("k", None, 4.0)
    assert ledger.begin("k", 5.0).verdict is Verdict.RETRY
    ledger.finish("k", "fallback", 6.0)
    assert ledger.begin("k", 7.0).verdict is Verdict.TOO_MANY
    assert ledger.begin("k", 67.5).verdict is Verdict.FIRST  # forgotten after the window


def test_a_running_mark_lapses_unless_renewed():
    ledger = AttemptLedger(Retries(), lease_s=10)
    ledger.begin("a", 0.0)
    ledger.begin("b", 0.0)
    ledger.renew(["a"], 8.0)
    assert ledger.begin("a", 12.0).verdict is Verdict.IN_PROGRESS
    assert ledger.begin("b", 12.0).verdict is Verdict.RETRY  # its holder died: the retry may run


def test_the_retry_budget_is_per_branch_and_scales_with_first_attempts():
    budget = RetryBudget(Retries(budget_ratio=0.2, budget_min=2, budget_window_s=10))
    assert [budget.allow("b1", True, 0.0) for _ in range(3)] == [True, True, False]  # the minimum
    assert budget.allow("b2", True, 0.0)  # another branch has its own
    for _ in range(20):
        budget.allow("b1", False, 1.0)
    assert [budget.allow("b1", True, 1.0) for _ in range(3)] == [True, True, False]  # 20 % of 20 = 4
    assert budget.allow("b1", True, 11.0)  # the window moved on


def test_retry_after_follows_the_drain_and_is_spread():
    meter = DrainMeter(half_life_s=1.0)
    assert meter.seconds_to_drain(10) is None
    meter.observe(0.0, 0)
    meter.observe(1.0, 5)  # 5 finished per second
    assert meter.seconds_to_drain(19) == pytest.approx(4.0)
    settings = RetryAfter(jitter=0.5, max=60)
    rng = random.Random(1)
    values = [retry_after_s(2, 4.0, settings, rng) for _ in range(200)]
    assert min(values) >= 2 and max(values) <= 6 and len(set(values)) >= 4  # 4 s +/- 50 %
    assert {retry_after_s(2, None, settings, rng) for _ in range(50)} <= {1, 2, 3}
    # a drain past the longest retry-after: spread below it, never past it, and not piled on it
    long_drain = [retry_after_s(2, 1000.0, settings, rng) for _ in range(200)]
    assert max(long_drain) == 60 and min(long_drain) >= 20 and long_drain.count(60) <= 10
    assert len(set(long_drain)) >= 20
    floor_past_max = [retry_after_s(90, None, RetryAfter(jitter=0.5, max=10), rng) for _ in range(50)]
    assert max(floor_past_max) <= 10 and len(set(floor_past_max)) >= 3


def test_a_name_belongs_to_its_caller_and_branch_and_is_given_to_one_request():
    assert named_key("bank-a", "0001", "k") != named_key("bank-b", "0001", "k")
    assert named_key("bank-a", "0001", "k") != named_key("bank-a", "0002", "k")
    assert named_key("bank-a", "0001", "k") == named_key("bank-a", "0001", "k")
    digest = request_digest("/v1/chat/completions", b'{"a": 1}')
    assert digest != request_digest("/v1/completions", b'{"a": 1}')
    assert body_key("bank-a", "0001", digest) != named_key("bank-a", "0001", digest)  # never the same name


def test_a_name_given_to_another_request_is_no_retry_of_it():
    ledger = AttemptLedger(Retries(max_attempts=3, window_s=60), lease_s=10)
    assert ledger.begin("k", 0.0, "cheap").verdict is Verdict.FIRST
    assert ledger.begin("k", 1.0, "costly").verdict is Verdict.OTHER_REQUEST  # while the first runs...
    ledger.finish("k", None, 2.0)
    other = ledger.begin("k", 3.0, "costly")
    assert (other.verdict, other.age_s) == (Verdict.OTHER_REQUEST, 0.0)  # ...and after: no age, no place
    again = ledger.begin("k", 4.0, "cheap")
    assert (again.verdict, again.attempt, again.age_s) == (Verdict.RETRY, 2, 4.0)  # its own retry still is


def test_a_fresh_first_attempt_starts_its_name_over():
    ledger = AttemptLedger(Retries(max_attempts=3, window_s=60), lease_s=10)
    ledger.begin("body", 0.0, "d", fresh=True)
    copy = ledger.begin("body", 5.0, "d", fresh=True)  # the same body again, the first still running
    assert (copy.verdict, copy.age_s) == (Verdict.FIRST, 0.0)
    ledger.finish("body", "primary", 6.0)
    retry = ledger.begin("body", 8.0, "d")  # its retry finds it: aged from its own first attempt
    assert (retry.verdict, retry.attempt, retry.failed_in, retry.age_s) == (Verdict.RETRY, 2, "primary", 3.0)
