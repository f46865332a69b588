"""`allocate_pages` / `commit_pages` (issue 23): the SQLite store's `allocate` and `commit`
as plain tuples, for `Tier.save` on the save threads — the same rows stored as through
the models, and the same checks of what is stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import keys, register

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.meta.models import CommitItem, PageGrant
from hf3fsctl.meta.protocol import SavesPages
from hf3fsctl.meta.sqlite.store import MetadataStore

CHECKSUM = "xxh3:0123456789abcdef"


def _rows(store: MetadataStore, ns: str) -> list[tuple[Any, ...]]:
    """What an entry stores, less the times (two stores are written moments apart)."""
    with store._read() as conn:
        return conn.execute(
            "SELECT key, rank, page, state, depth, checksum, size, renew_s,"
            " expires_at IS NULL, deadline IS NULL FROM entries WHERE namespace = ?"
            " ORDER BY key",
            (ns,),
        ).fetchall()


@pytest.mark.parametrize(
    ("retention_s", "renew_on_read"),
    [(None, False), (60.0, False), (60.0, True), (None, True)],
    ids=["no-expiry", "expiry", "renewed", "renew-without-expiry"],
)
def test_the_tuple_calls_store_what_the_model_calls_store(
    tmp_path: Path, retention_s: float | None, renew_on_read: bool
) -> None:
    chain = [*keys(5), keys(1)[0]]  # a key named twice takes its first depth
    models, tuples = MetadataStore(tmp_path / "a.db"), MetadataStore(tmp_path / "b.db")
    ns_a, ns_b = register(models), register(tuples)
    result = models.allocate(ns_a, 0, chain, 3)
    grant = tuples.allocate_pages(ns_b, 0, chain, 3)
    assert isinstance(tuples, SavesPages) and isinstance(grant, PageGrant)
    assert grant.allocated == [(a.key, a.page) for a in result.allocated]
    assert (grant.existing, grant.no_space) == (result.existing, result.no_space)
    items = [
        CommitItem(
            key=a.key,
            page=a.page,
            checksum=CHECKSUM,
            size=4096,
            retention_s=retention_s,
            renew_on_read=renew_on_read,
        )
        for a in result.allocated
    ]
    written = [(key, page, CHECKSUM) for key, page in grant.allocated]
    assert models.commit(ns_a, 0, items) == 5
    assert tuples.commit_pages(ns_b, 0, written, 4096, retention_s, renew_on_read) == 5
    assert _rows(tuples, ns_b) == _rows(models, ns_a)
    assert tuples.allocate_pages(ns_b, 0, chain[:2]).existing == chain[:2]
    assert tuples.check_invariants() == [] and models.check_invariants() == []
    models.close()
    tuples.close()


@pytest.mark.parametrize(
    ("pages", "size", "retention_s"),
    [
        ([("k", 0, "")], 4096, None),
        ([("k", 0, "x" * 65)], 4096, None),
        ([("k", 0, CHECKSUM)], -1, None),
        ([("k", 0, CHECKSUM)], 4096, 0.0),
    ],
    ids=["empty-checksum", "long-checksum", "negative-size", "zero-retention"],
)
def test_commit_pages_refuses_what_a_commit_item_refuses(
    tmp_path: Path, pages: list[tuple[str, int, str]], size: int, retention_s: float | None
) -> None:
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store)
    key = keys(1)[0]
    (allocated,) = store.allocate_pages(ns, 0, [key]).allocated
    with pytest.raises(InvalidRequest):
        store.commit_pages(ns, 0, [(key, allocated[1], c) for _, _, c in pages], size, retention_s)
    assert store.locate_pages(ns, 0, [key]) == [None]  # still pending, nothing committed
    store.close()


def test_allocate_pages_gives_each_key_its_depth(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store)
    chain = keys(3)
    store.allocate_pages(ns, 0, [*chain, chain[0]], depths=[4, 0, 7, 9])  # first depth wins
    with store._read() as conn:
        depths = dict(conn.execute("SELECT key, depth FROM entries WHERE namespace = ?", (ns,)))
    assert depths == {chain[0]: 4, chain[1]: 0, chain[2]: 7}
    for bad in ([0, 1], [0, 1, -1], [0, 1, 2.0]):
        with pytest.raises(InvalidRequest):
            store.allocate_pages(ns, 0, keys(3, salt="x"), depths=bad)  # type: ignore[arg-type]
    store.close()
