"""Engines discovered through DNS, without a socket: what an answer does to a name's addresses
and to a pool's engines (core/discovery.py), DNS messages read and written (core/dns_message.py),
the discovery loop with a resolver that answers as told, and the engine picker that follows it."""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.control.discovery import EngineDiscovery
from extproc.core.capacity import BackendReading, Placing
from extproc.core.config import ConfigError, parse_config
from extproc.core.discovery import (EMPTY, FAILED, OK, NameState, Resolution, answered, changes, dns_names, engines,
                                    nameserver_address)
from extproc.core.dns_message import (AAAA, NXDOMAIN, A, BadResponse, decode_response, encode_name, encode_query,
                                      qtype_for)
from extproc.core.pool_config import dns_backend
from extproc.envoy.config_check import check_envoy
from extproc.lifecycle.placement import BackendPicker
from extproc.lifecycle.slots import Slots
from extproc.ops.metrics import Metrics
from extproc.stores.local_queue import LocalQueueStore
from extproc_testbed.envoy_config import EnvoyLayout, render, template_path
from extproc_testbed.stack import metric_sum, parse_samples

from ..conftest import e2e_config

NAME = "vllm-primary.llm.svc.cluster.local"


# -- configuration ----------------------------------------------------------------------------------

def config_with(backends, pick_backend=True, **discovery):
    raw = e2e_config()
    raw["pools"]["primary"]["capacity"] = {"backends": backends, "pick_backend": pick_backend,
                                           "kv_tokens_per_backend": 1000}
    if discovery:
        raw["discovery"] = discovery
    return parse_config(raw)


def test_a_backend_may_be_a_dns_name_with_a_port_that_the_sidecar_picks_among():
    assert dns_backend(f"dns://{NAME}:8000") == (NAME, 8000)
    config = config_with([f"dns://{NAME}:8000", "http://10.0.0.9:8000"])
    assert config.pools["primary"].capacity.picks_backend
    assert config.discovery.interval_s == 5 and config.discovery.empty_after == 2
    assert config.discovery.nameserver is None and config.discovery.lookup_family == "V4_ONLY"
    for bad in (f"dns://{NAME}", f"dns://{NAME}:8000/v1", f"dns://{NAME}:8000?x=1", "dns://:8000", f"dns://u@{NAME}:1"):
        assert dns_backend(bad) is None
        with pytest.raises(ConfigError, match="dns://NAME:PORT"):
            config_with([bad], pick_backend=False)
    with pytest.raises(ConfigError, match="http://IP:PORT or dns://NAME:PORT"):
        config_with([f"http://{NAME}:8000"])


def test_the_nameserver_is_an_address_and_a_port():
    assert config_with([f"dns://{NAME}:8000"], nameserver="127.0.0.1:5353").discovery.nameserver == "127.0.0.1:5353"
    assert nameserver_address("[::1]:53") == ("::1", 53)
    for bad in ("127.0.0.1", "dns.example:53", "127.0.0.1:0", "127.0.0.1:70000", "::1:53x"):
        assert nameserver_address(bad) is None
        with pytest.raises(ConfigError, match="nameserver"):
            config_with([f"dns://{NAME}:8000"], nameserver=bad)


# -- what an answer does ----------------------------------------------------------------------------

def test_an_answer_keeps_the_usable_addresses_of_its_family_each_once_in_order():
    assert answered(["10.0.0.3", "10.0.0.1", "10.0.0.3", "fe80::1", "junk"]) == Resolution(("10.0.0.1", "10.0.0.3"))
    assert answered(["10.0.0.3", "fd00::2"], "V6_ONLY") == Resolution(("fd00::2",))
    assert answered([]).empty
    # an answer with addresses none of which is usable says nothing of the engines: a failure
    assert answered(["0.0.0.0", "224.0.0.1", "nonsense"]).failure is not None


def test_a_failure_keeps_the_known_addresses_and_only_repeated_empty_answers_empty_a_name():
    state = NameState()
    assert state.apply(Resolution(("10.0.0.1", "10.0.0.2")), empty_after=2) == OK
    assert state.apply(Resolution(failure="timeout"), 2) == FAILED
    assert state.addresses == ("10.0.0.1", "10.0.0.2") and state.failure == "timeout"
    assert state.apply(Resolution(), 2) == EMPTY  # once: may be a zone being rewritten
    assert state.addresses == ("10.0.0.1", "10.0.0.2") and state.failure is None
    assert state.apply(Resolution(("10.0.0.2",)), 2) == OK  # an answer starts the count over
    assert state.apply(Resolution(), 2) == EMPTY and state.addresses == ("10.0.0.2",)
    assert state.apply(Resolution(), 2) == EMPTY and state.addresses == ()  # twice in a row: no engine
    one = NameState(("10.0.0.1",))
    assert one.apply(Resolution(), empty_after=1) == EMPTY and one.addresses == ()


def test_a_pools_engines_are_its_listed_backends_and_what_its_names_stand_for():
    backends = ("http://10.0.0.9:8000", f"dns://{NAME}:8000", "dns://other:9000", f"dns://{NAME}:8001")
    assert dns_names(backends) == {NAME, "other"}
    known = {NAME: ("10.0.0.1", "10.0.0.9"), "other": ("fd00::1",)}
    assert engines(backends, known) == ("http://10.0.0.9:8000", "http://10.0.0.1:8000", "http://[fd00::1]:9000",
                                        "http://10.0.0.1:8001", "http://10.0.0.9:8001")
    assert engines(backends, {}) == ("http://10.0.0.9:8000",)
    assert changes(("a", "b", "c"), ("c", "d", "a")) == (("d",), ("b",))


# -- DNS messages -----------------------------------------------------------------------------------

def name_bytes(name: str) -> bytes:
    return encode_name(name)


def response(query_id: int, name: str, records: list[tuple[int, bytes]], rcode: int = 0, truncated: bool = False,
             compress: bool = True) -> bytes:
    """A server's response: the question, then `records` (type, data) for `name`."""
    flags = 0x8180 | rcode | (0x0200 if truncated else 0)
    out = struct.pack(">HHHHHH", query_id, flags, 1, len(records), 0, 0)
    out += name_bytes(name) + struct.pack(">HH", A, 1)
    owner = b"\xc0\x0c" if compress else name_bytes(name)  # a pointer to the question's name
    for rtype, data in records:
        out += owner + struct.pack(">HHIH", rtype, 1, 5, len(data)) + data
    return out


def a(address: str) -> tuple[int, bytes]:
    return (A if ipaddress.ip_address(address).version == 4 else AAAA), ipaddress.ip_address(address).packed


def test_a_query_asks_for_one_names_records_and_offers_a_large_udp_answer():
    query = encode_query(NAME, A, 0x1234)
    assert query[:12] == struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 1)
    assert query[12:].startswith(b"\x0cvllm-primary\x03llm\x03svc\x07cluster\x05local\x00\x00\x01\x00\x01")
    assert query.endswith(b"\x00\x00\x29\x10\x00\x00\x00\x00\x00\x00\x00")  # OPT: 4096 bytes
    assert encode_name("a.b.") == encode_name("a.b") and qtype_for("V6_ONLY") == AAAA
    for bad in ("", "a..b", "x" * 64 + ".com", ".".join(["abcdefgh"] * 40)):
        with pytest.raises(ValueError):
            encode_name(bad)


def test_a_response_gives_the_records_of_the_type_asked():
    cname = (5, name_bytes("target.example"))
    answer = decode_response(response(7, NAME, [cname, a("10.0.0.2"), a("10.0.0.1"), a("fd00::1")]), 7, A)
    assert answer.rcode == 0 and answer.addresses == ("10.0.0.2", "10.0.0.1") and not answer.truncated
    answer = decode_response(response(7, NAME, [a("fd00::1")], compress=False), 7, AAAA)
    assert answer.addresses == ("fd00::1",)
    assert decode_response(response(7, NAME, [], rcode=NXDOMAIN), 7, A).rcode == NXDOMAIN
    assert decode_response(response(7, NAME, [a("10.0.0.1")], truncated=True), 7, A).truncated


def test_a_response_to_another_query_or_broken_is_a_bad_response():
    good = response(7, NAME, [a("10.0.0.1")])
    cases = {
        "another id": (good, 8),
        "a query, not a response": (bytes([good[0], good[1], good[2] & 0x7F]) + good[3:], 7),
        "too short": (good[:11], 7),
        "cut in a record": (good[:-2], 7),
        "a pointer out of the message": (good[:-16] + b"\xc0", 7),
        "an A record of 5 bytes": (response(7, NAME, [(A, b"\x01\x02\x03\x04\x05")]), 7),
        "a reserved label type": (good[:12] + b"\x40" + good[13:], 7),
    }
    for what, (data, query_id) in cases.items():
        with pytest.raises(BadResponse):
            decode_response(data, query_id, A)
            pytest.fail(what)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2**16 - 1), st.sampled_from([A, AAAA]))
def test_no_garbage_raises_anything_but_a_bad_response(data, query_id, qtype):
    try:
        decode_response(data, query_id, qtype)
    except BadResponse:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=6))
def test_no_corrupted_response_raises_anything_but_a_bad_response(flips):
    data = bytearray(response(7, NAME, [a("10.0.0.1"), a("10.0.0.2"), (5, name_bytes("x.example"))]))
    for at, value in flips:
        if at < len(data):
            data[at] = value
    try:
        answer = decode_response(bytes(data), 7, A)
    except BadResponse:
        return
    assert all(ipaddress.ip_address(address).version == 4 for address in answer.addresses)


# -- the discovery loop, with a resolver that answers as told ----------------------------------------

class ToldResolver:
    """Answers each name with what it was told last (a Resolution, or an exception to raise)."""

    def __init__(self) -> None:
        self.answers: dict[str, Resolution | Exception] = {}
        self.asked: list[tuple[str, str, float]] = []

    async def resolve(self, name: str, family: str, timeout_s: float) -> Resolution:
        self.asked.append((name, family, timeout_s))
        answer = self.answers.get(name, Resolution())
        if isinstance(answer, Exception):
            raise answer
        return answer


class Steps:
    """The loop's sleep: each interval passes when the test says (`step`)."""

    def __init__(self) -> None:
        self.sleeping = asyncio.Event()
        self.intervals: list[float] = []
        self._wake: asyncio.Future | None = None

    async def sleep(self, seconds: float) -> None:
        self.intervals.append(seconds)
        self._wake = asyncio.get_running_loop().create_future()
        self.sleeping.set()
        await self._wake

    async def step(self) -> None:
        """Let one interval pass, and wait until the resolution after it is done."""
        await self.sleeping.wait()
        self.sleeping.clear()
        self._wake.set_result(None)
        await self.sleeping.wait()


def samples(metrics: Metrics) -> dict:
    return parse_samples(metrics.render().decode())


async def test_the_loop_resolves_every_interval_and_says_when_a_pools_engines_changed():
    config = config_with([f"dns://{NAME}:8000", "http://10.0.0.9:8000"], interval_s=3, timeout_s=0.5)
    resolver, steps, metrics = ToldResolver(), Steps(), Metrics()
    changed: list[tuple[str, ...]] = []
    discovery = EngineDiscovery(lambda: config, metrics, resolver, sleep=steps.sleep)

    async def on_change() -> None:
        changed.append(discovery.engines("primary"))

    discovery.on_change = on_change
    resolver.answers[NAME] = Resolution(("10.0.0.1",))
    await discovery.start()
    try:
        assert resolver.asked == [(NAME, "V4_ONLY", 0.5)]
        assert discovery.engines("primary") == ("http://10.0.0.1:8000", "http://10.0.0.9:8000")
        assert discovery.engines("fallback") == ()  # no backend listed: none
        resolver.answers[NAME] = Resolution(("10.0.0.1", "10.0.0.2"))
        await steps.step()
        assert steps.intervals[0] == 3
        assert changed == [("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.9:8000")]
        resolver.answers[NAME] = RuntimeError("a resolver's bug")  # a failure: nothing changes
        await steps.step()
        resolver.answers[NAME] = Resolution(failure="no answer within 0.5 s")
        await steps.step()
        assert len(changed) == 1 and len(discovery.engines("primary")) == 3
        resolver.answers[NAME] = Resolution()  # empty once: kept; twice: gone, the listed one stays
        await steps.step()
        assert len(changed) == 1
        await steps.step()
        assert changed[-1] == discovery.engines("primary") == ("http://10.0.0.9:8000",)
        seen = samples(metrics)
        assert metric_sum(seen, "extproc_discovered_engines", pool="primary") == 1
        assert {result: metric_sum(seen, "extproc_discovery_resolutions_total", host=NAME, result=result)
                for result in (OK, EMPTY, FAILED)} == {OK: 2, EMPTY: 2, FAILED: 2}
        assert metric_sum(seen, "extproc_discovered_engines", pool="fallback") == 0
    finally:
        await discovery.stop()


async def test_a_reload_that_lists_other_backends_is_followed_and_a_name_no_longer_listed_forgotten():
    configs = [config_with([f"dns://{NAME}:8000"])]
    resolver = ToldResolver()
    resolver.answers[NAME] = Resolution(("10.0.0.1",))
    resolver.answers["other"] = Resolution(("10.0.0.5",))
    now = [100.0]
    discovery = EngineDiscovery(lambda: configs[-1], Metrics(), resolver, clock=lambda: now[0])
    assert not discovery.changing("primary")
    assert await discovery.resolve() is True
    # Envoy resolves the name on a clock of its own: for two intervals it may not have the change
    assert discovery.changing("primary") and not discovery.changing("fallback")
    now[0] += 2 * 5
    assert not discovery.changing("primary")
    configs.append(config_with(["dns://other:9000"]))
    assert discovery.engines("primary") == ()  # listed, not resolved yet: no engine until it is
    assert await discovery.resolve() is True
    assert discovery.engines("primary") == ("http://10.0.0.5:9000",) and set(discovery.names) == {"other"}
    assert await discovery.resolve() is False


# -- the engine picker follows the engines ----------------------------------------------------------

class ToldEngines:
    """A pool's engines as the test says (as EngineDiscovery gives them)."""

    def __init__(self, *engines: str) -> None:
        self.known = [tuple(engines)]
        self.lately_changed = False

    def engines(self, pool: str) -> tuple[str, ...]:
        return self.known[-1]

    def changing(self, pool: str) -> bool:
        return self.lately_changed

    def draining(self, pool: str) -> frozenset[str]:
        return frozenset()


def test_an_engine_that_appears_is_picked_once_read_and_one_gone_is_never_picked_again():
    config = config_with([f"dns://{NAME}:8000"])
    told = ToldEngines("http://10.0.0.1:8000")
    known = told.known
    picker = BackendPicker(lambda: config, told)
    idle = BackendReading(0.0, 1000, saturated=False)
    picker.observe("primary", {"http://10.0.0.1:8000": idle})
    assert picker.pick("primary", "t1", Placing(100)) == "10.0.0.1:8000"
    known.append(("http://10.0.0.1:8000", "http://10.0.0.2:8000"))
    # not read yet: as if saturated, named last
    assert picker.pick("primary", "t2", Placing(100)) == "10.0.0.1:8000,10.0.0.2:8000"
    picker.observe("primary", {url: idle for url in known[-1]})
    assert picker.pick("primary", "t3", Placing(100)).startswith("10.0.0.2:8000")  # the least loaded
    known.append(("http://10.0.0.2:8000",))  # 10.0.0.1 went: never named again, before any poll
    assert picker.pick("primary", "t4", Placing(100)) == "10.0.0.2:8000"
    assert not picker.moved("t4", "10.0.0.1:8000")  # an answer from an engine gone is not counted there
    picker.release("t1")  # what ran there ends as it would
    assert picker.running("primary") == {"10.0.0.1:8000": (1, 100), "10.0.0.2:8000": (2, 200)}
    known.append(())
    assert picker.pick("primary", "t5", Placing(100)) is None  # no engine: Envoy's cluster has none either


def test_picks_envoy_could_not_follow_while_the_engines_change_say_nothing_of_whether_it_follows():
    """An engine just discovered may not be a host of Envoy's cluster yet (it resolves the name on
    a clock of its own): a request placed there runs elsewhere, and that is no sign that Envoy
    balances by a policy of its own."""
    config = config_with([f"dns://{NAME}:8000"])
    told = ToldEngines("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    picker = BackendPicker(lambda: config, told)
    metrics = Metrics()
    slots = Slots(LocalQueueStore({"primary": 8, "fallback": 4}), metrics, picker)
    told.lately_changed = True
    for i in range(60):  # named 10.0.0.2 first; Envoy, without it yet, ran them on 10.0.0.1
        slots.ran_on(placed(f"a{i}", "10.0.0.2:8000,10.0.0.1:8000"), "10.0.0.1:8000")
    assert slots.picks_followed("primary") is None  # nothing known either way
    assert metric_sum(samples(metrics), "extproc_engine_picks_total", pool="primary", followed="false") == 60
    for i in range(60):  # Envoy has it now, and follows
        slots.ran_on(placed(f"b{i}", "10.0.0.2:8000,10.0.0.1:8000"), "10.0.0.2:8000")
    assert slots.picks_followed("primary") is True
    told.lately_changed = False  # settled: a pick not followed counts again
    for i in range(60):
        slots.ran_on(placed(f"c{i}", "10.0.0.2:8000,10.0.0.1:8000"), "10.0.0.1:8000")
    assert slots.picks_followed("primary") is False


def placed(ticket_id: str, endpoints: str) -> SimpleNamespace:
    """An exchange the sidecar placed (what Slots.ran_on reads of it)."""
    lease = SimpleNamespace(pool="primary", ticket=SimpleNamespace(id=ticket_id))
    return SimpleNamespace(lease=lease, endpoints=endpoints)


# -- Envoy's cluster resolves the same names (extproc check-config --envoy) --------------------------

def envoy_template() -> dict:
    return yaml.safe_load(template_path().read_text())


def primary_cluster(envoy: dict) -> dict:
    return next(c for c in envoy["static_resources"]["clusters"] if c["name"] == "vllm_primary")


def test_the_check_finds_a_discovered_pool_whose_cluster_does_not_resolve_its_names():
    # the template's vllm_primary resolves vllm-primary on port 8000, as STRICT_DNS
    assert check_envoy(envoy_template(), config_with(["dns://vllm-primary:8000"])) == []
    findings = check_envoy(envoy_template(), config_with(["dns://vllm-0:8000", "dns://vllm-primary:9000"]))
    assert [f.where for f in findings] == ["clusters[vllm_primary].load_assignment"] * 2
    assert "vllm-0:8000" in findings[0].what and "vllm-primary:9000" in findings[1].what
    for kind in ("STATIC", "LOGICAL_DNS"):  # LOGICAL_DNS: the first address alone is a host
        envoy = envoy_template()
        primary_cluster(envoy)["type"] = kind
        assert [f.where for f in check_envoy(envoy, config_with(["dns://vllm-primary:8000"]))] == [
            "clusters[vllm_primary].load_assignment"]
    findings = check_envoy(envoy_template(), config_with(["dns://vllm-primary:8000"], lookup_family="V6_ONLY"))
    assert [f.where for f in findings] == ["clusters[vllm_primary].dns_lookup_family"]
    # the same cluster as the DNS cluster extension (where Envoy takes a refresh rate)
    layout = EnvoyLayout(listen=("127.0.0.1", 1), admin=("127.0.0.1", 2), extproc=[("127.0.0.1", 3)],
                         clusters={"vllm_primary": [("engines.svc.test", 8000)]}, nameserver=("127.0.0.1", 53),
                         dns_refresh_s=1)
    rendered = render(envoy_template(), layout)
    assert "type" not in primary_cluster(rendered)
    assert check_envoy(rendered, config_with(["dns://engines.svc.test:8000"])) == []
    assert check_envoy(rendered, config_with(["dns://engines.svc.test:8000"], lookup_family="V6_ONLY")) != []
