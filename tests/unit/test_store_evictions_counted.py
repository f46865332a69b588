"""Evictions counted by the SQLite store reach `/metrics` (the counting itself is part of
the contract: `tests/contract/test_contract_evictions_counted.py`)."""

from __future__ import annotations

from pathlib import Path

from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.sqlite.store import MetadataStore


def test_evictions_are_exported_to_prometheus(tmp_path: Path) -> None:
    from hf3fsctl.meta.server.metrics import ServerMetrics

    store = MetadataStore(tmp_path / "m.db")
    ns = register(store)
    store_keys(store, ns, keys(3))
    store.evict(EvictRequest(all=True))
    text = ServerMetrics(store).render()[0].decode()
    assert f'hf3fsctl_evicted_keys_total{{namespace="{ns}",reason="admin"}} 3.0' in text
