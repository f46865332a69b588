"""The store's change log read by followers (KV events): `changes(since, namespace, limit)`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.server import create_app
from hf3fsctl.meta.store import MetadataStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    s = MetadataStore(tmp_path / "meta.db", lease_s=0)
    yield s
    s.close()


def test_reading_from_the_end_returns_nothing_but_where_to_go_on(store: MetadataStore) -> None:
    ns = register(store)
    store_keys(store, ns, keys(3))
    start = store.changes(-1)
    assert start.changes == [] and start.next_seq > 0
    store_keys(store, ns, keys(2, start=10))
    after = store.changes(start.next_seq)
    assert [(c.key, c.delta) for c in after.changes] == [(k, 1) for k in keys(2, start=10)]
    assert not after.missed


def test_commits_and_removals_are_logged_in_order_per_rank(store: MetadataStore) -> None:
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
    assert seqs == sorted(seqs) and log.next_seq == seqs[-1]
    assert max(i for i, c in enumerate(log.changes) if c.delta == 1) < min(
        i for i, c in enumerate(log.changes) if c.delta == -1
    )


def test_a_namespace_filter_still_advances_past_other_namespaces(store: MetadataStore) -> None:
    mine, other = register(store, model="a"), register(store, model="b")
    since = store.changes(-1).next_seq
    store_keys(store, other, keys(3, salt="o"))
    store_keys(store, mine, keys(1))
    log = store.changes(since, namespace=mine)
    assert [c.key for c in log.changes] == keys(1)
    assert store.changes(log.next_seq, namespace=mine).changes == []


def test_limit_pages_through_the_log(store: MetadataStore) -> None:
    ns = register(store)
    since = store.changes(-1).next_seq
    store_keys(store, ns, keys(5))
    seen: list[str] = []
    while True:
        log = store.changes(since, limit=2)
        if not log.changes:
            break
        assert len(log.changes) <= 2
        seen += [c.key for c in log.changes]
        since = log.next_seq
    assert seen == keys(5)


def test_the_http_route_answers_the_same_slice(store: MetadataStore) -> None:
    ns = register(store)
    since = store.changes(-1).next_seq
    store_keys(store, ns, keys(2))
    with TestClient(create_app(store)) as http:
        answer = http.post("/v1/changes", json={"since": since, "namespace": ns})
        bad = http.post("/v1/changes", json={"since": -2})
    assert answer.status_code == 200
    assert answer.json() == store.changes(since, ns).model_dump(mode="json")
    assert bad.status_code == 422
