"""Real `redis-server` and `redis-sentinel` processes on loopback, for tests.

`RedisServer` runs one `redis-server` on a free 127.0.0.1 port in its own directory,
waits until it answers PING, and stops it (SIGTERM, then SIGKILL) — or kills it with
SIGKILL, as a crash does. `SentinelCluster` runs a master, a replica and 1–3 sentinels
watching them with short timers, so a failover takes about a second.

Persistence is off (`save ""`, `appendonly no`), on purpose:

- the contract suite never restarts a server, and an RDB snapshot forks the server,
  which costs a loaded 2-core machine for nothing;
- the failover tests prove what *replication* keeps: an entry counts as safe once the
  replica acknowledged it (`WAIT`), not once a disk did. A killed master is never
  restarted on its own (Redis's Sentinel docs warn that a master without persistence
  that restarts empty replicates its emptiness), so nothing here relies on its disk.

`persistent=True` turns on the append-only file (`appendfsync everysec`) for a test that
restarts one server and expects its data back.

Both binaries come from Debian's `redis-server` and `redis-sentinel` packages; `make
test` installs them when missing (the Makefile's `redis` target).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from helpers.servers import free_port
from hf3fsctl.bench.peers.redis_cluster import free_ports

HOST = "127.0.0.1"
SERVICE = "hf3fsctl"  # the Sentinel service name (`redis+sentinel://…/SERVICE`)
START_TIMEOUT_S = 20.0


def redis_binaries_missing() -> list[str]:
    """The Redis binaries this machine lacks (`make test` installs them)."""
    return [name for name in ("redis-server", "redis-sentinel") if shutil.which(name) is None]


def connect_port(port: int, timeout_s: float = 1.0) -> Any:
    """A new `redis.Redis` on 127.0.0.1:`port` (the caller closes it).

    redis-py's own retries are off: by default it retries a failed connection 3 times
    with a back-off of up to seconds, which would hide a dead server behind a slow call.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(
        host=HOST,
        port=port,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


@dataclass
class RedisServer:
    """One `redis-server` (or `redis-sentinel`) process in `directory` on `port`.

    Attributes:
        directory: the process's working directory (config, log, any data files).
        port: its loopback TCP port.
        settings: config lines (`name value`) beyond the defaults written by `start`.
        sentinel: run `redis-sentinel` instead of `redis-server`.
    """

    directory: Path
    port: int = field(default_factory=free_port)
    settings: list[str] = field(default_factory=list)
    sentinel: bool = False
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def config_path(self) -> Path:
        return self.directory / ("sentinel.conf" if self.sentinel else "redis.conf")

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def write_config(self) -> None:
        """The config file; a sentinel rewrites its own, so it is written once."""
        if self.sentinel and self.config_path.exists():
            return
        lines = [
            f"port {self.port}",
            f"bind {HOST}",
            f"dir {self.directory}",
            f"logfile {self.log_path}",
            "daemonize no",
        ]
        if not self.sentinel:
            lines += ['save ""', "appendonly no"]
        self.config_path.write_text("\n".join([*lines, *self.settings]) + "\n")

    def start(self, timeout_s: float = START_TIMEOUT_S) -> RedisServer:
        """Start the process and wait until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.write_config()
        binary = "redis-sentinel" if self.sentinel else "redis-server"
        self.process = subprocess.Popen(
            [binary, str(self.config_path)],
            cwd=self.directory,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{binary} exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.client().ping():
                    return self
            except Exception:  # not listening yet (ConnectionError, BusyLoadingError, …)
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{binary} did not answer PING in {timeout_s}s:\n{self.log()}")

    def client(self, timeout_s: float = 1.0) -> Any:
        """A new `redis.Redis` connected to this process (the caller closes it)."""
        return connect_port(self.port, timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if not self.alive():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def redis_server(
    directory: Path, *, persistent: bool = False, settings: Sequence[str] = ()
) -> RedisServer:
    """A started `redis-server` in `directory` (see the module docstring on persistence)."""
    extra = ["appendonly yes", "appendfsync everysec"] if persistent else []
    return RedisServer(directory, settings=[*extra, *settings]).start()


@dataclass
class SentinelCluster:
    """A master, one replica and `sentinels` sentinels on loopback, failing over fast.

    Sentinels declare the master down after `down_after_ms` without an answer and need
    `quorum` of them to agree; a failover that stalls is retried after `failover_timeout_ms`.
    Replication is diskless with no delay, so a replica syncs as soon as it connects.
    """

    directory: Path
    sentinels: int = 3
    quorum: int = 2
    down_after_ms: int = 500
    failover_timeout_ms: int = 2000
    service: str = SERVICE
    master: RedisServer = field(init=False)
    replica: RedisServer = field(init=False)
    sentinel_servers: list[RedisServer] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        replication = ["repl-diskless-sync yes", "repl-diskless-sync-delay 0"]
        master_port, replica_port, *sentinel_ports = free_ports(2 + self.sentinels)
        self.master = RedisServer(self.directory / "master", master_port, replication)
        self.replica = RedisServer(
            self.directory / "replica",
            replica_port,
            [*replication, f"replicaof {HOST} {master_port}"],
        )
        for i, port in enumerate(sentinel_ports):
            server = RedisServer(self.directory / f"sentinel-{i}", port, sentinel=True)
            server.settings = [
                "sentinel resolve-hostnames no",
                f"sentinel monitor {self.service} {HOST} {self.master.port} {self.quorum}",
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
                f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {self.service} 1",
            ]
            self.sentinel_servers.append(server)

    @property
    def url(self) -> str:
        """`redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,…/SERVICE/0`."""
        hosts = ",".join(f"{HOST}:{s.port}" for s in self.sentinel_servers)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    @property
    def servers(self) -> list[RedisServer]:
        return [self.master, self.replica, *self.sentinel_servers]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> SentinelCluster:
        """Start everything; return once the replica is in sync and every sentinel knows
        the master, the replica and the other sentinels (else a failover could not be
        voted on)."""
        for server in self.servers:
            server.start()
        deadline = time.monotonic() + timeout_s
        while (waiting := self._not_ready()) is not None:
            if time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {s.directory.name}:\n{s.log()[-2000:]}" for s in self.servers
                )
                self.stop()
                raise RuntimeError(f"sentinel cluster not ready in {timeout_s}s: {waiting}\n{logs}")
            time.sleep(0.1)
        return self

    def _not_ready(self) -> str | None:
        """What the cluster still waits for (None: ready)."""
        replica = self.replica.client()
        try:
            link = replica.info("replication").get("master_link_status")
        finally:
            replica.close()
        if link != "up":
            return f"replica link {link}"
        for server in self.sentinel_servers:
            conn = server.client()
            try:
                replicas = conn.execute_command("SENTINEL", "REPLICAS", self.service)
                peers = conn.execute_command("SENTINEL", "SENTINELS", self.service)
            finally:
                conn.close()
            if len(replicas) < 1 or len(peers) < self.sentinels - 1:
                return f"sentinel {server.port}: {len(replicas)} replicas, {len(peers)} peers"
        return None

    def master_port(self) -> int | None:
        """The port the first live sentinel reports as master now (None if none answers)."""
        for server in self.sentinel_servers:
            if not server.alive():
                continue
            conn = server.client()
            try:
                _, port = conn.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                return int(port)
            except Exception:
                continue
            finally:
                conn.close()
        return None

    def wait_for_new_master(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Block until the sentinels report a master other than `old_port`, and it
        accepts writes; returns its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self.master_port()
            if port is not None and port != old_port:
                conn = connect_port(port)
                try:
                    if conn.info("replication").get("role") == "master":
                        return port
                except Exception:
                    pass
                finally:
                    conn.close()
            time.sleep(0.05)
        raise RuntimeError(f"no new master within {timeout_s}s (old master port {old_port})")

    def stop(self) -> None:
        """Stop every process (sentinels first, so none fails over during shutdown)."""
        for server in [*self.sentinel_servers, self.replica, self.master]:
            server.stop()


@dataclass
class RedisClusterServers:
    """A local Redis Cluster: `masters` × (1 + `replicas`) `redis-server --cluster-enabled
    yes` processes on free ports, joined by `redis-cli --cluster create …
    --cluster-replicas N` (the 16,384 slots split evenly over the masters), ready once
    `CLUSTER INFO` says `cluster_state:ok` on every node. A replica is promoted about two
    seconds (`cluster-node-timeout`) after its master dies."""

    directory: Path
    masters: int = 3
    replicas: int = 0
    servers: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """`redis+cluster://127.0.0.1:P1,127.0.0.1:P2,…` (every node a startup node)."""
        return "redis+cluster://" + ",".join(f"{HOST}:{s.port}" for s in self.servers)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> RedisClusterServers:
        nodes = self.masters * (1 + self.replicas)
        ports = free_ports(2 * nodes)  # each node's client port and cluster bus port
        for i, port in enumerate(ports[:nodes]):
            self.servers.append(
                RedisServer(
                    self.directory / f"node{i}",
                    port=port,
                    settings=[
                        "cluster-enabled yes",
                        f"cluster-config-file {self.directory / f'node{i}' / 'nodes.conf'}",
                        f"cluster-port {ports[nodes + i]}",
                        "cluster-node-timeout 2000",
                    ],
                ).start(timeout_s)
            )
        subprocess.run(
            ["redis-cli", "--cluster", "create"]
            + [f"{HOST}:{s.port}" for s in self.servers]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(b"cluster_state:ok" in self._info(s) for s in self.servers):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the Redis Cluster in {self.directory} did not become ready")

    @staticmethod
    def _info(server: RedisServer) -> bytes:
        conn = server.client()
        try:
            return bytes(conn.execute_command("CLUSTER", "INFO"))
        finally:
            conn.close()

    def flush(self) -> None:
        """Empty every master (between tests sharing the cluster; without replicas)."""
        for server in self.servers:
            flush(server)

    def owner(self, key: str) -> RedisServer:
        """The node that serves `key`'s slot as master, as a live node's `CLUSTER SLOTS`
        says now."""
        live = next(server for server in self.servers if server.alive())
        conn = live.client()
        try:
            slot = int(conn.execute_command("CLUSTER", "KEYSLOT", key))
            ranges = conn.execute_command("CLUSTER", "SLOTS")
        finally:
            conn.close()
        for start, end, master, *_ in ranges:
            if int(start) <= slot <= int(end):
                return next(s for s in self.servers if s.port == int(master[1]))
        raise RuntimeError(f"no master serves slot {slot} of {key!r}")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def flush(server: RedisServer) -> None:
    """Empty every database of `server` (between tests sharing it)."""
    conn = server.client(timeout_s=5.0)
    try:
        conn.flushall()
    finally:
        conn.close()


@pytest.fixture(scope="session")
def redis_session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One `redis-server` for the whole session (tests flush it; see `redis_url`)."""
    missing = redis_binaries_missing()
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not installed: run `make test` (it installs Debian's "
            "redis-server and redis-sentinel) or `apt-get install redis-server redis-sentinel`"
        )
    server = redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_session_server: RedisServer) -> str:
    """The session's Redis, emptied for this test."""
    flush(redis_session_server)
    return redis_session_server.url


@pytest.fixture(scope="session")
def redis_cluster_servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterServers]:
    """One local 3-master Redis Cluster for the whole session (see `redis_cluster_url`)."""
    if redis_binaries_missing() or shutil.which("redis-cli") is None:
        raise RuntimeError("redis-server / redis-cli not installed: run `make redis`")
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster_servers: RedisClusterServers) -> str:
    """The session's Redis Cluster, emptied for this test."""
    redis_cluster_servers.flush()
    return redis_cluster_servers.url


@pytest.fixture(scope="module")
def sentinel_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelCluster]:
    """A master + replica + 3 sentinels (quorum 2), for the module; stopped afterwards."""
    cluster = SentinelCluster(tmp_path_factory.mktemp("sentinel")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


__all__ = [
    "RedisClusterServers",
    "RedisServer",
    "SentinelCluster",
    "connect_port",
    "flush",
    "free_ports",
    "redis_binaries_missing",
    "redis_cluster_servers",
    "redis_cluster_url",
    "redis_server",
    "redis_session_server",
    "redis_url",
    "sentinel_cluster",
]
