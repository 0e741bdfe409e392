"""The decision log's writer (extproc/ops/decision_log.py): every line kept, in order, while the
stream keeps up; when it falls behind, admission never waits, and what is dropped is counted
and said in the log."""

from __future__ import annotations

import io
import json
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.ops.decision_log import DecisionLines, DecisionLogWriter, encode_line


def test_every_line_is_written_in_order_while_the_stream_keeps_up():
    stream = io.StringIO()
    writer = DecisionLogWriter(lambda: stream, batch_lines=64)
    for i in range(5000):
        assert writer.write(json.dumps({"n": i}))
    writer.close()
    assert [json.loads(line)["n"] for line in stream.getvalue().splitlines()] == list(range(5000))
    assert writer.dropped == 0


class StuckStream(io.StringIO):
    """A stream whose writes hang until released (a full pipe, a stalled disk)."""

    def __init__(self):
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        self.release.wait()
        return super().write(text)


def test_a_stream_that_falls_behind_never_blocks_the_writer_and_the_drops_are_counted_and_said():
    stream = StuckStream()
    drops = []
    writer = DecisionLogWriter(lambda: stream, max_pending=10, batch_lines=1, on_drop=lambda: drops.append(1))
    writer.write("first")
    assert stream.entered.wait(5)  # the writer's thread is stuck in the stream's write

    accepted = []
    producer = threading.Thread(target=lambda: accepted.extend(writer.write(f"line-{i}") for i in range(100)))
    producer.start()
    producer.join(5)
    assert not producer.is_alive()  # a hundred decisions made while the stream hangs: none waited
    assert accepted.count(True) == 10 and accepted.count(False) == 90
    assert writer.dropped == 90 and len(drops) == 90  # extproc_decision_log_dropped_total

    stream.release.set()
    writer.flush()  # the stream caught up
    assert writer.write("after")
    writer.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "first"
    assert json.loads(lines[1]) == {"event": "decision_log_dropped", "lines": 90}  # said where the gap is
    assert lines[2:] == [f"line-{i}" for i in range(10)] + ["after"]


_texts = st.text(max_size=12)  # quotes, backslashes, control characters and non-ASCII among them
_numbers = st.one_of(st.none(), st.integers(-10**6, 10**9), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({
    "ts": st.floats(0, 2e9), "request_id": _texts, "tenant": _texts, "pool": st.one_of(st.none(), _texts),
    "class": _texts, "branch": _texts, "outcome": _texts, "wait_ms": st.integers(0, 10**7),
    "cost_tokens": _numbers, "priority": _numbers, "client_request_id": st.one_of(st.none(), _texts),
}, optional={"claims_lowered": st.lists(_texts, max_size=3), "backend": _texts,
             "forecast_wait_ms": st.integers(0, 10**7), "since_first_attempt_ms": st.integers(0, 10**7)}))
def test_a_decision_line_is_the_json_encoding_of_its_record(record):
    """The request path writes a record's line from pieces encoded once per classification: the
    line is still exactly the record's JSON encoding, whatever its strings hold."""
    order = ("ts", "request_id", "tenant", "pool", "class", "branch", "outcome", "wait_ms", "cost_tokens", "priority",
             "client_request_id", "claims_lowered", "backend", "forecast_wait_ms", "since_first_attempt_ms")
    record = {key: record[key] for key in order if key in record}  # as the gate builds it (decisions.py)
    lines = DecisionLines()
    classification = (record["tenant"], record["class"], record["branch"], record["priority"])
    assert lines.line(record, classification) == encode_line(record)
    assert lines.line({**record, "ts": record["ts"] + 1}, classification) == encode_line({**record, "ts": record["ts"] + 1})


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({
    "ts": st.floats(0, 2e9), "request_id": _texts, "tenant": _texts, "pool": st.one_of(st.none(), _texts),
    "class": _texts, "branch": _texts, "outcome": st.sampled_from(["admitted", "shed_overloaded"]),
    "wait_ms": st.integers(0, 10**7), "cost_tokens": _numbers, "priority": _numbers,
    "client_request_id": st.one_of(st.none(), _texts),
}, optional={"backend": _texts, "forecast_wait_ms": st.integers(0, 10**7)}),
    st.floats(0, 2e9), _texts, st.one_of(st.none(), st.integers(100, 599)), st.integers(0, 10**7), st.booleans())
def test_a_release_line_is_the_json_encoding_of_its_decision_released(record, ts, end, status, duration_ms, made):
    """A release line repeats its admission's fields, with another ts and outcome, then the
    release's own: exactly the JSON encoding of that record, whether the admission's line was
    made first (its pieces are used again) or not."""
    order = ("ts", "request_id", "tenant", "pool", "class", "branch", "outcome", "wait_ms", "cost_tokens", "priority",
             "client_request_id", "backend", "forecast_wait_ms")
    record = {key: record[key] for key in order if key in record}
    lines = DecisionLines()
    classification = (record["tenant"], record["class"], record["branch"], record["priority"])
    if made:
        assert lines.line(record, classification) == encode_line(record)
    released = {**record, "ts": ts, "outcome": "released", "end": end, "status": status, "duration_ms": duration_ms}
    assert lines.release(record, classification, ts, end, status, duration_ms) == encode_line(released)
    assert lines.release(record, classification, ts, end, status, duration_ms) == encode_line(released)  # taken once
