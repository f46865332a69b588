"""Background WAL checkpoints: the server's store moves committed pages into the
database file from its own thread, not inside a caller's commit."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.sqlite.store import MetadataStore


def _checkpoint_now(path: Path) -> None:
    """Copy the whole WAL into the database file from this thread (a `PASSIVE`
    checkpoint, retried while the store's own checkpointer holds the WAL)."""
    conn = sqlite3.connect(path)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            busy, logged, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            if not busy and logged == copied:
                return
            time.sleep(0.01)
        raise AssertionError("the WAL could not be checkpointed in 5 s")
    finally:
        conn.close()


def test_background_checkpointer_copies_the_wal_into_the_database(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db", background_checkpoint=True)
    ns = register(store, num_pages=10_000)
    _checkpoint_now(tmp_path / "m.db")  # the registration's pages: the baseline
    before = (tmp_path / "m.db").stat().st_size
    for chain in range(40):
        store_keys(store, ns, keys(64, start=64 * chain))
    deadline = time.monotonic() + 5
    while (tmp_path / "m.db").stat().st_size == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "m.db").stat().st_size > before
    store.close()
