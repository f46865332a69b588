"""MetadataStore internals the contract suite cannot set through a config (the writer
deadline). The contract itself — namespaces, lookup, locate, allocate, commit, release,
stats — runs on every store in `tests/contract/test_contract_data_path.py`."""

from __future__ import annotations

import time
from pathlib import Path

from helpers.meta_builders import keys, register

from hf3fsctl.meta.sqlite.store import MetadataStore


def test_allocate_reclaims_pending_of_dead_writer(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db", pending_timeout_s=0.01)
    ns = register(store)
    first = store.allocate(ns, 0, keys(1)).allocated
    time.sleep(0.02)
    assert store.allocate(ns, 0, keys(1)).allocated == first
