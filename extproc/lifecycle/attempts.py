"""Client retries applied to one request when its body arrives (the rules: core/retries.py).

A request that names itself is refused while its previous attempt still runs, when its name
was given to a different request, and once it has made `retries.max_attempts` attempts; a
retry of one that failed in some pool avoids that pool. Only a retry whose earlier attempt has
ended comes back with its age (it keeps its place). Every retry spends from its branch's retry
budget, so a retry storm cannot multiply the load.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.config import Config
from ..core.events import Observers, RetryJudged
from ..core.retries import RetryBudget, Verdict, body_key, named_key, request_digest
from .exchange import Exchange
from .refusals import Refusals


class Attempts:
    def __init__(self, config: Config, begin_attempt, refusals: Refusals, observers: Observers,
                 clock: Callable[[], float]):
        self._begin_attempt = begin_attempt  # the control plane's attempt ledger
        self._refusals = refusals
        self._emit = observers.emit  # who hears each retry judged
        self.clock = clock
        self._budget = RetryBudget(config.retries)

    def reconfigure(self, config: Config) -> None:
        self._budget.settings = config.retries  # the counts so far are kept

    async def check(self, exchange: Exchange, raw_body: bytes) -> str | None:
        """Refuse (raises Rejection) or let the attempt run; return the pool it should avoid.
        A request that names itself only by counting its attempts is named by its body."""
        attempt = exchange.attempt
        c = exchange.classification
        digest = request_digest(exchange.path, raw_body)
        if attempt.key is not None:
            # (a trace id names one request per body: another body under it is another request)
            name = f"{attempt.key}\0{digest}" if attempt.traced else attempt.key
            attempt.ledger_key = named_key(c.tenant or "", c.branch_id, name)
        else:
            attempt.ledger_key, attempt.soft = body_key(c.tenant or "", c.branch_id, digest), True
        # A body-named request its client calls a first attempt is one, whatever came before.
        start = await self._begin_attempt(attempt.ledger_key, digest, attempt.soft and not attempt.declared_retry)
        verdict = start.verdict
        attempt.number = start.attempt
        if not attempt.soft:
            if verdict is Verdict.IN_PROGRESS:
                self._emit(RetryJudged("in_progress"))
                raise self._refusals.in_progress()
            if verdict is Verdict.OTHER_REQUEST:
                self._emit(RetryJudged("key_reused"))
                raise self._refusals.key_reused()
            if verdict is Verdict.TOO_MANY:
                self._emit(RetryJudged("too_many_attempts"))
                raise self._refusals.too_many_attempts(start.attempt)
        attempt.begun = verdict in (Verdict.FIRST, Verdict.RETRY)
        avoid = None
        # It comes back (its age, the pool to avoid) only once the attempt it repeats has ended.
        if verdict is Verdict.RETRY or (attempt.soft and verdict is Verdict.TOO_MANY):
            attempt.age_s = start.age_s
            avoid = start.failed_in
        if attempt.declared_retry or verdict is Verdict.RETRY:
            if not self._budget.allow(_budget_key(exchange), True, self.clock()):
                self._emit(RetryJudged("over_budget"))
                raise self._refusals.over_retry_budget(c.branch_id)
            self._emit(RetryJudged("allowed"))
        else:
            self._budget.allow(_budget_key(exchange), False, self.clock())
        return avoid

    def first(self, exchange: Exchange) -> None:
        """`check` for a request that neither names itself nor counts its attempts: a first
        attempt, counted in its branch's retry budget; nothing to avoid."""
        self._budget.allow(_budget_key(exchange), False, self.clock())

    @staticmethod
    def to_finish(exchange: Exchange) -> str | None:
        """The key the ledger must hear has finished, once (None: nothing begun)."""
        key = exchange.attempt.ledger_key if exchange.attempt.begun else None
        exchange.attempt.begun = False
        return key


def _budget_key(exchange: Exchange) -> tuple[str, str]:
    """Whose retry budget a request spends: its caller's, in its branch (a caller without a key
    names its branch itself, and must not spend a tenant's budget by naming the tenant's)."""
    c = exchange.classification
    return c.tenant, c.branch_id
