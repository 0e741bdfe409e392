"""The Lua scripts of the Redis stores, kept as files in stores/lua/, one per script.

What Redis runs for each is: the lease flag constants (written from `LeaseFlags`, so Python and
Lua name the same bits) and the line's (`QUIET_ARRIVALS`, from core/admission.py), the shared
prelude (`now_ms`: Redis TIME), the library of its store when it has one (`queue.lua`), then its
body (`queue_enqueue.lua`, `control_sync.lua`, ...).
"""

from __future__ import annotations

from importlib import resources

from ..core.admission import QUIET_ARRIVALS
from .queue import LeaseFlags

_LUA = resources.files("extproc.stores").joinpath("lua")
_LIBRARIES = {"queue": "queue.lua"}


def _read(name: str) -> str:
    return _LUA.joinpath(name).read_text("utf-8")


def script(store: str, name: str) -> str:
    """The full text of `store`'s script `name` (`lua/{store}_{name}.lua` and what it builds on)."""
    flags = "".join(f"local FLAG_{flag.name} = {flag.value}\n" for flag in LeaseFlags)
    flags += f"local QUIET_ARRIVALS = {QUIET_ARRIVALS}\n"
    library = _read(_LIBRARIES[store]) if store in _LIBRARIES else ""
    return flags + _read("prelude.lua") + library + _read(f"{store}_{name}.lua")
