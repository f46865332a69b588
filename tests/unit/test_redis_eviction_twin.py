"""Redis's eviction decides as SQLite's does, step by step, on random traffic.

`lua/eviction.lua` decides a round's victims one at a time from entries it reads in
chunks and writes them together; `meta/sqlite/eviction.py` is its twin. The same seeded
sequence of saves (chains of several depths), pending allocations, touches (`locate`,
which also leases), pins, and entries that expire runs against both stores, full so
that most saves evict; after every step both must hold the same entries, and each
allocate must have granted and refused the same keys. The contract suite checks each
rule alone; this checks them mixed, where a batched walk could drift (a key met twice,
a pinned or leased key between victims, a rank that lacks the key).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import PAGE_BYTES as PAGE
from helpers.meta_builders import commit_items, rank_file
from helpers.redis_servers import redis_session_server, redis_url

from hf3fsctl.config import MetadataUrl
from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.redis import RedisMetadataStore
from hf3fsctl.meta.sqlite.store import MetadataStore

__all__ = ["redis_session_server", "redis_url"]  # fixtures used here

PAGES = 48  # what the store holds: every few saves evict
EXPIRY_S = 0.2  # retention of the entries that expire during a run


def _register(store: Any, ranks: int, full: str) -> str:
    manifest = {"model": "twin", "tp_size": ranks, "pp_size": 1, "page_bytes": PAGE}
    ns = namespace_id(manifest)
    store.register_namespace(ns, manifest)
    num_pages = PAGES if full == "file" else 1 << 20
    for rank in range(ranks):
        store.register_rank(ns, rank_file(ns, rank, num_pages))
    if full == "capacity":
        store.set_capacity(PAGES * ranks * PAGE)
    return ns


def _entries(store: Any, ns: str) -> set[tuple[str, int, str]]:
    return {(e.key, e.rank, e.state) for e in store.list_entries(ns, limit=100_000)}


def _step(
    rng: random.Random, stores: list[Any], ns: str, ranks: int, saved: list[str], step: int
) -> list[Any]:
    """One random operation on every store; what each answered."""
    roll = rng.random()
    if roll < 0.12 and saved:  # touch (and lease) a few keys
        keys = rng.sample(saved, min(len(saved), rng.randint(1, 3)))
        rank = rng.randrange(ranks)
        return [[loc is not None for loc in s.locate(ns, rank, keys)] for s in stores]
    if roll < 0.2 and saved:  # pin a key, or drop every pin
        if rng.random() < 0.25:
            return [s.unpin(ns) for s in stores]
        keys = [rng.choice(saved)]
        return [s.pin(ns, keys).pinned for s in stores]
    # a chain of new keys, on every rank (the key's ranks commit one after another);
    # some stay pending on one rank, some expire soon
    length = rng.randint(1, 10)
    keys = [f"{step:08x}{i:08x}" for i in range(length)]
    first_depth = rng.randint(0, 3)
    pending_rank = rng.randrange(ranks) if rng.random() < 0.1 else None
    retention = EXPIRY_S if rng.random() < 0.1 else None
    answers: list[Any] = []
    for store in stores:
        got = []
        for rank in range(ranks):
            result = store.allocate(ns, rank, keys, first_depth=first_depth)
            got.append((sorted(a.key for a in result.allocated), sorted(result.no_space)))
            if rank != pending_rank:
                store.commit(ns, rank, commit_items(result.allocated, retention_s=retention))
        answers.append(got)
    saved.extend(keys)
    return answers


@pytest.mark.parametrize(
    ("ranks", "full", "seed"),
    [(1, "file", 1), (1, "capacity", 2), (2, "file", 3), (2, "capacity", 4)],
    ids=["one-rank-file-full", "one-rank-capacity", "two-ranks-file-full", "two-ranks-capacity"],
)
def test_redis_evicts_what_sqlite_evicts(
    redis_url: str, tmp_path: Path, ranks: int, full: str, seed: int
) -> None:
    options: dict[str, Any] = {"lease_s": 3600.0, "high_watermark": 0.9, "low_watermark": 0.7}
    sqlite = MetadataStore(tmp_path / "twin.db", **options)
    redis = RedisMetadataStore(MetadataUrl.parse(redis_url), timeout_s=5, **options)
    stores = [sqlite, redis]
    try:
        namespaces = {_register(s, ranks, full) for s in stores}
        assert len(namespaces) == 1
        ns = namespaces.pop()
        rng = random.Random(seed)
        saved: list[str] = []
        for step in range(120):
            answers = _step(rng, stores, ns, ranks, saved, step)
            assert answers[0] == answers[1], f"step {step}: the answers differ"
            assert _entries(sqlite, ns) == _entries(redis, ns), f"step {step}: entries differ"
            if step % 40 == 39:  # the short retentions pass: expired keys go first
                time.sleep(EXPIRY_S * 1.5)
            time.sleep(0.002)  # distinct access times (SQLite's clock is its own)
        assert redis.check_invariants() == []
        assert sqlite.check_invariants() == []
    finally:
        redis.close()
        sqlite.close()
