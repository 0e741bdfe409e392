"""The discovery loop: every `discovery.interval_s`, each name of the pools' `dns://` backends
is resolved (core/discovery.py says what an answer does to its engines), and when a pool's
engines changed the capacity loop runs at once: a new engine is probed and counted in the
pool's budget within the interval, and one gone is no longer picked from the moment its name
stopped answering with it (the engine picker reads `engines` on every pick).

Resolvers: the system's (getaddrinfo: /etc/hosts, /etc/resolv.conf and its search domains, as
Envoy's c-ares reads them), or a nameserver asked directly (`discovery.nameserver`).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..core.config import Config
from ..core.discovery import (EMPTY, FAILED, OK, DiscoverySettings, NameState, Resolution, answered, changes,
                              dns_names, engines, nameserver_address)
from ..core.dns_message import (NOERROR, NXDOMAIN, Answer, BadResponse, NotTheAnswer, decode_response, encode_query,
                                 qtype_for)
from ..ops.metrics import Metrics
from .periodic import Periodic

log = logging.getLogger("extproc.discovery")

# getaddrinfo's "no such name" and "no address": an empty answer, not a failure
_EMPTY_ERRORS = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_ADDRFAMILY")
                 if hasattr(socket, name)}


class Resolver(Protocol):
    async def resolve(self, name: str, family: str, timeout_s: float) -> Resolution: ...


class SystemResolver:
    """The system's resolver, through the event loop's getaddrinfo. A lookup runs in a thread
    that no timeout stops: while one for a name has not returned, asking for the name again is a
    failure that starts no other (a black-holed nameserver would hold a thread every interval,
    until the executor's were all taken and no other lookup ran)."""

    def __init__(self) -> None:
        self._running: dict[tuple[str, str], asyncio.Future] = {}  # (name, family) -> its lookup

    async def resolve(self, name: str, family: str, timeout_s: float) -> Resolution:
        loop = asyncio.get_running_loop()
        af = socket.AF_INET6 if family == "V6_ONLY" else socket.AF_INET
        if (running := self._running.get((name, family))) is not None and not running.done():
            return Resolution(failure="the previous lookup has not returned yet")
        lookup = self._running[name, family] = asyncio.ensure_future(
            loop.getaddrinfo(name, None, family=af, type=socket.SOCK_STREAM))
        lookup.add_done_callback(functools.partial(self._returned, (name, family)))
        try:
            async with asyncio.timeout(timeout_s):
                infos = await asyncio.shield(lookup)
        except socket.gaierror as error:
            if error.errno in _EMPTY_ERRORS:
                return Resolution()
            return Resolution(failure=error.strerror or str(error))
        except TimeoutError:
            return Resolution(failure=f"no answer within {timeout_s:g} s")
        except (OSError, UnicodeError) as error:
            return Resolution(failure=str(error) or type(error).__name__)
        return answered((info[4][0] for info in infos), family)

    def _returned(self, key: tuple[str, str], lookup: asyncio.Future) -> None:
        if self._running.get(key) is lookup:
            del self._running[key]
        if not lookup.cancelled():
            lookup.exception()  # retrieved: the error of one given up on is not logged as never retrieved


class NameserverResolver:
    """Asks one nameserver directly: over UDP, again over TCP when the answer was truncated."""

    def __init__(self, address: tuple[str, int]):
        self.address = address

    async def resolve(self, name: str, family: str, timeout_s: float) -> Resolution:
        qtype = qtype_for(family)
        try:
            ipaddress.ip_address(name)
            return answered([name], family)  # an address stands for itself, as getaddrinfo has it
        except ValueError:
            pass
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self._ask_udp(name, qtype)
                if answer.truncated:
                    answer = await self._ask_tcp(name, qtype)
        except TimeoutError:
            return Resolution(failure=f"no answer from {self.address[0]}:{self.address[1]} within {timeout_s:g} s")
        except (OSError, ValueError, asyncio.IncompleteReadError) as error:  # BadResponse, a name that cannot be asked
            return Resolution(failure=str(error) or type(error).__name__)
        if answer.rcode == NXDOMAIN or (answer.rcode == NOERROR and not answer.addresses):
            return Resolution()
        if answer.rcode != NOERROR:
            return Resolution(failure=f"the nameserver answered rcode {answer.rcode}")
        return answered(answer.addresses, family)

    async def _ask_udp(self, name: str, qtype: int) -> Answer:
        query_id = secrets.randbits(16)
        loop = asyncio.get_running_loop()
        response: asyncio.Future[Answer] = loop.create_future()

        class Reply(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr) -> None:  # only the nameserver's: the socket is connected
                if not response.done():
                    try:
                        response.set_result(decode_response(data, query_id, qtype, name))
                    except NotTheAnswer:
                        pass  # another query's (a late answer, a spoofer's guess): the answer may still come
                    except BadResponse as error:
                        response.set_exception(error)

            def error_received(self, exc: Exception) -> None:  # e.g. port unreachable
                if not response.done():
                    response.set_exception(exc)

        transport, _ = await loop.create_datagram_endpoint(Reply, remote_addr=self.address)
        try:
            transport.sendto(encode_query(name, qtype, query_id))
            return await response
        finally:
            transport.close()

    async def _ask_tcp(self, name: str, qtype: int) -> Answer:
        query_id = secrets.randbits(16)
        query = encode_query(name, qtype, query_id)
        reader, writer = await asyncio.open_connection(*self.address)
        try:
            writer.write(len(query).to_bytes(2, "big") + query)
            size = int.from_bytes(await reader.readexactly(2), "big")
            return decode_response(await reader.readexactly(size), query_id, qtype, name)
        finally:
            writer.close()


def resolver_for(settings: DiscoverySettings) -> Resolver:
    address = nameserver_address(settings.nameserver) if settings.nameserver else None
    return NameserverResolver(address) if address is not None else SystemResolver()


class EngineDiscovery:
    """The engines of each pool (`engines`), its `dns://` backends resolved every interval."""

    def __init__(self, config: Callable[[], Config], metrics: Metrics, resolver: Resolver | None = None,
                 on_change: Callable[[], Awaitable[None]] | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self._config = config
        self._clock = clock
        self.metrics = metrics
        self.resolver = resolver  # None: as the configuration says (its nameserver, or the system's)
        self._made: tuple[str | None, Resolver] | None = None  # (nameserver, the resolver made for it)
        self.on_change = on_change  # after a resolution changed some pool's engines
        self.names: dict[str, NameState] = {}
        self._engines: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # pool -> (backends, engines)
        self._changed_at: dict[str, float] = {}  # pool -> when a resolution last changed its engines
        self._resolving = asyncio.Lock()  # one resolution at a time (the loop's, a reload's)
        self._loop = Periodic(self._resolve_and_tell, lambda: self._config().discovery.interval_s,
                              "engine discovery failed; the engines known stay", sleep)

    def engines(self, pool: str) -> tuple[str, ...]:
        """The base URLs of `pool`'s engines now: its listed backends, and the addresses its
        `dns://` names stand for."""
        backends = self._config().pools[pool].capacity.backends
        cached = self._engines.get(pool)
        if cached is None or cached[0] is not backends:  # a reload lists other backends
            cached = self._engines[pool] = (backends, self._engines_of(backends))
        return cached[1]

    def _engines_of(self, backends: tuple[str, ...]) -> tuple[str, ...]:
        return engines(backends, {name: state.addresses for name, state in self.names.items()})

    def changing(self, pool: str) -> bool:
        """Whether a resolution changed `pool`'s engines within the last two intervals: Envoy's
        cluster resolves the same name on a clock of its own, and may not have the change yet."""
        at = self._changed_at.get(pool)
        return at is not None and self._clock() - at < 2 * self._config().discovery.interval_s

    async def start(self) -> None:
        await self.resolve()  # the first engines are known before the capacity loop's first tick
        self._loop.start()

    async def stop(self) -> None:
        self._loop.stop()

    async def _resolve_and_tell(self) -> None:
        if await self.resolve() and self.on_change is not None:
            await self.on_change()

    async def resolve(self, config: Config | None = None) -> bool:
        """Resolve every name of `config` once (a reload's, before it is put in force, so that
        its engines are known from the moment it is; None: the configuration in force); whether
        some pool's engines changed (from the ones in force to the ones `config` names)."""
        async with self._resolving:
            return await self._resolve(config if config is not None else self._config())

    async def _resolve(self, config: Config) -> bool:
        settings = config.discovery
        by_pool = {pool: dns_names(p.capacity.backends) for pool, p in config.pools.items()}
        wanted = sorted(set().union(*by_pool.values()))
        in_force = dns_names(url for pool in self._config().pools.values() for url in pool.capacity.backends)
        for gone in set(self.names) - set(wanted) - in_force:
            del self.names[gone]
        for pool in [pool for pool, names in by_pool.items() if not names]:
            self.metrics.discovered_engines.remove(pool)  # (a reload listed its engines instead)
        if not wanted:
            return False
        before = {pool: self.engines(pool) for pool in config.pools}
        if self.resolver is None and (self._made is None or self._made[0] != settings.nameserver):
            self._made = settings.nameserver, resolver_for(settings)  # kept: the system's knows its lookups under way
        resolver = self.resolver or self._made[1]
        results = await asyncio.gather(*(resolver.resolve(name, settings.lookup_family, settings.timeout_s)
                                         for name in wanted), return_exceptions=True)
        for name, resolution in zip(wanted, results, strict=True):
            if isinstance(resolution, BaseException):  # a resolver's bug: as a failure
                if not isinstance(resolution, Exception):
                    raise resolution
                resolution = Resolution(failure=f"{type(resolution).__name__}: {resolution}")
            self._took(name, resolution, settings)
        self._engines.clear()
        changed = False
        for pool, old in before.items():
            new = self._engines_of(config.pools[pool].capacity.backends)
            added, dropped = changes(old, new)
            if added or dropped:
                changed = True
                self._changed_at[pool] = self._clock()
                log.warning("pool %s: %d engine(s)%s%s", pool, len(new),
                            f", added {', '.join(added)}" if added else "",
                            f", dropped {', '.join(dropped)}" if dropped else "")
            if by_pool[pool]:
                self.metrics.discovered_engines.labels(pool).set(len(new))
        return changed

    def _took(self, name: str, resolution: Resolution, settings: DiscoverySettings) -> None:
        state = self.names.get(name)
        if state is None:
            state = self.names[name] = NameState()
            for result in (OK, EMPTY, FAILED):  # every series from zero, so a first failure is a change
                self.metrics.discovery_resolutions.labels(name, result)
        failing, known, cut, empty_after = state.failure is not None, state.addresses, state.cut, settings.empty_after
        result = state.apply(resolution, empty_after, settings.max_engines_per_name)
        if state.cut and not cut:
            log.warning("%s answered %d addresses: it stands for the lowest %d (discovery.max_engines_per_name)",
                        name, len(resolution.addresses), len(state.addresses))
        self.metrics.discovery_resolutions.labels(name, result).inc()
        if result == FAILED and not failing:
            log.warning("resolving %s failed (%s): its %d known address(es) stay", name, resolution.failure, len(known))
        elif result != FAILED and failing:
            log.warning("resolving %s works again", name)
        if result == EMPTY and known:
            log.warning("%s answered no address (%d time(s) in a row)%s", name, state.empties,
                        ": its addresses go" if not state.addresses else
                        f": its {len(known)} address(es) stay until it has answered so {empty_after} times")
