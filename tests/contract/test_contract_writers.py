"""The contract's writers: engines that wrote to a namespace, recorded once each."""

from __future__ import annotations

import pytest
from contract_backends import ALL_BACKENDS, Backend
from helpers.meta_builders import register

from hf3fsctl.errors import InvalidRequest, NotFound
from hf3fsctl.meta.models import WriterInfo
from hf3fsctl.meta.protocol import MetadataClient

BACKENDS = ALL_BACKENDS  # a new call: every way production reaches a store

EAGER = WriterInfo(id="a" * 12, numerics={"compilation_mode": "NONE", "enforce_eager": "true"})
COMPILED = WriterInfo(id="b" * 12, numerics={"compilation_mode": "DYNAMO_TRACE_ONCE"})


@pytest.fixture
def store(backend: Backend) -> MetadataClient:
    return backend.open()


def test_writers_are_recorded_per_namespace_once_each(store: MetadataClient) -> None:
    ns = register(store)
    other = register(store, model="other")
    store.record_writer(ns, EAGER)
    store.record_writer(ns, COMPILED)
    store.record_writer(ns, EAGER)  # a restart of the same engine
    store.record_writer(other, EAGER)
    found = store.writers(ns)
    assert [w.id for w in found[ns]] == [EAGER.id, COMPILED.id]
    assert found[ns][0].numerics == EAGER.numerics
    assert found[ns][0].first_seen > 0
    assert set(store.writers()) == {ns, other}


def test_a_namespace_without_writers_has_none(store: MetadataClient) -> None:
    ns = register(store)
    assert store.writers(ns) == {}


def test_writer_of_an_unknown_namespace_is_not_found(store: MetadataClient) -> None:
    with pytest.raises(NotFound):
        store.record_writer("0" * 16, EAGER)


def test_writer_with_too_many_settings_is_refused(store: MetadataClient) -> None:
    ns = register(store)
    many = WriterInfo(id="c" * 12, numerics={f"k{i}": "v" for i in range(33)})
    with pytest.raises(InvalidRequest):
        store.record_writer(ns, many)


def test_dropping_a_namespace_drops_its_writers(store: MetadataClient) -> None:
    ns = register(store)
    store.record_writer(ns, EAGER)
    store.drop_namespaces([ns])
    assert store.writers() == {}
