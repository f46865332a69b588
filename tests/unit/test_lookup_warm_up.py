"""The first lookup's one-time costs paid when the store is opened (issue 23).

`leading_hits` pads its IN list to a few fixed sizes (repeating the last key), and the
SQLite store's `prepare_lookup` compiles those statements (and the key cache's reads of
the log) on the calling thread's connection: a first lookup of any length then compiles
nothing, answers what an unpadded probe would, and the warm-up changes nothing stored.

"Compiles nothing" is checked with SQLite's authorizer (called while SQLite prepares a
statement, never when a cached one runs again), set before anything is warmed: setting
one expires the connection's prepared statements.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import commit_items, keys, register, sqlite_compiles, store_keys

from hf3fsctl.meta.sqlite import committed_index
from hf3fsctl.meta.sqlite.lookup_cache import CommittedKeyCache
from hf3fsctl.meta.sqlite.store import MetadataStore

STORED = 1_000
SIZES = [1, 9, 18, 64, 65, 200, 1_000]


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[str]]:
    """A store file holding `STORED` committed keys of one namespace."""
    path = tmp_path_factory.mktemp("lookup") / "m.db"
    store = MetadataStore(path)
    ns = register(store, num_pages=STORED + 10)
    chain = keys(STORED)
    store_keys(store, ns, chain)
    store.close()
    return path, ns, chain


def _asked(chain: list[str], size: int, hits: int) -> list[str]:
    """`size` keys whose first `hits` are stored, then a miss, then stored keys again
    (a lookup stops at its first miss)."""
    missing = keys(size, salt="missing")
    asked = chain[:hits] + missing[hits : hits + 1] + chain[hits + 1 : size]
    return asked[:size]


CASES = [
    (size, hits)
    for size in SIZES
    for hits in sorted({0, 1, size // 2, size - 1, size})
    if hits <= size
]


@pytest.mark.parametrize(("size", "hits"), CASES, ids=[f"{s}keys-{h}hits" for s, h in CASES])
def test_a_padded_lookup_stops_where_the_hits_do(
    stored: tuple[Path, str, list[str]], size: int, hits: int
) -> None:
    path, ns, chain = stored
    store = MetadataStore(path, read_only=True)
    asked = _asked(chain, size, hits)
    assert store.lookup(ns, asked) == hits  # from SQLite
    assert store.lookup(ns, asked) == hits  # the found keys from the cache
    store.close()


def test_expired_keys_end_a_padded_lookup(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store, num_pages=100)
    chain = keys(70)
    for part, retention in ((chain[:40], 1_000.0), (chain[40:], 50.0)):
        result = store.allocate(ns, 0, part)
        store.commit(ns, 0, commit_items(result.allocated, retention))
    conn, cache = store._conn(), CommittedKeyCache()
    now = time.time()
    for at, expected in ((now, 70), (now + 100, 40), (now + 2_000, 0)):
        with_cache = committed_index.leading_hits(conn, ns, chain, 1, at, cache=cache)
        without = committed_index.leading_hits(conn, ns, chain, 1, at)
        assert (with_cache, without) == (expected, expected)
    store.close()


def test_after_prepare_lookup_no_first_lookupsqlite_compiles(
    stored: tuple[Path, str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, ns, chain = stored
    fresh = MetadataStore(path)  # a fresh connection, as in a process that just started
    # the lookup counters' once-a-second write is not a lookup's statement
    monkeypatch.setattr(fresh, "_flush_if_free", lambda: None)
    compiled = sqlite_compiles(fresh)
    fresh.prepare_lookup()
    assert "key_lru" in {table for _, table in compiled}, compiled  # it did compile them
    compiled.clear()
    for size in SIZES:
        for hits in (size, size // 2):
            assert fresh.lookup(ns, _asked(chain, size, hits)) == hits
    assert compiled == []
    fresh.close()


def test_without_it_a_first_lookup_compiles_its_probe(stored: tuple[Path, str, list[str]]) -> None:
    """The control of the test above: the authorizer does see a cold lookup's compile."""
    path, ns, chain = stored
    fresh = MetadataStore(path)
    compiled = sqlite_compiles(fresh)
    assert fresh.lookup(ns, chain[:9]) == 9
    assert (sqlite3.SQLITE_READ, "key_lru") in compiled
    fresh.close()


def _what_a_reader_sees(path: Path) -> tuple[Any, ...]:
    conn = sqlite3.connect(path)
    try:
        return tuple(
            conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2, 3").fetchall()
            for table in ("entries", "namespaces", "key_lru", "changes")
        )
    finally:
        conn.close()


def test_prepare_lookup_changes_nothing_stored_or_cached(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = MetadataStore(path)
    ns = register(store)
    chain = keys(12)
    store_keys(store, ns, chain)
    assert store.lookup(ns, chain[:5]) == 5  # some cached keys and pending counters
    cached = dict(store._committed_keys.cached(ns) or {})
    pending = {n: list(c) for n, c in store._pending.by_namespace.items()}
    before, wal = _what_a_reader_sees(path), Path(f"{path}-wal").stat().st_size
    watcher = sqlite3.connect(path)
    version = watcher.execute("PRAGMA data_version").fetchone()
    store.prepare_lookup()
    assert store._conn().in_transaction is False
    assert _what_a_reader_sees(path) == before
    assert watcher.execute("PRAGMA data_version").fetchone() == version
    assert Path(f"{path}-wal").stat().st_size == wal
    assert store._committed_keys.cached(ns) == cached
    assert {n: list(c) for n, c in store._pending.by_namespace.items()} == pending
    watcher.close()
    assert store.check_invariants() == []
    store.close()


def test_a_read_only_store_prepares_its_lookups_too(stored: tuple[Path, str, list[str]]) -> None:
    path, ns, chain = stored
    reader = MetadataStore(path, read_only=True)
    compiled = sqlite_compiles(reader)
    reader.prepare_lookup()  # a read transaction: a reader looks up as a writer does
    compiled.clear()
    assert reader.lookup(ns, chain[:18]) == 18
    assert compiled == []
    reader.close()
