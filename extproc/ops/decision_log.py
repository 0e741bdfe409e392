"""The decision log: one JSON line per decision and per release (docs/logs.md), written off the
event loop. `DecisionLog` hears the request path's events (core/events.py) and hands its lines
to the writer.

The request path only appends the line, or the record and the function that formats it, to a
bounded buffer: the formatting, too, happens off the request path. A thread of its
own writes what is buffered, in order, many lines per write: every `flush_every_s`, when the
buffer passes `batch_lines`, and at once on `flush` (drain, stop). A stream that does not keep up
(a full pipe, a slow disk) never blocks admission: when `max_pending` lines wait, the next ones
are dropped and counted (`extproc_decision_log_dropped_total`), and the first line written
after a drop says how many went missing.

The thread wakes seldom (every 0.2 s, or per 4,096 lines): each wake takes the interpreter from
the event loop, and waking every 50 ms or 256 lines cost the request path 12 to 14 % of its
CPU time, measured through the servicer without gRPC. A line reaches the stream within 0.2 s.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from json.encoder import encode_basestring_ascii as _json_string  # the C encoder json.dumps uses
from typing import Any, TextIO

from ..core.config import Config
from ..core.events import RequestDecided, RequestFinished

# One JSON object per line and per decision (docs/logs.md).
decision_log = logging.getLogger("extproc.decisions")

encode_line = json.JSONEncoder(separators=(",", ":")).encode  # built once: json.dumps builds one per call

# The fields every decision record has first, in their order (lifecycle/decisions.py builds it).
_FIELDS = ("ts", "request_id", "tenant", "pool", "class", "branch", "outcome", "wait_ms", "cost_tokens", "priority",
           "client_request_id")


class DecisionLines:
    """A decision record as its JSON line, exactly what `encode_line(record)` writes (a test
    holds them equal), in about a third of its time: the fields a request shares with every
    request of its classification (tenant, class, branch, priority) are encoded once per
    classification, and the others are written as the types a record holds them (a record
    with other types is encoded by `encode_line`)."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._classified: dict[object, tuple[str, str, str, str]] = {}
        # An admission's line, in the pieces its release line repeats: id(record) -> (record,
        # the fields between `ts` and the outcome, those after it). Taken by `release`.
        self._admitted: dict[int, tuple[dict, str, str]] = {}

    def line(self, record: dict, classification: object) -> str:
        """The line of `record`, whose tenant, class, branch and priority are `classification`'s
        (a key that stands for them: the same key, the same values)."""
        ts, pool, cost, named = record["ts"], record["pool"], record["cost_tokens"], record["client_request_id"]
        if (type(ts) is not float or type(record["wait_ms"]) is not int or not (cost is None or type(cost) is int)
                or not (pool is None or type(pool) is str) or not (named is None or type(named) is str)):
            return encode_line(record)
        shared = self._classified.get(classification)
        if shared is None:
            if len(self._classified) >= self.size:
                self._classified.clear()
            shared = self._classified[classification] = (
                _json_string(record["tenant"]), _json_string(record["class"]), _json_string(record["branch"]),
                encode_line(record["priority"]))
        tenant, class_, branch, priority = shared
        middle = (f',"request_id":{_json_string(record["request_id"])},"tenant":{tenant},'
                  f'"pool":{"null" if pool is None else _json_string(pool)},"class":{class_},"branch":{branch},'
                  f'"outcome":')
        rest = (f',"wait_ms":{record["wait_ms"]},"cost_tokens":{"null" if cost is None else cost},'
                f'"priority":{priority},"client_request_id":{"null" if named is None else _json_string(named)}')
        if len(record) > len(_FIELDS):
            parts = [rest]
            for key in list(record)[len(_FIELDS):]:  # claims_lowered, backend, forecast_wait_ms, ...
                value = record[key]
                kind = type(value)
                parts.append(f',{_json_string(key)}:'
                             f'{_json_string(value) if kind is str else value if kind is int else encode_line(value)}')
            rest = "".join(parts)
        outcome = record["outcome"]
        if outcome == "admitted":
            if len(self._admitted) >= self.size:
                self._admitted.clear()
            self._admitted[id(record)] = (record, middle, rest)
        return f'{{"ts":{ts!r}{middle}{_json_string(outcome)}{rest}}}'

    def release(self, decided: dict, classification: object, ts: float, end: str, status: int | None,
                duration_ms: int) -> str:
        """The release line of an admission: `decided`'s fields with another `ts` and outcome
        ("released"), then the release's own (`end`, `status`, `duration_ms`): exactly
        `encode_line` of that record. When this made the admission's line, its pieces are used
        again rather than encoded twice."""
        made = self._admitted.pop(id(decided), None)
        if (made is None or made[0] is not decided or type(ts) is not float or type(end) is not str
                or type(duration_ms) is not int or not (status is None or type(status) is int)):
            return self.line({**decided, "ts": ts, "outcome": "released", "end": end, "status": status,
                              "duration_ms": duration_ms}, classification)
        _, middle, rest = made
        return (f'{{"ts":{ts!r}{middle}"released"{rest},"end":{_json_string(end)},'
                f'"status":{"null" if status is None else status},"duration_ms":{duration_ms}}}')


def _formatted(format_line: Callable[..., str], args: tuple) -> str:
    try:
        return format_line(*args)
    except Exception as error:  # noqa: BLE001 - a line that cannot be made must not stop the others
        return json.dumps({"event": "decision_log_unformattable", "error": repr(error)[:200]})


class DecisionLogWriter:
    def __init__(
        self,
        stream: Callable[[], TextIO] = lambda: sys.stderr,
        *,
        max_pending: int = 50_000,
        batch_lines: int = 4096,
        flush_every_s: float = 0.2,
        on_drop: Callable[[], None] = lambda: None,
    ):
        self._stream = stream  # looked up at each write: the process's stderr of the moment
        self.max_pending = max_pending
        self._batch_lines = batch_lines
        self._flush_every_s = flush_every_s
        self._on_drop = on_drop
        self._pending: deque[str] = deque()
        self._wake = threading.Event()
        self._writing = threading.Lock()  # one writer at a time: lines stay in order
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.dropped = 0  # since start (written by the caller's thread only)
        self._dropped_said = 0  # of those, said in the log itself (the writing thread's)

    def write(self, line: str | tuple[Callable[..., str], tuple]) -> bool:
        """Buffer one line (without its newline), or what makes it: `(format_line, args)`, which
        this writer's thread calls as it writes the line (so the request path does not format
        it). False when it was dropped. Never blocks."""
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            self._on_drop()
            return False
        self._pending.append(line)
        if self._stopped:  # after close (a last release as the process stops): written at once
            self.flush()
        elif self._thread is None:
            self._start()
        elif len(self._pending) >= self._batch_lines and not self._wake.is_set():
            self._wake.set()  # (set once: the thread clears it as it starts a write)
        return True

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="extproc-decision-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._flush_every_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Write every buffered line now (from any thread)."""
        with self._writing:
            while self._pending:
                lines = []
                dropped = self.dropped
                if dropped > self._dropped_said:
                    lines.append(json.dumps({"event": "decision_log_dropped", "lines": dropped - self._dropped_said}))
                    self._dropped_said = dropped
                pending = self._pending
                for _ in range(min(len(pending), 4096)):
                    line = pending.popleft()
                    lines.append(line if type(line) is str else _formatted(*line))
                stream = self._stream()
                try:
                    stream.write("\n".join(lines) + "\n")
                    stream.flush()
                except (OSError, ValueError):  # the stream went away (closed at exit): nothing to do
                    return

    def close(self) -> None:
        """Write what is left and stop the thread."""
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()


class DecisionLog:
    """Writes each decision's record as it is decided, and a `released` line as an admitted
    request ends: its admission's fields, another `ts` and outcome, the release's own at the end.
    Lines go to stderr through a `DecisionLogWriter`, unless the application gave the
    `extproc.decisions` logger a handler of its own: then through logging."""

    def __init__(self, enabled: bool, on_drop: Callable[[], None] = lambda: None,
                 wall_clock: Callable[[], float] = time.time):
        self.enabled = enabled  # config.logging.decisions (read twice a request: a plain bool, not the model's)
        self._wall_clock = wall_clock
        self._lines = DecisionLines()
        self.writer = None if decision_log.handlers else DecisionLogWriter(on_drop=on_drop)

    def subscriptions(self) -> list[tuple[type, Callable[[Any], None]]]:
        return [(RequestDecided, self.decided), (RequestFinished, self.finished)]

    def logging(self) -> bool:
        return self.enabled and decision_log.isEnabledFor(logging.INFO)

    def reconfigure(self, config: Config) -> None:
        self.enabled = config.logging.decisions

    def decided(self, event: RequestDecided) -> None:
        if not self.logging():
            return
        if event.classification is None:
            self._write(encode_line, event.record)
        else:
            self._write(self._lines.line, event.record, event.classification)

    def finished(self, event: RequestFinished) -> None:
        """A release repeats its admission's fields (its line's pieces, when that line was made),
        on the pool it was decided for; a failover's moved it: then its record names the pool."""
        decided = event.decision
        if decided is None or not self.logging():
            return
        ts, duration_ms = self._wall_clock(), round(event.since_arrival_s * 1000)
        if decided["pool"] == event.pool:
            self._write(self._lines.release, decided, event.classification, ts, event.end, event.status, duration_ms)
        else:
            self._write(encode_line, {**decided, "ts": ts, "pool": event.pool, "outcome": "released",
                                      "end": event.end, "status": event.status, "duration_ms": duration_ms})

    def _write(self, format_line: Callable[..., str], *args) -> None:
        """One line, `format_line(*args)`: formatted by the writer's thread as it writes it (a
        record is not changed once built), or here for the application's own handler."""
        if self.writer is not None:
            self.writer.write((format_line, args))
        else:  # handle() rather than info(): the same line, without looking up the caller's frame
            line = format_line(*args)
            decision_log.handle(decision_log.makeRecord(decision_log.name, logging.INFO, __file__, 0, line, (), None))

    def flush(self) -> None:
        """Write every decision line buffered so far (before the process ends, and for tests)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
