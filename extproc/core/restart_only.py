"""Which keys of the configuration a running server cannot change, marked on the model itself.

A field (or a whole section) annotated `RestartOnly("why")` is taken once, at start, by a part
that cannot take another value while it runs; `why` says which part. A mapping annotated
`FixedEntries("why")` (the pools, the classes) has entries whose keys apply live, but which
entries it holds is fixed at start. Every other key applies live. `restart_only_keys` reads the
marks off the model; a reload that changes a key they cover is refused (ops/reload.py).
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class RestartOnly:
    """The key, and every key under it, is taken at start: a reload that changes it is refused."""

    why: str


@dataclass(frozen=True)
class FixedEntries:
    """A mapping whose set of entries is fixed at start: adding or removing one is refused;
    the keys inside an entry apply live unless marked themselves."""

    why: str


Mark = RestartOnly | FixedEntries
ENTRY = "*"  # in a key pattern: any entry of a mapping, any item of a list


def _contents(annotation: Any) -> tuple[Any, bool]:
    """What a field holds, None aside, and whether that is a mapping or a list of it: (the type
    of its values or items, True), else (the type itself, False)."""
    if get_origin(annotation) in (Union, types.UnionType):
        options = [a for a in get_args(annotation) if a is not type(None)]
        if len(options) != 1:
            return annotation, False  # a choice of shapes ("*" or a list of names): one value
        annotation = options[0]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is dict:
        return args[1], True
    if origin in (tuple, list) and args:
        return args[0], True
    return annotation, False


def config_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo, bool]]:
    """Every field of `model` and of the models inside it, as (dotted key pattern, field, whether
    it holds a section of keys rather than a value); a mapping's entries and a list's items are
    `*` in the pattern (`pools.*.capacity.long_share`). Nothing under a RestartOnly field: it
    is restart-only as a whole."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        inner, entries = _contents(field.annotation)
        section = isinstance(inner, type) and issubclass(inner, BaseModel)
        yield key, field, section
        if section and not any(isinstance(mark, RestartOnly) for mark in field.metadata):
            yield from config_fields(inner, f"{key}.{ENTRY}." if entries else f"{key}.")


def restart_only_keys(model: type[BaseModel]) -> dict[str, Mark]:
    """The marks on `model`, by key pattern: `listen` (a whole section), `pools.*` (adding or
    removing a pool), `pools.*.capacity.long_share` (one key)."""
    found: dict[str, Mark] = {}
    for key, field, _ in config_fields(model):
        for mark in field.metadata:
            if isinstance(mark, RestartOnly):
                found[key] = mark
            elif isinstance(mark, FixedEntries):
                found[f"{key}.{ENTRY}"] = mark
    return found


def restart_reason(marks: Mapping[str, Mark], key: str) -> str | None:
    """Why a running server cannot apply a change of the dotted `key` (`tenants.1.name`,
    `pools.spare`), by `marks` (None: it applies it live). A RestartOnly pattern covers the keys
    under it too; a FixedEntries pattern only a whole entry, added or removed."""
    parts = key.split(".")
    for pattern, mark in marks.items():
        wanted = pattern.split(".")
        fits = len(parts) >= len(wanted) if isinstance(mark, RestartOnly) else len(parts) == len(wanted)
        if fits and all(w in (ENTRY, p) for w, p in zip(wanted, parts, strict=False)):
            return mark.why
    return None
