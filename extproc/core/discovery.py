"""Engines discovered through DNS, pure: the resolver loop is control/discovery.py.

A pool's backend "dns://NAME:PORT" (`capacity.backends`) stands for every address NAME resolves
to, each an engine at http://ADDRESS:PORT: probed, counted in the pool's budget and placed on as
a listed one is. A Kubernetes headless Service answers with one address per ready pod, a compose
service with one per container; Envoy's STRICT_DNS cluster on the same name sees the same hosts.

What one resolution does to the addresses a name stands for (`NameState.apply`):
- addresses: they are its engines from now on; an address no longer there is dropped at once;
- failed (no answer in time, a server failure, an answer that cannot be read or holds no usable
  address): the last known addresses stay, so a transient failure never empties a pool;
- empty (the name does not exist, NXDOMAIN, or has no address of the family): the last known
  addresses stay the first time, and go when the name has answered empty `empty_after` times in
  a row. A headless Service none of whose pods is ready answers so; a zone being rewritten may,
  for a moment.
A name stands for at most `max_engines_per_name` addresses, the lowest (`NameState.cut` says how
many more it answered). Addresses are taken as answered, loopback and link-local ones included
(an engine beside the sidecar, the tests' 127.0.0.x): the nameserver is trusted to name engines.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator

from .pool_config import StrictModel, dns_backend, engine_address

OK, EMPTY, FAILED = "ok", "empty", "failed"  # a resolution's result (extproc_discovery_resolutions_total)


class DiscoverySettings(StrictModel):
    """How the `dns://` backends are resolved (docs/configuration.md#discovered-engines)."""

    interval_s: float = Field(5.0, gt=0)  # Envoy's STRICT_DNS clusters refresh every 5 s by default
    timeout_s: float = Field(2.0, gt=0)  # one resolution; a later answer is a failure
    nameserver: str | None = None  # "IP:PORT": asked directly over UDP (TCP when truncated); none: the system's
    lookup_family: Literal["V4_ONLY", "V6_ONLY"] = "V4_ONLY"  # as the clusters' dns_lookup_family
    empty_after: int = Field(2, ge=1)  # empty answers in a row that empty a name
    max_engines_per_name: int = Field(256, ge=1)  # the addresses one name may stand for (the lowest)

    @field_validator("nameserver")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and nameserver_address(value) is None:
            raise ValueError(f"nameserver is IP:PORT ([IPv6]:PORT): {value!r}")
        return value


def nameserver_address(value: str) -> tuple[str, int] | None:
    """(IP, PORT) of "IP:PORT" or "[IPv6]:PORT" (None: malformed)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(host)), int(port)
    except ValueError:
        return None


@dataclass(frozen=True)
class Resolution:
    """What asking for a name gave: addresses, nothing (`empty`), or a `failure` (why)."""

    addresses: tuple[str, ...] = ()
    failure: str | None = None

    @property
    def empty(self) -> bool:
        return self.failure is None and not self.addresses


def answered(addresses: Iterable[str], family: str = "V4_ONLY") -> Resolution:
    """The resolution of an answer that gave `addresses`: those of the family, each once, in
    order; an answer none of whose addresses is usable is a failure, not an empty name."""
    addresses = list(addresses)
    version = 6 if family == "V6_ONLY" else 4
    usable: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for address in addresses:
        try:
            parsed = ipaddress.ip_address(address)
        except ValueError:
            continue
        if parsed.version == version and not parsed.is_unspecified and not parsed.is_multicast:
            usable.add(parsed)
    if addresses and not usable:
        return Resolution(failure=f"no usable address in the answer ({len(addresses)} given)")
    return Resolution(tuple(str(a) for a in sorted(usable)))


@dataclass
class NameState:
    """The addresses one name stands for, as its resolutions left them."""

    addresses: tuple[str, ...] = ()
    empties: int = 0  # empty answers in a row
    failure: str | None = None  # why the last resolution failed (None: it did not)
    cut: int = 0  # addresses beyond `max_engines_per_name` its last answer with addresses gave, left out

    def apply(self, resolution: Resolution, empty_after: int, max_addresses: int | None = None) -> str:
        """Take a resolution in; its result (OK, EMPTY or FAILED)."""
        self.failure = resolution.failure
        if resolution.failure is not None:
            return FAILED
        if resolution.empty:
            self.empties += 1
            if self.empties >= empty_after:
                self.addresses = ()
            return EMPTY
        self.empties = 0
        self.addresses = resolution.addresses[:max_addresses]
        self.cut = len(resolution.addresses) - len(self.addresses)
        return OK


def dns_names(backends: Iterable[str]) -> set[str]:
    """The names of the `dns://` backends among `backends`."""
    return {found[0] for url in backends if (found := dns_backend(url)) is not None}


def engine_url(address: str, port: int) -> str:
    """The base URL of the engine at `address`, `port`."""
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def engines(backends: Sequence[str], known: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """A pool's engines: its listed backends as they are, each `dns://NAME:PORT` replaced by the
    engines at NAME's known addresses; each engine once (by its address and port, an IPv4-mapped
    IPv6 address as the IPv4 one: the first URL that names it), in order."""
    found: dict[object, str] = {}
    for url in backends:
        name = dns_backend(url)
        for engine in [url] if name is None else [engine_url(address, name[1]) for address in known.get(name[0], ())]:
            found.setdefault(engine_address(engine) or engine, engine)
    return tuple(found.values())


def changes(old: Sequence[str], new: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(added, dropped): what is in `new` and not `old`, and the other way round, in order."""
    before, after = set(old), set(new)
    return tuple(u for u in new if u not in before), tuple(u for u in old if u not in after)
