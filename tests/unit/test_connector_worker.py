"""The worker side on its own: ranks, geometry checks, bounded staging."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hf3fsctl_connector
import pytest
import torch
from helpers.connector_harness import (
    BLOCK_SIZE,
    Harness,
    make_harness,
    make_kv_caches,
    make_request,
    pattern,
    prompt_tokens,
)
from hf3fsctl_connector.metadata import Hf3fsctlConnectorMetadata, LoadJob, SaveJob
from hf3fsctl_connector.namespace import build_manifest, load_settings
from hf3fsctl_connector.service import MetadataGuard
from hf3fsctl_connector.stats import StatsRecorder
from hf3fsctl_connector.worker import WorkerSide

from hf3fsctl.errors import ConfigError


@pytest.fixture
def harness(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Harness]:
    made = make_harness(tiny_model_dir, tmp_path / "store")
    yield made
    made.close()


def test_scheduler_and_worker_compute_the_same_namespace(harness: Harness) -> None:
    assert harness.connector.manifest.namespace_id == harness.worker.manifest.namespace_id


def test_block_hits_only_when_every_rank_committed(harness: Harness) -> None:
    settings = load_settings(harness.vllm_config)
    manifest = dataclasses.replace(
        build_manifest(harness.vllm_config, harness.kv_cache_config), tp_size=2
    )
    ranks = [
        WorkerSide(settings, manifest, harness.kv_cache_config, StatsRecorder(), rank=rank)
        for rank in (0, 1)
    ]
    keys = [f"{i + 1:032x}" for i in range(3)]
    meta = Hf3fsctlConnectorMetadata(saves=[SaveJob("r", [4, 5, 6], keys, 0)])
    guard = MetadataGuard(settings)
    hits = []
    try:
        for worker in ranks:
            _, views = make_kv_caches(harness.kv_cache_config)
            worker.register_kv_caches(views)
        for worker in ranks:
            worker.wait_for_save(meta)
            assert worker.drain(10)
            hits.append(guard.call(lambda c: c.lookup(manifest.namespace_id, keys)))
    finally:
        for worker in ranks:
            worker.shutdown()
        guard.close()
    assert hits == [0, 3]


def test_registration_warms_the_first_load_up_and_changes_nothing_stored(
    harness: Harness, tmp_path: Path
) -> None:
    """`register_kv_caches` pays the first load's one-time costs (the host cache's byte
    views, the store's lease statements: tests/unit/test_load_warm_up.py) without a hit,
    an access time or a lease moving."""
    import sqlite3

    stored = _stored_prompt(harness, 2)
    database = tmp_path / "store" / "metadata.db"

    def seen() -> tuple[object, ...]:
        conn = sqlite3.connect(database)
        try:
            # (registering writes the namespace's row: its use and lookup counters)
            return tuple(
                conn.execute(query).fetchall()
                for query in (
                    "SELECT * FROM entries ORDER BY 1, 2, 3",
                    "SELECT * FROM key_lru ORDER BY 1, 2, 3",
                    "SELECT id, hits FROM namespaces ORDER BY 1",
                )
            )
        finally:
            conn.close()

    before = seen()
    settings = load_settings(harness.vllm_config)
    worker = WorkerSide(settings, harness.worker.manifest, harness.kv_cache_config, StatsRecorder())
    try:
        _, views = make_kv_caches(harness.kv_cache_config)
        worker.register_kv_caches(views)
        assert worker.disabled is None
        assert worker._host_pieces is not None and worker._host_pieces[0] is worker.segments
        assert seen() == before
        blocks = list(range(len(stored)))
        worker.start_load_kv(Hf3fsctlConnectorMetadata(loads=[LoadJob("w", blocks, stored, True)]))
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()
    assert seen() != before  # the load itself counts its hits


def test_kv_tensor_not_matching_the_config_is_a_startup_error(
    harness: Harness, tmp_path: Path
) -> None:
    settings = load_settings(harness.vllm_config)
    worker = WorkerSide(settings, harness.worker.manifest, harness.kv_cache_config, StatsRecorder())
    _, views = make_kv_caches(harness.kv_cache_config)
    views = {name: view[::2] for name, view in views.items()}  # every other block
    try:
        with pytest.raises(ConfigError, match="blocks"):
            worker.register_kv_caches(views)
    finally:
        worker.shutdown()


def _staged(harness: Harness) -> None:
    """Save through staging, as device caches and sliding-window and Mamba groups do
    (a host cache of full attention saves from its blocks: `_saves_in_place`)."""
    harness.worker.worker_side._saves_in_place = lambda: False  # type: ignore[method-assign]


def _stall_saves(worker: WorkerSide) -> tuple[threading.Event, list[Any]]:
    gate = threading.Event()
    return gate, [worker._save_pool.submit(gate.wait, 10) for _ in range(2)]


def _run_until_finished(harness: Harness, request: Any) -> None:
    harness.scheduler.add_request(request)
    deadline = time.monotonic() + 10
    while not request.is_finished() and time.monotonic() < deadline:
        harness.step()
        time.sleep(0.001)


def _release_saves(gate: threading.Event, blockers: list[Any]) -> None:
    """Let the stalled save threads go, and wait until every save has ended."""
    gate.set()
    for blocker in blockers:
        blocker.result(5)
    assert hf3fsctl_connector.wait_for_saves(10)


def _holds_its_page(worker: WorkerSide, key: bytes) -> bool:
    """Whether the store holds `key` with the bytes the fake forward wrote for it."""
    stored = _stored_page(worker, key)
    return stored is not None and torch.equal(stored, pattern(key, worker.manifest.page_bytes))


def _stored_page(worker: WorkerSide, key: bytes) -> torch.Tensor | None:
    location = worker.guard.call(lambda c: c.locate(worker.namespace, worker.rank, [key.hex()]))
    if location[0] is None:
        return None
    data = torch.empty(worker.manifest.page_bytes, dtype=torch.uint8)
    worker.engine.read_pages(worker.page_file, [location[0].page], [data.numpy()])
    return data


def test_save_dropped_for_lack_of_staging_never_holds_the_request(harness: Harness) -> None:
    _staged(harness)
    pool = harness.worker.worker_side.pool
    # Wait out the start-up prewarm, which reserves staging while it faults pages in.
    hog = pool.acquire(1, pool.capacity_bytes, timeout_s=10)  # nothing left for saves
    assert hog is not None
    before = hf3fsctl_connector.process_totals()["failed_pool_exhausted"]
    try:
        harness.run(make_request("r", prompt_tokens(2 * BLOCK_SIZE + 1), max_tokens=1))
    finally:
        hog.release()
    dropped = hf3fsctl_connector.process_totals()["failed_pool_exhausted"] - before
    assert (dropped, "r" in harness.scheduler.requests) == (2, False)


def test_a_host_cache_saves_from_its_blocks_without_staging(harness: Harness) -> None:
    worker = harness.worker.worker_side
    pool = worker.pool
    hog = pool.acquire(1, pool.capacity_bytes, timeout_s=10)  # no staging at all
    assert hog is not None
    before = hf3fsctl_connector.process_totals()
    request = make_request("r", prompt_tokens(2 * BLOCK_SIZE + 1), max_tokens=1)
    try:
        harness.run(request)
        assert hf3fsctl_connector.wait_for_saves(10)
    finally:
        hog.release()
    after = hf3fsctl_connector.process_totals()
    assert after["failed_pool_exhausted"] == before["failed_pool_exhausted"]
    assert after["blocks_saved"] - before["blocks_saved"] == 2
    assert all(_holds_its_page(worker, bytes(h)) for h in request.block_hashes[:2])


def test_save_copies_blocks_before_the_step_returns(harness: Harness) -> None:
    _staged(harness)
    worker = harness.worker.worker_side
    gate, blockers = _stall_saves(worker)  # stall the I/O
    request = make_request("r", prompt_tokens(BLOCK_SIZE + 1), max_tokens=1)
    _run_until_finished(harness, request)
    harness.raw.zero_()  # the KV cache changes while the write is still pending
    _release_saves(gate, blockers)
    assert _holds_its_page(worker, bytes(request.block_hashes[0]))


def test_a_finished_requests_blocks_are_held_until_its_save_from_them_ends(
    harness: Harness,
) -> None:
    worker = harness.worker.worker_side
    gate, blockers = _stall_saves(worker)
    request = make_request("r", prompt_tokens(BLOCK_SIZE + 1), max_tokens=1)
    _run_until_finished(harness, request)
    for _ in range(3):
        harness.step()
    assert "r" in harness.scheduler.requests  # finished, its blocks still held
    _release_saves(gate, blockers)
    deadline = time.monotonic() + 10
    while "r" in harness.scheduler.requests and time.monotonic() < deadline:
        harness.step()  # get_finished reports it: vLLM frees the blocks
        time.sleep(0.001)
    assert "r" not in harness.scheduler.requests
    assert _holds_its_page(worker, bytes(request.block_hashes[0]))


def test_a_save_still_reading_a_preempted_requests_blocks_commits_nothing(
    harness: Harness,
) -> None:
    """vLLM may give a preempted request's blocks to another request in the forward after
    `handle_preemptions`: a save from those blocks that had not finished writing by then
    is released, not committed (it may hold the new bytes); a request not preempted is
    saved as usual."""
    worker = harness.worker.worker_side
    gate, blockers = _stall_saves(worker)
    kept = make_request("kept", prompt_tokens(BLOCK_SIZE + 1, salt=1), max_tokens=1)
    lost = make_request("lost", prompt_tokens(BLOCK_SIZE + 1, salt=2), max_tokens=1)
    harness.scheduler.add_request(kept)
    harness.scheduler.add_request(lost)
    harness.step()  # both prefill: their saves are planned, their writes wait
    before = hf3fsctl_connector.process_totals()["failed_reused"]
    worker.handle_preemptions(["lost", "unknown"])  # as vLLM before the next forward
    (blocks,) = harness.scheduler.kv_cache_manager.get_block_ids("lost")
    for pieces in worker._page_pieces(list(blocks)):  # that forward writes other data there
        for piece in pieces:
            piece[:] = bytes(len(piece))
    _release_saves(gate, blockers)
    assert hf3fsctl_connector.process_totals()["failed_reused"] - before == 1
    assert _stored_page(worker, bytes(lost.block_hashes[0])) is None
    assert _holds_its_page(worker, bytes(kept.block_hashes[0]))
    assert worker._preempted == {}  # forgotten with the last save of the request


def test_requests_preempted_under_a_full_kv_cache_never_leave_a_wrong_page(
    harness: Harness,
) -> None:
    """Three requests that outgrow the 64-block cache: vLLM preempts, frees and hands
    their blocks to the others while their saves may still read them. The scheduler names
    each preempted request that had saves to the workers, and every page the store holds
    is the page of its key (the fake forward writes each block's key's pattern)."""
    prompts = [prompt_tokens(12 * BLOCK_SIZE + 1, salt=n) for n in range(3)]
    requests = [make_request(f"r{n}", p, max_tokens=14 * BLOCK_SIZE) for n, p in enumerate(prompts)]
    before = hf3fsctl_connector.process_totals()["preempted"]
    harness.run(*requests, timeout_s=120)
    assert hf3fsctl_connector.wait_for_saves(10)
    preempted = [name for meta in harness.metas for name in meta.preempted]
    assert preempted and set(preempted) <= {r.request_id for r in requests}
    assert hf3fsctl_connector.process_totals()["preempted"] - before >= len(preempted)
    worker = harness.worker.worker_side
    checked = 0
    for request in requests:
        for block_hash in request.block_hashes[:12]:
            key = bytes(block_hash)
            stored = _stored_page(worker, key)
            if stored is not None:
                assert torch.equal(stored, pattern(key, worker.manifest.page_bytes))
                checked += 1
    assert checked >= 12  # most prompts' pages were saved


def _stored_prompt(harness: Harness, blocks: int) -> list[str]:
    """Run a prompt of `blocks` full blocks (+1 token) and return its stored keys."""
    request = make_request("cold", prompt_tokens(blocks * BLOCK_SIZE + 1), max_tokens=1)
    harness.run(request)
    assert hf3fsctl_connector.wait_for_saves(10)
    return [bytes(h).hex() for h in request.block_hashes[:blocks]]


def test_sync_load_reports_failed_blocks_in_the_same_step(harness: Harness) -> None:
    keys = _stored_prompt(harness, 2)
    worker = harness.worker.worker_side
    missing = f"{7:032x}"
    job = LoadJob("warm", [20, 21, 22], [*keys, missing], sync=True)
    worker.start_load_kv(Hf3fsctlConnectorMetadata(loads=[job]))
    errors = worker.get_block_ids_with_load_errors()
    assert (errors, worker.get_finished(set())) == ({22}, (None, None))


def test_sync_load_on_a_host_cache_fills_blocks_through_staging(harness: Harness) -> None:
    """Read into staging, then scattered: a read that outlived its step's wait (a hung
    file system) must never write into blocks given to another request meanwhile."""
    keys = _stored_prompt(harness, 2)
    worker = harness.worker.worker_side
    acquires = worker.pool.acquires
    job = LoadJob("warm", [30, 31], keys, sync=True)
    worker.start_load_kv(Hf3fsctlConnectorMetadata(loads=[job]))
    page_bytes = worker.manifest.page_bytes
    filled = all(
        torch.equal(harness.block_bytes(block), pattern(bytes.fromhex(key), page_bytes))
        for block, key in zip(job.block_ids, keys, strict=True)
    )
    assert (filled, worker.pool.acquires - acquires) == (True, 1)


def _corrupt_page(worker: WorkerSide, key: str) -> None:
    """Flip bytes in the middle of `key`'s stored page, on disk."""
    location = worker.guard.call(lambda c: c.locate(worker.namespace, worker.rank, [key]))[0]
    assert location is not None and worker.page_file is not None
    with open(worker.page_file.path, "r+b") as handle:
        handle.seek(location.page * worker.page_file.slot_bytes + location.size // 2)
        old = handle.read(16)
        handle.seek(location.page * worker.page_file.slot_bytes + location.size // 2)
        handle.write(bytes(b ^ 0xFF for b in old))


def _finish_load(worker: WorkerSide, req_id: str) -> None:
    deadline = time.monotonic() + 10
    while req_id not in (worker.get_finished(set())[1] or set()):
        assert time.monotonic() < deadline, f"load {req_id} never finished"
        time.sleep(0.005)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_corrupt_page_found_by_a_load_is_dropped_from_the_store(
    harness: Harness, sync: bool
) -> None:
    keys = _stored_prompt(harness, 2)
    worker = harness.worker.worker_side
    _corrupt_page(worker, keys[0])
    before = hf3fsctl_connector.process_totals()["invalidated"]
    worker.start_load_kv(Hf3fsctlConnectorMetadata(loads=[LoadJob("warm", [30, 31], keys, sync)]))
    if not sync:
        _finish_load(worker, "warm")
    errors = worker.get_block_ids_with_load_errors()
    assert hf3fsctl_connector.wait_for_saves(10)
    hits = worker.guard.call(lambda c: c.lookup(worker.namespace, keys))
    invalidated = hf3fsctl_connector.process_totals()["invalidated"] - before
    assert (errors, hits, invalidated) == ({30}, 0, 1)


def test_corrupt_page_fails_one_load_only(harness: Harness) -> None:
    prompt = prompt_tokens(2 * BLOCK_SIZE + 1)
    cold = make_request("cold", prompt, max_tokens=1)
    harness.run(cold)
    assert hf3fsctl_connector.wait_for_saves(10)
    _corrupt_page(harness.worker.worker_side, bytes(cold.block_hashes[0]).hex())
    before = hf3fsctl_connector.process_totals()["failed_checksum"]
    for req_id in ("warm", "again"):
        harness.run(make_request(req_id, prompt, max_tokens=1))
        assert hf3fsctl_connector.wait_for_saves(10)
    assert hf3fsctl_connector.process_totals()["failed_checksum"] - before == 1
