"""The contract's eviction counters: `stats` counts evictions per namespace and reason."""

from __future__ import annotations

import pytest
from contract_backends import Backend
from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.protocol import MetadataClient


def _evicted(store: MetadataClient, ns: str) -> dict[str, list[int]]:
    (stats,) = [s for s in store.stats().namespaces if s.id == ns]
    return stats.evicted


@pytest.mark.one_slot
def test_a_full_file_counts_its_evictions_as_file_full(backend: Backend) -> None:
    store = backend.open(high_watermark=0.9, low_watermark=0.5)
    ns = register(store, num_pages=10)
    store_keys(store, ns, keys(9))
    store_keys(store, ns, keys(2, start=50))
    counted = _evicted(store, ns)
    slot = store.get_namespace(ns).rank_files[0].slot_bytes
    assert (
        list(counted) == ["file_full"] and counted["file_full"][1] == counted["file_full"][0] * slot
    )


def test_admin_and_corrupt_evictions_are_counted_apart(backend: Backend) -> None:
    store = backend.open()
    ns = register(store)
    store_keys(store, ns, keys(4))
    (location,) = store.locate(ns, 0, keys(1))
    assert location is not None
    store.invalidate(ns, 0, [(location.key, location.page, location.checksum)])
    store.evict(EvictRequest(max_entries=2))
    counted = _evicted(store, ns)
    assert {reason: value[0] for reason, value in counted.items()} == {"corrupt": 1, "admin": 2}


def test_a_dry_run_counts_nothing(backend: Backend) -> None:
    store = backend.open()
    ns = register(store)
    store_keys(store, ns, keys(3))
    store.evict(EvictRequest(all=True, dry_run=True))
    assert _evicted(store, ns) == {}
