"""Where a long prompt may start, when the sidecar picks each request's engine.

vLLM schedules the prompts it is prefilling before anything waiting (chunked prefill): a prompt
longer than a step's token budget takes every step's budget until its prefill is done, so on its
engine nobody else starts for seconds (a 12k-token prompt: six steps, about 2.2 s on the
simulator), and every request already running there decodes one token per such step. Wherever a
long prompt starts, a latency-bound request running or arriving there misses its target.

So with `keep_long_apart`, long prompts get a lane of their own: an engine already running long
ones (while one fits), or one running no latency-bound request. A long prompt for which no engine
is such a lane waits, holding its slot, until one is (`long_may_start`), and meanwhile the lane
it will take (`lane`: the engine running the fewest latency-bound requests) gets no new ones, so
it drains of them in the time a loan takes. At most all engines that answer but one are lanes:
one is kept for the latency-bound requests. Where fewer than two engines answer, nothing can be
kept apart and nothing waits.
"""

from __future__ import annotations

from collections.abc import Sequence

from .capacity import BackendLoad, Placing


def _usable(loads: Sequence[BackendLoad], request: Placing) -> list[BackendLoad]:
    """The engines that answer and have room for the request's tokens."""
    return [load for load in loads if not load.saturated
            and (load.capacity_tokens is None or request.cost <= load.capacity_tokens - load.used_tokens)]


def _may_open_lane(healthy: Sequence[BackendLoad]) -> bool:
    """Whether one more engine may take long prompts: one is always kept free of them."""
    return sum(1 for load in healthy if load.long_running) < len(healthy) - 1


def long_may_start(loads: Sequence[BackendLoad], request: Placing) -> bool:
    """Whether the long prompt `request` may start now: an engine with room for it already runs
    long prompts, or one runs no latency-bound request and may become a lane. Always, where
    fewer than two engines answer: nothing can be kept apart there (one engine, the others
    down or not polled yet), and waiting would only hold the slot."""
    healthy = [load for load in loads if not load.saturated]
    if len(healthy) < 2:
        return True
    usable = _usable(healthy, request)
    if any(load.long_running for load in usable):
        return True
    return _may_open_lane(healthy) and any(not load.serving for load in usable)


def lane(loads: Sequence[BackendLoad], waiting: Placing | None, kept: str | None = None) -> str | None:
    """The engine a long prompt that waits (`waiting`) will open as a lane, for latency-bound
    requests to keep off so that it drains of them: `kept` (the one chosen before) while it is
    still a candidate, else of those with room for it and no long prompt yet, the one running
    the fewest latency-bound requests (then the most free KV tokens). Kept, because an engine
    serves latency-bound requests for a while after its last one started (`serving`): a lane
    that moved to whichever engine had more room at the moment would drain neither. None when
    nothing waits, when it may start already, or when no engine may open (it waits for room in
    a lane; engines running long prompts are kept off anyway)."""
    if waiting is None or long_may_start(loads, waiting):
        return None
    healthy = [load for load in loads if not load.saturated]
    if not _may_open_lane(healthy):
        return None
    candidates = [load for load in _usable(healthy, waiting) if not load.long_running]
    if not candidates:
        return None
    if kept in {load.endpoint for load in candidates}:
        return kept
    return min(candidates, key=lambda load: (load.bound_running, load.used_tokens - (load.capacity_tokens or 0))
               ).endpoint
