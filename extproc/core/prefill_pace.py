"""How fast the prompts of the classes without a latency target may start while latency-bound
requests run: one pool's prefill pace.

Why. vLLM prefills a newly scheduled prompt in its engine's next steps, up to the step's token
budget (2048 tokens by default), and every request running there waits for those steps: a step
that prefills 2048 tokens takes about 0.37 s on the simulator against 10 ms for a decode step.
The latency cap (core/capacity.LatencyLimiter) bounds how many requests of the other classes
*run*; it does not bound how fast their prompts *arrive* at the engines. Short requests turn over
in under a second, so even at the cap's floor their prompts kept most of each engine's time in
prefill through a burst (the matrix's 32-sequence engines: about 60 %), and the engine's steps
ran in convoys: a long step lets more requests finish, their replacements' prompts fill the next
step, and a loan that starts then decodes its answer beside full-budget steps (a loan's median
1.5-2 s of decode, against 0.6 s).

So the prompt tokens of the classes without a target are paced: a virtual schedule (GCRA) lets
`limit` tokens a second start, with `burst_s` of it at once; a request over the pace waits,
holding its slot, until its turn (lifecycle/prefill_pacing.py). While latency-bound requests run,
a surge is spread: at most `smooth` (2) times the demand of the last `rate_window_s` starts (a
burst's onset, or requests back together at their appointments, would otherwise fill the engines'
next steps with prefill). And the rate follows the latency-bound classes'
latency over the last `window_s` of their answers, as the cap does (the `quantile` of latency
over target, once `min_samples` answered):

- above `high`, it is cut from what started in the last `rate_window_s` (or the rate, if lower),
  in proportion to the overshoot (x high / pressure), at most halved;
- below `low`, it grows by a quarter;
- it is lifted (no pace) after a whole window in which it delayed nobody, or in which no
  latency-bound request answered (nobody to protect);
- it never goes below `floor_share` of the prompt tokens a second that started before the pace
  began (the demand it found): the other classes are slowed, never shut out; a request is never
  held past its wait (the gate places it then), nor more than `max_lead_s`;
- after each change the samples taken under the old rate are dropped, and the next decision
  waits for `min_samples` new ones.

Each replica paces what it admits; with several replicas sharing a line each follows the
latency its own requests see. Pure: samples, tokens and time in; a rate and delays out
(tests/unit/test_prefill_pace.py)."""

from __future__ import annotations

import math
from collections import deque

from .capacity import latency_pressure


class PrefillPace:
    def __init__(self, quantile: float = 0.9, high: float = 0.6, low: float = 0.4, max_cut: float = 0.5,
                 grow: float = 1.25, floor_share: float = 0.5, window_s: float = 10.0, interval_s: float = 1.0,
                 min_samples: int = 5, burst_s: float = 0.25, rate_window_s: float = 2.0, max_lead_s: float = 5.0,
                 smooth: float = 2.0):
        self.quantile = quantile
        self.high = high
        self.low = low
        self.max_cut = max_cut
        self.grow = grow
        self.floor_share = floor_share
        self.window_s = window_s
        self.interval_s = interval_s
        self.min_samples = min_samples
        self.burst_s = burst_s
        self.rate_window_s = rate_window_s
        self.max_lead_s = max_lead_s
        self.smooth = smooth
        self.rate: float | None = None  # prompt tokens a second (None: no pace)
        self._samples: deque[tuple[float, float]] = deque()  # (when, latency / target)
        self._started: deque[tuple[float, int]] = deque()  # (when, prompt tokens) asked to start, over the window
        self._started_sum = 0
        self._recent: deque[tuple[float, int]] = deque()  # the same, over the last `rate_window_s`
        self._recent_sum = 0
        self._demand = 0.0  # prompt tokens a second asked for, the most seen while not cut
        self._due = -math.inf  # when the next token is due on the schedule (GCRA's theoretical arrival)
        self._last = -math.inf
        self._changed_at = -math.inf
        self._observed_at = -math.inf
        self._delayed_at = -math.inf

    def configure(self, window_s: float, interval_s: float) -> PrefillPace:
        """Take new settings (at start, and on a reload), keeping the rate and the samples."""
        self.window_s, self.interval_s = window_s, interval_s
        return self

    def observe(self, now: float, latency_s: float, target_s: float) -> None:
        """A latency-bound request answered `latency_s` after it arrived; its class's target."""
        self._samples.append((now, latency_s / target_s))
        self._observed_at = now
        while self._samples[0][0] < now - self.window_s:  # (kept to the window whether or not anyone asks)
            self._samples.popleft()

    def pressure(self, now: float) -> float | None:
        return latency_pressure(self._samples, now, self.window_s, self.min_samples, self.quantile)

    def started_rate(self, now: float, whole_window: bool = False) -> float:
        """Prompt tokens a second asked to start (the demand) over the last `rate_window_s`, or
        over the whole `window_s`. Running sums: a read costs what expired since the last."""
        while self._started and self._started[0][0] < now - self.window_s:
            self._started_sum -= self._started.popleft()[1]
        while self._recent and self._recent[0][0] < now - self.rate_window_s:
            self._recent_sum -= self._recent.popleft()[1]
        return self._started_sum / self.window_s if whole_window else self._recent_sum / self.rate_window_s

    def floor(self) -> float:
        """The least the rate may be cut to: `floor_share` of the demand when the pace began, or
        of the demand over the last window if that is more (a demand that grew since)."""
        return max(1.0, self.floor_share * self._demand)

    def update(self, now: float) -> float | None:
        """The rate for the next interval (None: no pace)."""
        if now - self._last < self.interval_s:
            return self.rate
        self._last = now
        pressure = self.pressure(now)
        started = self.started_rate(now)
        # the demand the floor is a share of: over the whole window (not a burst's peak long
        # gone), and never less than when the pace began
        self._demand = max(self._demand if self.rate is not None else 0.0, self.started_rate(now, whole_window=True))
        before = self.rate
        if pressure is not None and pressure > self.high and started > 0:  # (no prompt asked: nothing to pace)
            base = started if self.rate is None else min(self.rate, started)
            cut = max(self.max_cut, self.high / pressure)
            self.rate = max(self.floor(), base * cut)
        elif self.rate is not None:
            if now - self._observed_at >= self.window_s or now - max(self._delayed_at, self._changed_at) >= self.window_s:
                self.rate = None  # nobody to protect, or the pace held nobody back for a window
            elif pressure is not None and pressure < self.low:
                self.rate *= self.grow
            else:
                self.rate = max(self.rate, self.floor())  # a demand that grew since raises the floor
        if self.rate != before:
            self._samples.clear()
            self._changed_at = now
        return self.rate

    def limit(self, now: float, cut: bool = True) -> float | None:
        """The prompt tokens a second that may start now (None: any). While latency-bound requests
        answer (one within the window), at most `smooth` times the demand of the last
        `rate_window_s` (never below the floor): a surge (a burst's onset, returns at their
        appointments, a line let go at once) is spread over a second or two instead of landing on
        the engines' next steps together; and, with `cut`, at most the rate the latency set."""
        if now - self._observed_at >= self.window_s:
            return None
        spread = max(self.smooth * self.started_rate(now), self.floor())
        return spread if self.rate is None or not cut else min(self.rate, spread)

    def delay(self, now: float, tokens: int, cut: bool = True) -> float:
        """Seconds until a prompt of `tokens` may start (0: now); its place on the schedule is
        taken from now on. Without `cut`, only a surge is spread (the rate the latency set is
        kept, not applied)."""
        self._started.append((now, tokens))
        self._started_sum += tokens
        self._recent.append((now, tokens))
        self._recent_sum += tokens
        self.update(now)
        limit = self.limit(now, cut)
        if limit is None:
            self._due = now
            return 0.0
        wait = max(0.0, self._due - self.burst_s - now)
        # (a request is held at most what is left of its wait and then starts, so the schedule
        # never runs more than `max_lead_s` ahead: past that, no wait would end at its turn)
        self._due = min(max(self._due, now) + tokens / limit, now + self.max_lead_s)
        if wait > 0:
            self._delayed_at = now
        return wait
