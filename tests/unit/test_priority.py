"""Classification and identity: pure functions, no I/O."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.config import ConfigError, load_config, parse_config
from extproc.core.outcomes import Outcome, Rejection
from extproc.core.priority import Claim, classify, identify, parse_claim
from extproc_testbed.demo import demo_config

SHIPPED = load_config()  # the embedded defaults: loan 0, complaint 1, archive 2; no tenants
CONFIG = parse_config(demo_config(), "demo")  # the same, with the demo's sample tenants


def claim(ticket_type=None, urgent=0, vip=0, bulk=False, branch=None) -> Claim:
    return Claim(ticket_type, urgent, vip, bulk, branch)


OFFICER = identify("Bearer sk-demo-loans-0001", CONFIG)  # urgent <= 3, vip <= 3, all types
SERVICE = identify("Bearer sk-demo-service-0002", CONFIG)  # complaint/archive, urgent <= 1, vip <= 2
ANONYMOUS = identify(None, CONFIG)


def test_seed_bases_and_factors():
    assert classify(claim("loan_approval"), OFFICER, CONFIG).score == 0
    assert classify(claim("complaint"), OFFICER, CONFIG).score == 1
    assert classify(claim("archive_query"), OFFICER, CONFIG).score == 2
    assert classify(claim("loan_approval", urgent=2), OFFICER, CONFIG).score == pytest.approx(-0.2)
    assert classify(claim("complaint", vip=2), OFFICER, CONFIG).score == pytest.approx(0.9)
    assert classify(claim("archive_query", bulk=True), OFFICER, CONFIG).score == pytest.approx(2.2)


def test_unknown_or_missing_type_gets_the_default_class():
    assert classify(claim(None), OFFICER, CONFIG).class_name == "archive_query"
    assert classify(claim("lottery"), OFFICER, CONFIG).class_name == "archive_query"


def test_boost_never_crosses_a_class_boundary():
    boosted = classify(claim("complaint", urgent=3, vip=3), OFFICER, CONFIG)
    slowest_loan = classify(claim("loan_approval", bulk=True), OFFICER, CONFIG)
    assert slowest_loan.score < boosted.score < 1
    assert boosted.score == pytest.approx(1 - 0.45)  # 0.3 + 0.15 clamped to max_adjustment


@given(
    st.sampled_from(["loan_approval", "complaint", "archive_query"]),
    st.sampled_from(["loan_approval", "complaint", "archive_query"]),
    st.integers(0, 100), st.integers(0, 100), st.booleans(), st.integers(0, 100), st.integers(0, 100), st.booleans(),
)
def test_class_order_holds_whatever_the_claims(a, b, ua, va, ba, ub, vb, bb):
    sa = classify(claim(a, ua, va, ba), OFFICER, CONFIG)
    sb = classify(claim(b, ub, vb, bb), OFFICER, CONFIG)
    if CONFIG.classes[a].base < CONFIG.classes[b].base:
        assert sa.score < sb.score


def test_claims_beyond_rights_are_lowered_and_reported():
    spoofed = classify(claim("complaint", urgent=3, vip=3), ANONYMOUS, CONFIG)
    assert spoofed.score == 2 and set(spoofed.lowered) == {"ticket_type", "urgent_level", "vip_level"}
    partial = classify(claim("complaint", urgent=3, vip=1), SERVICE, CONFIG)
    assert partial.score == pytest.approx(1 - 0.1 - 0.05) and partial.lowered == ("urgent_level",)
    loan = classify(claim("loan_approval"), SERVICE, CONFIG)
    assert loan.class_name == "complaint" and loan.lowered == ("ticket_type",)


def test_anonymous_callers_get_the_class_served_last_and_no_boosts():
    """A tenant barred from loans must not get them by dropping its key: by default a caller
    without a known key may claim only the class served last, with no urgency or VIP."""
    assert SHIPPED.tenants == () and SHIPPED.anonymous.ticket_types == ("archive_query",)
    for config in (SHIPPED, CONFIG):
        anonymous = identify(None, config)
        for ticket_type in ("loan_approval", "complaint", "archive_query"):
            c = classify(claim(ticket_type, urgent=3, vip=3, branch="0002"), anonymous, config)
            assert c.class_name == "archive_query" and c.score == 2
    # A configuration that says nothing of anonymous callers gets the same: its class served last.
    bare = parse_config(_config(), "test.yaml")
    assert bare.anonymous.ticket_types == ("b",)
    assert bare.anonymous.max_urgent_level == bare.anonymous.max_vip_level == 0
    assert classify(claim("a", urgent=3), identify(None, bare), bare).class_name == "b"
    # nor one that sets only the boosts
    partial = parse_config(_config(anonymous={"max_urgent_level": 1}), "test.yaml")
    assert partial.anonymous.ticket_types == ("b",) and partial.anonymous.max_urgent_level == 1
    assert parse_config(_config(anonymous={}), "test.yaml").anonymous.ticket_types == ("b",)
    # and one that trusts every caller says so
    trusting = parse_config(_config(anonymous={"ticket_types": "*"}), "test.yaml")
    assert classify(claim("a"), identify(None, trusting), trusting).class_name == "a"


def test_a_key_pasted_where_its_digest_belongs_is_not_printed():
    key = "sk-live-0123456789abcdef"
    with pytest.raises(ConfigError) as error:
        parse_config(_config(tenants=[{"name": "t", "api_key_sha256": [key]}]), "test.yaml")
    assert "tenants.0: api_key_sha256 entry 0 is not a SHA-256 digest" in str(error.value)
    assert key not in str(error.value) and "0123456789abcdef" not in str(error.value)


def test_tenant_branch_wins_over_header_branch():
    assert classify(claim(branch="9999"), OFFICER, CONFIG).branch_id == "0001"
    assert classify(claim(branch="9999"), ANONYMOUS, CONFIG).branch_id == "9999"
    assert classify(claim(), ANONYMOUS, CONFIG).branch_id == "unknown"


def test_identify_by_hashed_key_and_required_auth():
    assert OFFICER.tenant == "branch-0001-loans"
    assert identify("bearer sk-demo-loans-0001", CONFIG).tenant == "branch-0001-loans"
    assert identify("Bearer wrong", CONFIG).tenant == "anonymous"
    assert identify("Basic abc", CONFIG).tenant == "anonymous"
    required = CONFIG.model_copy(update={"auth": "required"})
    with pytest.raises(Rejection) as missing:
        identify(None, required)
    assert missing.value.outcome is Outcome.REJECTED_UNAUTHENTICATED
    with pytest.raises(Rejection):
        identify("Bearer wrong", required)
    assert identify("Bearer sk-demo-loans-0001", required).tenant == "branch-0001-loans"


@pytest.mark.parametrize(
    "headers",
    [{"x-urgent-level": "high"}, {"x-vip-level": "-1"}, {"x-urgent-level": "101"}, {"x-bulk": "maybe"}],
)
def test_malformed_priority_headers_are_a_400(headers):
    with pytest.raises(Rejection) as error:
        parse_claim(headers)
    assert error.value.outcome is Outcome.REJECTED_BAD_REQUEST


def test_parse_claim_reads_every_header():
    parsed = parse_claim({"x-ticket-type": " complaint ", "x-urgent-level": "2", "x-vip-level": "1",
                          "x-bulk": "TRUE", "x-branch-id": "0042"})
    assert parsed == Claim("complaint", 2, 1, True, "0042")


def _config(**changes) -> dict:
    base = {
        "classes": {"a": {"base": 0}, "b": {"base": 1}},
        "default_class": "a",
        "pools": {"p": {"cluster": "c", "max_inflight": 2}},
        "default_pool": "p",
    }
    base.update(changes)
    return base


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"default_class": "z"}, "default_class"),
        ({"priority": {"max_adjustment": 0.5}}, "max_adjustment"),
        ({"pools": {"p": {"cluster": "c", "max_inflight": 0}}}, "pools.p.max_inflight"),
        ({"pools": {"p": {"cluster": "c", "max_inflight": 1, "fallback": "q"}}}, "fallback"),
        ({"pools": {"p": {"cluster": "c", "max_inflight": 1, "tiers": {"yellow": 60, "orange": 50}}}}, "tiers"),
        ({"tenants": [{"name": "t", "api_key_sha256": ["nothex"]}]}, "api_key_sha256"),
        ({"tenants": [{"name": "t", "api_key_sha256": [hashlib.sha256(b"k").hexdigest()], "ticket_types": ["x"]}]},
         "tenants.0.ticket_types"),
        ({"auth": "sometimes"}, "auth"),
        ({"surprise": 1}, "surprise"),
        ({"pools": {"p": {"cluster": "c", "max_inflight": 1,
                          "capacity": {"pick_backend": True, "backends": ["http://vllm-0:8000"]}}}},
         "pools.p.capacity"),  # Envoy's override_host takes IP:PORT, not names
    ],
)
def test_config_errors_name_the_key(changes, key):
    with pytest.raises(ConfigError) as error:
        parse_config(_config(**changes), "test.yaml")
    assert key in str(error.value)
