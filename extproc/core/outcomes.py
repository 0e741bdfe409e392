"""Every way a request's admission can end, and the one place that turns an ending into an
HTTP status, headers and an OpenAI-style error body.

Every refusal the sidecar gives is also worded here, by the constructors below, one for each kind
of refusal: no other module builds a `Rejection` (tests/unit/test_outcomes.py checks). Those that decide
*when* to refuse, and with which `retry-after` over the state they see (lifecycle/refusals.py,
lifecycle/waiting_room.py, the parsers in core/, the degradable queue store), call them."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass

from .headers import IDEMPOTENCY_KEY, OUTCOME, REQUEST_ID, RETRY_AFTER, RETRY_AFTER_MS, SHOULD_RETRY


class Outcome(enum.Enum):
    """Low-cardinality label for how an admission decision ended (also a metric label)."""

    ADMITTED = "admitted"
    PASSED_THROUGH = "passed_through"  # no body to admit (e.g. GET /v1/models where no pool lists its models)
    MODELS_LISTED = "models_listed"  # GET /v1/models answered from the configuration (core/catalog.py)
    REJECTED_UNAUTHENTICATED = "rejected_unauthenticated"
    REJECTED_BAD_REQUEST = "rejected_bad_request"
    REJECTED_TOO_LARGE = "rejected_too_large"
    REJECTED_CONTEXT_LENGTH = "rejected_context_length"
    REJECTED_MODEL_NOT_FOUND = "rejected_model_not_found"  # no pool serves the requested model
    REJECTED_MODEL_NOT_ALLOWED = "rejected_model_not_allowed"  # the caller may not use the requested model
    SHED_OVERLOADED = "shed_overloaded"  # red tier, unprotected class
    SHED_QUEUE_FULL = "shed_queue_full"  # hard maximum reached
    EXPIRED_IN_QUEUE = "expired_in_queue"
    REJECTED_DRAINING = "rejected_draining"
    REJECTED_STORE_UNAVAILABLE = "rejected_store_unavailable"  # Redis down, on_failure: closed
    REJECTED_UNAVAILABLE = "rejected_unavailable"  # the pool's breaker is open and no fallback can take it
    REJECTED_NO_PAIRED_MODEL = "rejected_no_paired_model"  # the only pool left does not pair the model
    REJECTED_IN_PROGRESS = "rejected_in_progress"  # a retry of a request still waiting or running
    REJECTED_KEY_REUSED = "rejected_key_reused"  # its idempotency key was given to a different request
    REJECTED_RETRY_BUDGET = "rejected_retry_budget"  # the branch's retries are over its budget
    REJECTED_TOO_MANY_ATTEMPTS = "rejected_too_many_attempts"  # the request's key reached max_attempts
    REJECTED_PAST_DEADLINE = "rejected_past_deadline"  # no room for it before its class's deadline
    DEFERRED = "deferred"  # its forecast wait is longer than it may wait: an appointment instead
    YIELDED = "yielded"  # admitted, a long prompt gave its engine up to a latency-bound request (core/yielding.py)
    CANCELLED_CLIENT_GONE = "cancelled_client_gone"
    INTERNAL_ERROR = "internal_error"


@dataclass(frozen=True)
class _ErrorShape:
    status: int
    error_type: str
    code: str


_SHAPES: dict[Outcome, _ErrorShape] = {
    Outcome.REJECTED_UNAUTHENTICATED: _ErrorShape(401, "authentication_error", "invalid_api_key"),
    Outcome.REJECTED_BAD_REQUEST: _ErrorShape(400, "invalid_request_error", "invalid_request"),
    Outcome.REJECTED_TOO_LARGE: _ErrorShape(413, "invalid_request_error", "request_too_large"),
    Outcome.REJECTED_CONTEXT_LENGTH: _ErrorShape(400, "invalid_request_error", "context_length_exceeded"),
    Outcome.REJECTED_MODEL_NOT_FOUND: _ErrorShape(404, "invalid_request_error", "model_not_found"),
    Outcome.REJECTED_MODEL_NOT_ALLOWED: _ErrorShape(403, "invalid_request_error", "model_not_allowed"),
    Outcome.SHED_OVERLOADED: _ErrorShape(429, "rate_limit_error", "overloaded"),
    Outcome.SHED_QUEUE_FULL: _ErrorShape(429, "rate_limit_error", "queue_full"),
    Outcome.EXPIRED_IN_QUEUE: _ErrorShape(503, "server_error", "queue_wait_expired"),
    Outcome.REJECTED_DRAINING: _ErrorShape(503, "server_error", "draining"),
    Outcome.REJECTED_STORE_UNAVAILABLE: _ErrorShape(503, "server_error", "queue_unavailable"),
    Outcome.REJECTED_UNAVAILABLE: _ErrorShape(503, "server_error", "upstream_unavailable"),
    Outcome.REJECTED_NO_PAIRED_MODEL: _ErrorShape(503, "server_error", "model_unavailable"),
    Outcome.REJECTED_IN_PROGRESS: _ErrorShape(409, "invalid_request_error", "request_in_progress"),
    Outcome.REJECTED_KEY_REUSED: _ErrorShape(422, "invalid_request_error", "idempotency_key_reused"),
    Outcome.REJECTED_RETRY_BUDGET: _ErrorShape(429, "rate_limit_error", "retry_budget_exhausted"),
    Outcome.REJECTED_TOO_MANY_ATTEMPTS: _ErrorShape(429, "rate_limit_error", "too_many_attempts"),
    Outcome.REJECTED_PAST_DEADLINE: _ErrorShape(429, "rate_limit_error", "deadline_unreachable"),
    Outcome.DEFERRED: _ErrorShape(429, "rate_limit_error", "come_back_later"),
    Outcome.YIELDED: _ErrorShape(503, "server_error", "yielded_to_latency_bound"),
    Outcome.INTERNAL_ERROR: _ErrorShape(500, "server_error", "internal_error"),
}


class Rejection(Exception):
    """Raised by the decision path when a request must be answered instead of admitted."""

    def __init__(self, outcome: Outcome, message: str, retry_after_s: float | None = None, final: bool = False,
                 param: str | None = None):
        """`retry_after_s`: when to come back (an appointment, or a floor); `final`: do not;
        `param`: the field of the request at fault (the body's `param`)."""
        if outcome not in _SHAPES:
            raise ValueError(f"{outcome} is not a rejection")
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.retry_after_s = retry_after_s
        self.final = final
        self.param = param


def refuses(outcome: Outcome) -> bool:
    """Whether `outcome` is the sidecar answering the request itself (a refusal, an internal error)."""
    return outcome in _SHAPES


# Each refusal, worded. A person may read the message; a client acts on the status, the code,
# `retry-after` and `x-should-retry` (`final`).

# -- the request itself (core/openai_request.py, core/priority.py, core/retries.py, core/capacity.py)

def bad_request(message: str, param: str | None = None) -> Rejection:
    """400: a body or a header the sidecar cannot read; `param`, the field at fault."""
    where = f" ({param})" if param else ""
    return Rejection(Outcome.REJECTED_BAD_REQUEST, f"{message}{where}", param=param)


def bad_header(name: str, must_be: str, raw: str) -> Rejection:
    """400: header `name` holds `raw`, not what it `must_be` (e.g. "true or false")."""
    return bad_request(f"Header {name} must be {must_be}, got {raw[:40]!r}.")


def bad_idempotency_key(max_length: int) -> Rejection:
    return bad_request(f"{IDEMPOTENCY_KEY} / {REQUEST_ID} must be printable and at most {max_length} characters.")


def too_large(size: int, limit: int) -> Rejection:
    return Rejection(Outcome.REJECTED_TOO_LARGE, f"Request body of {size} bytes exceeds the limit of {limit} bytes.")


def context_length_exceeded(limit: int, cost: int, prompt_tokens: int) -> Rejection:
    return Rejection(
        Outcome.REJECTED_CONTEXT_LENGTH,
        f"This model's maximum context length is {limit} tokens. However, you requested about "
        f"{cost} tokens ({prompt_tokens} in the messages, {cost - prompt_tokens} in the completion). "
        "Please reduce the length of the messages or completion.",
    )


def unauthenticated(key_given: bool) -> Rejection:
    """401: no API key, or one no tenant holds."""
    return Rejection(Outcome.REJECTED_UNAUTHENTICATED,
                     "Incorrect API key provided." if key_given else "Missing API key.")


# -- the model it asks for (core/catalog.py), where pools list the models they serve

_MODEL_SHOWN = 200  # of a requested model's name, the characters a message repeats


def model_not_found(model: str) -> Rejection:
    """404: no pool serves `model` (OpenAI's wording)."""
    return Rejection(Outcome.REJECTED_MODEL_NOT_FOUND,
                     f"The model `{model[:_MODEL_SHOWN]}` does not exist or you do not have access to it.",
                     param="model")


def model_not_allowed(model: str, tenant: str | None) -> Rejection:
    """403: a pool serves `model`, and the caller's tenant (None: a caller without a known key)
    may not use it (tenants[].models, anonymous.models)."""
    who = "Callers without an API key do" if tenant is None else f"Tenant `{tenant}` does"
    return Rejection(Outcome.REJECTED_MODEL_NOT_ALLOWED,
                     f"{who} not have access to model `{model[:_MODEL_SHOWN]}`.", param="model")


# -- the sidecar's own state (envoy/servicer.py, stores/degradable_queue.py, lifecycle/refusals.py)

def internal_error() -> Rejection:
    return Rejection(Outcome.INTERNAL_ERROR, "Internal gateway error.")


def store_unavailable(retry_after_s: float | None) -> Rejection:
    """Redis is down and the queue's `on_failure` is `closed`."""
    return Rejection(Outcome.REJECTED_STORE_UNAVAILABLE, "The admission queue is unavailable; retry later.",
                     retry_after_s)


def draining(retry_after_s: float) -> Rejection:
    return Rejection(Outcome.REJECTED_DRAINING, "This gateway instance is shutting down; retry.", retry_after_s)


def unavailable(home: str, retry_after_s: float) -> Rejection:
    """The `home` pool's breaker is open and no fallback pool can take the request."""
    return Rejection(Outcome.REJECTED_UNAVAILABLE, f"The {home} pool is failing and no fallback pool can take the "
                     "request; retry later.", retry_after_s)


def no_paired_model(home: str, pool: str, retry_after_s: float) -> Rejection:
    """The `home` pool is failing and `pool`, the one left, pairs no model with the requested one."""
    return Rejection(Outcome.REJECTED_NO_PAIRED_MODEL, f"The {home} pool is failing and the {pool} pool has no "
                     "model paired with the requested one; retry later.", retry_after_s)


# -- retries (lifecycle/refusals.py)

def in_progress(retry_after_s: float) -> Rejection:
    return Rejection(Outcome.REJECTED_IN_PROGRESS,
                     "A request with this idempotency-key / x-request-id is still being served; "
                     "wait for it instead of repeating it.", retry_after_s)


def key_reused(window_s: float) -> Rejection:
    return Rejection(Outcome.REJECTED_KEY_REUSED,
                     "This idempotency-key was given to a different request within "
                     f"{window_s:g} s; a retry must repeat its request exactly: "
                     "give a new request a new key.")


def too_many_attempts(attempts: int, window_s: float, retry_after_s: float) -> Rejection:
    return Rejection(Outcome.REJECTED_TOO_MANY_ATTEMPTS,
                     f"This request was attempted {attempts} times; it will not be run again "
                     f"within {window_s:g} s.", retry_after_s)


def over_retry_budget(branch: str, retry_after_s: float) -> Rejection:
    return Rejection(Outcome.REJECTED_RETRY_BUDGET,
                     f"Branch {branch} is retrying more than its retry budget allows; retry later.", retry_after_s)


# -- turned away (lifecycle/waiting_room.py): shed, a full line, a wait that ran out, a forecast too long

_WHY = {
    Outcome.SHED_OVERLOADED: "The {pool} pool's line is long",
    Outcome.SHED_QUEUE_FULL: "The {pool} pool's line is full",
    Outcome.EXPIRED_IN_QUEUE: "No room came free in the {pool} pool within the {wait:g} s this request may wait",
    Outcome.DEFERRED: "The {pool} pool is forecast to have room for this request in {forecast:.1f} s, more than "
                      "the {wait:g} s it may wait",
}


def turned_away(outcome: Outcome, pool: str, max_wait_s: float, forecast_s: float,
                retry_after_s: float) -> Rejection:
    """One of the waiting room's four refusals (`_WHY`) without an appointment: retry later."""
    why = _WHY[outcome].format(pool=pool, wait=max_wait_s, forecast=forecast_s)
    return Rejection(outcome, f"{why}; retry later.", retry_after_s)


def appointment(outcome: Outcome, pool: str, max_wait_s: float, forecast_s: float, delay_s: float) -> Rejection:
    """One of the waiting room's four refusals (`_WHY`) with an appointment `delay_s` from now."""
    why = _WHY[outcome].format(pool=pool, wait=max_wait_s, forecast=forecast_s)
    return Rejection(outcome, f"{why}: come back in {delay_s:.1f} s (retry-after), when it is forecast to have "
                              f"room; this request keeps its place.", delay_s)


def yielded(pool: str, delay_s: float) -> Rejection:
    """An admitted long prompt gave its engine up in its prefill (core/yielding.py): come back."""
    return Rejection(Outcome.YIELDED, f"This long prompt gave its engine up in its prefill: a request with a latency "
                                      f"target arrived in the {pool} pool, and Envoy may send it to the same engine. "
                                      f"Come back in {delay_s:.1f} s (retry-after): it keeps its place in line and "
                                      f"this sidecar does not ask it to yield again.", delay_s)


def past_deadline(pool: str, deadline_s: float, class_name: str) -> Rejection:
    """No appointment fits the class's deadline: a final answer (`x-should-retry: false`)."""
    return Rejection(Outcome.REJECTED_PAST_DEADLINE,
                     f"The {pool} pool cannot answer this request within the {deadline_s:g} s "
                     f"deadline of class {class_name}; do not retry it.", final=True)


@dataclass(frozen=True)
class HttpReply:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def reply_for(rejection: Rejection) -> HttpReply:
    shape = _SHAPES[rejection.outcome]
    body = {
        "error": {
            "message": rejection.message,
            "type": shape.error_type,
            "param": rejection.param,
            "code": shape.code,
        }
    }
    headers = [("content-type", "application/json"), (OUTCOME, rejection.outcome.value)]
    if rejection.retry_after_s is not None:
        # whole seconds for every client; milliseconds for those that read them (the OpenAI SDKs)
        headers.append((RETRY_AFTER, str(max(1, math.ceil(rejection.retry_after_s)))))
        headers.append((RETRY_AFTER_MS, str(max(1, round(rejection.retry_after_s * 1000)))))
    if rejection.final:
        headers.append((SHOULD_RETRY, "false"))
    return HttpReply(shape.status, tuple(headers), json.dumps(body).encode())
