"""The contract's admission (issue 22): `admit` counts sightings of keys in the store,
shared by every client, bounded, and counts the keys it turned away."""

from __future__ import annotations

import importlib
import time

import pytest
from contract_backends import ALL_BACKENDS, Backend
from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.errors import NotFound
from hf3fsctl.meta.protocol import MetadataClient

BACKENDS = ALL_BACKENDS
# Where each backend keeps its bound (a module constant next to its implementation).
_BOUND_MODULES = (
    "hf3fsctl.meta.sqlite.admission",
    "hf3fsctl.meta.redis.admission",
    "hf3fsctl.meta.redis.store",
)


@pytest.fixture
def store(backend: Backend) -> MetadataClient:
    return backend.open()


def skipped(client: MetadataClient, ns: str) -> int:
    return next(n for n in client.stats().namespaces if n.id == ns).admission_skipped


def test_a_key_is_admitted_once_seen_after_hits_times_by_any_client(
    backend: Backend, store: MetadataClient
) -> None:
    ns = register(store)
    other = backend.connect()
    key = keys(1)
    assert store.admit(ns, key, 3) == [False]
    assert other.admit(ns, key, 3) == [False]
    assert store.admit(ns, key, 3) == [True]
    assert other.admit(ns, key, 3) == [True]  # still seen enough


def test_after_hits_of_one_or_less_admits_everything_and_records_nothing(
    store: MetadataClient,
) -> None:
    ns = register(store)
    chain = keys(3)
    assert store.admit(ns, chain, 1) == [True] * 3
    assert store.admit(ns, chain, 0) == [True] * 3
    assert store.admit(ns, chain, 2) == [False] * 3  # the first sighting recorded
    assert store.admit(ns, chain, 2) == [True] * 3


def test_one_call_answers_per_key_and_counts_a_repeated_key_once(store: MetadataClient) -> None:
    ns = register(store)
    seen, new = keys(1, salt="seen"), keys(1, salt="new")
    store.admit(ns, seen, 2)
    assert store.admit(ns, [*seen, *new, *new], 2) == [True, False, False]
    assert store.admit(ns, new, 2) == [True]


def test_keys_turned_away_are_counted_in_stats(store: MetadataClient) -> None:
    ns = register(store)
    chain = keys(4)
    store.admit(ns, chain, 2)  # 4 turned away
    store.admit(ns, [*chain[:2], *keys(1, salt="x")], 2)  # 1 more
    assert skipped(store, ns) == 5


@pytest.mark.one_slot
def test_counts_are_bounded_least_recently_seen_dropped_first(
    store: MetadataClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in _BOUND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "ADMISSION_TRACKED_KEYS"):
            monkeypatch.setattr(module, "ADMISSION_TRACKED_KEYS", 3)
    ns = register(store)
    a, b, c, d = keys(4)
    for key in (a, b, c, d):  # four sightings of four keys: a, the oldest, is dropped
        assert store.admit(ns, [key], 2) == [False]
        time.sleep(0.01)
    assert store.admit(ns, [d], 2) == [True]
    assert store.admit(ns, [a], 2) == [False]  # counted from one again


def test_admit_in_an_unknown_namespace_is_not_found(store: MetadataClient) -> None:
    with pytest.raises(NotFound):
        store.admit("0123456789abcdef", keys(1), 2)


def test_a_committed_key_is_still_answered(store: MetadataClient) -> None:
    ns = register(store)
    chain = keys(2)
    store.admit(ns, chain, 2)
    store_keys(store, ns, chain)  # its count may be dropped now …
    assert len(store.admit(ns, chain, 2)) == 2  # … admit still answers every key
