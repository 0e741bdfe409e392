"""The decision log's writer: one JSON line per decision, written off the event loop.

The request path only appends the line, already built, to a bounded buffer. A thread of its
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
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import TextIO


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

    def write(self, line: str) -> bool:
        """Buffer one line (without its newline); False when it was dropped. Never blocks."""
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
                    lines.append(pending.popleft())
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
