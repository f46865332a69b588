"""What the Redis Cluster failover tests share (`tests/reliability/test_redis_cluster_failover.py`,
`test_redis_sharded_failover.py`): a 3-master cluster with a replica each, waiting until a
master's replica holds what it acknowledged, writer threads saving through one client
across the kill, and a lookup asked until a new master answers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.meta_builders import commit_items, keys
from helpers.redis_servers import RedisClusterServers, RedisServer
from hf3fsctl.errors import MetadataUnavailable

PROMOTION_WAIT_S = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """3 masters with one replica each, for this test."""
    servers = RedisClusterServers(tmp_path / "cluster", masters=3, replicas=1).start()
    try:
        yield servers
    finally:
        servers.stop()


def _offset(server: Any, field: str) -> int:
    conn = server.client()
    try:
        return int(conn.info("replication").get(field, -1))
    finally:
        conn.close()


def _replicates(server: Any, master: Any) -> bool:
    conn = server.client()
    try:
        info = conn.info("replication")
    finally:
        conn.close()
    return bool(info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port)


def wait_replicated(cluster: RedisClusterServers, master: RedisServer) -> None:
    """Until `master`'s replica has what the master acknowledged so far (then a kill loses
    none of it, and the replica may be promoted)."""
    replica = next(s for s in cluster.servers if _replicates(s, master))
    acked = _offset(master, "master_repl_offset")
    deadline = time.monotonic() + 10
    while _offset(replica, "slave_repl_offset") < acked:
        assert time.monotonic() < deadline, "the replica never caught up"
        time.sleep(0.02)


class SavingWriters:
    """Threads allocating and committing 8-key batches of `ns` through `store` until
    stopped: `writes` counts the saves that succeeded (`ok`; `ok_after` once `promoted` is
    set) and the typed failures (`unavailable`); `untyped` holds any other exception."""

    def __init__(self, store: Any, ns: str, count: int = 2) -> None:
        self.store, self.ns = store, ns
        self.stop = threading.Event()
        self.promoted = threading.Event()
        self.untyped: list[BaseException] = []
        self.writes = {"ok": 0, "unavailable": 0, "ok_after": 0}
        self.threads = [threading.Thread(target=self._write, args=(i,)) for i in range(count)]

    def __enter__(self) -> SavingWriters:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def _write(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            batch = keys(8, start=n, salt=f"w{i}")
            n += 8
            try:
                got = self.store.allocate(self.ns, 0, batch)
                self.store.commit(self.ns, 0, commit_items(got.allocated))
                self.writes["ok"] += 1
                self.writes["ok_after"] += self.promoted.is_set()
            except MetadataUnavailable:
                self.writes["unavailable"] += 1
                time.sleep(0.05)
            except BaseException as exc:  # anything else fails the test
                self.untyped.append(exc)
                return


def lookup_until_answered(store: Any, ns: str, saved: list[str]) -> tuple[int, list[str]]:
    """Ask `lookup` until a master answers: (what it found, each try's outcome)."""
    outcomes: list[str] = []
    deadline = time.monotonic() + PROMOTION_WAIT_S
    while True:
        try:
            found = store.lookup(ns, saved)
            outcomes.append("ok")
            return found, outcomes
        except MetadataUnavailable:
            outcomes.append("unavailable")
        assert time.monotonic() < deadline, f"no new master within {PROMOTION_WAIT_S}s"
        time.sleep(0.1)
