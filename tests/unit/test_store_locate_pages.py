"""`locate_pages` (issue 23): the SQLite store's `locate` as plain tuples, for `Tier.load`
on the engine thread — the same answer as `locate`, with the same read lease."""

from __future__ import annotations

from pathlib import Path

from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.models import EvictRequest, PageLocation
from hf3fsctl.meta.protocol import LocatesPages
from hf3fsctl.meta.sqlite.store import MetadataStore


def test_locate_pages_answers_what_locate_answers(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store)
    chain = keys(4)
    store_keys(store, ns, chain)
    asked = [*chain, keys(1, salt="absent")[0], chain[0]]  # a miss, and a key named twice
    pages = store.locate_pages(ns, 0, asked)
    assert isinstance(store, LocatesPages)
    assert all(page is None or isinstance(page, PageLocation) for page in pages)
    assert [None if page is None else page.to_location() for page in pages] == store.locate(
        ns, 0, asked
    )
    store.close()


def test_locate_pages_takes_the_read_lease(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db", lease_s=60.0)
    ns = register(store)
    chain = keys(3)
    store_keys(store, ns, chain)
    located = store.locate_pages(ns, 0, chain[:1])
    assert located[0] is not None
    store.evict(EvictRequest(all=True))
    # evicted, but the leased page is not handed out again while the lease runs
    fresh = store.allocate(ns, 0, keys(3, salt="fresh"))
    assert located[0].page not in {a.page for a in fresh.allocated}
    assert store.check_invariants() == []
    store.close()


def test_a_locate_padded_to_its_statement_size_leases_and_counts_each_key_once(
    tmp_path: Path,
) -> None:
    """The lease statement's IN list is padded to a few fixed sizes (by repeating the last
    key): the repeats find no second row, so a key's hits grow by one per locate."""
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store)
    chain = keys(10)
    store_keys(store, ns, chain)
    for count in (1, 3, 9, 10):  # sizes that pad to 8 and to 32, and one that fills 8
        located = store.locate_pages(ns, 0, chain[:count])
        assert [page.key for page in located if page is not None] == chain[:count]
    hits = {entry.key: entry.hits for entry in store.list_entries(ns)}
    assert [hits[key] for key in chain] == [4, 3, 3, 2, 2, 2, 2, 2, 2, 1]
    assert store.check_invariants() == []
    store.close()
