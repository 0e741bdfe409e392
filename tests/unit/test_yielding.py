"""Which long prompts yield their engine to a latency-bound arrival (core/yielding.py), on a stepped
clock; the whole path through real Envoy: tests/e2e/test_yielding.py."""

from __future__ import annotations

import pytest

from extproc.core.yielding import YieldBook, yields_for_s


def test_a_prompt_yields_for_its_prefill_at_the_pools_pace():
    assert yields_for_s(10_000, 5000.0) == pytest.approx(2.0)
    assert yields_for_s(4_500, 5000.0) == pytest.approx(0.9)
    assert yields_for_s(10_000, 0.0) == 0.0  # 0: never


def test_a_latency_bound_arrival_takes_the_prompts_still_in_their_prefill_once():
    book = YieldBook()
    book.started("primary", "a", now=10.0, for_s=2.0)
    book.started("primary", "b", now=11.5, for_s=1.0)
    book.started("other", "c", now=11.0, for_s=5.0)
    assert book.arrived("primary", 12.2) == ["b"]  # a's prefill is over (12.0): it keeps its engine
    assert book.watched("primary") == 0  # each yields once: the next arrival finds none
    assert book.arrived("primary", 12.3) == []
    assert book.arrived("other", 12.3) == ["c"]  # each pool's own arrivals


def test_a_prompt_whose_answer_began_or_that_ended_yields_no_more():
    book = YieldBook()
    book.started("primary", "a", now=0.0, for_s=2.0)
    book.started("primary", "b", now=0.0, for_s=2.0)
    book.ended("primary", "a")
    book.ended("primary", "never-watched")  # (every exchange's end is told: most were never watched)
    book.ended(None, "b-unrouted")
    assert book.arrived("primary", 1.0) == ["b"]


def test_nothing_yields_for_a_prompt_with_no_time_to_yield_in():
    book = YieldBook()
    book.started("primary", "a", now=0.0, for_s=0.0)
    assert book.watched("primary") == 0 and book.arrived("primary", 0.0) == []
