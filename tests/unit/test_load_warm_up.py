"""The first load's one-time costs paid at registration (issue 23): the SQLite store's
`prepare_locate_pages` (and `Tier.warm_up`, which calls it) compiles the lease statements
on the calling thread's connection and changes nothing a reader sees.

"Compiles no statement" is checked with SQLite's authorizer, which SQLite calls while it
prepares a statement and never when a cached one runs again. The authorizer is set before
anything is warmed: setting one expires the connection's prepared statements.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.meta_builders import (
    PAGE_BYTES,
    keys,
    register,
    register_growable,
    sqlite_compiles,
    store_keys,
)

from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.storage.posix import PosixEngine
from hf3fsctl.tier import LOADED, StagingRows, Tier


def _what_a_reader_sees(path: Path) -> tuple[Any, ...]:
    """Entries (hits, access times, leases), namespaces (hits, last use) and key LRU rows,
    read through a connection of its own."""
    conn = sqlite3.connect(path)
    try:
        return tuple(
            conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2, 3").fetchall()
            for table in ("entries", "namespaces", "key_lru")
        )
    finally:
        conn.close()


def _wal_bytes(path: Path) -> int:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_prepare_locate_pages_changes_nothing_a_reader_sees(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = MetadataStore(path)
    ns = register(store)
    chain = keys(12)
    store_keys(store, ns, chain)
    store.locate_pages(ns, 0, chain[:3])  # some hits and leases to keep
    before, wal = _what_a_reader_sees(path), _wal_bytes(path)
    watcher = sqlite3.connect(path)  # its data_version moves when another one commits
    version = watcher.execute("PRAGMA data_version").fetchone()
    store.prepare_locate_pages(ns, 0)
    assert store._conn().in_transaction is False
    assert _what_a_reader_sees(path) == before
    assert watcher.execute("PRAGMA data_version").fetchone() == version  # nothing committed
    assert _wal_bytes(path) == wal
    watcher.close()
    assert store.check_invariants() == []
    store.close()


def test_the_first_locate_after_it_compiles_no_statement(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store, num_pages=300)
    chain = keys(200)
    store_keys(store, ns, chain)
    store.close()
    # a fresh store object: a fresh connection, as in a process that just started
    fresh = MetadataStore(tmp_path / "m.db")
    compiled = sqlite_compiles(fresh)
    fresh.prepare_locate_pages(ns, 0)
    assert "entries" in {table for _, table in compiled}, compiled  # it did compile them
    compiled.clear()
    for count in (1, 9, 36, 200):  # each of the four padded sizes
        located = fresh.locate_pages(ns, 0, chain[:count])
        assert [page.key for page in located if page is not None] == chain[:count]
    assert compiled == []
    fresh.close()


def test_without_it_the_first_locate_compiles_the_lease_statement(tmp_path: Path) -> None:
    """The control of the test above: the authorizer does see a cold locate's compile."""
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store)
    chain = keys(4)
    store_keys(store, ns, chain)
    store.close()
    fresh = MetadataStore(tmp_path / "m.db")
    compiled = sqlite_compiles(fresh)
    fresh.locate_pages(ns, 0, chain)
    assert (sqlite3.SQLITE_UPDATE, "entries") in compiled
    fresh.close()


def test_a_read_only_store_has_nothing_to_prepare(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    store = MetadataStore(path)
    ns = register(store)
    store.close()
    reader = MetadataStore(path, read_only=True)
    reader.prepare_locate_pages(ns, 0)  # no write transaction: it would fail
    reader.close()


@pytest.fixture
def tier_over_store(tmp_path: Path) -> Iterator[tuple[Tier, MetadataStore, list[str]]]:
    root = tmp_path / "root"
    root.mkdir()
    seed = MetadataStore(tmp_path / "meta.db")
    seed.set_capacity(64 * PAGE_BYTES)
    ns, files = register_growable(seed, root)
    engine = PosixEngine(io_threads=1)
    chain = keys(5)
    rows = [np.full(PAGE_BYTES, i + 1, dtype=np.uint8) for i in range(len(chain))]
    saved = Tier(ns, 0, files[0], engine, lambda fn: fn(seed)).save(chain, rows)
    assert saved.count("saved") == len(chain), saved.kinds
    seed.close()
    store = MetadataStore(tmp_path / "meta.db")
    yield Tier(ns, 0, files[0], engine, lambda fn: fn(store)), store, chain
    engine.close()
    files[0].close()
    store.close()


def test_a_warmed_up_tier_loads_without_compiling(
    tier_over_store: tuple[Tier, MetadataStore, list[str]],
) -> None:
    tier, store, chain = tier_over_store
    compiled = sqlite_compiles(store)
    tier.warm_up()
    assert compiled
    compiled.clear()
    out = [np.zeros(PAGE_BYTES, dtype=np.uint8) for _ in chain]
    outcome = tier.load(chain, StagingRows(out))
    assert outcome.kinds == [LOADED] * len(chain)
    assert [int(row[0]) for row in out] == [1, 2, 3, 4, 5]
    assert compiled == []


def test_a_warm_up_that_fails_leaves_the_load_to_pay(
    tier_over_store: tuple[Tier, MetadataStore, list[str]],
) -> None:
    tier, _, chain = tier_over_store

    def down(fn: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")

    Tier(tier.namespace, 0, tier.page_file, tier.engine, down).warm_up()  # does not raise
    out = [np.zeros(PAGE_BYTES, dtype=np.uint8) for _ in chain]
    assert tier.load(chain, StagingRows(out)).kinds == [LOADED] * len(chain)
