"""The contract's change log (`changes`): what followers such as KV events read.

Every store logs each committed rank a key gains (+1) or loses (-1), in order, whoever
made the change; `since = -1` starts at the log's end; `next_seq` pages through it; a
namespace filter still advances past other namespaces' rows.
"""

from __future__ import annotations

import pytest
from contract_backends import ALL_BACKENDS, Backend
from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.protocol import MetadataClient

BACKENDS = ALL_BACKENDS


@pytest.fixture
def store(backend: Backend) -> MetadataClient:
    return backend.open()


def test_reading_from_the_end_returns_nothing_but_where_to_go_on(store: MetadataClient) -> None:
    ns = register(store)
    store_keys(store, ns, keys(3))
    start = store.changes(-1)
    assert start.changes == []
    store_keys(store, ns, keys(2, start=10))
    after = store.changes(start.next_seq)
    assert [(c.key, c.delta) for c in after.changes] == [(k, 1) for k in keys(2, start=10)]
    assert not after.missed and after.next_seq > start.next_seq


@pytest.mark.one_slot
def test_commits_and_removals_are_logged_in_order_per_rank(store: MetadataClient) -> None:
    ns = register(store, tp_size=2)
    since = store.changes(-1).next_seq
    chain = keys(2)
    store_keys(store, ns, chain, ranks=2)
    store.evict(EvictRequest(namespace=ns, all=True))
    log = store.changes(since)
    plus = [c.key for c in log.changes if c.delta == 1]
    minus = [c.key for c in log.changes if c.delta == -1]
    assert sorted(plus) == sorted(chain * 2) and sorted(minus) == sorted(chain * 2)
    seqs = [c.seq for c in log.changes]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert max(i for i, c in enumerate(log.changes) if c.delta == 1) < min(
        i for i, c in enumerate(log.changes) if c.delta == -1
    )


def test_a_namespace_filter_still_advances_past_other_namespaces(store: MetadataClient) -> None:
    mine, other = register(store, model="a"), register(store, model="b")
    since = store.changes(-1).next_seq
    store_keys(store, other, keys(3, salt="o"))
    store_keys(store, mine, keys(1))
    log = store.changes(since, namespace=mine)
    assert [c.key for c in log.changes] == keys(1)
    assert store.changes(log.next_seq, namespace=mine).changes == []


@pytest.mark.one_slot
def test_limit_pages_through_the_log(store: MetadataClient) -> None:
    ns = register(store)
    since = store.changes(-1).next_seq
    store_keys(store, ns, keys(5))
    seen: list[str] = []
    for _ in range(10):
        log = store.changes(since, limit=2)
        if not log.changes:
            break
        assert len(log.changes) <= 2
        seen += [c.key for c in log.changes]
        since = log.next_seq
    assert seen == keys(5)


def test_a_malformed_namespace_is_refused(store: MetadataClient) -> None:
    with pytest.raises(InvalidRequest):
        store.changes(-1, namespace="not a namespace")
