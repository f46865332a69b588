"""Redis Cluster failover under the store: 3 masters with one replica each on loopback,
the store on `redis+cluster://`; the master serving the store's slot (its hash tag) is
killed with SIGKILL after commits were acknowledged and replicated, while two writer
threads keep allocating and committing through the same client.

What must hold, as for Sentinel (`test_redis_failover.py`): every call meanwhile either
succeeds or raises the typed `MetadataUnavailable`; caching resumes on the promoted
replica with the same client; no entry whose commit was acknowledged and replicated (the
replica's own `slave_repl_offset` past the master's offset after the commit) is lost;
the new master holds a sound store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import commit_items, keys, register
from helpers.redis_servers import RedisClusterServers

from hf3fsctl.errors import MetadataUnavailable
from hf3fsctl.meta.client import open_metadata_client

PROMOTION_WAIT_S = 60.0
pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
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
    return info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port


def test_a_killed_master_fails_over_and_keeps_what_was_replicated(
    cluster: RedisClusterServers,
) -> None:
    store = open_metadata_client(cluster.url, timeout_s=2.0)
    try:
        ns = register(store, num_pages=100_000)
        saved = keys(200, salt="a")
        result = store.allocate(ns, 0, saved)
        assert store.commit(ns, 0, commit_items(result.allocated)) == len(saved)
        master = cluster.owner("{hf3fsctl}:info")
        replica = next(s for s in cluster.servers if _replicates(s, master))
        acked = _offset(master, "master_repl_offset")
        deadline = time.monotonic() + 10
        while _offset(replica, "slave_repl_offset") < acked:  # replicated: safe to kill
            assert time.monotonic() < deadline, "the replica never caught up"
            time.sleep(0.02)
        stop = threading.Event()
        untyped: list[BaseException] = []
        writes = {"ok": 0, "unavailable": 0}

        def writer(i: int) -> None:
            n = 0
            while not stop.is_set():
                batch = keys(8, start=n, salt=f"w{i}")
                n += 8
                try:
                    got = store.allocate(ns, 0, batch)
                    store.commit(ns, 0, commit_items(got.allocated))
                    writes["ok"] += 1
                except MetadataUnavailable:
                    writes["unavailable"] += 1
                    time.sleep(0.05)
                except BaseException as exc:  # anything else fails the test
                    untyped.append(exc)
                    return

        writers = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        for thread in writers:
            thread.start()
        time.sleep(0.3)
        master.kill()
        outcomes: list[str] = []
        deadline = time.monotonic() + PROMOTION_WAIT_S
        while True:
            try:
                found = store.lookup(ns, saved)
                outcomes.append("ok")
                break
            except MetadataUnavailable:
                outcomes.append("unavailable")
            assert time.monotonic() < deadline, f"no new master within {PROMOTION_WAIT_S}s"
            time.sleep(0.1)
        time.sleep(0.5)  # the writers run on the new master too
        stop.set()
        for thread in writers:
            thread.join(30)
        assert untyped == []  # every failed call was the typed MetadataUnavailable
        assert writes["ok"] > 0 and writes["unavailable"] > 0, writes
        assert "unavailable" in outcomes  # the kill was felt, as the typed error only
        assert found == len(saved)  # nothing acknowledged and replicated was lost
        more = keys(10, salt="b")
        again = store.allocate(ns, 0, more)
        assert store.commit(ns, 0, commit_items(again.allocated)) == len(more)
        assert store.check_invariants() == []
    finally:
        store.close()
