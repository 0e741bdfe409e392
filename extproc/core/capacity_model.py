"""How many engines a pool needs, pure: per-engine capacity at the classes' latency targets,
from what the sidecar observed, and the engines the demand it sees calls for, now and a few
minutes ahead.

Theory of operation
-------------------
An engine runs at most `N` requests at once: its `max_num_seqs`, fewer when its KV cache
cannot hold that many requests of the observed mean cost (`kv_tokens x safety / mean cost`),
and fewer still when the latency-bound classes would miss their target at `N`. That last limit
is read from the observations: every first byte of a class with a `latency_target_s` gives the
engine's share of its latency (first byte less queue wait) over the target, and the per-engine
concurrency at that moment. Per concurrency level the 90th percentile of those ratios is kept;
a least-squares line through the levels says at which concurrency the engine's share reaches
`engine_latency_share` of the target (the rest of the target is left to waiting in line). The
line is trusted only between what was seen: while no level (of at least 5 first bytes) misses the
mark, the engine's own limit stands (a line drawn through light load alone would extrapolate
noise); once one does, the answer lies below the lowest level that misses, and at least at the
highest level under it that keeps the mark.

A request of class `c` holds its slot for its service time (admission to the end of its answer),
and that time grows with the requests its engine runs beside it (they share each decode step).
So each completion is kept with the per-engine concurrency it ran at (the time-weighted mean of
what the ticks saw, `ran_at`, over the request's life), and per class a least-squares line
`S_c(n) = base_c + per_request_c x n` is fitted through them (`ServiceFit`). The engine is sized
where it should run: at `n* = target_utilisation x N` requests (queues stay short only below
saturation), where by Little's law it completes `n* / S_c(n*)` requests of class `c` a second:
`capacity_rps[c] = n* / S_c(n*)`. The service times read while the engines ran full (longer, as
each step is shared by more requests) then move the fit along its line, not the capacity: the
engines asked for a demand are the same whether it was measured at light load or in overload,
and the utilisation margin costs what running at `n*` rather than `N` costs (a few per cent when
the service time grows with concurrency, not a quarter). The line needs the concurrencies seen
to span half a request (between their 10th and 90th percentiles); a negative intercept becomes
a line through the origin, a falling one the mean. Seen at one level `n0` only (mean `s0`: a
steady night, or engines held full), the last line drawn keeps its slope, through `(n0, s0)`;
with none yet, the fit says what that level allows: below `n0` the engine gives no more than it
gave there (`S(n) = s0 x n / n0`, so a count read in overload is not inflated by the stretched
times); above it, `s0`. Completions of unknown concurrency leave the mean (`S_c(n) = s0`).

The demand is every first attempt of a request, whatever became of it (admitted, queued, shed,
turned away, degraded to the fallback pool: all count for their home pool), over the last
`window_s` (a replica hears only its own: with a line shared by N replicas, each arrival it
hears stands for N, weighed as it is heard, so a change of N changes no arrival already
counted), plus what waits in line now, to be served within `drain_s`. The engines needed now
are `sum_c demand_c / capacity_rps[c]`, rounded up. The engines needed `horizon_s` ahead (a new
engine takes about a minute to start, so the autoscaler must act on where the demand is
going) add the slope of the least-squares line through the arrivals' work (the backlog is
drained now, not a trend) over the last `trend_s` to today's need, never below it, and never
more growth than that window saw: a step in demand is not a ramp, and a line drawn across one
would ask for twice the step. Only once a whole `window_s` of demand and half a `trend_s` of
history were seen (a trend read off the first seconds would be noise). The desired count is the
larger of the two, within `[min_backends, max_backends]`.

Scale-in protection: the desired count never falls while the pool's tier is above green, and
falls only to the highest count wanted over the last `scale_in_hold_s` (a stabilization
window: a lull of a few seconds inside a burst removes no engine). A need beyond
`max_backends` is reported (`beyond_max`): that decision belongs to a person, not an
autoscaler.

What a benchmark compares with the smallest fixed pool that held its targets: `needed_now`
rounded up (`extproc_needed_backends{horizon="now"}`), the engines this demand needs at `n*`,
free of the trend and the hold; `service_fit` and `sizing_concurrency` say how it was reached.

Until a class's service time was measured (10 completions; a class with fewer borrows the
pool's), its capacity is unknown (None), and the pool keeps the engines it has: a figure read
off the first few completions would be noise, and the stabilization window would hold it. Nor is any
count wanted before a whole `window_s` of demand was seen: the pool keeps the engines it has.
Service times, costs and latencies are the most recent `SAMPLES_KEPT` of each kind within their
memory: memory and each tick's work stay bounded at any rate. Pure: observations and the clock
come in, an `Estimate` comes out.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

_QUANTILE = 0.9
# The most recent service times, costs and first-byte latencies kept (of each kind): at
# thousands of requests a second, a few minutes of every sample would be hundreds of thousands
# of tuples walked at every tick. Arrivals are only counted, so they are kept for the window.
SAMPLES_KEPT = 2048
_MIN_SERVICE_SAMPLES = 10  # a service time from fewer completions is not a measurement yet
_MIN_LEVEL_SAMPLES = 5  # a concurrency level with fewer first bytes says nothing yet
_MIN_SPREAD = 0.5  # requests per engine between the 10th and 90th percentile: one level below it


@dataclass(frozen=True)
class ModelSettings:
    """The knobs of one pool's model (the configuration's `pools.NAME.autoscale`)."""

    min_backends: int = 1
    max_backends: int | None = None
    target_utilisation: float = 0.8
    window_s: float = 30.0
    trend_s: float = 120.0
    horizon_s: float = 120.0
    drain_s: float = 30.0
    scale_in_hold_s: float = 300.0
    engine_latency_share: float = 0.75


@dataclass(frozen=True)
class ServiceFit:
    """A class's service time at per-engine concurrency n: `base_s + per_request_s x min(n, upto)`
    (`upto`: the one level seen, beyond which nothing says the time grows; None: the line)."""

    base_s: float
    per_request_s: float
    upto: float | None = None

    def at(self, concurrency: float) -> float:
        n = concurrency if self.upto is None else min(concurrency, self.upto)
        return self.base_s + self.per_request_s * n

    def as_dict(self) -> dict:
        return {"base_s": round(self.base_s, 4), "per_request_s": round(self.per_request_s, 4),
                "upto": None if self.upto is None else round(self.upto, 2)}


@dataclass(frozen=True)
class Estimate:
    """What the model says of a pool now."""

    backends: int  # engines serving now (as the probes see them)
    per_engine_concurrency: int  # N: requests one engine runs at once inside the targets
    capacity_rps: dict[str, float | None]  # per class: requests per second one engine carries
    demand_rps: dict[str, float]  # per class: arrivals (first attempts) plus the backlog to drain
    sizing_concurrency: float  # n*: the per-engine concurrency the pool is sized for (u x N)
    service_fit: dict[str, ServiceFit | None]  # per class: service time against concurrency
    needed_now: float | None  # engines the demand needs now (unrounded; None: capacity unknown)
    needed_ahead: float | None  # the same, horizon_s ahead on the trend
    wanted: int  # the raw count, within the bounds, before the scale-in hold
    desired: int  # what the autoscaler should run
    beyond_max: bool  # the demand needs more than max_backends
    held: bool  # the scale-in hold kept `desired` above `wanted`

    def as_dict(self) -> dict:
        return {"backends": self.backends, "per_engine_concurrency": self.per_engine_concurrency,
                "capacity_rps": {c: None if v is None else round(v, 3) for c, v in self.capacity_rps.items()},
                "demand_rps": {c: round(v, 3) for c, v in self.demand_rps.items()},
                "sizing_concurrency": round(self.sizing_concurrency, 2),
                "service_fit": {c: None if f is None else f.as_dict() for c, f in self.service_fit.items()},
                "needed_now": None if self.needed_now is None else round(self.needed_now, 2),
                "needed_ahead": None if self.needed_ahead is None else round(self.needed_ahead, 2),
                "desired_backends": self.desired, "beyond_max": self.beyond_max, "held": self.held}


@dataclass
class _ClassSamples:
    arrivals: deque = field(default_factory=deque)  # (time, weight)
    arrived: float = 0.0  # their weights' sum
    # (time, seconds, per-engine concurrency or None)
    service: deque = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))
    cost: deque = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))  # (time, tokens)


class CapacityModel:
    """One pool's model. Feed it with `arrived`, `served`, `responded`; read it with `estimate`."""

    def __init__(self, targets: Mapping[str, float | None], max_num_seqs: int,
                 settings: ModelSettings = ModelSettings(), kv_tokens_per_engine: int | None = None,
                 kv_safety: float = 0.85, started_at: float | None = None):
        self.targets = dict(targets)  # class -> latency target (None: none)
        self.max_num_seqs = max_num_seqs
        self.settings = settings
        self.kv_tokens_per_engine = kv_tokens_per_engine
        self.kv_safety = kv_safety
        self._classes: dict[str, _ClassSamples] = {c: _ClassSamples() for c in self.targets}
        # (time, concurrency, engine latency / target)
        self._latency: deque[tuple[float, int, float]] = deque(maxlen=4 * SAMPLES_KEPT)
        # (time, per-engine concurrency from then, its integral over time before then)
        self._load: deque[tuple[float, float, float]] = deque(maxlen=SAMPLES_KEPT)
        self._lines: dict[str, ServiceFit] = {}  # per class: the last line drawn across a spread
        self._work: deque[tuple[float, float]] = deque()  # (time, engines needed now) for the trend
        self._wanted: deque[tuple[float, int]] = deque()  # (time, wanted) for the scale-in hold
        self._desired: int | None = None
        # since when demand is counted (the first arrival when not told): the window is shorter
        # until it is full
        self._since: float | None = started_at

    # -- observations --------------------------------------------------------------------------

    def _samples(self, class_name: str) -> _ClassSamples:
        samples = self._classes.get(class_name)  # (on the request path: no new samples built to look one up)
        if samples is None:
            samples = self._classes[class_name] = _ClassSamples()
        return samples

    def arrived(self, now: float, class_name: str, weight: float = 1.0) -> None:
        """A request's first attempt reached the pool (its home), whatever became of it; it
        stands for `weight` of the pool's (a replica that hears 1/N of them: N)."""
        if self._since is None:
            self._since = now
        samples = self._samples(class_name)
        samples.arrivals.append((now, weight))
        samples.arrived += weight

    def ran_at(self, now: float, concurrency: float) -> None:
        """The pool's engines run `concurrency` requests each from `now` (a tick's reading)."""
        integral = 0.0
        if self._load:
            then, level, before = self._load[-1]
            if now < then:
                return
            integral = before + level * (now - then)
        self._load.append((now, max(0.0, concurrency), integral))
        keep = max(10 * self.settings.window_s, 60.0)
        while len(self._load) > 1 and self._load[1][0] < now - keep:
            self._load.popleft()

    def _integral(self, at: float) -> float:
        i = max(0, bisect_right(self._load, at, key=lambda e: e[0]) - 1)
        then, level, before = self._load[i]
        return before + level * max(0.0, at - then)

    def mean_load(self, start: float, end: float) -> float | None:
        """The per-engine concurrency over [start, end], time-weighted (None: never told)."""
        if not self._load:
            return None
        start = max(start, self._load[0][0])
        if end - start <= 1e-9:
            return self._load[max(0, bisect_right(self._load, end, key=lambda e: e[0]) - 1)][1]
        return (self._integral(end) - self._integral(start)) / (end - start)

    def served(self, now: float, class_name: str, service_s: float, cost_tokens: int | None = None,
               concurrency: float | None = None) -> None:
        """An admitted request of `class_name` completed `service_s` after its admission, at
        `concurrency` requests per engine (when not told: the mean of what `ran_at` said)."""
        samples = self._samples(class_name)
        service_s = max(0.0, service_s)
        if concurrency is None:
            concurrency = self.mean_load(now - service_s, now)
        samples.service.append((now, service_s, concurrency))
        if cost_tokens:
            samples.cost.append((now, cost_tokens))

    def responded(self, now: float, class_name: str, engine_s: float, concurrency: float) -> None:
        """A first byte came `engine_s` after admission, with `concurrency` requests per engine
        in flight. Only classes with a latency target are kept."""
        target = self.targets.get(class_name)
        if target:
            self._latency.append((now, max(1, round(concurrency)), engine_s / target))

    # -- the estimate --------------------------------------------------------------------------

    def _forget(self, now: float) -> None:
        s = self.settings
        keep = max(s.window_s, 1.0)
        service_keep = max(10 * s.window_s, 60.0)  # service times change slowly: a longer memory
        for samples in self._classes.values():
            while samples.arrivals and samples.arrivals[0][0] <= now - keep:
                samples.arrived -= samples.arrivals.popleft()[1]
            if not samples.arrivals:
                samples.arrived = 0.0  # no float drift left behind
            for queue in (samples.service, samples.cost):
                while queue and queue[0][0] < now - service_keep:
                    queue.popleft()
        while self._latency and self._latency[0][0] < now - service_keep:
            self._latency.popleft()
        while self._work and self._work[0][0] < now - s.trend_s:
            self._work.popleft()
        while self._wanted and self._wanted[0][0] < now - s.scale_in_hold_s:
            self._wanted.popleft()

    def engine_limit(self) -> int:
        """The most requests one engine can hold: max_num_seqs, or what its KV cache holds of
        the mean observed cost."""
        limit = self.max_num_seqs
        costs = [tokens for samples in self._classes.values() for _, tokens in samples.cost]
        if self.kv_tokens_per_engine and costs:
            mean_cost = sum(costs) / len(costs)
            limit = min(limit, max(1, int(self.kv_tokens_per_engine * self.kv_safety / mean_cost)))
        return limit

    def slo_concurrency(self) -> int:
        """N: the per-engine concurrency at which the latency-bound classes keep their target."""
        limit = self.engine_limit()
        levels: dict[int, list[float]] = {}
        for _, n, ratio in self._latency:
            levels.setdefault(n, []).append(ratio)
        if not levels:
            return limit
        mark = self.settings.engine_latency_share
        points = sorted((n, _quantile(ratios, _QUANTILE), len(ratios)) for n, ratios in levels.items()
                        if len(ratios) >= _MIN_LEVEL_SAMPLES)
        over = [n for n, q, _ in points if q > mark]
        if not over:
            return limit  # no level seen misses the mark: no evidence of a latency limit below the engine's
        lowest_over = min(over)
        under = max((n for n, q, _ in points if q <= mark and n < lowest_over), default=1)
        fit = _line([(n, q) for n, q, _ in points], [w for _, _, w in points])
        if fit is not None and fit[1] > 0:
            intercept, slope = fit
            crossing = math.floor((mark - intercept) / slope)
            under = max(under, min(crossing, lowest_over - 1))
        return max(1, min(limit, under))

    def service_fit(self, class_name: str) -> ServiceFit | None:
        """The class's service time against per-engine concurrency (see the module's docstring);
        a class never measured borrows the pool's completions. None: not measured yet."""
        kept = list(self._samples(class_name).service)
        if len(kept) < _MIN_SERVICE_SAMPLES:
            kept = [sample for samples in self._classes.values() for sample in samples.service]
        if len(kept) < _MIN_SERVICE_SAMPLES:
            return None
        known = [(n, s) for _, s, n in kept if n is not None]
        if len(known) < _MIN_SERVICE_SAMPLES:
            return ServiceFit(sum(s for _, s, _ in kept) / len(kept), 0.0)
        mean_n = sum(n for n, _ in known) / len(known)
        mean_s = sum(s for _, s in known) / len(known)
        spread = sorted(n for n, _ in known)
        if _quantile(spread, _QUANTILE) - _quantile(spread, 1 - _QUANTILE) < _MIN_SPREAD:
            line = self._lines.get(class_name)
            if line is not None and line.per_request_s * mean_n < mean_s:  # the slope, through today's level
                return ServiceFit(mean_s - line.per_request_s * mean_n, line.per_request_s)
            if mean_n <= 1e-9:
                return ServiceFit(mean_s, 0.0)
            return ServiceFit(0.0, mean_s / mean_n, upto=mean_n)  # one level: what it allows
        fit = _line(known)
        if fit is None or fit[1] <= 0:
            line = ServiceFit(mean_s, 0.0)  # no growth with concurrency seen
        elif fit[0] < 0:  # through the origin: the least-squares slope
            line = ServiceFit(0.0, sum(n * s for n, s in known) / sum(n * n for n, _ in known))
        else:
            line = ServiceFit(fit[0], fit[1])
        self._lines[class_name] = line
        return line

    def service_s(self, class_name: str, concurrency: float | None = None) -> float | None:
        """The class's service time at `concurrency` per engine (None: the mean kept)."""
        if concurrency is None:
            kept = [s for _, s, _ in self._samples(class_name).service]
            if len(kept) < _MIN_SERVICE_SAMPLES:
                kept = [s for samples in self._classes.values() for _, s, _ in samples.service]
            return sum(kept) / len(kept) if len(kept) >= _MIN_SERVICE_SAMPLES else None
        fit = self.service_fit(class_name)
        return None if fit is None else fit.at(concurrency)

    def estimate(self, now: float, backends: int, queued: Mapping[str, int] | None = None,
                 above_green: bool = False) -> Estimate:
        """The estimate at `now`, with `backends` engines serving, `queued` requests in line by
        class, and whether the pool's tier is above green (no scale-in then)."""
        s = self.settings
        self._forget(now)
        queued = queued or {}
        n = self.slo_concurrency()
        at = n * s.target_utilisation  # n*: where the engines should run
        span = max(1.0, min(s.window_s, now - self._since)) if self._since is not None else s.window_s
        capacity: dict[str, float | None] = {}
        demand: dict[str, float] = {}
        fits: dict[str, ServiceFit | None] = {}
        needed: float | None = 0.0
        arriving = 0.0  # the part of `needed` that the arrivals alone need (the trend's)
        for class_name in sorted(set(self._classes) | set(queued)):
            fits[class_name] = fit = self.service_fit(class_name)
            service = None if fit is None else fit.at(at)
            capacity[class_name] = at / service if service else None
            arrivals = self._samples(class_name).arrived / span
            demand[class_name] = arrivals + queued.get(class_name, 0) / max(s.drain_s, 1e-9)
            if demand[class_name] > 0:
                if capacity[class_name] is None:
                    needed = None
                elif needed is not None:
                    needed += demand[class_name] / capacity[class_name]
                    arriving += arrivals / capacity[class_name]
        ahead = None
        # A full window of demand seen: before it, the first seconds' arrivals, services and
        # latencies would set the count, and the stabilization window would hold it.
        settled = self._since is not None and now - self._since >= s.window_s
        if needed is not None:
            self._work.append((now, arriving))
            history = self._work[-1][0] - self._work[0][0] >= s.trend_s / 2
            fit = _line([(t - now, w) for t, w in self._work]) if settled and history else None
            if fit is not None:
                seen = arriving - min(w for _, w in self._work)  # the growth the window saw
                ahead = needed + max(0.0, min(fit[1] * s.horizon_s, seen))
            else:
                ahead = needed
        if needed is None or ahead is None or not settled:
            raw = max(backends, s.min_backends)  # not measured yet: keep what runs
        else:
            raw = max(s.min_backends, math.ceil(max(needed, ahead) - 1e-9))
        beyond = s.max_backends is not None and raw > s.max_backends
        wanted = min(raw, s.max_backends) if s.max_backends is not None else raw
        self._wanted.append((now, wanted))
        desired = max(w for _, w in self._wanted)  # the stabilization window
        if above_green and self._desired is not None:
            desired = max(desired, self._desired)
        self._desired = desired
        return Estimate(backends=backends, per_engine_concurrency=n, capacity_rps=capacity, demand_rps=demand,
                        sizing_concurrency=at, service_fit=fits, needed_now=needed, needed_ahead=ahead,
                        wanted=wanted, desired=desired, beyond_max=beyond, held=desired > wanted)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _line(points: list[tuple[float, float]], weights: list[float] | None = None) -> tuple[float, float] | None:
    """Weighted least squares y = a + b x; None when x does not vary."""
    weights = weights or [1.0] * len(points)
    total = sum(weights)
    if len(points) < 2 or total <= 0:
        return None
    mx = sum(w * x for (x, _), w in zip(points, weights, strict=True)) / total
    my = sum(w * y for (_, y), w in zip(points, weights, strict=True)) / total
    sxx = sum(w * (x - mx) ** 2 for (x, _), w in zip(points, weights, strict=True))
    if sxx <= 1e-12:
        return None
    sxy = sum(w * (x - mx) * (y - my) for (x, y), w in zip(points, weights, strict=True))
    slope = sxy / sxx
    return my - slope * mx, slope
