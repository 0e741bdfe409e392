"""Client retries, pure: which request is a retry, whether it may run, and when refused
clients should come back. No I/O; time is passed in.

Theory of operation
-------------------
A request names itself with `idempotency-key` (or, failing that, a client-sent `x-request-id`).
A client that only numbers its attempts (`x-stainless-retry-count`, 0 first, as the OpenAI SDKs
send) is named by its body. Either name belongs to its caller and branch (`named_key`,
`body_key`): two tenants using the same key never meet. The attempt ledger remembers each name,
and the request it was given to (`request_digest`: path and body), for `retries.window_s`
after it was last seen:

- a name whose previous attempt is still waiting or running is refused (409): a retry never
  runs beside the request it repeats;
- a name given to another request (a different body) is refused (422): a retry repeats its
  request exactly, and a key cannot lend a new request the place of an old one;
- a name that already made `max_attempts` attempts is refused (429);
- otherwise the attempt runs, and if the previous one failed in some pool, routing prefers the
  other pool (see routing.py).

A body is no proof of identity (two callers of a branch may send the same text), so a name seen
only through the body is never refused, and only a declared retry (a count above 0) is one: a
count of 0 starts the name afresh (`fresh`), whatever was seen before, so its own retries find
it. Only a retry whose earlier attempt has ended comes back (keeps its place, see
appointments.py); a copy sent while the first still waits or runs gains nothing.

Every retry (a known name, or `x-stainless-retry-count` above 0) also spends from its branch's
retry budget: within `budget_window_s` a branch may retry at most
`max(budget_min, budget_ratio x its first attempts)` times (429 beyond), so a storm of retries
cannot multiply the load a branch puts on the pool.

`retry-after` is the time the pool needs to drain its line at the rate it is draining now
(appointments.DrainMeter; at least the configured floor), spread by +/- `jitter` so 200
refused branches do not all come back in the same second, and never more than `max`.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from .config import Retries, RetryAfter
from .headers import IDEMPOTENCY_KEY, REQUEST_ID, SDK_RETRY_COUNT
from .outcomes import bad_idempotency_key

_MAX_KEY_LENGTH = 256


def attempt_key(headers: Mapping[str, str]) -> str | None:
    """The name a client gives its request, if any (raises 400 for an absurd one)."""
    key = (headers.get(IDEMPOTENCY_KEY) or headers.get(REQUEST_ID) or "").strip()
    if not key:
        return None
    if len(key) > _MAX_KEY_LENGTH or not key.isprintable():
        raise bad_idempotency_key(_MAX_KEY_LENGTH)
    return key


def declared_retry(headers: Mapping[str, str]) -> bool:
    count = headers.get(SDK_RETRY_COUNT, "").strip()
    return count.isdigit() and int(count) > 0


def counts_its_attempts(headers: Mapping[str, str]) -> bool:
    """The client numbers its attempts (the OpenAI SDKs send `x-stainless-retry-count`, 0 first)."""
    return headers.get(SDK_RETRY_COUNT, "").strip().isdigit()


def request_digest(path: str, body: bytes) -> str:
    """What a name is given to: the request's path and body."""
    return hashlib.sha256(b"\0".join((path.encode(), body))).hexdigest()[:32]


def _scoped(kind: str, tenant: str, branch: str, name: str) -> str:
    digest = hashlib.sha256(b"\0".join((tenant.encode(), branch.encode(), name.encode()))).hexdigest()
    return f"{kind}:{digest[:32]}"


def named_key(tenant: str, branch: str, key: str) -> str:
    """The ledger's name for a request the client named: its key, within its caller and branch."""
    return _scoped("key", tenant, branch, key)


def body_key(tenant: str, branch: str, digest: str) -> str:
    """The ledger's name for a request that names itself only by counting its attempts: the same
    caller, branch and request (`request_digest`: what the OpenAI SDKs send again when they retry)."""
    return _scoped("body", tenant, branch, digest)


class Verdict(enum.Enum):
    FIRST = "first"
    RETRY = "retry"
    IN_PROGRESS = "in_progress"
    OTHER_REQUEST = "other_request"  # the name was given to another request (another body)
    TOO_MANY = "too_many"


@dataclass(frozen=True)
class AttemptStart:
    verdict: Verdict
    attempt: int = 1
    failed_in: str | None = None  # the pool where the previous attempt failed
    age_s: float = 0.0  # since the first attempt (0 for the first)


@dataclass
class _Entry:
    attempts: int
    running_until: float  # 0 when no attempt runs
    failed_in: str | None
    seen: float
    first: float  # when the first attempt began
    digest: str  # the request the name was given to ("": not known)


class AttemptLedger:
    """The attempts of named requests in this process (a shared store keeps its own copy with
    the same rules; see stores/redis_control.py). A running attempt is marked for `lease_s`,
    renewed while it runs, so a replica that dies does not block its clients' retries for long."""

    def __init__(self, settings: Retries, lease_s: float = 10.0):
        self.settings = settings
        self.lease_s = lease_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def _evict(self, now: float) -> None:
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if now - entry.seen < self.settings.window_s:
                break
            del self._entries[key]

    def begin(self, key: str, now: float, digest: str = "", fresh: bool = False) -> AttemptStart:
        """An attempt of the request named `key` (the request itself: `digest`) begins; `fresh`:
        its client says it is a first attempt, and the name starts over whatever it held."""
        self._evict(now)
        entry = self._entries.get(key)
        if entry is None or fresh:
            self._entries[key] = _Entry(1, now + self.lease_s, None, now, now, digest)
            self._entries.move_to_end(key)
            return AttemptStart(Verdict.FIRST)
        if digest and entry.digest and digest != entry.digest:
            return AttemptStart(Verdict.OTHER_REQUEST, entry.attempts)
        age = now - entry.first
        if entry.running_until > now:
            return AttemptStart(Verdict.IN_PROGRESS, entry.attempts, entry.failed_in, age)
        if entry.attempts >= self.settings.max_attempts:
            return AttemptStart(Verdict.TOO_MANY, entry.attempts, entry.failed_in, age)
        entry.attempts += 1
        entry.running_until = now + self.lease_s
        entry.seen = now
        self._entries.move_to_end(key)
        return AttemptStart(Verdict.RETRY, entry.attempts, entry.failed_in, age)

    def renew(self, keys: list[str], now: float) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.running_until:
                entry.running_until = now + self.lease_s

    def finish(self, key: str, failed_in: str | None, now: float) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.running_until = 0.0
        entry.failed_in = failed_in
        entry.seen = now
        self._entries.move_to_end(key)


class RetryBudget:
    """Per caller and branch: retries within `budget_window_s` at most max(budget_min, ratio x firsts).
    Kept by each replica for the requests it sees (like Envoy's and Finagle's retry budgets)."""

    def __init__(self, settings: Retries):
        self.settings = settings
        self._events: dict[Hashable, deque[tuple[float, bool]]] = {}

    def allow(self, who: Hashable, is_retry: bool, now: float) -> bool:
        events = self._events.setdefault(who, deque())
        horizon = now - self.settings.budget_window_s
        while events and events[0][0] <= horizon:
            events.popleft()
        if is_retry:
            retries = sum(1 for _, retry in events if retry)
            firsts = len(events) - retries
            if retries >= max(self.settings.budget_min, self.settings.budget_ratio * firsts):
                return False
        events.append((now, is_retry))
        if len(self._events) > 4 * 1024:  # spoofed branch ids must not grow this without bound
            self._events = {b: e for b, e in self._events.items() if e and e[-1][0] > horizon}
        return True


def retry_after_s(floor_s: int, drain_s: float | None, settings: RetryAfter, rng: random.Random) -> int:
    """Whole seconds to tell a refused client: the drain time (at least `floor_s`), spread
    uniformly by +/- `settings.jitter`, never below 1 nor above `settings.max`."""
    base = float(floor_s) if drain_s is None else max(float(floor_s), drain_s)
    # the spread's top at `max`, not past it: values above it would all read `max`, a herd
    base = min(base, settings.max / (1 + settings.jitter))
    spread = base * settings.jitter
    return min(settings.max, max(1, math.ceil(rng.uniform(base - spread, base + spread))))
