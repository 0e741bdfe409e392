"""What a reload makes of a file, without a server: the version, the diff of dotted keys, what
is refused (a file that cannot be used, or one that changes a key only a restart applies, named
with why), and every key of the configuration accounted for, restart-only (marked on the model,
core/restart_only.py) or applied live. A real server reloaded (in process and as processes),
and what operators set at run time kept through a reload, are in tests/e2e/test_reload.py;
the control plane keeping the operator's settings, in tests/unit/test_operator_settings.py."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import get_origin

import yaml

from extproc.core.config import Config, parse_config
from extproc.core.restart_only import FixedEntries, RestartOnly, config_fields, restart_only_keys
from extproc.ops.reload import (ABSENT, RESTART_ONLY, ConfigSource, classify, diff, prepare_reload, record_lines, render,
                                restart_reason, version_of)

from ..conftest import CLERK_KEY, e2e_config

LOOPBACK = "127.0.0.1"

NEW_CLERK_KEY = "sk-test-clerk-rotated"
# One line of the change record: `config NEW (previous OLD) changed KEY: OLD → NEW`.
CHANGE_LINE = re.compile(r"config (?P<version>[0-9a-f]{12}) \(previous (?P<previous>[0-9a-f]{12})\) changed "
                         r"(?P<key>\S+): (?P<old>.+) → (?P<new>.+)$")


def key_sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def base_config() -> dict:
    """The end-to-end config with auth required (so a key's rotation shows), any free ports."""
    return e2e_config(auth="required", listen={"host": LOOPBACK, "grpc_port": 0, "metrics_port": 0},
                      admin={"port": 0})


def edited(data: dict, changes: dict[str, object]) -> dict:
    """A deep copy of `data` with dotted keys set (list items by index)."""
    result = copy.deepcopy(data)
    for key, value in changes.items():
        *path, last = [int(p) if p.isdigit() else p for p in key.split(".")]
        node = result
        for part in path:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
        node[last] = value
    return result


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def canary_config() -> dict:
    """base_config with a canary pool (its rollout moved at run time by `extproc admin canary`)."""
    return edited(base_config(), {"canary": {"pool": "fallback"}})


# The weekly kind of change: one class's wait, one pool's slots, one tenant's key rotated.
LIVE_CHANGES = {
    "classes.complaint.max_wait_s": 30,
    "pools.primary.max_inflight": 2,
    "tenants.1.api_key_sha256": [key_sha(NEW_CLERK_KEY)],
}


def test_the_version_is_the_hash_of_the_canonical_validated_config():
    data = base_config()
    config = parse_config(data)
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    assert version_of(config) == hashlib.sha256(canonical.encode()).hexdigest()[:12]
    reordered = dict(reversed(list(data.items())))
    spelled_out = edited(data, {"priority.urgent_per_level": 0.1, "retries.max_attempts": 3})  # the defaults
    assert version_of(parse_config(reordered)) == version_of(parse_config(spelled_out)) == version_of(config)
    assert version_of(parse_config(edited(data, {"classes.complaint.max_wait_s": 59}))) != version_of(config)
    # The keys the command line sets are left out: the workers and replicas of one file share its version.
    assert (ConfigSource(None, {"listen": {"grpc_port": 1}}).version(config)
            == version_of(parse_config(edited(data, {"listen.grpc_port": 2})), {"listen": {"grpc_port": 2}})
            != version_of(config))


def test_the_diff_is_flat_dotted_keys_each_marked_live_or_restart():
    old = parse_config(base_config())
    new = parse_config(edited(base_config(), {
        **LIVE_CHANGES,
        "listen.grpc_port": 5,
        "classes.audit": {"base": 4},
        "pools.fallback.models.other": "other-small",
        "pools.primary.breaker.instant.threshold": 0.5,
        "pools.primary.breaker.instant.window_s": 2,
        "pools.primary.capacity.long_share": 0.3,
    }))
    changes = {c.key: c for c in classify(diff(old.model_dump(mode="json"), new.model_dump(mode="json")))}
    assert {key: (render(c.old), render(c.new), c.needs_restart) for key, c in changes.items() if key != "classes.audit"} == {
        "listen.grpc_port": ("0", "5", True),
        "classes.complaint.max_wait_s": ("60.0", "30.0", False),
        "tenants.1.api_key_sha256": (json.dumps([key_sha(CLERK_KEY)]), json.dumps([key_sha(NEW_CLERK_KEY)]), False),
        "pools.primary.max_inflight": ("1", "2", False),
        "pools.primary.capacity.long_share": ("0.5", "0.3", True),
        "pools.primary.breaker.instant.window_s": ("1.0", "2.0", True),
        "pools.primary.breaker.instant.threshold": ("0.3", "0.5", False),
        "pools.fallback.models.other": ("(absent)", '"other-small"', False),
    }
    added = changes["classes.audit"]  # a new class: one change carrying the whole class
    assert added.old is ABSENT and added.new["base"] == 4.0 and added.needs_restart
    assert changes["classes.complaint.max_wait_s"].line() == "classes.complaint.max_wait_s: 60.0 → 30.0"


def test_what_a_reload_refuses(tmp_path):
    running = parse_config(base_config())
    version = version_of(running)
    path = tmp_path / "extproc.yaml"

    def refusal(text: str | None) -> str:
        if text is not None:
            path.write_text(text)
        plan = prepare_reload(running, ConfigSource(str(path)))
        assert not plan.accepted and plan.config is None and plan.version == plan.previous_version == version
        return plan.refused_reason

    for source in (None, ConfigSource(None)):
        plan = prepare_reload(running, source)
        assert not plan.accepted and "embedded defaults" in plan.refused_reason
    assert "cannot read" in refusal(None)  # no file there
    assert "not valid YAML" in refusal("classes: [unclosed\n")
    bad = edited(base_config(), {"classes.quick_check.max_wait_s": 0})
    assert "classes.quick_check.max_wait_s: Input should be greater than 0" in refusal(yaml.safe_dump(bad))
    dotted = base_config()
    dotted["classes"]["tier.two"] = {"base": 3}  # names are keys of the dotted change record
    assert "class name 'tier.two' must start with a letter" in refusal(yaml.safe_dump(dotted))
    typo = edited(base_config(), {"classes.complaint.max_wait": 30})
    assert "classes.complaint.max_wait: Extra inputs are not permitted" in refusal(yaml.safe_dump(typo))
    # A new pool needs a restart: the file is refused as a whole, the fallback naming it too.
    needs_the_new_pool = edited(base_config(), {"pools.spare": {"cluster": "vllm_spare", "max_inflight": 1},
                                                "pools.primary.fallback": "spare"})
    assert refusal(yaml.safe_dump(needs_the_new_pool)) == (
        "pools.spare (the set of pools is fixed at start (queue lines, breakers, metrics per pool)) needs a restart: "
        "a restart applies it, or put its running value back to reload the rest")


def test_a_reload_applies_every_change_of_a_file_that_changes_no_restart_only_key(tmp_path):
    running = parse_config(base_config())
    path = write(tmp_path / "extproc.yaml", edited(base_config(), LIVE_CHANGES))
    plan = prepare_reload(running, ConfigSource(str(path)))
    assert plan.accepted and plan.config is not None and not plan.needs_restart
    assert plan.config.classes["complaint"].max_wait_s == 30
    assert [c.key for c in plan.changes] == ["classes.complaint.max_wait_s", "tenants.1.api_key_sha256",
                                             "pools.primary.max_inflight"]
    assert plan.version == version_of(plan.config) != plan.previous_version == version_of(running)
    lines = record_lines(plan, "SIGHUP")
    assert lines[0] == (f"config reload (SIGHUP) accepted: version {plan.version} (previous {plan.previous_version}), "
                        "3 changed")
    parsed = [CHANGE_LINE.match(line) for line in lines[1:]]
    assert [(m["version"], m["previous"], m["key"], m["old"], m["new"]) for m in parsed] == [
        (plan.version, plan.previous_version, c.key, render(c.old), render(c.new)) for c in plan.changes]

    same = prepare_reload(running, ConfigSource(str(write(path, base_config()))))
    assert same.accepted and not same.changes and not same.needs_restart and same.version == same.previous_version
    assert record_lines(same, "admin API") == [
        f"config reload (admin API) accepted: no change; version {same.version} stays in force"]


def test_a_reload_that_changes_a_restart_only_key_is_refused_naming_it_and_why(tmp_path):
    running = parse_config(base_config())
    version = version_of(running)
    path = write(tmp_path / "extproc.yaml", edited(base_config(), {
        **LIVE_CHANGES, "listen.grpc_port": 5, "pools.primary.capacity.long_share": 0.3}))
    plan = prepare_reload(running, ConfigSource(str(path)))
    assert not plan.accepted and plan.config is None and not plan.changes  # none of the file applies
    assert plan.version == plan.previous_version == version
    assert [(c.key, render(c.old), render(c.new), c.restart_reason) for c in plan.needs_restart] == [
        ("listen.grpc_port", "0", "5", "the ext_proc, health and metrics sockets are bound at start"),
        ("pools.primary.capacity.long_share", "0.5", "0.3", "the queue lines take the long lane's share at start")]
    assert plan.refused_reason == (
        "listen.grpc_port (the ext_proc, health and metrics sockets are bound at start), "
        "pools.primary.capacity.long_share (the queue lines take the long lane's share at start) need a restart: "
        "a restart applies them, or put their running values back to reload the rest")
    assert record_lines(plan, "SIGHUP") == [
        f"config reload (SIGHUP) refused: {plan.refused_reason}; version {version} stays in force",
        f"config {version} needs a restart for listen.grpc_port: 0 → 5",
        f"config {version} needs a restart for pools.primary.capacity.long_share: 0.5 → 0.3"]

    # The command line's overrides are applied again: a flag that overrides the file is no change.
    write(path, edited(base_config(), {**LIVE_CHANGES, "listen.grpc_port": 5}))
    overridden = prepare_reload(running, ConfigSource(str(path), {"listen": {"grpc_port": 0}}))
    assert overridden.accepted and not overridden.needs_restart and len(overridden.changes) == len(LIVE_CHANGES)


# -- every key of the configuration: restart-only, or applied live --------------------------

# Every key a reload applies live, by section (`*`: any pool, class or tenant). What puts each
# in force: the parts that read the configuration in force on every decision (the gate and
# its helpers, routing, the waiting room, the shadow copies and failover), and those a reload
# gives the new settings (SidecarServer._apply: the capacity loop rebuilt, the breakers, the
# retry budget, the control plane, the capacity model, the failover store). A key added to
# the model must be marked restart-only (core/restart_only.py) or listed here.
APPLIED_LIVE = {
    "": {"default_class", "auth", "default_pool", "drain_timeout_s"},
    "classes.*": {"base", "max_wait_s", "protected", "degradable", "latency_target_s", "deadline_s"},
    "priority": {"urgent_per_level", "vip_per_level", "bulk_penalty", "max_adjustment"},
    "anonymous": {"ticket_types", "max_urgent_level", "max_vip_level", "models"},
    "tenants.*": {"name", "branch_id", "api_key_sha256", "ticket_types", "max_urgent_level", "max_vip_level",
                  "models"},
    "pools.*": {"cluster", "max_inflight", "fallback", "served_models", "models", "long_pool"},
    "pools.*.tiers": {"yellow", "orange", "red", "hard_max"},
    "pools.*.capacity": {"backends", "kv_tokens_per_backend", "safety_factor", "max_num_seqs", "long_request_tokens",
                         "offload_request_tokens", "nvml_dynamic_batch", "latency_window_s", "latency_floor_share",
                         "latency_floor_share_envoy_placed",
                         "latency_headroom_share", "prefill_pace", "pick_backend", "keep_long_apart",
                         "spill_tokens_per_s", "bound_lately_s", "long_quiet_s", "long_prefill_tokens_per_s"},
    "pools.*.capacity.aimd": {"high", "low", "decrease", "increase_step", "min_factor", "interval_s"},
    "pools.*.breaker.instant": {"threshold", "min_requests", "open_s", "probes", "backoff", "max_open_s"},
    "pools.*.breaker.sustained": {"threshold", "min_requests", "recover_below", "hold_s", "probe_interval_s"},
    "pools.*.breaker.deep": {"threshold", "min_requests"},
    "pools.*.autoscale": {"min_backends", "max_backends", "target_utilisation", "window_s", "trend_s", "horizon_s",
                          "drain_s", "scale_in_hold_s", "engine_latency_share"},
    "limits": {"max_body_bytes", "max_message_timeout_s"},
    "requests": {"default_max_tokens", "max_model_len", "context_reserve"},
    "probes": {"interval_s", "stale_after_s", "timeout_s", "kv_bytes_per_token"},
    "discovery": {"interval_s", "timeout_s", "nameserver", "lookup_family", "empty_after", "max_engines_per_name"},
    "engine_drain": {"deadline_s", "settle_s"},
    "queue": {"scale_out_every_s", "engine_priority", "appointments", "decide_at_arrival"},
    "retry_after_s": {"overloaded", "wait_expired", "draining", "unavailable", "max", "jitter"},
    "retries": {"budget_ratio", "budget_min", "budget_window_s", "failover"},
    "canary": {"pool", "of", "order"},
    "shadow": {"share", "pool", "max_share"},
    "logging": {"decisions"},
}


def a_key(pattern: str) -> str:
    """A key of the pattern, with names the test configuration has."""
    first, *rest = pattern.split(".")
    names = {"pools": "primary", "classes": "complaint", "tenants": "1"}
    return ".".join([first, *(names.get(first, "0") if part == "*" else part for part in rest)])


def test_every_key_of_the_configuration_is_restart_only_or_applied_live():
    leaves = [key for key, _, section in config_fields(Config) if not section]
    live = {key for key in leaves if restart_reason(a_key(key)) is None}
    listed = {f"{section}.{name}" if section else name for section, names in APPLIED_LIVE.items() for name in names}
    assert sorted(live - listed) == [], "mark these restart-only on the model, or list them in APPLIED_LIVE"
    assert sorted(listed - live) == [], "listed as live, but restart-only or no key of the model"
    restart_only = ("listen", "admin", "redis", "relay", "alerts", "probes.nvml", "queue.promote_after_s",
                    "queue.scale_out_webhook", "retries.window_s", "retries.max_attempts", "canary.digits",
                    "pools.*.capacity.long_share", "pools.*.breaker.instant.window_s", "pools.*.breaker.deep.buckets")
    assert [key for key in restart_only if restart_reason(a_key(key)) is None] == []
    assert restart_reason("listen.tls.cert_file") == restart_reason("listen")  # a section's mark covers its keys
    assert restart_reason("pools.spare") and restart_reason("classes.audit")  # a pool or a class added or removed
    assert restart_reason("pools.fallback.models.other") is None  # a map entry of a pool applies live
    assert restart_reason("tenants.2") is None  # so does a tenant added


def test_the_restart_marks_are_well_formed():
    marks = restart_only_keys(Config)
    assert marks == RESTART_ONLY and len(marks) >= 15
    for key, field, section in config_fields(Config):
        found = [m for m in field.metadata if isinstance(m, (RestartOnly, FixedEntries))]
        assert len(found) <= 1, f"{key}: one mark at most"
        for mark in found:
            why = mark.why
            assert why and why == why.strip() and not why.endswith("."), f"{key}: {why!r}"  # read in parentheses
            assert restart_reason(a_key(key if isinstance(mark, RestartOnly) else f"{key}.*")) == why
        if any(isinstance(m, FixedEntries) for m in found):
            assert get_origin(field.annotation) is dict, f"{key}: FixedEntries marks a mapping"
        if section and any(isinstance(m, RestartOnly) for m in found):  # marked once, at the section
            inner = field.annotation if isinstance(field.annotation, type) else None
            assert inner is not None and not restart_only_keys(inner), f"{key}: marks inside a restart-only section"
