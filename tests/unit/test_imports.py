"""The package's shape, checked over its import graph (every import: at the top of a module,
inside a function, under TYPE_CHECKING): no cycles, each subpackage imports only the layers
below it, the pure core does no I/O, and the testbed (testbed/extproc_testbed, a distribution of
its own) uses the product only through its pure core, while the product never names the testbed;
and docs/layout.md names every module in its folder's section."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "extproc"
TESTBED = ROOT / "testbed" / "extproc_testbed"

# What each subpackage may import from the package (itself always). The top-level modules
# (server.py, the composition root; cli.py; workers.py) may import anything; event_loop.py
# imports nothing of the package, so any layer may use it.
LAYERS = {
    "core": set(),
    "stores": {"core"},
    "ops": {"core", "stores", "admin"},
    "control": {"core", "stores", "ops"},
    "lifecycle": {"core", "stores", "ops", "control"},
    "envoy": {"core", "lifecycle"},
    "admin": set(),
}
LEAVES = {"extproc.event_loop"}
# The decision core is plain functions and classes over plain data, with the clock passed in.
NO_IO_IN_CORE = {"asyncio", "grpc", "redis", "aiohttp", "envoy", "google", "uvloop", "prometheus_client",
                 "socket", "subprocess", "urllib.request", "threading", "time"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules of the package it imports, other top-level modules it imports)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (inside if alias.name.startswith("extproc") else outside).add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("extproc"):
                outside.add(target)
                continue
            for alias in node.names:  # `from . import x` names a module; `from .m import f` does not
                candidate = f"{target}.{alias.name}"
                inside.add(candidate if candidate in MODULES else target)
    return inside, outside


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {name: imports(path) for name, path in MODULES.items()}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and MODULES[module].name == "__init__.py") else None


def test_there_is_no_import_cycle():
    edges = {name: {m for m in inside if m in MODULES and m != name} for name, (inside, _) in GRAPH.items()}
    state: dict[str, int] = {}  # 1 on the path, 2 done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for name, (inside, _) in GRAPH.items():
        own = layer(name)
        for target in inside:
            if target not in MODULES or target == "extproc":
                continue
            theirs = layer(target)
            if own is None:  # a top-level module: the composition root and the command line
                continue
            if theirs is None:
                if target not in LEAVES:
                    wrong.append(f"{name} -> {target}")
            elif theirs != own and theirs not in LAYERS[own]:
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_the_core_does_no_io():
    found = []
    for name, (_, outside) in GRAPH.items():
        if layer(name) == "core":
            found += [f"{name} imports {m}" for m in outside if m.split(".")[0] in NO_IO_IN_CORE or m in NO_IO_IN_CORE]
    assert found == []


def test_every_layer_is_a_package_and_no_production_file_loses_its_reader():
    assert {layer(name) for name in MODULES} - {None} == set(LAYERS)
    long = {name: n for name, path in MODULES.items()
            if layer(name) != "admin" and (n := len(path.read_text("utf-8").splitlines())) > 420}
    assert long == {}


def what_the_testbed_imports() -> dict[str, set[str]]:
    """Each testbed module's imports of the product (extproc...), its own modules left out."""
    found = {}
    for path in TESTBED.rglob("*.py"):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        found[path.name] = {t for t in targets if t == "extproc" or t.startswith("extproc.")}
    return found


def test_the_testbed_uses_only_the_products_pure_core():
    """What it simulates and measures must stand apart from what it measures: it may read the
    configuration's defaults and the core's plain functions, never the gate, the stores or the
    servers (it runs the sidecar as a process, as a user does)."""
    allowed = {"extproc", "extproc.event_loop"}
    found = what_the_testbed_imports()
    assert len(found) > 30  # the testbed was read
    wrong = {name: sorted(t for t in targets if t not in allowed and not t.startswith("extproc.core"))
             for name, targets in found.items()}
    assert {name: targets for name, targets in wrong.items() if targets} == {}


def test_the_product_never_imports_the_testbed():
    wrong = [name for name, (_, outside) in GRAPH.items() if any(m.split(".")[0] == "extproc_testbed" for m in outside)]
    text = [name for name, path in MODULES.items() if "extproc_testbed" in path.read_text("utf-8")]
    assert wrong == [] and text == []


def layout_sections() -> dict[str, str]:
    """docs/layout.md's bullets, heading and text, by their bold heading (`core/` — the pure
    decisions, Top level, ...)."""
    text = (ROOT / "docs" / "layout.md").read_text("utf-8")
    parts = re.split(r"^- \*\*(.+?)\*\*", text, flags=re.M)
    return {title: title + body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_the_layout_page_names_every_module_where_it_lies():
    """docs/layout.md names each module of the package in its folder's section (a top-level one
    under Top level) and each of the testbed's under Not production: the tree and its page agree."""
    sections = layout_sections()

    def section(heading: str) -> str:
        found = [body for title, body in sections.items() if title.startswith(heading)]
        assert len(found) == 1, heading
        return found[0]

    unnamed = []
    for name, path in MODULES.items():
        if path.name == "__init__.py" or layer(name) == "admin":
            continue
        own = layer(name)
        heading = f"`{own}/" if own else "Top level"
        if f"`{path.name}`" not in section(heading) and f"`{own}/{path.name}`" not in section(heading):
            unnamed.append(path.relative_to(ROOT).as_posix())
    unnamed += [path.relative_to(ROOT).as_posix() for path in sorted(TESTBED.glob("*.py"))
                if path.name != "__init__.py" and f"`{path.name}`" not in section("Not production")]
    assert unnamed == []
