"""`check_invariants` catches each kind of corruption (written into the DB by hand)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.sqlite.store import MetadataStore

CORRUPTIONS = {
    "page-free-and-owned": (
        "INSERT INTO free_pages SELECT namespace, rank, page, 0, 0 FROM entries LIMIT 1",
        "both free and owned",
    ),
    "page-out-of-range": ("UPDATE entries SET page = 999 WHERE depth = 0", "outside"),
    "committed-without-checksum": (
        "UPDATE entries SET checksum = NULL WHERE depth = 0",
        "no checksum",
    ),
    "used-count-wrong": ("UPDATE rank_files SET used = used + 1", "used pages"),
    "page-leaked": ("UPDATE rank_files SET next_unused = next_unused + 1", "leak"),
    "leased-page-reused": (
        "UPDATE entries SET page_free_at = created + 10 WHERE depth = 0",
        "while its last lease",
    ),
    "pending-without-deadline": (
        "UPDATE entries SET state = 0, deadline = NULL WHERE depth = 0",
        "no writer deadline",
    ),
    "rank-beyond-namespace": (
        "UPDATE namespaces SET num_ranks = 0",
        "ranks",
    ),
}


@pytest.mark.parametrize(
    ("statement", "message"), list(CORRUPTIONS.values()), ids=list(CORRUPTIONS)
)
def test_check_invariants_reports_corruption(tmp_path: Path, statement: str, message: str) -> None:
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store, num_pages=8)
    store_keys(store, ns, keys(3))
    store.close()
    with sqlite3.connect(tmp_path / "m.db") as conn:
        conn.execute(statement)
    problems = MetadataStore(tmp_path / "m.db").check_invariants()
    assert any(message in p for p in problems), problems
