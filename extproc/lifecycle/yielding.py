"""Where an admitted long prompt **yields** its engine to a latency-bound request (the rule and
why: core/yielding.py).

The gate tells this what happens: a prompt admitted (`watch`, which gives the servicer the
signal to wait on beside Envoy's next message), a latency-bound request arrived (`arrived`), a
response begun or an exchange over (`ended`). When the signal fires, the servicer asks
`give_way` for the answer to send on the stream in Envoy's place: the request's state machine
moves it to `yielded` (released at its end as such), and it is told when to come back.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from ..core.config import Config
from ..core.outcomes import Rejection, yielded
from ..core.request_life import Phase, Yielded
from ..core.yielding import YieldBook, yields_for_s
from .exchange import Exchange

# The load control's rule for a pool's long prompts (LoadController.long_rule) under which they yield.
YIELDING_RULE = "wait_for_quiet"
MIN_COMEBACK_S = 1.0  # the soonest a yielded prompt is told to come back: after its attempt's end is recorded
COMEBACK_SPREAD = 0.5  # ...and up to this share later, so that the prompts that yielded to one burst spread out


class LongPromptYields:
    def __init__(self, perform: Callable[[Exchange, Yielded], object], clock: Callable[[], float],
                 long_rule: Callable[[str], str | None], rng: random.Random | None = None):
        self._perform = perform
        self._clock = clock
        self._rng = rng or random.Random()
        self._book = YieldBook()
        self._signals: dict[str, asyncio.Event] = {}  # exchange id -> set when it yields
        self._yielded: dict[str, float] = {}  # the names of the requests that yielded -> when, oldest first
        self.long_rule = long_rule  # the load control's rule for a pool's long prompts (None: none known)

    def watch(self, exchange: Exchange) -> asyncio.Event | None:
        """An admitted request: the signal that it yields, for a non-streamed long prompt of a
        class without a latency target, in a pool whose long prompts wait for quiet spells, that
        the sidecar will know when it comes back (its client names it with an idempotency key, or
        counts its attempts: not a trace id, which a proxy may set anew on each attempt), that has
        an attempt left to come back with, and that has not yielded here yet; None for any other."""
        lease, pool, request = exchange.lease, exchange.pool, exchange.request
        if lease is None or pool is None or request is None or request.stream or exchange.phase is not Phase.ADMITTED:
            return None
        ticket, attempt, config = lease.ticket, exchange.attempt, exchange.config
        if not ticket.long or ticket.bounded or attempt.ledger_key is None or attempt.traced \
                or attempt.number >= config.retries.max_attempts or self._yielded_lately(attempt.ledger_key, config) \
                or self.long_rule(pool) != YIELDING_RULE:
            return None
        for_s = yields_for_s(exchange.prompt_tokens, config.pools[pool].capacity.long_prefill_tokens_per_s)
        if for_s <= 0:
            return None
        self._book.started(pool, exchange.id, self._clock(), for_s)
        signal = self._signals[exchange.id] = asyncio.Event()
        return signal

    def arrived(self, pool: str) -> None:
        """A latency-bound request arrived in `pool`: the prompts still in their prefill there yield."""
        for exchange_id in self._book.arrived(pool, self._clock()):
            signal = self._signals.pop(exchange_id, None)
            if signal is not None:
                signal.set()

    def ended(self, exchange: Exchange) -> None:
        """Its response began, or its exchange is over: it yields no more."""
        if self._signals.pop(exchange.id, None) is not None:
            self._book.ended(exchange.pool, exchange.id)

    def give_way(self, exchange: Exchange) -> Rejection | None:
        """The answer the yielding request gets instead of its engine's; None if its response came
        first. Come back soon: not at an appointment the waiting room's forecast would give (a
        class without a target may be told to come back near its deadline in a burst), but once
        the latency-bound requests it yielded to have begun (`long_quiet_s`, at least a second and
        `retry_after_s.overloaded`, and up to half as much again); back, it keeps its place in line
        (its age)."""
        pool = exchange.pool
        if exchange.phase is not Phase.ADMITTED or pool is None:
            return None
        self._perform(exchange, Yielded())
        config = exchange.config
        self._remember(exchange.attempt.ledger_key, config.retries.window_s)
        soonest = max(MIN_COMEBACK_S, float(config.retry_after_s.overloaded), config.pools[pool].capacity.long_quiet_s)
        return yielded(pool, soonest * (1 + COMEBACK_SPREAD * self._rng.random()))

    def _yielded_lately(self, name: str, config: Config) -> bool:
        """Whether `name` yielded here within the attempt ledger's memory (`retries.window_s`)."""
        when = self._yielded.get(name)
        return when is not None and self._clock() - when < config.retries.window_s

    def _remember(self, name: str | None, window_s: float) -> None:
        """It yielded: never again here while the attempt ledger knows it (`retries.window_s`)."""
        now = self._clock()
        while self._yielded and next(iter(self._yielded.values())) < now - window_s:
            self._yielded.pop(next(iter(self._yielded)))
        if name is not None:
            self._yielded[name] = now
