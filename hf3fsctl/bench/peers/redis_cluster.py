"""A private Redis Cluster: M masters on free loopback ports, no replicas, persistence off.

Contract: `RedisCluster.start` raises `MetadataUnavailable` with a hint when
`redis-server` or `redis-cli` is not on PATH (the benchmark then skips the mode), and
without one when the cluster started but did not come up (`cluster_state:ok` on every
node within 60 s); its data lives only in the work directory it is given. The masters
are joined by `redis-cli --cluster create` (the 16,384 slots split evenly), with
`cluster-node-timeout 2000`. `cpu_by_master` reads each master's CPU from /proc (as
`cpu_seconds`); `used_memory`, `keys_by_master`, `script_usec` and `memory_usage` read
each master's own accounting and add them up, for `bench metadata`'s `redis-cluster`
and `redis-sharded` modes.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from hf3fsctl.bench.peers.process import stop_process, wait_for_port
from hf3fsctl.bench.peers.redis_server import RedisServer
from hf3fsctl.errors import InvalidRequest, MetadataUnavailable

HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0
MIN_MASTERS = 3  # `redis-cli --cluster create` refuses fewer


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on loopback now (held open together while chosen,
    so no two are the same)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class RedisCluster:
    """`masters` `redis-server --cluster-enabled yes` processes joined into one cluster."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        if masters < MIN_MASTERS:
            raise InvalidRequest(f"a Redis Cluster needs at least {MIN_MASTERS} masters")
        self.directory = directory
        ports = free_ports(2 * masters)  # each node's client port and cluster bus port
        self.ports = ports[:masters]
        self.bus_ports = ports[masters:]
        self.processes: list[subprocess.Popen[bytes]] = []

    def url(self, shards: int = 1) -> str:
        """`redis+cluster://127.0.0.1:P1,…` (every master a startup node), with
        `?shards=N` when `shards` > 1."""
        hosts = ",".join(f"{HOST}:{port}" for port in self.ports)
        return f"redis+cluster://{hosts}" + (f"?shards={shards}" if shards > 1 else "")

    def pids(self) -> list[int]:
        """The masters' process ids, in port order."""
        return [process.pid for process in self.processes]

    def start(self) -> RedisCluster:
        """Start the masters, join them, and wait until every node says cluster_state:ok.

        Raises:
            MetadataUnavailable: with a hint when redis-server or redis-cli is missing;
                without one when a node did not start or the cluster did not come up.
        """
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            missing = " and ".join(
                name for name, path in (("redis-server", server), ("redis-cli", cli)) if not path
            )
            raise MetadataUnavailable(
                f"{missing} {'are' if ' and ' in missing else 'is'} not installed here",
                hint="apt-get install redis-server (it ships redis-cli; make test does), "
                "or leave out the redis-cluster and redis-sharded modes",
            )
        try:
            for number, (port, bus) in enumerate(zip(self.ports, self.bus_ports, strict=True)):
                self._start_node(server, self.directory / f"node{number}", port, bus)
            self._create(cli)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, binary: str, directory: Path, port: int, bus: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        log = directory / "redis-server.log"
        command = [binary, "--port", str(port), "--bind", HOST, "--cluster-enabled", "yes"]
        command += ["--cluster-config-file", str(directory / "nodes.conf")]
        command += ["--cluster-port", str(bus), "--cluster-node-timeout", "2000"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(directory)]
        command += ["--logfile", str(log)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        self.processes.append(process)
        wait_for_port(process, port, f"redis-server (cluster node {port})", log)

    def _create(self, cli: str) -> None:
        command = [cli, "--cluster", "create", *(f"{HOST}:{port}" for port in self.ports)]
        command += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=READY_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            tail = done.stdout.decode(errors="replace")[-2000:]
            raise MetadataUnavailable(
                f"redis-cli --cluster create exited {done.returncode}: {tail}"
            )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in self._cluster_info(port) for port in self.ports):
                return
            time.sleep(0.05)
        raise MetadataUnavailable(
            f"the Redis Cluster on ports {self.ports} did not reach cluster_state:ok "
            f"within {READY_TIMEOUT_S:g} s"
        )

    def _cluster_info(self, port: int) -> str:
        with self.client(port) as client:
            return str(client.execute_command("CLUSTER", "INFO"))

    def stop(self) -> None:
        """SIGTERM each master, then SIGKILL."""
        for process in self.processes:
            stop_process(process)

    def client(self, port: int) -> Any:
        """A plain redis-py client of one master (its own accounting, never the store's data)."""
        import redis

        return redis.Redis(host=HOST, port=port, decode_responses=True)

    def cpu_by_master(self) -> list[float]:
        """Each master's CPU seconds (user + system, /proc), in port order."""
        from hf3fsctl.bench.metadata.processes import cpu_seconds

        return [cpu_seconds(pid) for pid in self.pids()]

    def rss_by_master(self) -> list[int]:
        """Each master's resident set (bytes), in port order."""
        from hf3fsctl.bench.metadata.processes import rss_bytes

        return [rss_bytes(pid) for pid in self.pids()]

    def keys_by_master(self) -> list[int]:
        """Each master's key count (`DBSIZE`), in port order."""
        counts = []
        for port in self.ports:
            with self.client(port) as client:
                counts.append(int(client.dbsize()))
        return counts

    def used_memory(self) -> int:
        """`INFO memory` used_memory summed over the masters."""
        total = 0
        for port in self.ports:
            with self.client(port) as client:
                total += int(client.info("memory")["used_memory"])
        return total

    def script_usec(self) -> tuple[int, int]:
        """(calls, µs) of Lua scripts summed over the masters (`RedisServer.script_usec`)."""
        calls = usec = 0
        for port in self.ports:
            master_calls, master_usec = self._master(port).script_usec()
            calls, usec = calls + master_calls, usec + master_usec
        return calls, usec

    def memory_usage(self, sample_keys: int = 100_000, samples: int = 200) -> dict[str, Any]:
        """`MEMORY USAGE` of each master (`RedisServer.memory_usage`: every key, or a
        sample of `sample_keys` scaled to its key count), summed, by key pattern."""
        total: dict[str, Any] = {"keys": 0, "sampled_keys": 0, "bytes": 0.0}
        patterns: dict[str, dict[str, Any]] = {}
        for port in self.ports:
            usage = self._master(port).memory_usage(sample_keys, samples)
            for name in ("keys", "sampled_keys", "bytes"):
                total[name] += usage[name]
            for pattern, row in usage["by_pattern"].items():
                merged = patterns.setdefault(
                    pattern, {"type": row["type"], "keys": 0, "bytes": 0.0}
                )
                merged["keys"] += row["keys"]
                merged["bytes"] += row["bytes"]
        total["samples_per_key"] = samples
        total["by_pattern"] = dict(sorted(patterns.items(), key=lambda item: -item[1]["bytes"]))
        return total

    def _master(self, port: int) -> RedisServer:
        """A `RedisServer` handle of a running master, for its accounting calls."""
        handle = RedisServer(self.directory)
        handle.port = port
        return handle

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MasterCpu:
    """The masters' CPU as a cell reads it: called, it reads every master's CPU seconds
    and returns their sum (a cell's `server_cpu`), keeping each reading so `window` can
    say how the last window's CPU split between the masters."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.cluster = cluster
        self.readings: list[list[float]] = []

    def __call__(self) -> float:
        reading = self.cluster.cpu_by_master()
        self.readings.append(reading)
        return sum(reading)

    def window(self, number: int | None = None) -> dict[str, Any]:
        """The CPU seconds each master spent in a cell's window — the `number`-th pair of
        readings (None: the last two) — and the busiest master's share of their sum:
        about 1.0 when one master serves the whole store, down to 1/M when M masters
        share the load evenly."""
        pair = self.readings[-2:] if number is None else self.readings[2 * number : 2 * number + 2]
        if len(pair) < 2:
            return {"master_cpu_s": None, "busiest_master_cpu_share": None}
        began, ended = pair
        used = [max(0.0, end - start) for start, end in zip(began, ended, strict=True)]
        total = sum(used)
        return {
            "master_cpu_s": used,
            "busiest_master_cpu_share": max(used) / total if total > 0 else None,
        }
