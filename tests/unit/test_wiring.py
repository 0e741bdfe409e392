"""How the parts are wired, read over the package's source: each part takes its callbacks when
it is built, and everything that listens subscribes in one place, the composition root
(server.py). No module assigns a callback to another object after it was built (an `on_*`
attribute, a patched `before_render`, any lambda, partial or bound method put on another
object's attribute, a `setattr` on another object), and no part sets a callback of its own
after its construction."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "extproc"
GENERATED = PACKAGE / "admin" / "v1"  # the admin API's code, generated from proto/
# An attribute whose name says it holds a callback.
CALLBACK_NAME = re.compile(r"^(on|before|after)_|callback|hook|handler|listener|_cb$")
# The calls that make one part listen to another: made in server.py alone.
SUBSCRIBING = {"subscribe", "refresh_before_render"}
BUILDING = {"__init__", "__post_init__"}


def _functions(node: ast.AST) -> set[str]:
    return {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _callable(value: ast.expr, methods: set[str], local: set[str]) -> bool:
    """Whether `value` is, by its form, a callable: a lambda, a partial, a method of the class
    (`self.method`) or a function defined in the enclosing function."""
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        return (isinstance(func, ast.Name) and func.id == "partial") or \
            (isinstance(func, ast.Attribute) and func.attr == "partial")
    if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self":
        return value.attr in methods
    return isinstance(value, ast.Name) and value.id in local


def wired_after_construction(source: str) -> list[str]:
    """Each place in `source` that assigns a callback after construction: to another object's
    attribute (anywhere), or to its own outside `__init__`."""
    found: list[str] = []

    def visit(node: ast.AST, methods: set[str], function: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, {n.name for n in child.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))},
                      None)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, methods, child)
                continue
            if isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and child.value is not None:
                tops = child.targets if isinstance(child, ast.Assign) else [child.target]
                local = _functions(function) if function is not None else set()
                building = isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) and function.name in BUILDING
                for target in (t for top in tops for t in (top.elts if isinstance(top, ast.Tuple) else [top])):
                    if not isinstance(target, ast.Attribute):
                        continue
                    own = isinstance(target.value, ast.Name) and target.value.id == "self"
                    if own and building:
                        continue
                    if CALLBACK_NAME.search(target.attr) or _callable(child.value, methods, local):
                        found.append(f"{child.lineno}: {ast.unparse(target)} = {ast.unparse(child.value)}")
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "setattr" \
                    and child.args and not (isinstance(child.args[0], ast.Name) and child.args[0].id == "self"):
                found.append(f"{child.lineno}: {ast.unparse(child)}")
            visit(child, methods, function)

    visit(ast.parse(source), set(), None)
    return found


def production_files() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if GENERATED not in path.parents]


def test_the_check_finds_each_way_a_callback_was_once_wired_by_hand():
    """What the wiring looked like before the observers were fed by events (3746a79^), and what
    else would do the same."""
    old = '''
class PoolWatch:
    def __init__(self, metrics):
        metrics.before_render = self.publish_gauges

    def publish_gauges(self):
        pass


class Server:
    def __init__(self, gate, load, watch):
        self.on_tick = lambda: None  # its own, while it is built: allowed
        gate.decisions.on_demand, gate.decisions.on_served = (watch.arrived, watch.served)
        self.gate.on_first_byte = load.observe_first_byte
        gate.pool_changed = lambda pool, snapshot: None
        load.listen = functools.partial(print, "x")
        load.notify = self.tick
        setattr(load, "readings", print)

    def tick(self):
        pass

    def reload(self, load):
        def heard(event):
            pass
        load.hear = heard
        self.on_tick = print  # its own, after it was built
        load.limit = self.limit  # data, not a callback: allowed
        load.settings = dict(a=1)  # allowed
'''
    assert [line.split(":")[0] for line in wired_after_construction(old)] == [
        "4", "13", "13", "14", "15", "16", "17", "18", "26", "27"]


def test_no_callback_is_assigned_after_construction():
    assigned = {f"{path.relative_to(PACKAGE).as_posix()}:{line}"
                for path in production_files() for line in wired_after_construction(path.read_text("utf-8"))}
    assert assigned == set()


def test_every_part_that_listens_subscribes_in_server_py():
    """The observers of the request path's events (core/events.Observers.subscribe) and the gauges
    written as metrics are read (ops/metrics.Metrics.refresh_before_render): one list, in the
    composition root."""
    where = {path.relative_to(PACKAGE).as_posix()
             for path in production_files()
             for node in ast.walk(ast.parse(path.read_text("utf-8")))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SUBSCRIBING}
    assert where == {"server.py"}
