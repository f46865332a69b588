"""The contract's namespaces and data path: register, lookup, locate, allocate, commit,
release, stats, list_entries — on every store and through HTTP."""

from __future__ import annotations

import time

import pytest
from contract_backends import ALL_BACKENDS, Backend
from helpers.meta_builders import (
    commit_items,
    keys,
    manifest,
    rank_file,
    register,
    store_keys,
)

from hf3fsctl.errors import InvalidRequest, NamespaceConflict, NotFound
from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.models import Allocation, CommitItem, RankFile
from hf3fsctl.meta.protocol import MetadataClient

BACKENDS = ALL_BACKENDS


@pytest.fixture
def store(backend: Backend) -> MetadataClient:
    return backend.open(lease_s=30)


def test_connect_gives_a_client_of_the_protocol(store: MetadataClient) -> None:
    assert isinstance(store, MetadataClient)


def test_register_namespace_is_idempotent(store: MetadataClient) -> None:
    data = manifest()
    ns = namespace_id(data)
    first = store.register_namespace(ns, data)
    assert store.register_namespace(ns, data) == first


def test_register_namespace_takes_ranks_from_manifest(store: MetadataClient) -> None:
    data = manifest(tp_size=4)
    assert store.register_namespace(namespace_id(data), data).num_ranks == 4


def test_register_namespace_rejects_id_not_matching_manifest(store: MetadataClient) -> None:
    with pytest.raises(InvalidRequest, match="does not match"):
        store.register_namespace("0123456789abcdef", manifest())


def test_register_namespace_with_another_manifest_is_a_conflict(store: MetadataClient) -> None:
    ns = register(store)
    with pytest.raises((NamespaceConflict, InvalidRequest)):
        store.register_namespace(ns, manifest(model="other"))


def test_register_rank_conflict_on_different_file(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    with pytest.raises(NamespaceConflict):
        store.register_rank(ns, rank_file(ns, 0, 11))


def test_register_rank_identical_is_idempotent(store: MetadataClient) -> None:
    ns = register(store, num_pages=10)
    assert store.register_rank(ns, rank_file(ns, 0, 10)).rank_files == [rank_file(ns, 0, 10)]


@pytest.mark.parametrize(
    "bad",
    [
        RankFile(rank=1, path="x", page_bytes=4096, slot_bytes=4096, num_pages=1),
        RankFile(rank=0, path="x", page_bytes=8192, slot_bytes=8192, num_pages=1),
    ],
    ids=["rank-out-of-range", "page-bytes-not-manifest"],
)
def test_register_rank_rejects_invalid_file(store: MetadataClient, bad: RankFile) -> None:
    data = manifest()
    ns = namespace_id(data)
    store.register_namespace(ns, data)
    with pytest.raises(InvalidRequest):
        store.register_rank(ns, bad)


def test_get_namespace_unknown_is_not_found(store: MetadataClient) -> None:
    with pytest.raises(NotFound):
        store.get_namespace("0123456789abcdef")


def test_namespaces_lists_every_registered(store: MetadataClient) -> None:
    ids = {register(store, model="a"), register(store, model="b")}
    assert {n.id for n in store.namespaces()} == ids


def test_lookup_counts_leading_committed_keys_only(store: MetadataClient) -> None:
    ns = register(store)
    chain = keys(6)
    store_keys(store, ns, chain[:3] + chain[4:])
    assert store.lookup(ns, chain) == 3


def test_lookup_requires_every_rank(store: MetadataClient) -> None:
    ns = register(store, tp_size=2)
    chain = keys(4)
    result = store.allocate(ns, 0, chain)
    store.commit(ns, 0, commit_items(result.allocated))
    assert store.lookup(ns, chain) == 0


def test_lookup_ignores_pending_entries(store: MetadataClient) -> None:
    ns = register(store)
    store.allocate(ns, 0, keys(3))
    assert store.lookup(ns, keys(3)) == 0


def test_lookup_sees_commits_of_another_client(backend: Backend, store: MetadataClient) -> None:
    ns = register(store)
    reader = backend.connect()
    assert reader.lookup(ns, keys(2)) == 0
    store_keys(store, ns, keys(2))
    assert reader.lookup(ns, keys(2)) == 2


def test_lookup_rejects_malformed_key(store: MetadataClient) -> None:
    ns = register(store)
    with pytest.raises(InvalidRequest):  # the wording is each layer's own
        store.lookup(ns, ["NOT-HEX"])


def test_lookup_unknown_namespace_is_not_found(store: MetadataClient) -> None:
    with pytest.raises(NotFound):
        store.lookup("0123456789abcdef", keys(1))


def test_locate_returns_committed_location_and_none_for_missing(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(1))
    found, missing = store.locate(ns, 0, [keys(1)[0], keys(1, start=9)[0]])
    assert (found is not None, missing) == (True, None)
    assert found.checksum and found.size == 4096


def test_locate_returns_the_committed_checksum(store: MetadataClient) -> None:
    ns = register(store)
    (allocation,) = store.allocate(ns, 0, keys(1)).allocated
    (item,) = commit_items([allocation])
    store.commit(ns, 0, [item])
    (found,) = store.locate(ns, 0, keys(1))
    assert found is not None and (found.page, found.checksum) == (item.page, item.checksum)


def test_locate_counts_hits(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(2))
    store.locate(ns, 0, keys(2))
    assert store.stats().namespaces[0].hits == 2


def test_allocate_gives_distinct_pages(store: MetadataClient) -> None:
    ns = register(store)
    result = store.allocate(ns, 0, keys(10))
    assert len({a.page for a in result.allocated}) == 10


def test_allocate_reports_committed_and_pending_keys_as_existing(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(2))
    store.allocate(ns, 0, keys(2, start=2))
    assert store.allocate(ns, 0, keys(4)).existing == keys(4)


@pytest.mark.one_slot
def test_allocate_no_space_when_full_of_pending(store: MetadataClient) -> None:
    ns = register(store, num_pages=4)
    store.allocate(ns, 0, keys(4))
    assert store.allocate(ns, 0, keys(2, start=4)).no_space == keys(2, start=4)


def test_allocate_unregistered_rank_is_not_found(store: MetadataClient) -> None:
    ns = register(store)
    with pytest.raises(NotFound):
        store.allocate(ns, 3, keys(1))


def test_commit_only_exact_pending_pairs(store: MetadataClient) -> None:
    ns = register(store)
    (allocation,) = store.allocate(ns, 0, keys(1)).allocated
    wrong = CommitItem(key=allocation.key, page=allocation.page + 1, checksum="ab", size=1)
    assert store.commit(ns, 0, [wrong]) == 0


def test_commit_twice_counts_once(store: MetadataClient) -> None:
    ns = register(store)
    items = commit_items(store.allocate(ns, 0, keys(3)).allocated)
    assert (store.commit(ns, 0, items), store.commit(ns, 0, items)) == (3, 0)


def test_release_frees_only_exact_pending_pairs(store: MetadataClient) -> None:
    ns = register(store)
    allocated = store.allocate(ns, 0, keys(2)).allocated
    wrong = Allocation(key=allocated[0].key, page=allocated[1].page)
    assert store.release(ns, 0, [wrong, allocated[1]]) == 1


def test_release_does_not_free_committed(store: MetadataClient) -> None:
    ns = register(store)
    allocated = store.allocate(ns, 0, keys(1)).allocated
    store.commit(ns, 0, commit_items(allocated))
    assert store.release(ns, 0, allocated) == 0


@pytest.mark.one_slot
def test_released_page_is_reused(store: MetadataClient) -> None:
    ns = register(store, num_pages=1)
    allocated = store.allocate(ns, 0, keys(1)).allocated
    store.release(ns, 0, allocated)
    assert store.allocate(ns, 0, keys(1, start=5)).allocated[0].page == allocated[0].page


def test_released_key_can_be_allocated_again(store: MetadataClient) -> None:
    ns = register(store)
    allocated = store.allocate(ns, 0, keys(1)).allocated
    store.release(ns, 0, allocated)
    assert [a.key for a in store.allocate(ns, 0, keys(1)).allocated] == keys(1)


def test_stats_counts_keys_pages_and_lookup_traffic(store: MetadataClient) -> None:
    ns = register(store, num_pages=10, tp_size=2)
    store_keys(store, ns, keys(3), ranks=2)
    store.lookup(ns, keys(5))
    got = store.stats().namespaces[0]
    slot = store.get_namespace(ns).rank_files[0].slot_bytes
    assert (got.keys, got.pages_used, got.bytes_live) == (3, 6, 6 * slot)
    assert (got.lookups, got.lookup_keys, got.hit_keys) == (1, 5, 3)


def test_lookup_counters_survive_a_new_client(backend: Backend, store: MetadataClient) -> None:
    ns = register(store)
    store.lookup(ns, keys(4))
    store.close()
    assert backend.connect().stats().namespaces[0].lookup_keys == 4


def test_list_entries_most_recent_first(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(2))
    time.sleep(0.01)
    store.locate(ns, 0, keys(1, start=1))
    assert store.list_entries(ns)[0].key == keys(1, start=1)[0]


def test_list_entries_pages_with_limit_and_offset(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(5))
    first, rest = store.list_entries(ns, limit=2), store.list_entries(ns, limit=10, offset=2)
    assert (len(first), len(rest), {e.key for e in first + rest}) == (2, 3, set(keys(5)))


def test_committed_entries_survive_a_new_client(backend: Backend, store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(5))
    store.close()
    assert backend.connect().lookup(ns, keys(5)) == 5


def test_health_reports_ok(store: MetadataClient) -> None:
    assert store.health()["status"] == "ok"


def test_fresh_store_has_no_invariant_violations(backend: Backend, store: MetadataClient) -> None:
    ns = register(store, num_pages=8)
    store_keys(store, ns, keys(4))
    store.allocate(ns, 0, keys(2, start=4))
    assert backend.invariants() == []
