"""The event loop the servers run on: uvloop where it is installed, else asyncio's own.

Measured on the request path (`extproc bench overhead`): uvloop cuts the sidecar's CPU per
request by about a fifth, and does nothing for a bare pass-through processor, whose time is
all in gRPC. Everything here is plain asyncio; only the loop under it changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

try:
    import uvloop
except ImportError:  # not on this platform: asyncio's loop works the same, a little slower
    uvloop = None


def name() -> str:
    return "uvloop" if uvloop is not None else "asyncio"


def run(main: Coroutine[Any, Any, Any]) -> Any:
    if uvloop is not None:
        return uvloop.run(main)
    return asyncio.run(main)
