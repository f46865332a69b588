"""KV events (connector/events.py) follow every store's change log.

The follower is driven by `poll()` (its own thread polls rarely here), so every
assertion is about what one read of the real log turns into, not about timing. The
same scenarios run on the embedded SQLite store, Redis and the HTTP service.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from contract_backends import ALL_BACKENDS, Backend
from helpers.meta_builders import commit_items, register, store_keys
from hf3fsctl_connector.events import BlockPayload, StoreEvents
from hf3fsctl_connector.service import MetadataGuard
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.protocol import MetadataClient

BACKENDS = ALL_BACKENDS
BLOCK = 4


def _external(block_hash: bytes) -> object:
    """The hash as vLLM publishes it (an int by default, or the bytes)."""
    return maybe_convert_block_hash(BlockHash(block_hash))


def _payloads(count: int, salt: int = 0) -> list[BlockPayload]:
    hashes = [hashlib.sha256(bytes([salt, i])).digest() for i in range(count)]
    return [
        BlockPayload(
            block_hash=h,
            parent_hash=hashes[i - 1] if i else None,
            token_ids=tuple(range(i * BLOCK, (i + 1) * BLOCK)),
            lora_id=None,
            lora_name=None,
            extra_keys=(("cache_salt", "tenant-a"),) if i == 0 else None,
        )
        for i, h in enumerate(hashes)
    ]


@pytest.fixture
def world(backend: Backend) -> Iterator[tuple[MetadataClient, str, StoreEvents]]:
    store = backend.open()
    namespace = register(store, tp_size=2)
    assert backend.config is not None
    guard = MetadataGuard(backend.config)
    events = StoreEvents(
        guard, namespace, num_ranks=2, block_size=BLOCK, medium="HF3FS", poll_s=3600
    )
    events.poll()  # the thread's first read may not have happened yet: start at the end
    yield store, namespace, events
    events.close()
    guard.close()


def test_a_saved_block_is_announced_once_committed_on_every_rank(
    world: tuple[MetadataClient, str, StoreEvents],
) -> None:
    store, ns, events = world
    payloads = _payloads(3)
    events.record_saves(payloads)
    keys = [p.block_hash.hex() for p in payloads]
    store_keys(store, ns, keys, ranks=1)  # rank 0 only: not a hit yet
    events.poll()
    assert events.take_events() == []
    result = store.allocate(ns, 1, keys)
    store.commit(ns, 1, commit_items(result.allocated))
    events.poll()
    stored = events.take_events()
    assert [type(e) for e in stored] == [BlockStored] * 3
    first = stored[0]
    assert isinstance(first, BlockStored)
    assert first.block_hashes == [_external(payloads[0].block_hash)]
    assert first.parent_block_hash is None and stored[1].parent_block_hash == _external(
        payloads[0].block_hash
    )
    assert first.token_ids == list(range(BLOCK)) and first.block_size == BLOCK
    assert first.medium == "HF3FS" and "tenant-a" in str(first.extra_keys)
    assert stored[1].extra_keys in (None, [None])
    events.poll()
    assert events.take_events() == []  # announced once


def test_removals_by_anyone_are_announced_once_per_key(
    world: tuple[MetadataClient, str, StoreEvents],
) -> None:
    store, ns, events = world
    keys = [p.block_hash.hex() for p in _payloads(4, salt=1)]
    store_keys(store, ns, keys, ranks=2)  # stored by someone else: no payload here
    events.poll()
    assert events.take_events() == []
    store.evict(EvictRequest(namespace=ns, all=True))  # e.g. `hf3fsctl evict --all`
    events.poll()
    removed = events.take_events()
    assert len(removed) == 1 and isinstance(removed[0], BlockRemoved)
    assert sorted(map(str, removed[0].block_hashes)) == sorted(
        str(_external(bytes.fromhex(k))) for k in keys
    )
    assert removed[0].medium == "HF3FS"
    store_keys(store, ns, keys[:1], ranks=2)  # stored again, removed again: announced again
    store.evict(EvictRequest(namespace=ns, all=True))
    events.poll()
    again = events.take_events()
    assert [e.block_hashes for e in again if isinstance(e, BlockRemoved)] == [
        [_external(bytes.fromhex(keys[0]))]
    ]


def test_an_engine_that_takes_no_events_keeps_only_the_newest(
    world: tuple[MetadataClient, str, StoreEvents], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hf3fsctl_connector.events as events_module

    store, ns, events = world
    monkeypatch.setattr(events_module, "MAX_TRACKED", 4)
    keys = [p.block_hash.hex() for p in _payloads(10, salt=2)]
    for key in keys:  # one at a time: the log orders the removals as the evictions ran
        store_keys(store, ns, [key], ranks=2)
    store.evict(EvictRequest(namespace=ns, all=True))
    events.poll()
    (removed,) = events.take_events()
    assert isinstance(removed, BlockRemoved)
    assert 0 < len(removed.block_hashes) <= 4
