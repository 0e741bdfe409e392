"""Long prompts that give their engine back when a latency-bound request arrives, where Envoy
places the pool's requests.

Why. Where Envoy places the pool's requests by its own policy (the load control's rule
"wait_for_quiet"), a long prompt of a class without a latency target starts only in a quiet
spell. A burst may still begin just after one started: nothing in the arrivals foretells it
(a burst's first half second may bring nothing). Envoy then sends some of the burst's
latency-bound requests to the long prompt's engine, where they wait for its prefill (a 12k-token
prompt: about 2.2 s on the simulator); neither holding them nor the engine's scheduling helps.

So such a prompt that started less than its prefill ago (its prompt tokens at the pool's
`long_prefill_tokens_per_s`) yields when a latency-bound request arrives in its pool: the sidecar
answers it 503 with a `retry-after`, Envoy resets its upstream request and vLLM aborts it, and it
comes back then. Only once: only a request the sidecar will know when it comes back
yields (its client names it with an idempotency key, or counts its attempts: core/retries.py),
and one that yielded does not yield again. A streamed prompt never yields: vLLM sends its response
headers before its prefill, and an answer that began is not taken back.

Each sidecar process (a replica, a `serve --workers` worker) watches the prompts it admitted and
the arrivals it sees, and remembers the requests that yielded there. Pure: `started`, `ended` and
`arrived` with the clock passed in (tests/unit/test_yielding.py).
"""

from __future__ import annotations


def yields_for_s(prompt_tokens: int, tokens_per_s: float) -> float:
    """How long after it starts a prompt of `prompt_tokens` may still yield: its prefill at
    `tokens_per_s` (0: never)."""
    return prompt_tokens / tokens_per_s if tokens_per_s > 0 else 0.0


class YieldBook:
    """The long prompts of each pool that yield to the next latency-bound arrival, and until when."""

    def __init__(self) -> None:
        self._until: dict[str, dict[str, float]] = {}  # pool -> exchange id -> yields before this time

    def started(self, pool: str, exchange_id: str, now: float, for_s: float) -> None:
        if for_s > 0:
            self._until.setdefault(pool, {})[exchange_id] = now + for_s

    def ended(self, pool: str | None, exchange_id: str) -> None:
        """Its answer began, or its exchange is over: it yields no more."""
        book = self._until.get(pool or "")
        if book is not None:
            book.pop(exchange_id, None)

    def arrived(self, pool: str, now: float) -> list[str]:
        """A latency-bound request arrived in `pool`: the prompts that yield now (each once)."""
        book = self._until.get(pool)
        if not book:
            return []
        yielding = [exchange_id for exchange_id, until in book.items() if now < until]
        book.clear()  # (the rest are past their prefill)
        return yielding
