"""Reloading the configuration at run time: what a candidate file changes, whether a running
server can put all of it in force, and the version of the configuration in force.

Pure apart from reading the file: `prepare_reload` loads and validates the candidate with the
same code as startup (`core/config.load_config`), diffs it against the running configuration as
flat dotted keys, and returns what to apply, or why not: a file that does not validate, or that
changes a key a running server cannot change (marked on the configuration model itself:
core/restart_only.py), is refused as a whole. The server applies it (server.py
`SidecarServer.reload`) and writes the change record (`record_lines`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core import restart_only
from ..core.config import Config, ConfigError, load_config

ABSENT = object()  # a key one side of a change does not have (an added or removed class, pool, map entry)
ABSENT_TEXT = "(absent)"
ARROW = "→"


def version_of(config: Config, without: Mapping[str, Any] | None = None) -> str:
    """First 12 hex characters of the SHA-256 of the canonical JSON of the validated config:
    every key (defaults included), dict keys sorted, no spaces. Two files that validate to the
    same configuration have the same version. `without` ({section: keys}) leaves out the keys
    the command line sets (ports, hosts, the Redis and relay URLs): they differ per replica and
    per worker of one deployment, which runs one version."""
    data = config.model_dump(mode="json")
    for section, keys in (without or {}).items():
        for key in keys:
            data.get(section, {}).pop(key, None)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:12]


def render(value: Any) -> str:
    """A value as the change record shows it: JSON, or `(absent)`."""
    return ABSENT_TEXT if value is ABSENT else json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Change:
    key: str  # dotted: "classes.quick_check.max_wait_s", "tenants.1.api_key_sha256"
    old: Any
    new: Any
    restart_reason: str | None = None  # set when a running server cannot apply it

    @property
    def needs_restart(self) -> bool:
        return self.restart_reason is not None

    def line(self) -> str:
        return f"{self.key}: {render(self.old)} {ARROW} {render(self.new)}"


def diff(old: Any, new: Any, prefix: str = "") -> list[Change]:
    """Every leaf that differs between two plain (JSON-like) configurations, as dotted keys.

    Mappings are walked key by key; lists of mappings (tenants) index by index; any other list
    is one value. A key only one side has (a class, a pool, a model mapping entry) is one change
    whose other side is ABSENT, carrying the whole subtree."""
    if isinstance(old, dict) and isinstance(new, dict):
        changes: list[Change] = []
        keys = list(old) + [k for k in new if k not in old]
        for key in keys:
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in new:
                changes.append(Change(path, old[key], ABSENT))
            elif key not in old:
                changes.append(Change(path, ABSENT, new[key]))
            else:
                changes.extend(diff(old[key], new[key], path))
        return changes
    if _records(old) and _records(new):
        changes = []
        for index in range(max(len(old), len(new))):
            path = f"{prefix}.{index}"
            if index >= len(new):
                changes.append(Change(path, old[index], ABSENT))
            elif index >= len(old):
                changes.append(Change(path, ABSENT, new[index]))
            else:
                changes.extend(diff(old[index], new[index], path))
        return changes
    return [] if old == new else [Change(prefix, old, new)]


def _records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)


# The keys a running server cannot change, read off the marks on the configuration model.
RESTART_ONLY = restart_only.restart_only_keys(Config)


def restart_reason(key: str) -> str | None:
    """Why a running server cannot apply a change of `key` (None: it applies it live)."""
    return restart_only.restart_reason(RESTART_ONLY, key)


def classify(changes: list[Change]) -> list[Change]:
    """The same changes, each marked with why it needs a restart, if it does."""
    return [Change(c.key, c.old, c.new, restart_reason(c.key)) for c in changes]


@dataclass(frozen=True)
class ConfigSource:
    """Where the running configuration came from: the file given to `serve --config` (None:
    the embedded defaults) and the command-line overrides applied on top of it, per section
    (`{"listen": {"grpc_port": 50051}}`), applied again on every reload."""

    path: str | None
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def load(self) -> Config:
        """Load and validate the file (raises ConfigError), then apply the overrides."""
        config = load_config(self.path)
        for section, values in self.overrides.items():
            if values:
                config = config.model_copy(update={section: getattr(config, section).model_copy(update=dict(values))})
        return config

    def version(self, config: Config) -> str:
        """The version of `config`, the keys the command line sets left out."""
        return version_of(config, self.overrides)


@dataclass(frozen=True)
class ReloadPlan:
    """What a reload would do: refused (with the reason), or the configuration to put in force."""

    accepted: bool
    version: str  # in force after the reload (the running one when refused)
    previous_version: str
    config: Config | None = None  # to put in force (None when refused)
    changes: tuple[Change, ...] = ()  # applied
    needs_restart: tuple[Change, ...] = ()  # refused for these: keys only a restart applies
    refused_reason: str = ""


def one_line(error: ConfigError) -> str:
    """A ConfigError's message (a headline, then one line per offending key) as one log line."""
    head, *rest = [part.strip() for part in str(error).splitlines() if part.strip()] or ["invalid configuration"]
    return f"{head}: {'; '.join(rest)}" if rest else head


def prepare_reload(running: Config, source: ConfigSource | None) -> ReloadPlan:
    """Read the source again and work out what a reload changes. Never raises ConfigError:
    a file that cannot be used is a refused plan naming the key."""
    current = source.version(running) if source is not None else version_of(running)

    def refused(reason: str) -> ReloadPlan:
        return ReloadPlan(False, current, current, refused_reason=reason)

    if source is None or source.path is None:
        return refused("no configuration file to read again: the server runs on the embedded defaults "
                       "(start it with --config FILE to reload)")
    try:
        candidate = source.load()
    except ConfigError as error:
        return refused(one_line(error))
    changes = classify(diff(running.model_dump(mode="json"), candidate.model_dump(mode="json")))
    restart = tuple(c for c in changes if c.needs_restart)
    if restart:
        return ReloadPlan(False, current, current, needs_restart=restart, refused_reason=restart_refusal(restart))
    return ReloadPlan(True, source.version(candidate), current, candidate, tuple(changes))


def restart_refusal(restart: tuple[Change, ...]) -> str:
    """Why a file that changes keys only a restart applies is refused: each key, and why."""
    keys = ", ".join(f"{c.key} ({c.restart_reason})" for c in restart)
    if len(restart) == 1:
        return f"{keys} needs a restart: a restart applies it, or put its running value back to reload the rest"
    return f"{keys} need a restart: a restart applies them, or put their running values back to reload the rest"


def record_lines(plan: ReloadPlan, trigger: str) -> list[str]:
    """The change record of a reload, one log line each: a summary, then one line per applied
    key (`config V (previous P) changed key: old → new`), or, when refused for keys only a
    restart applies, one line per such key (`config V needs a restart for key: old → new`)."""
    if not plan.accepted:
        lines = [f"config reload ({trigger}) refused: {plan.refused_reason}; version {plan.version} stays in force"]
        return lines + [f"config {plan.version} needs a restart for {c.line()}" for c in plan.needs_restart]
    if not plan.changes:
        return [f"config reload ({trigger}) accepted: no change; version {plan.version} stays in force"]
    lines = [f"config reload ({trigger}) accepted: version {plan.version} (previous {plan.previous_version}), "
             f"{len(plan.changes)} changed"]
    return lines + [f"config {plan.version} (previous {plan.previous_version}) changed {c.line()}"
                    for c in plan.changes]
