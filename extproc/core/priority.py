"""Who is calling, what they claim, and the priority they get: pure functions over headers.

A score is `class base + adjustment`; lower is served first. The adjustment comes from the
urgency, VIP and bulk claims, each first bounded by the caller's rights, and is clamped to
+/- `priority.max_adjustment`, which config validation keeps below half the gap between class
bases, so no claim moves a request across a class boundary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from .config import CallerRights, Config
from .headers import BRANCH_ID, BULK, CLAIM_HEADERS, TICKET_TYPE, URGENT_LEVEL, VIP_LEVEL
from .outcomes import bad_header, unauthenticated

_MAX_LEVEL = 100
_TRUE = {"1", "true", "yes"}
_FALSE = {"", "0", "false", "no"}


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str  # "anonymous" when no known key was presented
    branch_id: str | None
    rights: CallerRights


@dataclass(frozen=True)
class Claim:
    """What the request says about itself, parsed but not yet trusted."""

    ticket_type: str | None
    urgent_level: int
    vip_level: int
    bulk: bool
    branch_id: str | None


@dataclass(frozen=True, slots=True)
class Classification:
    class_name: str
    score: float
    branch_id: str
    tenant: str
    lowered: tuple[str, ...]  # which claims were cut down to the caller's rights


def _bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Callers:
    """Who may call, built once from the config: a key's SHA-256 digest -> its tenant.

    Looking the digest up in a dict leaks nothing an attacker could use: the digest of a guess
    is not the secret, and a key that matches no tenant costs the same as one that does."""

    def __init__(self, config: Config):
        self.config = config
        self._by_digest = {
            digest: Caller(tenant.name, tenant.branch_id, tenant)
            for tenant in config.tenants for digest in tenant.api_key_sha256
        }
        self._anonymous = Caller("anonymous", None, config.anonymous)

    def identify(self, authorization: str | None) -> Caller:
        """Resolve the caller from its bearer token; raise 401 when auth is required and unknown."""
        token = _bearer_token(authorization)
        if token is not None:
            caller = self._by_digest.get(hashlib.sha256(token.encode()).hexdigest())
            if caller is not None:
                return caller
        if self.config.auth == "required":
            raise unauthenticated(key_given=token is not None)
        return self._anonymous


def identify(authorization: str | None, config: Config) -> Caller:
    """`Callers(config).identify(authorization)`, for one-off use."""
    return Callers(config).identify(authorization)


def _level(headers: Mapping[str, str], name: str) -> int:
    raw = headers.get(name, "").strip()
    if raw == "":
        return 0
    if not raw.isdigit() or int(raw) > _MAX_LEVEL:
        raise bad_header(name, f"an integer between 0 and {_MAX_LEVEL}", raw)
    return int(raw)


def parse_claim(headers: Mapping[str, str]) -> Claim:
    """Read the priority headers (lower-case names); malformed values are a 400."""
    bulk_raw = headers.get(BULK, "").strip().lower()
    if bulk_raw not in _TRUE | _FALSE:
        raise bad_header(BULK, "true or false", bulk_raw)
    ticket_type = headers.get(TICKET_TYPE, "").strip() or None
    branch_id = headers.get(BRANCH_ID, "").strip()[:64] or None
    return Claim(
        ticket_type=ticket_type,
        urgent_level=_level(headers, URGENT_LEVEL),
        vip_level=_level(headers, VIP_LEVEL),
        bulk=bulk_raw in _TRUE,
        branch_id=branch_id,
    )


def _allowed_class(claimed: str, rights: CallerRights, config: Config) -> str:
    """The claimed class if the caller may claim it, else the nearest class it may claim that
    is not served earlier; failing that, the latest-served class it may claim."""
    if rights.may_claim(claimed):
        return claimed
    claimed_base = config.classes[claimed].base
    allowed = sorted(
        (policy.base, name) for name, policy in config.classes.items() if rights.may_claim(name)
    )
    if not allowed:  # validation keeps this from happening; be safe anyway
        return config.default_class
    for base, name in allowed:
        if base >= claimed_base:
            return name
    return allowed[-1][1]


def classify(claim: Claim, caller: Caller, config: Config) -> Classification:
    lowered: list[str] = []
    class_name = claim.ticket_type if claim.ticket_type in config.classes else config.default_class
    permitted = _allowed_class(class_name, caller.rights, config)
    if permitted != class_name:
        lowered.append("ticket_type")
        class_name = permitted

    urgent = claim.urgent_level
    if urgent > caller.rights.max_urgent_level:
        urgent = caller.rights.max_urgent_level
        lowered.append("urgent_level")
    vip = claim.vip_level
    if vip > caller.rights.max_vip_level:
        vip = caller.rights.max_vip_level
        lowered.append("vip_level")

    factors = config.priority
    adjustment = (
        -factors.urgent_per_level * urgent
        - factors.vip_per_level * vip
        + (factors.bulk_penalty if claim.bulk else 0.0)
    )
    limit = factors.max_adjustment
    adjustment = max(-limit, min(limit, adjustment))
    score = round(config.classes[class_name].base + adjustment, 6)
    branch_id = caller.branch_id or claim.branch_id or "unknown"
    return Classification(class_name, score, branch_id, caller.tenant, tuple(lowered))


class Classifier:
    """`classify(parse_claim(headers), caller, config)`, remembered: the same caller making the
    same claims (most requests) gets the same classification without working it out again."""

    def __init__(self, config: Config, size: int = 4096):
        self.config = config
        self.size = size
        self._known: dict[tuple, Classification] = {}

    def classify(self, headers: Mapping[str, str], caller: Caller) -> Classification:
        key = (caller.tenant, *map(headers.get, CLAIM_HEADERS))
        known = self._known.get(key)
        if known is None:
            known = classify(parse_claim(headers), caller, self.config)  # a malformed claim raises 400
            if len(self._known) >= self.size:
                self._known.clear()
            self._known[key] = known
        return known
