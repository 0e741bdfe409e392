"""What `extproc demo` adds to the embedded defaults: a second model on a pool of its own, and
three sample tenants and their keys.

The embedded defaults (what `extproc serve` and the image run with when given no file) serve one
model, on the primary pool and its fallback, and know no tenant, so every caller there has the
anonymous rights: the class served last, no boosts. The demo routes by model
(docs/configuration.md, "Routing by model"): the large `deepseek-sim` on the primary pool (its
fallback runs `deepseek-sim-small` for the requests it reroutes), and a small `qwen-sim` for
archive queries on the archive pool, each on engines of its own; `GET /v1/models` lists both.
It shows what keys change: a loans officer's key may claim every class and urgency up to 3; a
service desk's key only complaints and archive queries; an archive clerk's key archive queries
on the small model alone (403 for the large one). Without a key, a demo caller is anonymous too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from extproc.core.config import default_config_text

LARGE_MODEL = "deepseek-sim"  # the primary pool's (the embedded defaults' fallback pairs it)
SMALL_MODEL = "qwen-sim"  # the archive pool's
ARCHIVE_ENGINE = "http://127.0.0.1:8004"  # beside the defaults' engines on 8001-8003

DEMO_KEYS = {"sk-demo-loans-0001": "branch-0001-loans", "sk-demo-service-0002": "branch-0002-service",
             "sk-demo-archive-0003": "branch-0003-archive"}

_RIGHTS = {
    "branch-0001-loans": {"branch_id": "0001", "ticket_types": ["loan_approval", "complaint", "archive_query"],
                          "max_urgent_level": 3, "max_vip_level": 3},
    "branch-0002-service": {"branch_id": "0002", "ticket_types": ["complaint", "archive_query"],
                            "max_urgent_level": 1, "max_vip_level": 2},
    "branch-0003-archive": {"branch_id": "0003", "ticket_types": ["archive_query"],
                            "max_urgent_level": 0, "max_vip_level": 0, "models": [SMALL_MODEL]},
}


def demo_tenants() -> list[dict]:
    return [{"name": name, "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()], **_RIGHTS[name]}
            for key, name in DEMO_KEYS.items()]


def key_lines() -> list[str]:
    """Each sample key, its tenant, and the models it is limited to (if any)."""
    lines = []
    for key, name in DEMO_KEYS.items():
        models = _RIGHTS[name].get("models")
        lines.append(f"{key}  ({name}{': ' + ', '.join(models) + ' only' if models else ''})")
    return lines


def demo_config() -> dict:
    """The embedded defaults with the second model's pool and the sample tenants."""
    config = yaml.safe_load(default_config_text())
    pools = config["pools"]
    pools["primary"]["served_models"] = [LARGE_MODEL]
    pools["archive"] = {"cluster": "vllm_archive", "max_inflight": 8, "served_models": [SMALL_MODEL],
                        "tiers": dict(pools["fallback"]["tiers"]), "capacity": {"backends": [ARCHIVE_ENGINE]}}
    config["tenants"] = demo_tenants()
    return config


def write_demo_config(path: Path) -> Path:
    path.write_text(yaml.safe_dump(demo_config(), sort_keys=False), "utf-8")
    return path
