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

import time

import pytest
from helpers.cluster_failover import (
    SavingWriters,
    cluster,
    lookup_until_answered,
    wait_replicated,
)
from helpers.meta_builders import commit_items, keys, register
from helpers.redis_servers import RedisClusterServers

from hf3fsctl.meta.client import open_metadata_client

__all__ = ["cluster"]  # the fixture used here
pytestmark = [pytest.mark.integration, pytest.mark.slow]


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
        wait_replicated(cluster, master)  # replicated: safe to kill
        with SavingWriters(store, ns) as writers:
            time.sleep(0.3)
            master.kill()
            found, outcomes = lookup_until_answered(store, ns, saved)
            time.sleep(0.5)  # the writers run on the new master too
        untyped, writes = writers.untyped, writers.writes
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
