"""The contract under concurrent writers: clients racing to allocate the same new keys
get one owner per key, and no page is ever owned twice.

Each writer is a thread with its own client (its own connections), released together by
a barrier, so their allocations really overlap in the store.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from contract_backends import Backend
from helpers.meta_builders import commit_items, keys, register

from hf3fsctl.meta.models import Allocation
from hf3fsctl.meta.protocol import MetadataClient

WRITERS = 4
ROUNDS = 5
CHAIN = 6


def _race(writers: list[MetadataClient], work: Callable[[int, MetadataClient], Any]) -> list[Any]:
    """Run `work(i, client)` on one thread per writer, all released at once; re-raise."""
    barrier = threading.Barrier(len(writers))
    results: list[Any] = [None] * len(writers)
    errors: list[BaseException] = []

    def run(i: int, client: MetadataClient) -> None:
        try:
            barrier.wait(30)
            results[i] = work(i, client)
        except BaseException as exc:  # reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not [t for t in threads if t.is_alive()], "a writer did not finish in 120 s"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def writers(backend: Backend) -> list[MetadataClient]:
    first = backend.open(lease_s=30)
    return [first, *(backend.connect() for _ in range(WRITERS - 1))]


def _allocate_rounds(ns: str) -> Callable[[int, MetadataClient], list[Allocation]]:
    """Each writer allocates the same `ROUNDS` chains and commits what it was granted."""

    def work(_: int, client: MetadataClient) -> list[Allocation]:
        granted: list[Allocation] = []
        for round_ in range(ROUNDS):
            result = client.allocate(ns, 0, keys(CHAIN, salt=f"r{round_}-"))
            client.commit(ns, 0, commit_items(result.allocated))
            granted.extend(result.allocated)
        return granted

    return work


def test_racing_writers_get_one_owner_per_key(
    backend: Backend, writers: list[MetadataClient]
) -> None:
    ns = register(writers[0], num_pages=200)
    granted = _race(writers, _allocate_rounds(ns))
    owners = Counter(a.key for allocations in granted for a in allocations)
    assert (len(owners), max(owners.values())) == (ROUNDS * CHAIN, 1)
    assert backend.invariants() == []


def test_racing_writers_never_share_a_page(backend: Backend, writers: list[MetadataClient]) -> None:
    ns = register(writers[0], num_pages=200)
    granted = _race(writers, _allocate_rounds(ns))
    pages = [a.page for allocations in granted for a in allocations]
    assert len(pages) == len(set(pages)) == ROUNDS * CHAIN
    assert backend.invariants() == []


def test_every_raced_key_is_committed_once(backend: Backend, writers: list[MetadataClient]) -> None:
    ns = register(writers[0], num_pages=200)
    _race(writers, _allocate_rounds(ns))
    found = [writers[0].lookup(ns, keys(CHAIN, salt=f"r{r}-")) for r in range(ROUNDS)]
    entries = writers[0].list_entries(ns, limit=1000)
    assert (found, len(entries)) == ([CHAIN] * ROUNDS, ROUNDS * CHAIN)
    assert backend.invariants() == []


def test_racing_writers_on_a_full_store_share_its_pages_without_overlap(
    backend: Backend, writers: list[MetadataClient]
) -> None:
    # 10 pages for 4 writers × 6 distinct keys each: some get no_space, none a taken page
    ns = register(writers[0], num_pages=10)

    def work(i: int, client: MetadataClient) -> list[Allocation]:
        result = client.allocate(ns, 0, keys(CHAIN, salt=f"w{i}-"))
        return list(result.allocated)

    granted = _race(writers, work)
    pages = [a.page for allocations in granted for a in allocations]
    assert (len(pages), len(set(pages))) == (10, 10)
    assert backend.invariants() == []


def test_racing_evictions_and_allocations_keep_the_store_sound(
    backend: Backend, writers: list[MetadataClient]
) -> None:
    from hf3fsctl.meta.models import EvictRequest

    ns = register(writers[0], num_pages=16)

    def work(i: int, client: MetadataClient) -> None:
        for round_ in range(ROUNDS):
            if i == 0:
                client.evict(EvictRequest(namespace=ns, max_entries=3))
            else:
                chain = keys(CHAIN, salt=f"w{i}-r{round_}-")
                client.commit(ns, 0, commit_items(client.allocate(ns, 0, chain).allocated))
                client.locate(ns, 0, chain)

    _race(writers, work)
    assert backend.invariants() == []
