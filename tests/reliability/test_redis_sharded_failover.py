"""Redis Cluster failover under the sharded store: the store on `redis+cluster://…?shards=4`
over 3 masters with one replica each on loopback (the cluster of
`test_redis_cluster_failover.py`); the master serving shard 0 (the store-wide records,
the change-log cursors, the lookup counters) is killed with SIGKILL after commits to
every shard were acknowledged and replicated, while two writer threads keep allocating
and committing through the same client — each call spanning the shards.

What must hold, as for one slot: every call meanwhile either succeeds or raises the typed
`MetadataUnavailable`; caching resumes on the promoted replica with the same client; no
entry whose commit was acknowledged and replicated (the replica's own
`slave_repl_offset` past the master's offset after the commit) is lost, on any shard, and
each is still found at its page and checksum; every shard holds a sound store. And a
client that only saves (no lookup to refresh its view of the cluster) must resume too.
"""

from __future__ import annotations

import time

import pytest
from helpers.cluster_failover import (
    PROMOTION_WAIT_S,
    SavingWriters,
    cluster,
    lookup_until_answered,
    wait_replicated,
)
from helpers.meta_builders import checksum, commit_items, keys, register
from helpers.redis_servers import RedisClusterServers

from hf3fsctl.errors import MetadataUnavailable
from hf3fsctl.meta.client import open_metadata_client
from hf3fsctl.meta.redis.sharded import ShardedRedisStore

__all__ = ["cluster"]  # the fixture used here

SHARDS = 4
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_killed_master_fails_over_and_every_shard_keeps_what_was_replicated(
    cluster: RedisClusterServers,
) -> None:
    store = open_metadata_client(f"{cluster.url}?shards={SHARDS}", timeout_s=2.0)
    try:
        assert isinstance(store, ShardedRedisStore)
        ns = register(store, num_pages=100_000)
        saved = keys(200, salt="a")
        result = store.allocate(ns, 0, saved)
        assert store.commit(ns, 0, commit_items(result.allocated)) == len(saved)
        assert {store.shard_of(k) for k in saved} == set(range(SHARDS))
        master = cluster.owner("{hf3fsctl}:info")  # shard 0's
        wait_replicated(cluster, master)
        with SavingWriters(store, ns) as writers:
            time.sleep(0.3)
            master.kill()
            found, outcomes = lookup_until_answered(store, ns, saved)
            writers.promoted.set()
            time.sleep(0.5)  # the writers run on the new master too
        untyped, writes = writers.untyped, writers.writes
        assert untyped == []  # every failed call was the typed MetadataUnavailable
        assert writes["ok_after"] > 0 and writes["unavailable"] > 0, writes
        assert "unavailable" in outcomes  # the kill was felt, as the typed error only
        assert found == len(saved)  # nothing acknowledged and replicated was lost
        located = store.locate(ns, 0, saved)
        assert [(loc.page, loc.checksum) if loc else None for loc in located] == [
            (a.page, checksum(a.key, a.page)) for a in result.allocated
        ]
        more = keys(10, salt="b")
        again = store.allocate(ns, 0, more)
        assert store.commit(ns, 0, commit_items(again.allocated)) == len(more)
        assert store.lookup(ns, more) == len(more)
        assert store.check_invariants() == []
    finally:
        store.close()


def test_a_client_that_only_saves_resumes_after_a_failover(cluster: RedisClusterServers) -> None:
    store = open_metadata_client(f"{cluster.url}?shards={SHARDS}", timeout_s=2.0)
    try:
        ns = register(store, num_pages=100_000)
        saved = keys(64, salt="a")
        first = store.allocate(ns, 0, saved)
        assert store.commit(ns, 0, commit_items(first.allocated)) == len(saved)
        master = cluster.owner("{hf3fsctl}:info")
        wait_replicated(cluster, master)
        master.kill()
        deadline = time.monotonic() + PROMOTION_WAIT_S
        while cluster.owner("{hf3fsctl}:info") is master:  # asked of a live node, not the store
            assert time.monotonic() < deadline, f"no new master within {PROMOTION_WAIT_S}s"
            time.sleep(0.1)
        batch, resumed = 0, False
        deadline = time.monotonic() + 6  # seconds to find the new master
        while not resumed and time.monotonic() < deadline:
            chain = keys(16, start=16 * batch, salt="after")  # every shard, each time
            batch += 1
            try:
                got = store.allocate(ns, 0, chain)
                resumed = store.commit(ns, 0, commit_items(got.allocated)) == len(chain)
            except MetadataUnavailable:
                time.sleep(0.2)
        assert resumed, f"no save spanning the shards succeeded in {batch} tries"
        assert len([loc for loc in store.locate(ns, 0, saved) if loc]) == len(saved)
    finally:
        store.close()
