"""`hf3fsctl evict` on SQLite in transactions of at most `ADMIN_EVICT_KEYS` keys: the
same keys go, in the same order, as in one transaction, and the writer lock is let go
between them (a large store's every save waits on it otherwise)."""

from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.sqlite import store as sqlite_store
from hf3fsctl.meta.sqlite.store import MetadataStore

# Two namespaces, one of 2 ranks; chains committed apart (distinct last accesses); a
# pinned key and a pending one (neither may go).
CHAINS = 6
CHAIN = 7


def _fill(path: Path) -> tuple[list[str], list[list[str]]]:
    store = MetadataStore(path, high_watermark=1.0, low_watermark=0.9)
    a, b = (
        register(store, num_pages=200, model="a"),
        register(store, num_pages=200, tp_size=2, model="b"),
    )
    chains = []
    for i in range(CHAINS):
        chain = keys(CHAIN, salt=f"c{i}")
        store_keys(store, a if i % 2 else b, chain, ranks=1 if i % 2 else 2)
        chains.append(chain)
        time.sleep(0.002)
    store.pin(a, chains[1][:1])
    store.allocate(a, 0, keys(3, salt="pending"))
    store.close()
    return [a, b], chains


def _evicted(path: Path, request: EvictRequest) -> tuple[Any, list[tuple[str, str, int]]]:
    store = MetadataStore(path)
    try:
        result = store.evict(request)
    finally:
        store.close()
    conn = sqlite3.connect(path)
    try:
        left = conn.execute(
            "SELECT namespace, key, rank FROM entries ORDER BY namespace, key, rank"
        ).fetchall()
    finally:
        conn.close()
    return result, left


@pytest.mark.parametrize(
    "criteria",
    [
        {"all": True},
        {"max_entries": 11},
        {"max_entries": 3},
        {"target_usage": 0.05},
        {"all": True, "include_pinned": True},
        {"all": True, "namespace": "first"},
        {"older_than_s": 0.0},
    ],
)
def test_batched_eviction_leaves_what_one_transaction_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, criteria: dict[str, Any]
) -> None:
    namespaces, _ = _fill(tmp_path / "m.db")
    if criteria.get("namespace") == "first":
        criteria = criteria | {"namespace": namespaces[0]}
    shutil.copy(tmp_path / "m.db", tmp_path / "ref.db")
    request = EvictRequest(**criteria)
    expected = _evicted(tmp_path / "ref.db", request)  # the default: one transaction here

    commits: list[str] = []
    real_conn = MetadataStore._conn

    def traced(self: MetadataStore) -> sqlite3.Connection:
        conn = real_conn(self)
        conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
        return conn

    monkeypatch.setattr(sqlite_store, "ADMIN_EVICT_KEYS", 4)
    monkeypatch.setattr(MetadataStore, "_conn", traced)
    got = _evicted(tmp_path / "m.db", request)
    assert got == expected
    assert expected[0].keys > 0
    assert len(commits) >= -(-expected[0].keys // 4)  # at most 4 keys per transaction


def test_a_dry_run_is_one_transaction_that_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(tmp_path / "m.db")
    shutil.copy(tmp_path / "m.db", tmp_path / "ref.db")
    monkeypatch.setattr(sqlite_store, "ADMIN_EVICT_KEYS", 4)
    dry, left = _evicted(tmp_path / "m.db", EvictRequest(all=True, dry_run=True))
    real, _ = _evicted(tmp_path / "ref.db", EvictRequest(all=True))
    conn = sqlite3.connect(tmp_path / "m.db")
    before = conn.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
    conn.close()
    assert (dry.keys, dry.pages, dry.by_namespace) == (real.keys, real.pages, real.by_namespace)
    assert dry.dry_run and len(left) == before and real.keys > 4
