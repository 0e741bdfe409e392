"""The models the configuration serves, pure: whether a request's `model` may be served to its
caller, and the OpenAI model list the sidecar answers `GET /v1/models` with. No I/O.

Theory of operation
-------------------
Routing by model is on when a pool lists `served_models`. Then each request goes to the pool
that serves its body's `model` (core/routing.py: its home; its canary, long pool and fallback are
that pool's), and before any queue:

- a request without a `model` gets 400, one for a model no pool serves 404 (`model_not_found`),
  one for a model its caller may not use (`tenants[].models`, `anonymous.models`) 403
  (`model_not_allowed`), each in OpenAI's shape with `"param": "model"`;
- `GET /v1/models` is answered from the configuration, in the headers phase (no engine asked,
  a body or none): the models the caller may use, in OpenAI's list shape; `GET /v1/models/ID`
  with that model, or 404 for one the caller may not use (as OpenAI answers: a list that hides
  a model does not confirm it exists). The path is read as the engine would read it
  (`canonical_path`: escapes decoded, slashes merged, dot segments resolved), so no spelling of
  it reaches an engine; HEAD is answered as GET.

Off (no pool lists any), every request goes to the default pool whatever its model, the sidecar
never answers 404 for a model, and `GET /v1/models` passes through to the engines, as it did
before pools listed their models.
"""

from __future__ import annotations

import json

from .config import Config, Tenant
from .headers import OUTCOME
from .openai_request import canonical_path
from .outcomes import HttpReply, Outcome, bad_request, model_not_allowed, model_not_found
from .priority import Caller

MODELS_PATH = "/v1/models"
_ONE_MODEL = MODELS_PATH + "/"


def check_model(config: Config, caller: Caller, model: str | None) -> str:
    """The pool that serves `model` to `caller`; raises 400 (no model), 404 (no pool serves it)
    or 403 (the caller may not use it) where pools list their models."""
    if not config.model_pools:
        return config.default_pool
    if model is None:
        raise bad_request("You must provide a model parameter.", "model")
    pool = config.model_pools.get(model)
    if pool is None:
        raise model_not_found(model)
    if not caller.rights.may_use(model):
        raise model_not_allowed(model, caller.rights.name if isinstance(caller.rights, Tenant) else None)
    return pool


def lists_models(config: Config, method: str | None, path: str) -> bool:
    """Whether the sidecar answers this request itself: GET (or HEAD) of /v1/models or
    /v1/models/ID, however spelt, while pools list their models."""
    if not config.model_pools or method not in ("GET", "HEAD"):
        return False
    target = canonical_path(path)
    return target == MODELS_PATH or target.startswith(_ONE_MODEL)


def listing(config: Config, caller: Caller, method: str | None, path: str, created: int) -> HttpReply | None:
    """The sidecar's answer to a request it answers itself (`lists_models`): the models `caller`
    may use, or the one model /v1/models/ID names, from the configuration; `created`, the time
    (Unix seconds) the model objects say. None: pass it on (any other request, and every request
    while no pool lists its models). Raises 404 for an ID the caller may not use or none serves."""
    if not lists_models(config, method, path):
        return None
    target = canonical_path(path)
    if target == MODELS_PATH:
        data = [_model(model, created) for model in config.model_pools if caller.rights.may_use(model)]
        return _json({"object": "list", "data": data})
    model = target[len(_ONE_MODEL):]
    if model not in config.model_pools or not caller.rights.may_use(model):
        raise model_not_found(model)
    return _json(_model(model, created))


def _model(model: str, created: int) -> dict:
    # (owned_by as vLLM says it: the pool a model lives in is the operator's business)
    return {"id": model, "object": "model", "created": created, "owned_by": "vllm"}


def _json(body: dict) -> HttpReply:
    return HttpReply(200, (("content-type", "application/json"), (OUTCOME, Outcome.MODELS_LISTED.value)),
                     json.dumps(body).encode())
