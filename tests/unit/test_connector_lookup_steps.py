"""How many engine steps a warm request takes, and what an embedded store's lookup costs the step.

Issue 23 ("Fixed costs"): a hit an embedded store holds is offered in the step that first
asks (no thread hand-off, no step spent waiting), so a warm request takes the steps a
request served by vLLM's own prefix cache takes; a slow embedded store still costs a step
at most one lookup, and sends lookups back to the threads. vLLM's real `Scheduler` with
the connector (`tests.helpers.connector_harness`); no wall-clock thresholds.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import hf3fsctl_connector
import pytest
from helpers.connector_harness import (
    BLOCK_SIZE,
    Harness,
    make_harness,
    make_request,
    prompt_tokens,
)
from vllm.v1.request import Request

from hf3fsctl.meta.sqlite.store import MetadataStore

# 2 prefixes x 2 suffixes, all at once, as `bench e2e --quick` sends them (scaled down).
PREFIXES = [prompt_tokens(3 * BLOCK_SIZE, salt=s) for s in (1, 2)]
PROMPTS = [p + prompt_tokens(BLOCK_SIZE + 5, salt=10 + i) for p in PREFIXES for i in range(2)]
# A budget no loaded machine stretches one embedded lookup past: a lookup over it is sent to
# a thread and its request waits steps for the answer, and these tests count steps, not time.
ROOMY = {"connector.lookup_wait_ms": 1000}


def _new(harnesses: list[Harness], model: Path, store: Path, **kwargs: Any) -> Harness:
    harness = make_harness(model, store, **kwargs)
    harnesses.append(harness)
    return harness


def _steps_to_first_token(harness: Harness, tag: str) -> list[int]:
    """Run PROMPTS at once; per request, the engine step (1-based) that sampled its first token."""
    requests: list[Request] = [
        make_request(f"{tag}{i}", prompt, max_tokens=3) for i, prompt in enumerate(PROMPTS)
    ]
    for request in requests:
        harness.scheduler.add_request(request)
    first: dict[str, int] = {}
    deadline = time.monotonic() + 30
    step = 0
    while len(first) < len(requests) and time.monotonic() < deadline:
        harness.step()
        step += 1
        for request in requests:
            if request.output_token_ids and request.request_id not in first:
                first[request.request_id] = step
    harness.run()
    return [first.get(r.request_id, -1) for r in requests]


def test_embedded_hit_is_offered_in_the_step_that_first_asks(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    # 1 µs: no lookup thread could answer within it; the embedded store answers in the call.
    store = tmp_path / "store"
    prompt = PROMPTS[0]
    cold = _new(harnesses, tiny_model_dir, store)
    cold.run(make_request("cold", prompt))
    assert hf3fsctl_connector.wait_for_saves(10)
    warm = _new(harnesses, tiny_model_dir, store, extra={"connector.lookup_wait_ms": 0.001})
    warm.scheduler.add_request(make_request("warm", prompt))
    first = warm.step()
    scheduled = {new.req_id: new.num_computed_tokens for new in first.scheduled_new_reqs}
    loaded = [key for job in first.kv_connector_metadata.loads for key in job.keys]
    assert (scheduled, len(loaded)) == ({"warm": 4 * BLOCK_SIZE}, 4)


def test_warm_requests_take_the_steps_of_vllms_own_prefix_cache(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    # The floor has the connector too (same engine args), so it gets the same budget: with the
    # default one a CI run under load sent its lookups to threads and counted [1, 1, 23, 30].
    floor = _new(harnesses, tiny_model_dir, tmp_path / "floor", prefix_caching=True, extra=ROOMY)
    _steps_to_first_token(floor, "first")
    floor_steps = _steps_to_first_token(floor, "again")  # vLLM's prefix cache, same process
    store = tmp_path / "store"
    cold = _new(harnesses, tiny_model_dir, store, prefix_caching=True, extra=ROOMY)
    _steps_to_first_token(cold, "cold")
    assert hf3fsctl_connector.wait_for_saves(10)
    # A fresh scheduler and worker on the stored pages.
    warm = _new(harnesses, tiny_model_dir, store, prefix_caching=True, extra=ROOMY)
    warm_steps = _steps_to_first_token(warm, "warm")
    loaded = sum(len(job.keys) for meta in warm.metas for job in meta.loads)
    assert (warm_steps, loaded) == (floor_steps, 2 * 4 + 2 * 1)  # 2 prefixes, 4 own suffixes


def test_slow_embedded_lookup_costs_the_step_one_lookup_and_moves_lookups_to_threads(
    harnesses: list[Harness],
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = tmp_path / "store"
    cold = _new(harnesses, tiny_model_dir, store)
    cold.run(make_request("cold", PROMPTS[0]))
    assert hf3fsctl_connector.wait_for_saves(10)
    warm = _new(harnesses, tiny_model_dir, store, extra={"connector.lookup_wait_ms": 10})
    client = warm.connector.scheduler_side.guard.client()
    real = client.lookup

    def slow(namespace: str, keys: list[str]) -> int:
        time.sleep(0.1)  # ten times the step's budget
        return int(real(namespace, keys))

    client.lookup = slow
    matched = warm.connector.get_num_new_matched_tokens
    with caplog.at_level("WARNING", logger="hf3fsctl_connector"):
        answers = [matched(make_request(f"r{i}", PROMPTS[i]), 0) for i in range(2)]
        warm.step()  # a new step, a new budget
        answers.append(matched(make_request("r2", PROMPTS[2]), 0))
    # The first, already running, finishes on the engine thread; the second is handed to a
    # thread and not waited for (the step's budget is spent); in the next step the third
    # goes to a thread too and is waited for 10 ms only. vLLM asks again next step.
    assert answers == [(4 * BLOCK_SIZE, False), (None, False), (None, False)]
    assert "lookups run off the engine step" in caplog.text


def test_a_fresh_schedulers_first_lookups_compile_nothing(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler side has its embedded store compile the lookups when it opens it
    (`prepare_lookup`), on the thread that then answers them inline (issue 23)."""
    store = tmp_path / "store"
    cold = _new(harnesses, tiny_model_dir, store)
    cold.run(make_request("cold", PROMPTS[0]))
    assert hf3fsctl_connector.wait_for_saves(10)
    compiled: list[tuple[int, str | None]] = []
    prepare = MetadataStore.prepare_lookup

    def watched(self: MetadataStore) -> None:  # the authorizer first: it expires statements
        def authorize(action: int, table: str | None, *_: Any) -> int:
            compiled.append((action, table))
            return sqlite3.SQLITE_OK

        self._conn().set_authorizer(authorize)
        monkeypatch.setattr(self, "_flush_if_free", lambda: None)  # the counters' timed write
        prepare(self)

    monkeypatch.setattr(MetadataStore, "prepare_lookup", watched)
    warm = _new(harnesses, tiny_model_dir, store, extra=ROOMY)
    assert (sqlite3.SQLITE_READ, "key_lru") in compiled
    compiled.clear()
    for i, prompt in enumerate(PROMPTS):
        warm.scheduler.add_request(make_request(f"warm{i}", prompt))
    first = warm.step()
    loads = sorted(len(job.keys) for job in first.kv_connector_metadata.loads)
    assert loads == [3, 4]  # PROMPTS[0] stored, PROMPTS[1] its prefix
    assert compiled == []
