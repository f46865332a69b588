"""The contract's invalidate: exact-match drops on every rank, stale reports, leases."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from contract_backends import Backend
from helpers.lease_window import leasing
from helpers.meta_builders import commit_items, keys, register, store_keys

from hf3fsctl.meta.models import Location
from hf3fsctl.meta.protocol import MetadataClient

LEASE_S = 0.25  # long enough to allocate within, short enough to sleep past


@pytest.fixture
def store(backend: Backend) -> MetadataClient:
    return backend.open(lease_s=60)


def _located(store: MetadataClient, ns: str, key: str, rank: int = 0) -> Location:
    location = store.locate(ns, rank, [key])[0]
    assert location is not None
    return location


def test_exact_report_drops_only_that_key(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    chain = keys(3)
    store_keys(store, ns, chain)
    dropped = store.invalidate(ns, 0, [_located(store, ns, chain[1])])
    present = [loc is not None for loc in store.locate(ns, 0, chain)]
    assert (dropped, present) == (1, [True, False, True])


def test_report_as_plain_triple_drops_the_key(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    store_keys(store, ns, keys(1))
    loc = _located(store, ns, keys(1)[0])
    assert store.invalidate(ns, 0, [(loc.key, loc.page, loc.checksum)]) == 1


STALE: dict[str, Callable[[Location], tuple[str, int, str]]] = {
    "other-page": lambda loc: (loc.key, loc.page + 1, loc.checksum),
    "other-checksum": lambda loc: (loc.key, loc.page, "0" * 16),
}


@pytest.mark.parametrize("stale", list(STALE.values()), ids=list(STALE))
def test_report_not_matching_the_committed_page_is_ignored(
    store: MetadataClient, stale: Callable[[Location], tuple[str, int, str]]
) -> None:
    ns = register(store, num_pages=10)
    store_keys(store, ns, keys(2))
    dropped = store.invalidate(ns, 0, [stale(_located(store, ns, keys(2)[0]))])
    assert (dropped, store.lookup(ns, keys(2))) == (0, 2)


def test_stale_report_after_a_re_save_keeps_the_new_page(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    key = keys(1)
    store_keys(store, ns, key)
    old = _located(store, ns, key[0])
    store.invalidate(ns, 0, [old])
    store_keys(store, ns, key)  # re-saved under another page (the old one is leased)
    dropped = store.invalidate(ns, 0, [old])  # the first report, delivered again
    assert (dropped, store.lookup(ns, key)) == (0, 1)


def test_repeated_report_is_idempotent(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    store_keys(store, ns, keys(1))
    loc = _located(store, ns, keys(1)[0])
    assert [store.invalidate(ns, 0, [loc]), store.invalidate(ns, 0, [loc])] == [1, 0]


def test_key_is_dropped_on_every_rank(store: MetadataClient) -> None:
    ns = register(store, num_pages=10, tp_size=2)
    store_keys(store, ns, keys(2), ranks=2)
    store.invalidate(ns, 0, [_located(store, ns, keys(2)[0])])
    remaining = {(e.key, e.rank) for e in store.list_entries(ns)}
    assert remaining == {(keys(2)[1], 0), (keys(2)[1], 1)}


def test_pending_entry_of_another_rank_survives(store: MetadataClient) -> None:
    ns = register(store, num_pages=10, tp_size=2)
    key = keys(1)
    store_keys(store, ns, key, ranks=1)
    pending = store.allocate(ns, 1, key).allocated
    store.invalidate(ns, 0, [_located(store, ns, key[0])])
    assert store.commit(ns, 1, commit_items(pending)) == 1


@pytest.mark.one_slot
def test_leased_page_is_not_reused_until_the_lease_ends(backend: Backend) -> None:
    store = backend.open(lease_s=LEASE_S)
    ns = register(store, num_pages=1)
    store_keys(store, ns, keys(1))
    located, lease = leasing(lambda: _located(store, ns, keys(1)[0]), LEASE_S)
    store.invalidate(ns, 0, [located])
    during = store.allocate(ns, 0, keys(1, start=1))
    if lease.still_held():  # asked well within the lease (a slow machine skips this)
        assert len(during.no_space) == 1
    lease.sleep_past()
    after = store.allocate(ns, 0, keys(1, start=2))
    assert [a.page for a in after.allocated] == [0]


def test_invariants_hold_after_invalidation(backend: Backend, store: MetadataClient) -> None:
    ns = register(store, num_pages=10, tp_size=2)
    store_keys(store, ns, keys(4), ranks=2)
    store.allocate(ns, 1, keys(1, start=9))
    store.invalidate(ns, 0, [_located(store, ns, k) for k in keys(4)[:2]])
    store.invalidate(ns, 1, [_located(store, ns, keys(4)[3], rank=1)])
    assert (backend.invariants(), store.stats().pages_used) == ([], 3)
