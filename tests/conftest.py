from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import yaml

from extproc_testbed.redis_server import RedisCluster, RedisServer
from extproc_testbed.stack import PORT_SHARE_ENV, SimSpec, Stack, StackPorts
from extproc_testbed.traffic import ANONYMOUS_RIGHTS

TIME_SCALE = "0.2"

# The tests by layer, one folder each, and each test marked with its folder's name (`pytest -m
# unit`): unit, the pure core, one request's state and the simulator's scheduler, in-process
# (no socket, no process, no Redis: `make test-fast`); stores, the stores and control stores
# against real Redis; e2e, whatever starts processes or opens sockets (Envoy, the sidecar's
# servers, simulated and real engines). tests/unit/test_layout.py holds the layout.
TESTS = Path(__file__).resolve().parent

# Run in parallel workers (pytest-xdist: `make test`), each worker and the processes it starts
# draw the ports they listen on from a share of their own (extproc_testbed.stack.free_port).
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ[PORT_SHARE_ENV] = f"{os.environ['PYTEST_XDIST_WORKER'].removeprefix('gw')}/" \
                                 f"{os.environ['PYTEST_XDIST_WORKER_COUNT']}"
LAYERS = ("unit", "stores", "e2e")

# API keys the end-to-end tests present.
OFFICER_KEY = "sk-test-officer"  # may claim urgency up to 3
CLERK_KEY = "sk-test-clerk"  # complaint/archive only, no boosts


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def e2e_config(**overrides) -> dict:
    """A small pool (one slot) and low tiers, so contention is easy to create."""
    config = {
        "classes": {
            "loan_approval": {"base": 0, "max_wait_s": 60, "protected": True},
            "complaint": {"base": 1, "max_wait_s": 60},
            "archive_query": {"base": 2, "max_wait_s": 60, "degradable": True},
            "quick_check": {"base": 3, "max_wait_s": 1},
        },
        "default_class": "archive_query",
        "anonymous": ANONYMOUS_RIGHTS,  # the tests' callers without a key claim their class
        "tenants": [
            {"name": "officer", "branch_id": "0001", "api_key_sha256": [_sha(OFFICER_KEY)],
             "max_urgent_level": 3, "max_vip_level": 3},
            {"name": "clerk", "branch_id": "0002", "api_key_sha256": [_sha(CLERK_KEY)],
             "ticket_types": ["complaint", "archive_query", "quick_check"]},
        ],
        "pools": {
            "primary": {"cluster": "vllm_primary", "max_inflight": 1, "fallback": "fallback",
                        "tiers": {"yellow": 2, "orange": 4, "red": 6, "hard_max": 10}},
            "fallback": {"cluster": "vllm_fallback", "max_inflight": 4, "models": {"deepseek-sim": "deepseek-sim-small"}},
        },
        "default_pool": "primary",
        "limits": {"max_body_bytes": 65536, "max_message_timeout_s": 120},
        "drain_timeout_s": 20,
    }
    config.update(overrides)
    return config


def start_stack(tmp: Path, config: dict, primaries: int = 1) -> Stack:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "extproc.yaml"
    path.write_text(yaml.safe_dump(config))
    sim_args = ("--time-scale", TIME_SCALE)
    return Stack(
        tmp, StackPorts.random(primary=primaries), path,
        primary=SimSpec("deepseek-sim", sim_args), fallback=SimSpec("deepseek-sim-small", sim_args),
    ).start()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("stack"), e2e_config())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server for the module's tests (they flush it as they need)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A real three-master Redis Cluster for the module's tests."""
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.kill()


def layer_of(path: Path) -> str | None:
    """The layer of a test file: the folder under tests/ it lies in (None for one elsewhere)."""
    path = Path(path).resolve()
    if not path.is_relative_to(TESTS):
        return None
    parts = path.relative_to(TESTS).parts
    return parts[0] if len(parts) > 1 and parts[0] in LAYERS else None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        layer = layer_of(item.path)
        if layer is not None:
            item.add_marker(layer)
