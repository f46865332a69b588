"""The connector inside vLLM's real Scheduler, with a real worker side and SQLite store.

Each test runs requests through `tests.helpers.connector_harness` (schedule → fake
forward that writes key-derived bytes → worker calls → update_from_output) and checks
one invariant of the scheduler/worker contract.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import hf3fsctl_connector
import pytest
import torch
from helpers.connector_harness import (
    BLOCK_SIZE,
    Harness,
    make_harness,
    make_request,
    pattern,
    prompt_tokens,
)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def harnesses(tiny_model_dir: Path, store: Path) -> Iterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for harness in made:
        harness.close()


def _new(harnesses: list[Harness], model: Path, store: Path, **kwargs: object) -> Harness:
    harness = make_harness(model, store, **kwargs)
    harnesses.append(harness)
    return harness


def _cold(harnesses: list[Harness], model: Path, store: Path, prompt: list[int]) -> Harness:
    """Run `prompt` once and wait until its pages are committed."""
    cold = _new(harnesses, model, store)
    cold.run(make_request("cold", prompt))
    assert hf3fsctl_connector.wait_for_saves(10)
    return cold


def _loads(harness: Harness) -> list[tuple[int, str]]:
    return [
        (block, key)
        for meta in harness.metas
        for job in meta.loads
        for block, key in zip(job.block_ids, job.keys, strict=True)
    ]


ASYNC = {"connector.load_mode": "async", "connector.lookup_wait_ms": 0}


def test_lookup_in_flight_returns_none_then_a_hit(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    prompt = prompt_tokens(3 * BLOCK_SIZE + 5)
    _cold(harnesses, tiny_model_dir, store, prompt)
    warm = _new(harnesses, tiny_model_dir, store, extra=ASYNC)
    request = make_request("warm", prompt)
    first = warm.connector.get_num_new_matched_tokens(request, 0)
    deadline = time.monotonic() + 5
    answer = first
    while answer[0] is None and time.monotonic() < deadline:
        time.sleep(0.01)
        answer = warm.connector.get_num_new_matched_tokens(request, 0)
    assert (first, answer) == ((None, False), (3 * BLOCK_SIZE, True))


def test_fast_lookup_answers_a_sync_hit_in_the_first_call(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    prompt = prompt_tokens(3 * BLOCK_SIZE + 5)
    _cold(harnesses, tiny_model_dir, store, prompt)
    warm = _new(harnesses, tiny_model_dir, store, extra={"connector.lookup_wait_ms": 1000})
    answer = warm.connector.get_num_new_matched_tokens(make_request("warm", prompt), 0)
    assert answer == (3 * BLOCK_SIZE, False)


@pytest.mark.parametrize("load_mode", ["sync", "async"], ids=["sync", "async"])
def test_warm_request_loads_the_stored_bytes(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path, load_mode: str
) -> None:
    prompt = prompt_tokens(4 * BLOCK_SIZE + 9)
    _cold(harnesses, tiny_model_dir, store, prompt)
    warm = _new(harnesses, tiny_model_dir, store, extra={"connector.load_mode": load_mode})
    warm.run(make_request("warm", prompt))
    page_bytes = warm.worker.worker_side.manifest.page_bytes
    loads = _loads(warm)
    assert len(loads) == 4
    assert all(
        torch.equal(warm.block_bytes(block), pattern(bytes.fromhex(key), page_bytes))
        for block, key in loads
    )


def test_last_prompt_token_is_never_covered(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    prompt = prompt_tokens(4 * BLOCK_SIZE)  # every prompt block is full and stored
    _cold(harnesses, tiny_model_dir, store, prompt)
    warm = _new(harnesses, tiny_model_dir, store)
    warm.run(make_request("warm", prompt))
    assert len(_loads(warm)) == 3


def test_each_prompt_block_is_saved_once_under_chunked_prefill(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    harness = _new(harnesses, tiny_model_dir, store, max_num_batched_tokens=64)
    request = make_request("chunked", prompt_tokens(5 * BLOCK_SIZE + 7))
    harness.run(request)
    jobs = [job for meta in harness.metas for job in meta.saves]
    expected = [bytes(h).hex() for h in request.block_hashes[:5]]
    assert (harness.saved_keys(), len(jobs) > 1) == (expected, True)


def test_stored_prefix_is_not_saved_again(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    shared = prompt_tokens(3 * BLOCK_SIZE)
    harness = _cold(harnesses, tiny_model_dir, store, [*shared, 1, 2, 3])
    before = len(harness.saved_keys())
    second = make_request("second", shared + prompt_tokens(2 * BLOCK_SIZE + 3, salt=9))
    harness.run(second)
    new_keys = harness.saved_keys()[before:]
    assert new_keys == [bytes(h).hex() for h in second.block_hashes[3:5]]


@pytest.mark.parametrize("save_decode", [False, True], ids=["prompt_only", "with_decode"])
def test_decode_blocks_are_saved_only_when_enabled(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path, save_decode: bool
) -> None:
    harness = _new(
        harnesses, tiny_model_dir, store, extra={"connector.save_decode_blocks": save_decode}
    )
    # 40 prompt tokens (1 full block) + 60 generated: KV of 99 tokens → 3 full blocks.
    harness.run(make_request("decode", prompt_tokens(40), max_tokens=60))
    assert len(harness.saved_keys()) == (3 if save_decode else 1)


def test_blocks_are_held_until_the_saves_finish(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    harness = _new(harnesses, tiny_model_dir, store)
    gate = threading.Event()
    pool = harness.worker.worker_side._save_pool
    blockers = [pool.submit(gate.wait, 10) for _ in range(2)]  # occupy both save threads
    request = make_request("held", prompt_tokens(2 * BLOCK_SIZE + 1), max_tokens=1)
    harness.scheduler.add_request(request)
    deadline = time.monotonic() + 10
    while not request.is_finished() and time.monotonic() < deadline:
        harness.step()
        time.sleep(0.001)
    for _ in range(3):
        harness.step()
    held_while_saving = "held" in harness.scheduler.requests
    gate.set()
    for blocker in blockers:
        blocker.result(5)
    harness.run()
    assert (held_while_saving, "held" in harness.scheduler.requests) == (True, False)


def test_request_with_nothing_to_save_is_not_held(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    prompt = prompt_tokens(2 * BLOCK_SIZE + 3)
    harness = _cold(harnesses, tiny_model_dir, store, prompt)
    request = make_request("again", prompt, max_tokens=1)
    assert harness.connector.request_finished(request, []) == (False, None)


# Tokens a warm request computes when all 3 loaded blocks fail: the whole prompt again
# and one decode step; a sync load also ran the 4-token tail once over the bad blocks
# (that step's output is dropped by vLLM).
@pytest.mark.parametrize(
    ("load_mode", "wasted"), [("sync", 4), ("async", 0)], ids=["sync", "async"]
)
def test_corrupted_pages_are_reported_and_recomputed(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path, load_mode: str, wasted: int
) -> None:
    prompt = prompt_tokens(3 * BLOCK_SIZE + 4)
    _cold(harnesses, tiny_model_dir, store, prompt)
    for page_file in store.glob("*/rank-*.pages"):
        page_file.write_bytes(b"\xff" * page_file.stat().st_size)
    before = hf3fsctl_connector.process_totals()["failed_checksum"]
    warm = _new(harnesses, tiny_model_dir, store, extra={"connector.load_mode": load_mode})
    warm.run(make_request("warm", prompt))
    loaded_blocks = {block for block, _ in _loads(warm)}
    failed = hf3fsctl_connector.process_totals()["failed_checksum"] - before
    prefilled = sum(output.num_scheduled_tokens.get("warm", 0) for output in warm.outputs)
    assert (warm.invalid_reported, failed, prefilled) == (
        loaded_blocks,
        3,
        len(prompt) + 1 + wasted,
    )


def test_dead_metadata_service_serves_misses_without_hanging(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    extra = {
        "metadata.url": "http://127.0.0.1:9",  # nothing listens on the discard port
        "metadata.timeout_s": 0.3,
        "metadata.retry_backoff_s": 60,
    }
    before = hf3fsctl_connector.process_totals()["misses"]
    harness = _new(harnesses, tiny_model_dir, store, extra=extra)
    started = time.monotonic()
    harness.run(
        make_request("a", prompt_tokens(2 * BLOCK_SIZE + 1), max_tokens=1),
        make_request("b", prompt_tokens(2 * BLOCK_SIZE + 1, salt=3), max_tokens=1),
        timeout_s=20,
    )
    misses = hf3fsctl_connector.process_totals()["misses"] - before
    assert (misses, _loads(harness), time.monotonic() - started < 10) == (2, [], True)


def test_silent_metadata_service_costs_a_step_at_most_the_lookup_wait(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    with socket.socket() as silent:  # accepts connections (kernel backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        extra = {
            "metadata.url": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "metadata.timeout_s": 0.5,
            "metadata.retry_backoff_s": 60,
            "connector.lookup_wait_ms": 20,
        }
        harness = _new(harnesses, tiny_model_dir, store, extra=extra)
        request = make_request("a", prompt_tokens(2 * BLOCK_SIZE + 1))
        started = time.monotonic()
        answer = harness.connector.get_num_new_matched_tokens(request, 0)
        elapsed = time.monotonic() - started
    assert (answer, elapsed < 1.0) == ((None, False), True)  # 20 ms wait, 0.5 s timeout


def test_lookup_wait_is_a_budget_per_step_not_per_request(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path
) -> None:
    # 100 waiting requests and a store that never answers: the step waits for lookups
    # at most lookup_wait_ms in all (per request it would be 100 x 50 ms = 5 s).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(128)
        extra = {
            "metadata.url": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "metadata.timeout_s": 2,
            "metadata.retry_backoff_s": 60,
            "connector.lookup_wait_ms": 50,
        }
        harness = _new(harnesses, tiny_model_dir, store, extra=extra)
        for index in range(100):
            harness.scheduler.add_request(
                make_request(f"r{index}", prompt_tokens(2 * BLOCK_SIZE + 1, salt=index))
            )
        asked: list[str] = []
        original = harness.connector.get_num_new_matched_tokens

        def counted(request: object, num_computed: int) -> tuple[int | None, bool]:
            asked.append(getattr(request, "request_id", ""))
            return original(request, num_computed)  # type: ignore[arg-type]

        harness.connector.get_num_new_matched_tokens = counted  # type: ignore[method-assign]
        started = time.monotonic()
        harness.scheduler.schedule()
        elapsed = time.monotonic() - started
    assert (len(set(asked)) >= 100, elapsed < 2.5) == (True, True)


def test_load_failure_policy_other_than_recompute_is_warned(
    harnesses: list[Harness], tiny_model_dir: Path, store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    harness = _new(harnesses, tiny_model_dir, store)
    harness.vllm_config.kv_transfer_config.kv_load_failure_policy = "fail"  # type: ignore[union-attr]
    from hf3fsctl_connector.connector import Hf3fsctlConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with caplog.at_level("WARNING", logger="hf3fsctl_connector"):
        connector = Hf3fsctlConnector(
            harness.vllm_config, KVConnectorRole.SCHEDULER, harness.kv_cache_config
        )
    connector.shutdown()
    assert "kv_load_failure_policy='fail'" in caplog.text
