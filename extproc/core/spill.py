"""How fast the prompts of the classes without a latency target may start on an engine that runs
latency-bound requests, where the sidecar places them: each engine's spill pace.

Where the sidecar picks the engines and keeps prompts apart (`pick_backend`, `keep_long_apart`),
a request of a class without a latency target goes to an engine running no latency-bound request
while one has room for it (capacity.backend_order). When none has (the one free of them holds
the long prompts' lane and its KV cache is spoken for, or its slots are full), the request goes
to an engine running loans, and each of its prompt's chunks lengthens every step of every loan
there. Without a pace such spills came in bunches: in the matrix's 32-sequence template cell at
seed 17 (run again with the placements logged), ten prompts were placed beside the loans within
a tenth of a second as the lane's cache filled, and the loans there decoded their 64 tokens in
1.4-3.5 s beside that prefill (bench/results/matrix/matrix.json at 6ce42ec), where they take
0.5 s beside none.

So on each engine that runs latency-bound requests the other classes' prompts start at a pace:
`tokens_per_s` of their KV tokens (prompt and `max_tokens`) a second, one request at a time on a
virtual schedule (GCRA with no burst: each start moves the engine's next turn on by its tokens
over the rate). The default, 2048 a second, is one engine step's token budget (vLLM's
`max_num_batched_tokens`) a second: on the simulator at most about a third of an engine's time
(the rate counts `max_tokens` too), less on a GPU. A request whose turn has not come there,
while an engine serving none is full or has no room for it, waits, holding its slot, for its
turn or for room there (`SpillPace.may_spill`; Slots.wait_for_lane), and is placed when its wait
runs out. Not in vLLM's own line on the full one: after a burst, with the line catching up,
requests piled up there by the dozen (and their slots with them) while the loans' engine idled
between its turns. Where every engine serves latency-bound requests there is nowhere better to
wait for, and the pace only orders them.
Pure: endpoints, tokens and time in (tests/unit/test_spill_pace.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .capacity import BackendLoad, Placing


class SpillPace:
    """One pool's spill pace: each engine's next turn for a prompt of the other classes."""

    def __init__(self, tokens_per_s: float):
        self.tokens_per_s = tokens_per_s
        self._due: dict[str, float] = {}  # endpoint -> when its next prompt may start

    def spent(self, loads: Sequence[BackendLoad], now: float) -> frozenset[str]:
        """The engines serving latency-bound requests whose turn has not come yet."""
        return frozenset(load.endpoint for load in loads
                         if load.serving and self._due.get(load.endpoint, -math.inf) > now)

    def started(self, load: BackendLoad, request: Placing, now: float) -> None:
        """`request` was placed on `load`: one of a class without a latency target (not a long
        prompt: core/long_lane.py keeps those apart) takes its turn there if it serves them."""
        if not (request.bound or request.long) and load.serving:
            due = max(self._due.get(load.endpoint, now), now)
            self._due[load.endpoint] = due + request.cost / self.tokens_per_s
        for endpoint in [e for e, due in self._due.items() if due <= now]:  # (turns come: nothing to keep)
            del self._due[endpoint]

    def may_spill(self, loads: Sequence[BackendLoad], request: Placing, first: str, now: float) -> bool:
        """Whether `request`, placed on the engine `first`, may start now: always, unless it is of
        a class without a latency target, `first` serves latency-bound requests and its turn has
        not come, and another engine that answers serves none (the request is beside them only for
        want of room there: it waits for its turn, or for that room)."""
        if request.bound or request.long or first not in self.spent(loads, now):
            return True
        return not spills(loads, first)


def spills(loads: Sequence[BackendLoad], first: str) -> bool:
    """Whether a request placed on the engine `first` goes beside latency-bound requests only for
    want of room elsewhere: `first` serves them, and another engine that answers serves none."""
    return any(load.endpoint == first and load.serving for load in loads) \
        and any(load.endpoint != first and not load.serving for load in loads if not load.saturated)
