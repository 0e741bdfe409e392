"""What `extproc demo` adds to the embedded defaults: two sample tenants and their keys.

The embedded defaults (what `extproc serve` and the image run with when given no file) know no
tenant, so every caller there has the anonymous rights: the class served last, no boosts. The
demo shows what keys change: a loans officer's key may claim every class and urgency up to 3; a
service desk's key only complaints and archive queries. Without a key, a demo caller is
anonymous too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from extproc.core.config import default_config_text

DEMO_KEYS = {"sk-demo-loans-0001": "branch-0001-loans", "sk-demo-service-0002": "branch-0002-service"}

_RIGHTS = {
    "branch-0001-loans": {"branch_id": "0001", "ticket_types": ["loan_approval", "complaint", "archive_query"],
                          "max_urgent_level": 3, "max_vip_level": 3},
    "branch-0002-service": {"branch_id": "0002", "ticket_types": ["complaint", "archive_query"],
                            "max_urgent_level": 1, "max_vip_level": 2},
}


def demo_tenants() -> list[dict]:
    return [{"name": name, "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()], **_RIGHTS[name]}
            for key, name in DEMO_KEYS.items()]


def demo_config() -> dict:
    """The embedded defaults with the sample tenants."""
    config = yaml.safe_load(default_config_text())
    config["tenants"] = demo_tenants()
    return config


def write_demo_config(path: Path) -> Path:
    path.write_text(yaml.safe_dump(demo_config(), sort_keys=False), "utf-8")
    return path
