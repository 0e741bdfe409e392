"""Every way a request's admission can end, and the one place that turns an ending into an
HTTP status, headers and an OpenAI-style error body."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass

from .headers import OUTCOME, RETRY_AFTER, RETRY_AFTER_MS, SHOULD_RETRY


class Outcome(enum.Enum):
    """Low-cardinality label for how an admission decision ended (also a metric label)."""

    ADMITTED = "admitted"
    PASSED_THROUGH = "passed_through"  # no body to admit (e.g. GET /v1/models)
    REJECTED_UNAUTHENTICATED = "rejected_unauthenticated"
    REJECTED_BAD_REQUEST = "rejected_bad_request"
    REJECTED_TOO_LARGE = "rejected_too_large"
    REJECTED_CONTEXT_LENGTH = "rejected_context_length"
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
    Outcome.INTERNAL_ERROR: _ErrorShape(500, "server_error", "internal_error"),
}


class Rejection(Exception):
    """Raised by the decision path when a request must be answered instead of admitted."""

    def __init__(self, outcome: Outcome, message: str, retry_after_s: float | None = None, final: bool = False):
        """`retry_after_s`: when to come back (an appointment, or a floor); `final`: do not."""
        if outcome not in _SHAPES:
            raise ValueError(f"{outcome} is not a rejection")
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.retry_after_s = retry_after_s
        self.final = final


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
            "param": None,
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
