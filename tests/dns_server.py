"""A real DNS server on loopback whose records a test sets: Debian's dnsmasq (the package
dnsmasq-base, installed by tools/system-packages.sh), answering from a hosts file that it reads
again on SIGHUP. Names under `.test` are its own: one it does not hold is answered NXDOMAIN, as a
Kubernetes headless Service with no ready pod is."""

from __future__ import annotations

import grp
import os
import pwd
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

from extproc.core.dns_message import AAAA, A, Answer, BadResponse, decode_response, encode_query
from extproc_testbed.stack import LOOPBACK, find_program, free_port, port_is_free


def dnsmasq_binary() -> str:
    for path in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq"):  # sbin: not on a user's PATH
        if Path(path).is_file():
            return path
    return find_program("dnsmasq", "apt-get install dnsmasq-base (tools/system-packages.sh)")


def udp_port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


class Dnsmasq:
    def __init__(self, workdir: Path, *extra: str):
        self.workdir = workdir
        self.extra = extra
        self.hosts = workdir / "hosts"
        self.records: dict[str, list[str]] = {}
        self.port = free_port()
        while not udp_port_is_free(self.port):
            self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> tuple[str, int]:
        return LOOPBACK, self.port

    @property
    def nameserver(self) -> str:
        """As the sidecar's discovery.nameserver takes it."""
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> Dnsmasq:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write()
        log = open(self.workdir / "dnsmasq.log", "ab")
        self.process = subprocess.Popen(
            [dnsmasq_binary(), "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
             f"--addn-hosts={self.hosts}", f"--listen-address={LOOPBACK}", "--bind-interfaces", f"--port={self.port}",
             "--local=/test/", "--local-ttl=0", "--pid-file=", "--log-queries", "--log-facility=-",
             # as root it would read the hosts file again as nobody, who cannot reach a test's folder
             f"--user={pwd.getpwuid(os.getuid()).pw_name}", f"--group={grp.getgrgid(os.getgid()).gr_name}",
             *self.extra],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + 10
        while port_is_free(self.port):  # its TCP socket: it is listening
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq did not start:\n{(self.workdir / 'dnsmasq.log').read_text()}")
            time.sleep(0.05)
        return self

    def _write(self) -> None:
        lines = [f"{address} {name}" for name, addresses in self.records.items() for address in addresses]
        self.hosts.write_text("".join(f"{line}\n" for line in lines))

    def set(self, name: str, addresses: list[str]) -> None:
        """`name` answers `addresses` from now on (NXDOMAIN for none); returns once it does."""
        self.records[name] = list(addresses)
        self._write()
        if self.process is not None:
            self.process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            qtype = AAAA if addresses and ":" in addresses[0] else A
            while (answer := self._answer(name, qtype)) is None or not (
                    answer.truncated or sorted(answer.addresses) == sorted(addresses)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dnsmasq does not answer {addresses} for {name}")
                time.sleep(0.05)

    def ask(self, name: str) -> list[str]:
        """The A records it answers for `name` now, over UDP (a part, when truncated)."""
        answer = self._answer(name)
        return [] if answer is None else list(answer.addresses)

    def _answer(self, name: str, qtype: int = A) -> Answer | None:
        query_id = secrets.randbits(16)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(1)
            s.sendto(encode_query(name, qtype, query_id), self.address)
            try:
                return decode_response(s.recv(4096), query_id, qtype, name)
            except (OSError, BadResponse):
                return None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
