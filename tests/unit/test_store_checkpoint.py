"""Background WAL checkpoints: the server's store moves committed pages into the
database file from its own thread, not inside a caller's commit."""

from __future__ import annotations

import time
from pathlib import Path

from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.sqlite.store import MetadataStore


def test_background_checkpointer_copies_the_wal_into_the_database(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db", background_checkpoint=True)
    ns = register(store, num_pages=10_000)
    time.sleep(0.6)  # the registration's pages are checkpointed
    before = (tmp_path / "m.db").stat().st_size
    for chain in range(40):
        store_keys(store, ns, keys(64, start=64 * chain))
    deadline = time.monotonic() + 5
    while (tmp_path / "m.db").stat().st_size == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "m.db").stat().st_size > before
    store.close()
