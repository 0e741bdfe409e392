"""The request path's counters and histograms read, on /metrics, exactly as prometheus_client's."""

import math

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from extproc.ops import metric_types

BUCKETS = (0.001, 0.01, 0.1, 1, 10)


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text a scrape reads, without the `_created` series (the sidecar turns them off)."""
    return sorted(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)


def _both(kind: str, *args, **kwargs):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    a = getattr(metric_types, kind)(*args, registry=ours, **kwargs)
    b = getattr(prometheus_client, kind)(*args, registry=theirs, **kwargs)
    return (a, ours), (b, theirs)


def test_a_labelled_counter_reads_as_prometheus_clients():
    (a, ours), (b, theirs) = _both("Counter", "extproc_x", "Things counted", ["pool", "end"])
    for metric in (a, b):
        metric.labels("primary", "completed").inc()
        metric.labels("primary", "completed").inc(2.5)
        metric.labels("fallback", 'say "hi"\n').inc()
        metric.labels("canary", "declared")  # declared at zero
        metric.labels("gone", "soon").inc()
        metric.remove("gone", "soon")
    assert _exposition(ours) == _exposition(theirs)
    assert a.labels("primary", "completed").value == 3.5


def test_an_unlabelled_counter_and_histogram_read_as_prometheus_clients():
    (a, ours), (b, theirs) = _both("Counter", "extproc_y", "Dropped")
    (h, ours2), (g, theirs2) = _both("Histogram", "extproc_y_seconds", "Time", buckets=BUCKETS)
    for counter, histogram in ((a, h), (b, g)):
        counter.inc()
        for value in (0.0005, 0.001, 0.05, 3, 99, 0):
            histogram.observe(value)
    assert _exposition(ours) == _exposition(theirs)
    assert _exposition(ours2) == _exposition(theirs2)


def test_a_labelled_histogram_reads_as_prometheus_clients_on_every_bucket_edge():
    (a, ours), (b, theirs) = _both("Histogram", "extproc_z_seconds", "Wait", ["pool", "class"], buckets=BUCKETS)
    for metric in (a, b):
        for value in (*BUCKETS, 0.0, 1e-9, 0.5, 10.000001, math.inf):
            metric.labels("primary", "loan").observe(value)
        metric.labels("fallback", "archive")
    assert _exposition(ours) == _exposition(theirs)
    a.clear()
    b.clear()
    assert _exposition(ours) == _exposition(theirs)


def test_wrong_label_counts_and_a_falling_counter_are_refused():
    registry = CollectorRegistry()
    counter = metric_types.Counter("extproc_w", "W", ["pool"], registry=registry)
    with pytest.raises(ValueError):
        counter.labels("primary", "extra")
    with pytest.raises(ValueError):
        counter.labels("primary").inc(-1)
    with pytest.raises(ValueError):
        metric_types.Histogram("extproc_v_seconds", "V", buckets=(1, 0.5), registry=registry)
    with pytest.raises(ValueError):  # the registry refuses a name twice, as for prometheus_client's own
        metric_types.Counter("extproc_w", "W again", registry=registry)
