"""kv_role, a request's kv_transfer_params and admission, inside vLLM's real Scheduler.

Each test runs requests through `tests.helpers.connector_harness` (real scheduler, real
worker side, real SQLite store and page files; a fake forward writes key-derived bytes)
and checks one invariant of issue 22: what a producer, a consumer and a request's
`save` / `load` / `retention` / `pin` do to the store, and which blocks admission
(`connector.store_after_hits`) lets through.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hf3fsctl_connector
import pytest
from helpers.connector_harness import (
    BLOCK_SIZE,
    Harness,
    make_harness,
    make_request,
    pattern,
    prompt_tokens,
)

from hf3fsctl.config import load_config
from hf3fsctl.keys import block_keys
from hf3fsctl.meta.base import StoreCore
from hf3fsctl.meta.client import connect
from hf3fsctl.meta.protocol import MetadataClient

PROMPT_BLOCKS = 3


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def client(store: Path) -> Iterator[MetadataClient]:
    config = load_config(
        None,
        overrides={"storage.path": str(store), "metadata.url": f"sqlite:///{store}/metadata.db"},
        environ={},
    )
    opened = connect(config)
    yield opened
    opened.close()


def _new(harnesses: list[Harness], model: Path, store: Path, **kwargs: Any) -> Harness:
    harness = make_harness(model, store, **kwargs)
    harnesses.append(harness)
    return harness


def _run(harness: Harness, *requests: Any) -> None:
    harness.run(*requests)
    assert hf3fsctl_connector.wait_for_saves(10)


def _prompt(salt: int = 0) -> list[int]:
    return prompt_tokens(PROMPT_BLOCKS * BLOCK_SIZE + 5, salt)


def _loads(harness: Harness) -> list[tuple[int, str]]:
    return [
        (block, key)
        for meta in harness.metas
        for job in meta.loads
        for block, key in zip(job.block_ids, job.keys, strict=True)
    ]


def _entries(client: MetadataClient, harness: Harness) -> dict[str, Any]:
    namespace = harness.connector.scheduler_side.namespace
    try:
        return {e.key: e for e in client.list_entries(namespace, limit=1000)}
    except Exception:  # nothing registered yet
        return {}


# --- kv_role ----------------------------------------------------------------------------


def test_a_consumer_saves_nothing(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path, client: MetadataClient
) -> None:
    consumer = _new(harnesses, tiny_model_dir, store, kv_role="kv_consumer")
    _run(consumer, make_request("c", _prompt()))
    assert consumer.saved_keys() == []
    assert _entries(client, consumer) == {}


def test_a_consumer_loads_the_pages_a_producer_saved(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    prompt = _prompt()
    producer = _new(harnesses, tiny_model_dir, store, kv_role="kv_producer")
    _run(producer, make_request("p", prompt))
    assert len(producer.saved_keys()) == PROMPT_BLOCKS
    consumer = _new(harnesses, tiny_model_dir, store, kv_role="kv_consumer")
    _run(consumer, make_request("c", prompt))
    loads = _loads(consumer)
    assert [key for _, key in loads] == producer.saved_keys()
    page = consumer.worker.worker_side.manifest.page_bytes
    for block, key in loads:
        assert bool((consumer.block_bytes(block) == pattern(bytes.fromhex(key), page)).all())
    assert consumer.saved_keys() == []


def test_a_producer_loads_nothing_and_does_not_save_a_stored_prefix_again(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    prompt = _prompt()
    _run(_new(harnesses, tiny_model_dir, store), make_request("first", prompt))
    producer = _new(harnesses, tiny_model_dir, store, kv_role="kv_producer")
    request = make_request("again", prompt + prompt_tokens(BLOCK_SIZE, salt=5))
    _run(producer, request)
    assert _loads(producer) == []
    # Only the block past the stored prefix is saved (the stored ones are looked up).
    assert producer.saved_keys() == block_keys(
        request.block_hashes[PROMPT_BLOCKS : request.num_prompt_tokens // BLOCK_SIZE]
    )


# --- kv_transfer_params -----------------------------------------------------------------


def test_save_false_leaves_no_entry(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path, client: MetadataClient
) -> None:
    harness = _new(harnesses, tiny_model_dir, store)
    _run(harness, make_request("private", _prompt(), kv_transfer_params={"save": False}))
    assert harness.saved_keys() == []
    assert _entries(client, harness) == {}


def test_load_false_computes_the_prompt_and_saves_nothing_already_stored(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    prompt = _prompt()
    _run(_new(harnesses, tiny_model_dir, store), make_request("cold", prompt))
    harness = _new(harnesses, tiny_model_dir, store)
    _run(harness, make_request("fresh", prompt, kv_transfer_params={"load": False}))
    assert _loads(harness) == [] and harness.saved_keys() == []


@pytest.mark.parametrize(
    ("params", "extra", "retention"),
    [
        ({"retention": "1h"}, {}, 3600.0),
        ({"retention": 90}, {"retention.default": "5m"}, 90.0),
        ({}, {"retention.default": "5m"}, 300.0),
        ({}, {}, None),
    ],
    ids=["request", "request-wins", "config-default", "never"],
)
def test_retention_becomes_the_entries_expiry(
    harnesses: list[Harness],
    tiny_model_dir: Path,
    store: Path,
    client: MetadataClient,
    params: dict[str, Any],
    extra: dict[str, Any],
    retention: float | None,
) -> None:
    harness = _new(harnesses, tiny_model_dir, store, extra=extra)
    before = time.time()
    _run(harness, make_request("r", _prompt(), kv_transfer_params=params))
    entries = _entries(client, harness)
    assert len(entries) == PROMPT_BLOCKS
    for entry in entries.values():
        if retention is None:
            assert entry.expires_at is None
        else:
            assert entry.expires_at is not None
            assert before + retention <= entry.expires_at <= time.time() + retention


def test_an_expired_entry_is_not_loaded(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    prompt = _prompt()
    retention_s = 0.3
    _run(
        _new(harnesses, tiny_model_dir, store),
        make_request("c", prompt, kv_transfer_params={"retention": retention_s}),
    )
    saved = time.time()  # every commit has returned: its entries expire before this + 0.3 s
    time.sleep(max(0.0, saved + retention_s + 0.1 - time.time()))
    warm = _new(harnesses, tiny_model_dir, store)
    _run(warm, make_request("w", prompt))
    assert _loads(warm) == []
    assert len(warm.saved_keys()) == PROMPT_BLOCKS  # saved anew


@pytest.mark.parametrize(("pin", "ttl"), [(True, None), ("10m", 600.0)], ids=["pin", "ttl"])
def test_pin_pins_the_requests_stored_keys(
    harnesses: list[Harness],
    tiny_model_dir: Path,
    store: Path,
    client: MetadataClient,
    pin: object,
    ttl: float | None,
) -> None:
    harness = _new(harnesses, tiny_model_dir, store)
    before = time.time()
    _run(harness, make_request("pinned", _prompt(), kv_transfer_params={"pin": pin}))
    pins = {p.key: p for p in client.list_pins()}
    assert set(pins) == set(harness.saved_keys()) and len(pins) == PROMPT_BLOCKS
    for info in pins.values():
        assert info.stored
        if ttl is None:
            assert info.expires is None
        else:
            assert info.expires is not None and before + ttl <= info.expires <= time.time() + ttl


def test_pin_also_pins_a_prefix_that_was_loaded(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path, client: MetadataClient
) -> None:
    prompt = _prompt()
    cold = _new(harnesses, tiny_model_dir, store)
    _run(cold, make_request("cold", prompt))
    warm = _new(harnesses, tiny_model_dir, store)
    _run(warm, make_request("warm", prompt, kv_transfer_params={"pin": True}))
    assert _loads(warm) and warm.saved_keys() == []
    deadline = time.monotonic() + 5
    while len(client.list_pins()) < PROMPT_BLOCKS and time.monotonic() < deadline:
        time.sleep(0.02)  # the scheduler pins off the engine thread
    assert {p.key for p in client.list_pins()} == set(cold.saved_keys())


def test_unknown_keys_and_bad_types_never_stop_the_request(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    harness = _new(harnesses, tiny_model_dir, store)
    params = {"do_remote_prefill": False, "save": "no", "retention": "soon", "pin": [1]}
    _run(harness, make_request("odd", _prompt(), kv_transfer_params=params))
    assert len(harness.saved_keys()) == PROMPT_BLOCKS  # every bad key ignored


# --- admission --------------------------------------------------------------------------


def test_store_after_hits_saves_a_prompt_the_nth_time_it_is_seen(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path, client: MetadataClient
) -> None:
    prompt = _prompt()
    admitting = {"connector.store_after_hits": 2}
    first = _new(harnesses, tiny_model_dir, store, extra=admitting)
    _run(first, make_request("once", prompt))
    assert first.saved_keys() == []
    second = _new(harnesses, tiny_model_dir, store, extra=admitting)  # another engine
    _run(second, make_request("twice", prompt))
    assert len(second.saved_keys()) == PROMPT_BLOCKS
    stats = {n.id: n for n in client.stats().namespaces}
    assert stats[first.connector.scheduler_side.namespace].admission_skipped == PROMPT_BLOCKS


def test_admission_saves_only_the_admitted_run_after_the_stored_prefix(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    shared = prompt_tokens(2 * BLOCK_SIZE)
    harness = _new(harnesses, tiny_model_dir, store, extra={"connector.store_after_hits": 2})
    a = make_request("a", shared + prompt_tokens(2 * BLOCK_SIZE + 3, salt=1))
    _run(harness, a)
    b = make_request("b", shared + prompt_tokens(2 * BLOCK_SIZE + 3, salt=2))
    _run(harness, b)
    # b's two shared blocks are seen a second time; its own blocks once: not saved,
    # nor is any block after the first one not admitted.
    assert harness.saved_keys() == block_keys(b.block_hashes[:2])


def test_store_after_hits_0_never_asks_the_store(
    harnesses: list[Harness],
    tiny_model_dir: Path,
    store: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []

    def spy(self: Any, namespace: str, keys: list[str], after_hits: int) -> list[bool]:
        asked.append(after_hits)
        return [True] * len(keys)

    monkeypatch.setattr(StoreCore, "admit", spy)
    for hits in (0, 1):
        harness = _new(
            harnesses, tiny_model_dir, store / str(hits), extra={"connector.store_after_hits": hits}
        )
        _run(harness, make_request(f"r{hits}", _prompt(hits)))
        assert len(harness.saved_keys()) == PROMPT_BLOCKS
    assert asked == []
