"""Which long prompts yield their engine to a latency-bound arrival (core/yielding.py), on a stepped
clock; the whole path through real Envoy: tests/e2e/test_yielding.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from extproc.core.admission import Ticket
from extproc.core.config import load_config
from extproc.core.outcomes import Outcome, reply_for
from extproc.core.request_life import Phase
from extproc.core.yielding import YieldBook, yields_for_s
from extproc.lifecycle.exchange import Attempt, Exchange
from extproc.lifecycle.yielding import LongPromptYields
from extproc.stores.queue import Lease


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
    assert book.arrived("primary", 12.3) == []  # each yields once: the next arrival finds none
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
    assert book.arrived("primary", 0.0) == []


# -- which admitted requests yield, and what they are told (lifecycle/yielding.py) ----------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admitted(config, *, tokens: int = 10_000, bounded: bool = False, key: str | None = "key-1",
             traced: bool = False, number: int = 1, stream: bool = False, name: str = "x1") -> Exchange:
    exchange = Exchange(name, None, SimpleNamespace(class_name="archive_query"), arrived_at=0.0, config=config)
    exchange.route_to(SimpleNamespace(pool="primary"))
    ticket = Ticket(score=1, seq=1, id=name, class_name="archive_query", cost=tokens + 256,
                    long=tokens + 256 > 4096, bounded=bounded)
    exchange.lease, exchange.prompt_tokens = Lease("primary", ticket), tokens
    exchange.request = SimpleNamespace(stream=stream)
    exchange.attempt = Attempt(key, traced=traced, ledger_key=None if key is None else f"ledger:{key}",
                               number=number)
    exchange.phase = Phase.ADMITTED
    return exchange


def rig(rule: str | None = "wait_for_quiet"):
    clock, performed = Clock(), []

    def perform(exchange, event):
        performed.append(type(event).__name__)
        exchange.phase = Phase.YIELDED

    return LongPromptYields(perform, clock, lambda pool: rule, random.Random(1)), clock, performed


def test_a_long_prompt_in_its_prefill_yields_to_a_latency_bound_arrival_and_is_told_when_to_come_back():
    config = load_config()
    yields, clock, performed = rig()
    exchange = admitted(config)
    signal = yields.watch(exchange)
    assert signal is not None and not signal.is_set()
    clock.now += 1.9  # 10k tokens at 5,000 a second: two seconds of prefill
    yields.arrived("primary")
    assert signal.is_set()
    rejection = yields.give_way(exchange)
    assert performed == ["Yielded"] and rejection.outcome is Outcome.YIELDED
    # a second at least (long_quiet_s 2 here: two), up to half again
    assert 2.0 <= rejection.retry_after_s <= 3.0 and reply_for(rejection).status == 503
    assert yields.give_way(exchange) is None  # (answered once: it is no longer admitted)
    # it comes back under its name: it never yields again
    assert yields.watch(admitted(config, name="x2")) is None


def test_a_prompt_past_its_prefill_or_whose_answer_began_keeps_its_engine():
    config = load_config()
    yields, clock, _ = rig()
    late, answered = admitted(config, name="late", key="a"), admitted(config, name="answered", key="b")
    late_signal, answered_signal = yields.watch(late), yields.watch(answered)
    yields.ended(answered)  # its response headers came
    clock.now += 1.0  # both still in their prefill: only the one whose answer began keeps its engine
    yields.watch(admitted(config, name="third", key="c"))  # (watched after: the arrival below takes it)
    yields.arrived("primary")
    assert late_signal.is_set() and not answered_signal.is_set()
    fresh = admitted(config, name="fresh", key="d")
    fresh_signal = yields.watch(fresh)
    clock.now += 2.1  # its prefill is over by the next arrival
    yields.arrived("primary")
    assert not fresh_signal.is_set()


@pytest.mark.parametrize(("why", "rule", "changes"), [
    ("a class with a latency target", "wait_for_quiet", {"bounded": True}),
    ("not long", "wait_for_quiet", {"tokens": 2000}),
    ("streamed: its answer begins before its prefill", "wait_for_quiet", {"stream": True}),
    ("unnamed: not known when it comes back", "wait_for_quiet", {"key": None}),
    ("named by a trace id, which may change on each attempt", "wait_for_quiet", {"traced": True}),
    ("no attempt left to come back with", "wait_for_quiet", {"number": 3}),
    ("Envoy follows the picks: long prompts have engines of their own", "placed_apart", {}),
    ("no rule known yet", None, {}),
])
def test_who_never_yields(why, rule, changes):
    yields, _, _ = rig(rule)
    assert yields.watch(admitted(load_config(), **changes)) is None, why


def test_yielding_is_off_at_a_prefill_pace_of_zero():
    config = load_config()
    for pool in config.pools.values():
        object.__setattr__(pool.capacity, "long_prefill_tokens_per_s", 0.0)
    yields, _, _ = rig()
    assert yields.watch(admitted(config)) is None


def test_the_names_that_yielded_are_forgotten_with_the_attempt_ledger():
    config = load_config()
    yields, clock, _ = rig()
    first = admitted(config, key="a")
    yields.watch(first)
    yields.give_way(first)
    clock.now += config.retries.window_s + 1
    other = admitted(config, key="b", name="x2")
    yields.watch(other)
    yields.give_way(other)  # (remembering it forgets the names older than the window)
    assert yields.watch(admitted(config, key="a", name="x3")) is not None
