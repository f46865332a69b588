"""The contract's retention (issue 22): entries that expire, renewed by reads only when
asked, evicted before any LRU victim, never served once expired (even while pinned).

Times are the store's clock (the same system clock as the test's: SQLite keeps float
seconds, Redis milliseconds). A test measures the times around each commit, so an
entry's expiry lies between `LeaseWindow.earliest` and `.latest`
(`helpers/lease_window.py`, as a lease's end); it sleeps just past
the latest (no fixed sleep longer than it needs) and asserts a present entry only when
its measured time was well before the earliest, so a slow machine skips that assertion
instead of failing it (no tight wall-clock thresholds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from contract_backends import ALL_BACKENDS, Backend
from helpers.lease_window import MARGIN_S, LeaseWindow
from helpers.meta_builders import (
    PAGE_BYTES,
    checksum,
    commit_items,
    keys,
    register,
    register_growable,
    store_keys,
    store_written,
    write_pages,
)

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.meta.models import CommitItem
from hf3fsctl.meta.protocol import MetadataClient

BACKENDS = ALL_BACKENDS
RETENTION_S = 0.4


@pytest.fixture
def store(backend: Backend) -> MetadataClient:
    return backend.open(high_watermark=0.8, low_watermark=0.5, lease_s=0.1)


def commit_expiring(
    client: MetadataClient,
    ns: str,
    rank: int,
    allocated: list[Any],
    retention_s: float,
    renew_on_read: bool = False,
) -> LeaseWindow:
    """Commit `allocated` on `rank` with a retention; returns the bounds on its expiry."""
    items = commit_items(allocated, retention_s, renew_on_read)
    sent = time.time()
    assert client.commit(ns, rank, items) == len(items)
    return LeaseWindow(sent + retention_s, time.time() + retention_s)


def store_expiring(
    client: MetadataClient,
    ns: str,
    chain: list[str],
    retention_s: float = RETENTION_S,
    renew_on_read: bool = False,
) -> LeaseWindow:
    """Allocate and commit `chain` on rank 0 with a retention; returns the bounds on its
    expiry."""
    result = client.allocate(ns, 0, chain)
    assert not result.no_space
    return commit_expiring(
        client, ns, 0, result.allocated, retention_s, renew_on_read=renew_on_read
    )


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Poll `condition` until true; returns the time it was first seen true."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
    return time.time()


def test_an_entry_is_gone_once_its_retention_has_passed(store: MetadataClient) -> None:
    ns = register(store)
    chain = keys(3)
    expiry = store_expiring(store, ns, chain)
    present = store.lookup(ns, chain)
    located = store.locate(ns, 0, chain)
    if expiry.still_held():  # asked well within the retention
        assert present == 3
        assert all(located)
    expiry.sleep_past()
    assert store.lookup(ns, chain) == 0
    assert store.locate(ns, 0, chain) == [None, None, None]


def test_a_key_counts_only_while_unexpired_on_every_rank(store: MetadataClient) -> None:
    ns = register(store, tp_size=2)
    chain = keys(2)
    store_keys(store, ns, chain, ranks=2)  # no retention
    assert store.lookup(ns, chain) == 2
    other = keys(2, salt="r")
    store_keys(store, ns, other, ranks=1)  # rank 1 never expires …
    result = store.allocate(ns, 1, other)
    expiry = commit_expiring(store, ns, 1, result.allocated, RETENTION_S)  # … rank 1's does
    present = store.lookup(ns, other)
    if expiry.still_held():
        assert present == 2
    expiry.sleep_past()
    assert store.lookup(ns, other) == 0
    assert store.locate(ns, 0, other) != [None, None]  # rank 0's copy is still served
    assert store.lookup(ns, chain) == 2


@pytest.mark.one_slot
def test_an_expired_entry_is_evicted_before_older_unexpired_ones(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    old = keys(4, salt="old")
    store_keys(store, ns, old)  # the least recently used, but kept
    time.sleep(0.01)
    expiring = keys(4, salt="expiring")
    store_expiring(store, ns, expiring).sleep_past()
    store_keys(store, ns, keys(1, start=100))  # 9 of 10 pages > 0.8: evicts to 0.5
    assert store.lookup(ns, old) == 4
    assert {e.key for e in store.list_entries(ns, limit=100)}.isdisjoint(expiring)
    evicted = next(n for n in store.stats().namespaces if n.id == ns).evicted
    assert evicted["expired"][0] == 4


def test_an_expired_key_is_saved_anew(store: MetadataClient) -> None:
    ns = register(store)
    chain = keys(2)
    store_expiring(store, ns, chain).sleep_past()
    result = store.allocate(ns, 0, chain)
    assert sorted(a.key for a in result.allocated) == sorted(chain)
    assert result.existing == []
    store.commit(
        ns,
        0,
        [
            CommitItem(key=a.key, page=a.page, checksum=checksum(a.key, a.page), size=PAGE_BYTES)
            for a in result.allocated
        ],
    )
    assert store.lookup(ns, chain) == 2


def test_a_read_renews_only_an_entry_committed_with_renew_on_read(store: MetadataClient) -> None:
    ns = register(store)
    retention_s = 1.0
    renewed, plain = keys(1, salt="renew"), keys(1, salt="plain")
    expiry = store_expiring(store, ns, renewed, retention_s, renew_on_read=True)
    store_expiring(store, ns, plain, retention_s)
    time.sleep(retention_s / 2)
    read_at = time.time()
    located = store.locate(ns, 0, renewed + plain)
    if expiry.still_held():
        assert None not in located
    # the plain entry expires at its commit + retention, read or not …
    wait_until(lambda: store.lookup(ns, plain) == 0)
    held = store.lookup(ns, renewed)
    if time.time() < read_at + retention_s - MARGIN_S:  # … the renewed one later
        assert held == 1
    wait_until(lambda: store.lookup(ns, renewed) == 0)  # a renewal is not forever


@pytest.mark.one_slot
def test_a_pinned_expired_entry_is_not_evicted_and_not_served(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    old = keys(4, salt="old")
    store_keys(store, ns, old)
    time.sleep(0.01)
    pinned = keys(4, salt="pinned")
    expiry = store_expiring(store, ns, pinned)
    store.pin(ns, pinned)
    expiry.sleep_past()
    assert store.lookup(ns, pinned) == 0
    assert store.locate(ns, 0, pinned) == [None] * 4
    store_keys(store, ns, keys(1, start=100))  # eviction: the unpinned old keys go
    held = {e.key for e in store.list_entries(ns, limit=100)}
    assert set(pinned) <= held
    assert store.lookup(ns, old) < 4


def test_entries_list_their_expiry(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(1, salt="forever"))
    expiry = store_expiring(store, ns, keys(1, salt="expiring"), retention_s=3600)
    by_key = {e.key: e for e in store.list_entries(ns)}
    assert by_key[keys(1, salt="forever")[0]].expires_at is None
    expires_at = by_key[keys(1, salt="expiring")[0]].expires_at
    assert expires_at is not None and expiry.earliest <= expires_at <= expiry.latest


def test_stats_count_expiring_and_expired_keys(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(2, salt="forever"))
    soon = store_expiring(store, ns, keys(3, salt="soon"))
    store_expiring(store, ns, keys(1, salt="later"), retention_s=3600)
    soon.sleep_past()
    stats = next(n for n in store.stats().namespaces if n.id == ns)
    assert (stats.expiring_keys, stats.expired_keys) == (4, 3)


@pytest.mark.parametrize("retention_s", [0.0, -1.0, float("inf"), float("nan")])
def test_a_retention_must_be_positive_and_finite(store: MetadataClient, retention_s: float) -> None:
    ns = register(store)
    allocated = store.allocate(ns, 0, keys(1)).allocated[0]
    item = CommitItem.model_construct(
        key=allocated.key,
        page=allocated.page,
        checksum="ab",
        size=PAGE_BYTES,
        retention_s=retention_s,
        renew_on_read=False,
    )
    with pytest.raises(InvalidRequest):
        store.commit(ns, 0, [item])


@pytest.mark.one_slot
def test_capacity_eviction_takes_expired_keys_before_older_unexpired_ones(
    backend: Backend,
) -> None:
    store = backend.open(high_watermark=0.8, low_watermark=0.5, lease_s=0.1, with_root=True)
    store.set_capacity(20 * PAGE_BYTES)  # 20 pages: evicts above 16, down to 10 + room
    ns, files = register_growable(store, backend.root)
    old = keys(4, salt="old")
    assert store_written(store, ns, files, old) == 4
    time.sleep(0.01)
    expiring = keys(8, salt="expiring")
    result = store.allocate(ns, 0, expiring)
    write_pages(files[0], [a.page for a in result.allocated])
    commit_expiring(store, ns, 0, result.allocated, RETENTION_S).sleep_past()
    assert store_written(store, ns, files, keys(5, salt="new")) == 5  # 17 pages > 16
    assert store.lookup(ns, old) == 4
    evicted = next(n for n in store.stats().namespaces if n.id == ns).evicted
    assert evicted["expired"][0] >= 5 and "capacity" not in evicted  # only expired keys went
    for file in files:
        file.close()
