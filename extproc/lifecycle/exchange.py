"""One request's state through its life, and what the gate answers at each step of it.

An `Exchange` is lifecycle state only: who asked, what, where it was routed, the slot it waits
for or holds, and how it ended. What a feature needs of it is grouped apart: the attempt
ledger's name for it (`Attempt`) and its failover (`FailoverState`). Protocol state stays in the
servicer.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..core.admission import Ticket
from ..core.config import Config
from ..core.headers import IDEMPOTENCY_KEY, RETRY_HEADERS
from ..core.openai_request import CompletionRequest
from ..core.outcomes import Outcome
from ..core.priority import Caller, Classification
from ..core.request_life import Phase
from ..core.retries import attempt_key, counts_its_attempts, declared_retry
from ..core.routing import Route
from ..stores.queue import Lease, Waiter


@dataclass(slots=True)
class Attempt:
    """The client's name for the request and what the attempt ledger knows of it (core/retries.py)."""

    key: str | None = None  # idempotency-key, or a client-sent x-request-id
    declared_retry: bool = False  # the client says it is retrying (x-stainless-retry-count)
    counted: bool = False  # the client numbers its attempts (x-stainless-retry-count, 0 first)
    # Named by x-request-id alone: a trace id, which a caller may pass on to each request it
    # makes for one of its own, so it names a request together with its body.
    traced: bool = False
    # The ledger's name for it: its key, or its body when it only counts its attempts, within its
    # caller and branch (`named_key`, `body_key`); also its name in the appointment book.
    ledger_key: str | None = None
    soft: bool = False  # named by its body: recognised when it comes back, never refused for its name
    begun: bool = False  # the ledger holds this key as running: it is finished when the exchange ends
    age_s: float = 0.0  # since its first attempt (0: this is the first, or a copy of one still running)
    number: int = 1  # which of its attempts this is, as the ledger counts them

    @property
    def returning(self) -> bool:
        """A later attempt of a request the ledger already knew (by its name, or its body and count)."""
        return self.age_s > 0


RETRY_HEADERS_SET = frozenset(RETRY_HEADERS)


def attempt_of(headers: Mapping[str, str]) -> Attempt:
    """What the request's headers say of its attempts (most name nothing and count nothing)."""
    if RETRY_HEADERS_SET.isdisjoint(headers):
        return Attempt()
    key = attempt_key(headers)
    return Attempt(key, declared_retry(headers), counts_its_attempts(headers),
                   traced=key is not None and IDEMPOTENCY_KEY not in headers)


@dataclass(slots=True)
class FailoverState:
    """A failed attempt answered from the fallback pool instead (failover.py)."""

    failed_in: str | None = None  # the pool whose upstream failed this request
    tried: bool = False  # at most once per request


@dataclass(slots=True)
class Exchange:
    id: str
    caller: Caller
    classification: Classification
    arrived_at: float
    # The configuration in force when its headers arrived: every decision on it reads this one,
    # whatever a reload puts in force meanwhile (ops/reload.py).
    config: Config = field(kw_only=True, repr=False)
    path: str = "/v1/chat/completions"
    method: str | None = None  # as Envoy sent it (None: not forwarded)
    attempt: Attempt = field(default_factory=Attempt)
    request: CompletionRequest | None = None
    cost: int | None = None  # tokens the request holds while admitted (prompt + max_tokens, each sequence: request_cost)
    prompt_tokens: int = 0  # its prompts' tokens, estimated (what its engine prefills)
    route: Route | None = None
    waiter: Waiter | None = None  # in line: from `enqueue` until `wait` has an answer
    lease: Lease | None = None
    may_wait_s: float = 0.0  # how long it may wait in line (its class's wait, within its deadline)
    forecast_wait_s: float | None = None  # its wait in line as forecast when it arrived
    queue_wait_s: float = 0.0
    admitted_at: float = 0.0
    endpoints: str | None = None  # the backends Envoy is told to try, best first (pools that pick)
    upstream_status: int | None = None
    # Where it is in its life, and how it ended: changed by the gate's driver alone, as the
    # request's state machine says (core/request_life.py).
    phase: Phase = Phase.ARRIVED
    outcome: Outcome | None = None
    decision: dict | None = None  # its decision record (decisions.py), sent to Envoy and logged
    failover: FailoverState = field(default_factory=FailoverState)
    shadowed: bool = False  # a copy runs on the fallback pool (shadow.py)
    yielded: bool = False  # admitted, it gave its engine up (yielding.py): set by the driver with the phase
    # The client's Authorization header, as Envoy passes it upstream: the requests the sidecar
    # sends itself (failover, shadow) carry it too. Never logged or recorded.
    authorization: str | None = field(default=None, repr=False)
    # Read on every step of the request path: kept as plain fields, not looked up each time.
    pool: str | None = field(default=None, init=False)  # route.pool (route_to sets both)
    class_name: str = field(default="", init=False)  # classification.class_name

    def __post_init__(self) -> None:
        self.class_name = self.classification.class_name

    def route_to(self, route: Route) -> None:
        self.route = route
        self.pool = route.pool


@dataclass(frozen=True, slots=True)
class Admission:
    """What to tell Envoy when a request is admitted."""

    set_headers: tuple[tuple[str, str], ...]
    body: bytes | None  # a rewritten body, or None to pass the original
    endpoints: str | None = None  # the backends to try, best first (pools that pick them)


@dataclass(frozen=True, slots=True)
class ResponsePlan:
    """What to do with the response headers of an admitted request."""

    set_headers: tuple[tuple[str, str], ...]
    fail_over: bool = False  # a failure the client has not seen: answer from the fallback pool
    read_body: bool = False  # a shadowed non-streamed request: its tokens are compared
    # The backend is done: a non-streamed answer comes whole once generation ended, so its
    # slot is released now and the ext_proc stream let go; a stream holds both to its end.
    finished: bool = True


class Tickets:
    """Exchange ids and the tickets they wait with, unique across every replica sharing a
    queue (process ids repeat across hosts: each gate draws a random prefix)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._prefix = f"{uuid.uuid4().hex[:12]}-"

    def exchange_id(self) -> str:
        return f"{self._prefix}{next(self._ids)}"

    def ticket(self, config: Config, exchange: Exchange, pool: str, score: float, cost: int,
               purpose: str | None = None) -> Ticket:
        """The exchange's ticket for `pool`; a `purpose` (failover, shadow) makes it a ticket of
        its own, never held to the latency cap's exemption."""
        class_name = exchange.class_name
        return Ticket(
            score=score,
            seq=next(self._ids),
            id=exchange.id if purpose is None else f"{exchange.id}-{purpose}",
            class_name=purpose or class_name,
            branch_id=exchange.classification.branch_id,
            cost=cost,
            long=cost > config.pools[pool].capacity.long_request_tokens,
            bounded=purpose is None and config.classes[class_name].latency_target_s is not None,
            waited_s=exchange.attempt.age_s if purpose is None else 0.0,
        )


def body_changes(config: Config, exchange: Exchange, chosen: Route, **extra: object) -> dict[str, object]:
    """What the body sent to `chosen` changes: the pool's paired model, the priority vLLM
    orders its own line by (`queue.engine_priority`, lower first), and `max_tokens` where the
    client of a chat or completion set no bound: the engine would run to the end of the
    context, and stops instead where the request was costed (`requests.default_max_tokens`).
    Another API's body (/v1/embeddings, /tokenize) gets none: the field is not one of its own."""
    assert exchange.request is not None
    changes: dict[str, object] = dict(extra)
    if exchange.request.needs_bound:
        changes["max_tokens"] = config.requests.default_max_tokens
    if chosen.model is not None and exchange.request.model != chosen.model:
        changes["model"] = chosen.model
    if config.queue.engine_priority:
        changes["priority"] = round(exchange.classification.score * 100)
    return changes


def remaining_wait(exchange: Exchange, now: float) -> float:
    """What is left of the exchange's wait in line (`may_wait_s`, from its arrival)."""
    return exchange.may_wait_s - (now - exchange.arrived_at)
