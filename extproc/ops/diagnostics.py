"""What an operator asks of a process that seems to grow: `kill -USR2 PID` writes one log line,
`object counts {...}`, with the Python objects the collector tracks, by type, largest first.
The soak (`extproc bench soak`) reads it to tell a leak from a warm cache."""

from __future__ import annotations

import gc
import json
import logging
from collections import Counter

log = logging.getLogger("extproc.diagnostics")


def object_counts(top: int = 40) -> dict:
    """Objects tracked by the garbage collector, after a collection: the total and the `top`
    types by count (type names qualified by module, so two `Ticket`s do not merge). A served
    process froze what its start made (server.run_server): those are not counted."""
    gc.collect()
    objects = gc.get_objects()
    by_type = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
    return {"objects": len(objects), "by_type": dict(by_type.most_common(top))}


def log_object_counts() -> None:
    log.warning("object counts %s", json.dumps(object_counts(), separators=(",", ":")))
