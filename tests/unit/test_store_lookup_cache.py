"""The lookup cache of the SQLite store (issue 21): keys a lookup found are answered from
memory, and the cache stays exact — whatever another process (another store on the same
file) drops, the next lookup misses it."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.meta_builders import commit_items, keys, register, store_keys

from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.sqlite import lookup_cache
from hf3fsctl.meta.sqlite.store import MetadataStore


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[MetadataStore, MetadataStore, str, list[str]]]:
    """Two stores on one file (two processes' views), 8 keys stored and looked up by the
    first, so that it caches them."""
    first = MetadataStore(tmp_path / "m.db")
    other = MetadataStore(tmp_path / "m.db")
    ns = register(first, tp_size=2)
    chain = keys(8)
    store_keys(first, ns, chain, ranks=2)
    assert first.lookup(ns, chain) == 8
    assert len(first._committed_keys) == 8
    yield first, other, ns, chain
    first.close()
    other.close()


def test_a_cached_prefix_is_answered_without_probing_sqlite(
    two: tuple[MetadataStore, MetadataStore, str, list[str]],
) -> None:
    first, _, ns, chain = two
    conn = first._conn()
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    assert first.lookup(ns, chain) == 8
    conn.set_trace_callback(None)
    assert not any("key_lru" in sql for sql in statements), statements


def test_a_key_another_process_evicts_is_missed(
    two: tuple[MetadataStore, MetadataStore, str, list[str]],
) -> None:
    first, other, ns, chain = two
    other.evict(EvictRequest(namespace=ns, max_entries=3))  # the chain's tail
    assert first.lookup(ns, chain) == other.lookup(ns, chain) == 5


def test_a_key_another_process_invalidates_on_one_rank_is_missed(
    two: tuple[MetadataStore, MetadataStore, str, list[str]],
) -> None:
    first, other, ns, chain = two
    (location,) = other.locate(ns, 1, chain[2:3])
    assert location is not None
    assert other.invalidate(ns, 1, [location]) == 1
    assert first.lookup(ns, chain) == 2


def test_a_dropped_namespace_is_missed(
    two: tuple[MetadataStore, MetadataStore, str, list[str]],
) -> None:
    first, other, ns, chain = two
    other.drop_namespaces([ns])
    register(other, tp_size=2)
    assert first.lookup(ns, chain) == 0


def test_a_cache_behind_a_pruned_log_starts_over(
    two: tuple[MetadataStore, MetadataStore, str, list[str]],
) -> None:
    first, other, ns, chain = two
    other.evict(EvictRequest(namespace=ns, max_entries=1))
    store_keys(other, ns, keys(2, salt="more"), ranks=2)
    conn = sqlite3.connect(first.path, isolation_level=None)
    conn.execute("DELETE FROM changes")  # pruned before the first store read the -1
    conn.close()
    assert first.lookup(ns, chain) == 7


def test_an_expired_cached_key_is_missed_and_a_renewed_one_asked_again(tmp_path: Path) -> None:
    first = MetadataStore(tmp_path / "m.db")
    other = MetadataStore(tmp_path / "m.db")
    ns = register(first)
    plain, renewed = keys(1, salt="plain"), keys(1, salt="renewed")
    for chain, renew in ((plain, False), (renewed, True)):
        result = first.allocate(ns, 0, chain)
        first.commit(
            ns,
            0,
            commit_items(result.allocated, 0.3, renew),
        )
    assert first.lookup(ns, plain) == first.lookup(ns, renewed) == 1  # cached, expiring
    other.locate(ns, 0, renewed)  # renewed by another process: no change row
    time.sleep(0.31)
    renewed_until = other.list_entries(ns, limit=10)
    assert first.lookup(ns, plain) == 0
    if any(e.key == renewed[0] and (e.expires_at or 0) > time.time() for e in renewed_until):
        assert first.lookup(ns, renewed) == 1
    first.close()
    other.close()


def test_the_cache_holds_at_most_its_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookup_cache, "CACHED_KEYS", 10)
    store = MetadataStore(tmp_path / "m.db")
    store._committed_keys = lookup_cache.CommittedKeyCache(10)
    ns = register(store)
    for start in range(0, 40, 8):
        chain = keys(8, start=start)
        store_keys(store, ns, chain)
        assert store.lookup(ns, chain) == 8
        assert len(store._committed_keys) <= 10
    assert store.lookup(ns, keys(40)) == 40  # correct whatever it holds
    store.close()
