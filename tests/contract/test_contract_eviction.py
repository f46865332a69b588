"""The contract's eviction: watermarks, LRU and chain order, leases, pending, admin evict."""

from __future__ import annotations

import time

import pytest
from contract_backends import ONE_SLOT_BACKENDS, Backend
from helpers.meta_builders import commit_items, keys, register, store_keys

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.protocol import MetadataClient

# Capacity and eviction order of one slot, with files and capacities of a few pages: the
# sharded store evicts per shard (tests/unit/test_redis_sharded.py covers it).
BACKENDS = ONE_SLOT_BACKENDS


@pytest.fixture
def store(backend: Backend) -> MetadataClient:
    return backend.open(high_watermark=0.8, low_watermark=0.5, lease_s=60)


def test_allocate_below_high_watermark_evicts_nothing(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    store_keys(store, ns, keys(7))
    store_keys(store, ns, keys(1, start=7))
    assert store.lookup(ns, keys(7)) == 7


def test_allocate_above_high_watermark_evicts_down_to_low(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    store_keys(store, ns, keys(8))
    store_keys(store, ns, keys(1, start=100))
    assert store.stats().pages_used == 5  # low watermark 0.5 of 10, including the new key


def test_eviction_takes_chain_tails_before_heads(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    store_keys(store, ns, keys(8))  # one commit: equal last_access, depth 0..7
    store_keys(store, ns, keys(1, start=100))
    assert store.lookup(ns, keys(8)) == 4


def test_eviction_takes_least_recently_used_chain_first(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    old, new = keys(4, salt="old"), keys(4, salt="new")
    store_keys(store, ns, old)
    time.sleep(0.01)
    store_keys(store, ns, new)
    store_keys(store, ns, keys(1, start=100))
    assert (store.lookup(ns, old), store.lookup(ns, new)) == (0, 4)


def test_allocate_eviction_skips_leased_entries(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    old = keys(4, salt="old")
    store_keys(store, ns, old)
    time.sleep(0.01)
    store_keys(store, ns, keys(4, salt="new"))
    store.locate(ns, 0, old)  # leased (and now most recent)
    store_keys(store, ns, keys(1, start=100))
    assert store.lookup(ns, old) == 4


def test_allocate_never_steals_pending_entries(store: MetadataClient) -> None:
    ns = register(store, num_pages=4)
    pending = store.allocate(ns, 0, keys(4)).allocated
    store.allocate(ns, 0, keys(2, start=10))
    assert store.commit(ns, 0, commit_items(pending)) == 4


def test_key_is_evicted_on_every_rank_at_once(store: MetadataClient) -> None:
    ns = register(store, num_pages=10, tp_size=2)
    store_keys(store, ns, keys(8), ranks=2)
    store_keys(store, ns, keys(1, start=100), ranks=1)
    used = {rf.rank: 0 for rf in store.get_namespace(ns).rank_files}
    for entry in store.list_entries(ns, limit=1000):
        used[entry.rank] += 1
    assert used[1] == used[0] - 1  # rank 1 lost exactly the keys rank 0 lost


def test_leased_page_is_not_reused_after_admin_eviction(store: MetadataClient) -> None:
    ns = register(store, num_pages=2)
    store_keys(store, ns, keys(2))
    store.locate(ns, 0, keys(2))
    store.evict(EvictRequest(all=True))
    assert store.allocate(ns, 0, keys(1, start=50)).no_space == keys(1, start=50)


def test_released_lease_page_is_reused_after_lease(backend: Backend) -> None:
    store = backend.open(lease_s=0.1)
    ns = register(store, num_pages=1)
    store_keys(store, ns, keys(1))
    store.locate(ns, 0, keys(1))
    store.evict(EvictRequest(all=True))
    time.sleep(0.15)
    assert len(store.allocate(ns, 0, keys(1, start=50)).allocated) == 1


@pytest.mark.parametrize(
    ("request_", "expected_keys"),
    [
        (EvictRequest(all=True), 6),
        (EvictRequest(max_entries=2), 2),
        (EvictRequest(target_usage=0.2), 4),  # 6 pages of a 10-page capacity → 2
        (EvictRequest(older_than_s=3600), 0),
        (EvictRequest(older_than_s=0), 6),
    ],
    ids=["all", "max-entries", "target-usage", "older-than-none", "older-than-all"],
)
def test_evict_criteria_select_expected_keys(
    store: MetadataClient, request_: EvictRequest, expected_keys: int
) -> None:
    ns = register(store, num_pages=10)
    store.set_capacity(10 * store.get_namespace(ns).rank_files[0].slot_bytes)
    store_keys(store, ns, keys(6))
    time.sleep(0.001)
    assert store.evict(request_).keys == expected_keys


def test_evict_max_entries_takes_tails_first(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    store_keys(store, ns, keys(6))
    store.evict(EvictRequest(max_entries=2))
    assert store.lookup(ns, keys(6)) == 4


def test_evict_by_namespace_leaves_others(store: MetadataClient) -> None:
    a, b = register(store, model="a"), register(store, model="b")
    store_keys(store, a, keys(3))
    store_keys(store, b, keys(3))
    store.evict(EvictRequest(namespace=a, all=True))
    assert (store.lookup(a, keys(3)), store.lookup(b, keys(3))) == (0, 3)


def test_evict_dry_run_changes_nothing(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(3))
    result = store.evict(EvictRequest(all=True, dry_run=True))
    assert (result.keys, result.dry_run, store.lookup(ns, keys(3))) == (3, True, 3)


def test_evict_reports_bytes_and_pages(store: MetadataClient) -> None:
    ns = register(store, tp_size=2)
    store_keys(store, ns, keys(3), ranks=2)
    result = store.evict(EvictRequest(all=True))
    assert (result.pages, result.bytes, result.by_namespace) == (6, 6 * 4096, {ns: 3})


def test_evict_skips_pending_keys(store: MetadataClient) -> None:
    ns = register(store)
    store.allocate(ns, 0, keys(2))
    assert store.evict(EvictRequest(all=True)).keys == 0


def test_evict_without_criteria_is_rejected(store: MetadataClient) -> None:
    with pytest.raises(InvalidRequest, match="say what to evict"):
        store.evict(EvictRequest())


def test_store_stays_sound_through_eviction_cycles(backend: Backend, store: MetadataClient) -> None:
    ns = register(store, num_pages=16, tp_size=2)
    for round_ in range(6):
        store_keys(store, ns, keys(5, salt=str(round_)), ranks=2)
        store.locate(ns, 0, keys(2, salt=str(round_)))
    assert backend.invariants() == []


def test_evict_criteria_combine_with_a_namespace(store: MetadataClient) -> None:
    a, b = register(store, model="a"), register(store, model="b")
    store_keys(store, a, keys(4))
    store_keys(store, b, keys(4))
    result = store.evict(EvictRequest(namespace=a, max_entries=2))
    assert (result.by_namespace, store.lookup(a, keys(4)), store.lookup(b, keys(4))) == (
        {a: 2},
        2,
        4,
    )


# What one allocation may evict beyond its own pages (SQLite `eviction.EVICT_BEYOND_NEED`,
# Redis `EVICT_BEYOND_NEED` in lua/allocate.lua): a larger watermark swing is spread over
# the allocations that follow, so no transaction holds the writer for seconds.
EVICT_BEYOND_NEED = 2048


def test_one_allocation_evicts_at_most_its_need_beyond_the_limit(backend: Backend) -> None:
    from hf3fsctl.meta.sqlite.eviction import EVICT_BEYOND_NEED as sqlite_limit

    assert sqlite_limit == EVICT_BEYOND_NEED
    store = backend.open(high_watermark=0.95, low_watermark=0.5)
    num_pages = 6000  # a swing of 0.45 x 6,000 = 2,700 pages, more than the limit
    ns = register(store, num_pages=num_pages)
    held = int(0.95 * num_pages)  # at the high watermark: the fill evicts nothing
    for start in range(0, held, 500):
        store_keys(store, ns, keys(min(500, held - start), start=start), first_depth=start)
    store_keys(store, ns, keys(3, salt="new"))  # over the high watermark: evicts
    (stats,) = [s for s in store.stats().namespaces if s.id == ns]
    assert stats.evicted["file_full"][0] == 3 + EVICT_BEYOND_NEED
    assert store.stats().pages_used == held + 3 - (3 + EVICT_BEYOND_NEED)
    # the least recently committed chunks went (2,051 keys: chunks 0-3 and the tail of
    # chunk 4); the rest of the swing waits for the next allocation over the watermark
    assert store.lookup(ns, keys(2000)) == 0
    assert store.lookup(ns, keys(500, start=2000)) == 449
    assert store.lookup(ns, keys(held - 2500, start=2500)) == held - 2500
    assert backend.invariants() == []
