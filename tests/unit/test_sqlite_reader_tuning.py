"""The lookup connection's tuning (issue 21): its page cache and mmap reach the SQLite
connection that answers lookups, and no other connection of the store."""

from __future__ import annotations

import threading
from pathlib import Path

from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.sqlite import MetadataStore
from hf3fsctl.meta.sqlite.database import CACHE_KIB


def _pragmas(store: MetadataStore) -> tuple[int, int]:
    """(cache_size, mmap_size) of this thread's connection of `store`."""
    conn = store._conn()
    return (
        int(conn.execute("PRAGMA cache_size").fetchone()[0]),
        int(conn.execute("PRAGMA mmap_size").fetchone()[0]),
    )


def test_knobs_reach_the_lookup_connection_only(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db", lookup_cache_kib=4096, mmap_bytes=1 << 20)
    try:
        ns = register(store)
        chain = keys(8)
        store_keys(store, ns, chain)
        writer: list[tuple[int, int]] = []
        other = threading.Thread(target=lambda: writer.append(_pragmas(store)))
        other.start()
        other.join()
        assert _pragmas(store) == (-CACHE_KIB, 0)  # before its first lookup: the default
        assert store.lookup(ns, chain) == 8
        assert _pragmas(store) == (-4096, 1 << 20)
        assert writer == [(-CACHE_KIB, 0)]  # another thread's connection: untouched
        assert store.lookup_tuning() == {"cache_kib": 4096, "mmap_bytes": 1 << 20}
    finally:
        store.close()


def test_defaults_are_every_connections(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db")
    try:
        ns = register(store)
        store_keys(store, ns, keys(4))
        assert store.lookup(ns, keys(4)) == 4
        assert _pragmas(store) == (-CACHE_KIB, 0)  # 2 MiB, no mmap: measured best at 10^7
        assert store.lookup_tuning() == {"cache_kib": CACHE_KIB, "mmap_bytes": 0}
    finally:
        store.close()
