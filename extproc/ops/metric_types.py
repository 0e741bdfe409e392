"""Counters and histograms of the request path, kept in plain numbers.

prometheus_client's own take a lock and check their state on every increment: some 5,000
machine instructions per update, and the request path makes about ten. These keep a float per
series and are read only when `/metrics` is: each is a collector on the Metrics registry, so the
exposition (names, `_total`, `le` buckets, HELP and TYPE) is prometheus_client's own. Only the
event loop's thread updates them (the sidecar's one writer); a scrape reads them on that thread
too. Gauges stay prometheus_client's: they are set when the metrics are read, not per request.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString


class _Labelled:
    """Series by label values: created on first use, or up front by `labels()` alone."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple, object] = {}
        if not self.labelnames:
            self._series[()] = self._new()
        registry.register(self)

    def _new(self):
        raise NotImplementedError

    def labels(self, *values):
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {values!r}")
            series = self._series[values] = self._new()
        return series

    def remove(self, *values) -> None:
        """Drop a series, if there is one."""
        self._series.pop(values, None)

    def clear(self) -> None:
        """Drop every series."""
        self._series.clear()

    def describe(self) -> list:
        return [self._family()]

    def collect(self) -> Iterable:
        family = self._family()
        for values, series in list(self._series.items()):
            self._add(family, [str(v) for v in values], series)
        return [family]

    def _family(self):
        raise NotImplementedError

    def _add(self, family, values: list[str], series) -> None:
        raise NotImplementedError


class CounterValue:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class Counter(_Labelled):
    """A counter (`<name>_total`), labelled or not: `.labels(*values).inc()`, or `.inc()`."""

    def _new(self) -> CounterValue:
        return CounterValue()

    def inc(self, amount: float = 1) -> None:
        self._series[()].inc(amount)  # type: ignore[attr-defined]

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: CounterMetricFamily, values: list[str], series: CounterValue) -> None:
        family.add_metric(values, series.value)


class HistogramValue:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative; the last bound is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect_left(self.bounds, amount)] += 1


class Histogram(_Labelled):
    """A histogram (`_bucket{le}`, `_sum`, `_count`), labelled or not."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry):
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(bounds):
            raise ValueError(f"{name}: buckets must be in increasing order")
        self.bounds = bounds if bounds and bounds[-1] == math.inf else (*bounds, math.inf)
        self._le = [floatToGoString(b) for b in self.bounds]
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new(self) -> HistogramValue:
        return HistogramValue(self.bounds)

    def observe(self, amount: float) -> None:
        self._series[()].observe(amount)  # type: ignore[attr-defined]

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def _add(self, family: HistogramMetricFamily, values: list[str], series: HistogramValue) -> None:
        running, buckets = 0, []
        for le, count in zip(self._le, series.counts, strict=True):
            running += count
            buckets.append((le, running))  # cumulative, as the exposition wants them
        family.add_metric(values, buckets, series.sum)
