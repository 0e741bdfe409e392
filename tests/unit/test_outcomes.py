"""Every refusal the sidecar gives is built in one module, core/outcomes.py, by its named
constructors: no other production module calls `Rejection(...)`, and the constructors between
them reach every rejection outcome, so none of the statuses in its table is left unreachable."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import json

from extproc.core import outcomes
from extproc.core.outcomes import _SHAPES, Outcome, Rejection, reply_for

PACKAGE = Path(__file__).resolve().parents[2] / "extproc"
HOME = PACKAGE / "core" / "outcomes.py"

_WAITING_ROOM = (Outcome.SHED_OVERLOADED, Outcome.SHED_QUEUE_FULL, Outcome.EXPIRED_IN_QUEUE, Outcome.DEFERRED)

# One call (or several, for those that take the outcome) of every constructor.
SAMPLES: dict[str, list[tuple]] = {
    "bad_request": [("Request body must be a JSON object.",), ("'model' must be a string.", "model")],
    "bad_header": [("x-bulk", "true or false", "maybe")],
    "bad_idempotency_key": [(256,)],
    "too_large": [(2048, 1024)],
    "context_length_exceeded": [(4000, 5000, 4500)],
    "unauthenticated": [(False,), (True,)],
    "model_not_found": [("gpt-unknown",)],
    "model_not_allowed": [("deepseek-sim", "clerk"), ("deepseek-sim", None)],
    "internal_error": [()],
    "store_unavailable": [(2,)],
    "draining": [(5,)],
    "unavailable": [("interactive", 10)],
    "no_paired_model": [("canary", "interactive", 10)],
    "in_progress": [(1,)],
    "key_reused": [(600.0,)],
    "too_many_attempts": [(4, 600.0, 30)],
    "over_retry_budget": [("main", 2)],
    "turned_away": [(outcome, "interactive", 20.0, 35.5, 3) for outcome in _WAITING_ROOM],
    "appointment": [(outcome, "interactive", 20.0, 35.5, 12.25) for outcome in _WAITING_ROOM],
    "past_deadline": [("batch", 600.0, "bulk")],
    "yielded": [("interactive", 2.5)],
}


def _constructors() -> set[str]:
    """The module's public functions that return a Rejection."""
    return {name for name, value in vars(outcomes).items()
            if inspect.isfunction(value) and value.__module__ == outcomes.__name__ and not name.startswith("_")
            and value.__annotations__.get("return") in ("Rejection", Rejection)}


def _names_rejection(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "Rejection") or \
        (isinstance(node, ast.Attribute) and node.attr == "Rejection")


def test_no_production_module_but_outcomes_builds_a_rejection():
    """`Rejection(...)`, or an alias of it, appears in no production module but core/outcomes.py."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == HOME:
            continue
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Call) and _names_rejection(node.func):
                found.append(f"{where}:{node.lineno} calls Rejection(...)")
            elif isinstance(node, ast.ImportFrom):
                found += [f"{where}:{node.lineno} imports Rejection as {alias.asname}"
                          for alias in node.names if alias.name == "Rejection" and alias.asname]
            elif isinstance(node, ast.ClassDef) and any(_names_rejection(base) for base in node.bases):
                found.append(f"{where}:{node.lineno} subclasses Rejection")
    assert found == []
    # ... and the module itself builds them only in its constructors.
    tree = ast.parse(HOME.read_text("utf-8"))
    inside = {id(node) for fn in tree.body if isinstance(fn, ast.FunctionDef) and fn.name in _constructors()
              for node in ast.walk(fn)}
    stray = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Call) and _names_rejection(node.func) and id(node) not in inside]
    assert stray == []


def test_every_constructor_is_sampled_and_together_they_reach_every_rejection_outcome():
    assert set(SAMPLES) == _constructors()
    built = [getattr(outcomes, name)(*args) for name, calls in SAMPLES.items() for args in calls]
    assert all(isinstance(rejection, Rejection) for rejection in built)
    assert {rejection.outcome for rejection in built} == set(_SHAPES)
    for rejection in built:  # each one answers as its outcome's status
        assert reply_for(rejection).status == _SHAPES[rejection.outcome].status


def test_the_constructors_word_each_refusal_as_before():
    """A few of the wordings clients and operators read, pinned (the move changed none)."""
    assert outcomes.bad_request("'model' must be a string.", "model").message == "'model' must be a string. (model)"
    assert outcomes.bad_header("x-bulk", "true or false", "maybe" * 10).message == \
        f"Header x-bulk must be true or false, got {('maybe' * 10)[:40]!r}."
    assert outcomes.unauthenticated(False).message == "Missing API key."
    assert outcomes.unauthenticated(True).message == "Incorrect API key provided."
    closed = outcomes.store_unavailable(2)
    assert (closed.outcome, closed.retry_after_s, closed.final) == (Outcome.REJECTED_STORE_UNAVAILABLE, 2, False)
    late = outcomes.past_deadline("batch", 600.0, "bulk")
    assert late.final and late.retry_after_s is None
    assert late.message == "The batch pool cannot answer this request within the 600 s deadline of class bulk; " \
                           "do not retry it."
    shed = outcomes.turned_away(Outcome.SHED_OVERLOADED, "interactive", 20.0, 0.0, 3)
    assert (shed.message, shed.retry_after_s) == ("The interactive pool's line is long; retry later.", 3)
    later = outcomes.appointment(Outcome.DEFERRED, "interactive", 20.0, 35.5, 12.25)
    assert later.retry_after_s == 12.25 and later.message == (
        "The interactive pool is forecast to have room for this request in 35.5 s, more than the 20 s it may "
        "wait: come back in 12.2 s (retry-after), when it is forecast to have room; this request keeps its place.")
    gave_way = outcomes.yielded("interactive", 2.5)
    assert (reply_for(gave_way).status, gave_way.retry_after_s) == (503, 2.5) and gave_way.message == (
        "This long prompt gave its engine up in its prefill: a request with a latency target arrived in the "
        "interactive pool, and Envoy may send it to the same engine. Come back in 2.5 s (retry-after): it keeps its "
        "place in line and this sidecar does not ask it to yield again.")


def test_a_model_nobody_serves_is_404_and_one_the_caller_may_not_use_403_in_openais_shape():
    """`"param": "model"`, the code a client acts on, OpenAI's wording for a model that does not
    exist; counted under outcomes of their own, with no retry-after (retrying changes nothing)."""
    missing = reply_for(outcomes.model_not_found("gpt-unknown"))
    assert missing.status == 404
    assert json.loads(missing.body) == {"error": {
        "message": "The model `gpt-unknown` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert dict(missing.headers)["x-extproc-outcome"] == "rejected_model_not_found"
    assert "retry-after" not in dict(missing.headers)
    denied = reply_for(outcomes.model_not_allowed("deepseek-sim", "clerk"))
    assert denied.status == 403
    assert json.loads(denied.body) == {"error": {
        "message": "Tenant `clerk` does not have access to model `deepseek-sim`.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_allowed"}}
    assert dict(denied.headers)["x-extproc-outcome"] == "rejected_model_not_allowed"
    anonymous = outcomes.model_not_allowed("deepseek-sim", None)
    assert anonymous.message == "Callers without an API key do not have access to model `deepseek-sim`."
    # a name sent by a client is repeated only so far
    assert len(outcomes.model_not_found("x" * 10_000).message) < 300


def test_a_bad_request_names_the_field_at_fault_in_param():
    assert json.loads(reply_for(outcomes.bad_request("'model' must be a string.", "model")).body)["error"]["param"] \
        == "model"
    assert json.loads(reply_for(outcomes.bad_request("Request body must be a JSON object.")).body)["error"]["param"] \
        is None
