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
from extproc.core.dns_message import (AAAA, NXDOMAIN, A, BadResponse, NotTheAnswer, decode_response, encode_name,
                                      encode_query, qtype_for)
from extproc.core.events import Observers, PickRan
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


def test_an_engine_listed_and_discovered_too_is_one_engine_and_a_listed_one_may_not_repeat():
    """Counted twice, an engine would be probed twice and its KV capacity counted twice in the budget."""
    known = {"vllm": ("10.0.0.5", "10.0.0.6")}
    assert engines(("http://10.0.0.5:8000/", "dns://vllm:8000"), known) == ("http://10.0.0.5:8000/",
                                                                            "http://10.0.0.6:8000")
    assert engines(("http://[::ffff:a00:5]:8000", "dns://vllm:8000", "dns://vllm:8000"), known) == (
        "http://[::ffff:a00:5]:8000", "http://10.0.0.6:8000")
    assert engines(("dns://vllm:8000", "http://10.0.0.6:8000"), known) == ("http://10.0.0.5:8000",
                                                                           "http://10.0.0.6:8000")
    assert engines(("dns://v6:8000",), {"v6": ("::ffff:10.0.0.5", "fd00::1")}) == ("http://[::ffff:10.0.0.5]:8000",
                                                                                   "http://[fd00::1]:8000")
    assert engines(("http://10.0.0.5:8000", "http://10.0.0.5:8001"), known) == ("http://10.0.0.5:8000",
                                                                                "http://10.0.0.5:8001")
    for twice in (["http://10.0.0.5:8000", "http://10.0.0.5:8000/"], ["http://10.0.0.5:8000", "http://10.0.0.5:8000"],
                  ["http://10.0.0.5:8000", "http://[::ffff:10.0.0.5]:8000"]):
        with pytest.raises(ConfigError, match=r"same engine \(address 10.0.0.5, port 8000\)"):
            config_with(twice, pick_backend=False)
    config_with(["http://10.0.0.5:8000", "http://10.0.0.5:8001", f"dns://{NAME}:8000"])  # one port each: two engines


# -- DNS messages -----------------------------------------------------------------------------------

def name_bytes(name: str) -> bytes:
    return encode_name(name)


def response(query_id: int, name: str, records: list[tuple[int, bytes]], rcode: int = 0, truncated: bool = False,
             compress: bool = True, qtype: int = A, owners: list[bytes] | None = None) -> bytes:
    """A server's response: the question (`name`, `qtype`), then `records` (type, data) for
    `name`, or each for its name in `owners`."""
    flags = 0x8180 | rcode | (0x0200 if truncated else 0)
    out = struct.pack(">HHHHHH", query_id, flags, 1, len(records), 0, 0)
    out += name_bytes(name) + struct.pack(">HH", qtype, 1)
    owner = b"\xc0\x0c" if compress else name_bytes(name)  # a pointer to the question's name
    for i, (rtype, data) in enumerate(records):
        out += (owner if owners is None else owners[i]) + struct.pack(">HHIH", rtype, 1, 5, len(data)) + data
    return out


def a(address: str) -> tuple[int, bytes]:
    return (A if ipaddress.ip_address(address).version == 4 else AAAA), ipaddress.ip_address(address).packed


def test_a_query_asks_for_one_names_records_and_offers_a_udp_answer_that_needs_no_fragment():
    query = encode_query(NAME, A, 0x1234)
    assert query[:12] == struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 1)
    assert query[12:].startswith(b"\x0cvllm-primary\x03llm\x03svc\x07cluster\x05local\x00\x00\x01\x00\x01")
    assert query.endswith(b"\x00\x00\x29\x04\xd0\x00\x00\x00\x00\x00\x00")  # OPT: 1232 bytes (DNS Flag Day 2020)
    assert encode_name("a.b.") == encode_name("a.b") and qtype_for("V6_ONLY") == AAAA
    for bad in ("", "a..b", "x" * 64 + ".com", ".".join(["abcdefgh"] * 40)):
        with pytest.raises(ValueError):
            encode_name(bad)


def test_a_response_gives_the_records_of_the_type_asked():
    answer = decode_response(response(7, NAME, [a("10.0.0.2"), a("10.0.0.1"), a("fd00::1")]), 7, A, NAME)
    assert answer.rcode == 0 and answer.addresses == ("10.0.0.2", "10.0.0.1") and not answer.truncated
    answer = decode_response(response(7, NAME, [a("fd00::1")], compress=False, qtype=AAAA), 7, AAAA, NAME)
    assert answer.addresses == ("fd00::1",)
    assert decode_response(response(7, NAME, [], rcode=NXDOMAIN), 7, A, NAME).rcode == NXDOMAIN
    assert decode_response(response(7, NAME, [a("10.0.0.1")], truncated=True), 7, A, NAME).truncated
    assert decode_response(response(7, NAME.upper(), [a("10.0.0.1")]), 7, A, NAME + ".").addresses == ("10.0.0.1",)


def test_a_truncated_response_is_asked_again_whatever_its_records_look_like():
    """A server that cuts its answer to fit may cut it inside a record and keep its count."""
    whole = response(7, NAME, [a("10.0.0.1"), a("10.0.0.2"), a("10.0.0.3")], truncated=True)
    for cut in (len(whole) - 6, len(whole) - 14, len(whole) - 30, 12):
        answer = decode_response(whole[:cut], 7, A, NAME)
        assert answer.truncated and answer.addresses == ()


def test_only_the_records_of_the_name_asked_and_of_the_names_its_cnames_lead_to_are_taken():
    chain = [(5, name_bytes("mid.example")), (5, name_bytes("target.example")),
             a("10.0.0.1"), a("10.0.0.2"), a("169.254.169.254")]
    owners = [b"\xc0\x0c", name_bytes("mid.example"), name_bytes("target.example"), name_bytes("TARGET.example"),
              name_bytes("evil.example")]
    assert decode_response(response(7, NAME, chain, owners=owners), 7, A, NAME).addresses == ("10.0.0.1", "10.0.0.2")
    # a CNAME of another name leads nowhere; records of another name alone: not an answer
    stray = [(5, name_bytes("evil.example")), a("169.254.169.254")]
    for records, owners in ((stray, [name_bytes("other.example"), name_bytes("evil.example")]),
                            ([a("169.254.169.254")], [name_bytes("evil.example")])):
        with pytest.raises(BadResponse, match="another name"):
            decode_response(response(7, NAME, records, owners=owners), 7, A, NAME)
    # the answer to another question
    for data, qtype in ((response(7, "other.example", [a("10.0.0.1")]), A), (response(7, NAME, [a("fd00::1")]), AAAA)):
        with pytest.raises(BadResponse, match="another question"):
            decode_response(data, 7, qtype, NAME)
    # a name that points at itself, or forward
    looped = struct.pack(">HHHHHH", 7, 0x8180, 1, 1, 0, 0) + b"\xc0\x0c" + b"\0\1\0\1"
    with pytest.raises(BadResponse, match="point back"):
        decode_response(looped + b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 0, 4) + b"\1\2\3\4", 7, A, NAME)


def test_a_response_to_another_query_or_broken_is_a_bad_response():
    good = response(7, NAME, [a("10.0.0.1")])
    with pytest.raises(NotTheAnswer):
        decode_response(good, 8, A, NAME)  # another id: a UDP reader waits on for its own
    with pytest.raises(NotTheAnswer):
        decode_response(encode_query(NAME, A, 7), 7, A, NAME)
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
            decode_response(data, query_id, A, NAME)
            pytest.fail(what)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2**16 - 1), st.sampled_from([A, AAAA]))
def test_no_garbage_raises_anything_but_a_bad_response(data, query_id, qtype):
    try:
        decode_response(data, query_id, qtype, NAME)
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
        answer = decode_response(bytes(data), 7, A, NAME)
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
    reloaded = config_with(["dns://other:9000"])
    assert await discovery.resolve(reloaded) is True  # a reload's names, before it is in force
    assert discovery.engines("primary") == ("http://10.0.0.1:8000",)  # the configuration in force's, still
    configs.append(reloaded)
    assert discovery.engines("primary") == ("http://10.0.0.5:9000",)  # from the moment it is in force
    assert await discovery.resolve() is False and set(discovery.names) == {"other"}


class HeldResolver(ToldResolver):
    """Answers as told once the test lets the answers go (`held` cleared)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = asyncio.Event()

    async def resolve(self, name: str, family: str, timeout_s: float) -> Resolution:
        await self.held.wait()
        return await super().resolve(name, family, timeout_s)


async def test_a_reloads_engines_are_resolved_before_it_is_in_force_so_no_pool_is_ever_seen_without_them(caplog):
    """While a resolution is under way (the loop's, the reload's own), the pool keeps the engines of
    the configuration in force: never none, which the capacity loop would take for a budget of 0
    and every probe gone."""
    configs = [config_with(["dns://old:8000"])]
    resolver = HeldResolver()
    resolver.answers = {"old": Resolution(("10.0.0.1", "10.0.0.2")),
                        "new": Resolution(("10.0.0.1", "10.0.0.2", "10.0.0.3"))}
    discovery = EngineDiscovery(lambda: configs[-1], Metrics(), resolver)
    resolver.held.set()
    await discovery.resolve()
    old = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    resolver.held.clear()
    loop_tick = asyncio.ensure_future(discovery.resolve())  # the loop's, under way
    reloaded = config_with(["dns://new:8000"])

    async def apply() -> None:  # as SidecarServer._apply does
        await discovery.resolve(reloaded)
        configs.append(reloaded)

    reload = asyncio.ensure_future(apply())
    for _ in range(5):
        await asyncio.sleep(0)
        assert discovery.engines("primary") == old
    caplog.clear()
    resolver.held.set()
    assert await loop_tick is False
    await reload
    assert discovery.engines("primary") == old + ("http://10.0.0.3:8000",)
    assert "dropped" not in caplog.text and "0 engine(s)" not in caplog.text


async def test_a_name_stands_for_at_most_max_engines_per_name_addresses_and_the_cut_is_logged(caplog):
    config = config_with([f"dns://{NAME}:8000"], max_engines_per_name=2)
    assert config_with([f"dns://{NAME}:8000"]).discovery.max_engines_per_name == 256
    with pytest.raises(ConfigError, match="max_engines_per_name"):
        config_with([f"dns://{NAME}:8000"], max_engines_per_name=0)
    resolver = ToldResolver()
    resolver.answers[NAME] = answered(["10.0.0.3", "10.0.0.1", "10.0.0.2"])
    discovery = EngineDiscovery(lambda: config, Metrics(), resolver)
    await discovery.resolve()
    assert discovery.engines("primary") == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert "answered 3 addresses: it stands for the lowest 2" in caplog.text
    caplog.clear()
    await discovery.resolve()
    assert "max_engines_per_name" not in caplog.text  # once, while it goes on
    state = NameState()
    assert state.apply(Resolution(("10.0.0.1", "10.0.0.2")), 2, max_addresses=1) == OK
    assert state.addresses == ("10.0.0.1",) and state.cut == 1


async def test_the_system_resolver_keeps_one_lookup_of_a_name_under_way_however_long_it_takes(monkeypatch):
    """getaddrinfo runs in a thread that no timeout stops: a lookup that does not return (a
    black-holed nameserver) must not start another every interval, until no thread is left for
    any other lookup. Its name's engines stay meanwhile, as for any failure."""
    loop = asyncio.get_running_loop()
    started: list[str] = []
    lookups: dict[str, asyncio.Future] = {}
    ready: dict[str, list] = {}

    async def getaddrinfo(host, port, *, family=0, type=0, proto=0, flags=0):
        started.append(host)
        lookups[host] = loop.create_future()
        if host in ready:
            lookups[host].set_result(ready[host])
        return await lookups[host]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    config = config_with([f"dns://{NAME}:8000", "dns://other:8000"], timeout_s=0.01)
    discovery = EngineDiscovery(lambda: config, Metrics())
    discovery.names[NAME] = NameState(("10.0.0.9",))
    for _ in range(3):  # three intervals: the first lookups never returned
        await discovery.resolve()
    assert sorted(started) == sorted([NAME, "other"])
    assert discovery.names[NAME].failure == "the previous lookup has not returned yet"
    assert discovery.engines("primary") == ("http://10.0.0.9:8000",)
    lookups[NAME].set_result([(2, 1, 6, "", ("10.0.0.1", 0))])
    lookups["other"].set_exception(OSError("no route"))  # returned, given up on
    await asyncio.sleep(0)
    ready.update({NAME: [(2, 1, 6, "", ("10.0.0.1", 0))],
                  "other": [(2, 1, 6, "", ("10.0.0.2", 0))]})
    await discovery.resolve()  # both returned: asked again
    assert sorted(started) == sorted([NAME, "other"] * 2)
    assert discovery.engines("primary") == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")


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
    observers, ran = Observers(), []
    observers.subscribe(PickRan, ran.append)
    slots = Slots(LocalQueueStore({"primary": 8, "fallback": 4}), observers, picker)
    told.lately_changed = True
    for i in range(60):  # named 10.0.0.2 first; Envoy, without it yet, ran them on 10.0.0.1
        slots.ran_on(placed(f"a{i}", "10.0.0.2:8000,10.0.0.1:8000"), "10.0.0.1:8000")
    assert slots.picks_followed("primary") is None  # nothing known either way
    assert ran == [PickRan("primary", False)] * 60  # each told, as having run elsewhere
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
