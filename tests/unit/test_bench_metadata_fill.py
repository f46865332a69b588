"""The benchmark's bulk fill (`bench/metadata/stores.py`) writes the rows the store's API does.

A store filled the bulk way (globally sorted keys, the fill connection's large cache and
no fsync) against one filled through the same `allocate` + `commit` calls on a plain
store connection: the same entries (timestamps aside), both sound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hf3fsctl.bench.metadata import stores
from hf3fsctl.bench.metadata.stores import create_store, key
from hf3fsctl.meta.sqlite.store import MetadataStore

ENTRIES = 2_500
CHUNK = 1_000  # three batches, the last one short


def _rows(db: Path, namespace: str) -> tuple[list[dict[str, Any]], list[str], Any]:
    store = MetadataStore(db)
    try:
        entries = store.list_entries(namespace, limit=ENTRIES + 10)
        rows = sorted(
            (e.model_dump(exclude={"created", "last_access"}) for e in entries),
            key=lambda row: row["key"],
        )
        return rows, store.check_invariants(), store.stats()
    finally:
        store.close()


@pytest.fixture
def filled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr(stores, "FILL_CHUNK", CHUNK)
    bulk_spec, bulk_db = create_store(tmp_path / "bulk", "full_1ns", ENTRIES, "t", "r", fork=False)
    with monkeypatch.context() as plain:
        plain.setattr(stores, "bulk_connection", lambda store: None)
        api_spec, api_db = create_store(tmp_path / "api", "full_1ns", ENTRIES, "t", "r", fork=False)
    assert bulk_spec.namespaces == api_spec.namespaces
    ns = bulk_spec.namespaces[0]
    return {"ns": ns, "bulk": _rows(bulk_db, ns), "api": _rows(api_db, ns)}


def test_bulk_fill_writes_the_rows_the_api_fill_does(filled: dict[str, Any]) -> None:
    bulk_rows, _, _ = filled["bulk"]
    api_rows, _, _ = filled["api"]
    assert len(bulk_rows) == ENTRIES
    assert bulk_rows == api_rows


def test_bulk_filled_store_is_sound(filled: dict[str, Any]) -> None:
    for name in ("bulk", "api"):
        _, problems, _ = filled[name]
        assert problems == [], name


def test_bulk_fill_commits_every_key_once(filled: dict[str, Any]) -> None:
    rows, _, stats = filled["bulk"]
    assert {row["key"] for row in rows} == {key("t", i) for i in range(ENTRIES)}
    assert {row["state"] for row in rows} == {"committed"}
    assert sorted(row["page"] for row in rows) == list(range(ENTRIES))
    differing = {
        name
        for name, value in stats.namespaces[0].model_dump().items()
        if filled["api"][2].namespaces[0].model_dump()[name] != value
    }
    assert differing <= {"created", "last_access", "last_used"}, differing  # clock times
