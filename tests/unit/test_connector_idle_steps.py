"""Idle engine steps take the connector's shortest path, and its clock still sees them.

Each test drives vLLM's real Scheduler (`tests.helpers.connector_harness`) and calls the
worker connector in the order vLLM 0.32's model runner does (`KVConnectorModelRunnerMixin.
_get_kv_connector_output`), then checks one invariant of the idle path (docs/design.md
"Idle steps, in the engine").
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import hf3fsctl_connector
from helpers.connector_harness import BLOCK_SIZE, Harness, make_harness, make_request, prompt_tokens
from hf3fsctl_connector.scheduler import NO_WORK
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput


def _new(harnesses: list[Harness], model: Path, store: Path, **kwargs: Any) -> Harness:
    harness = make_harness(model, store, **kwargs)
    harnesses.append(harness)
    return harness


def _engine_step(h: Harness) -> dict[str, Any]:
    """One step with the worker's calls in vLLM 0.32's order; what they answered."""
    output = h.scheduler.schedule()
    meta = output.kv_connector_metadata
    h.metas.append(meta)
    worker = h.worker
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    if output.has_sync_kv_loads:
        worker.start_load_kv(None)
    h._fake_forward(output)
    if not output.has_sync_kv_loads:
        worker.start_load_kv(None)
    worker.wait_for_save()
    results = worker.get_transfer_results(output.finished_req_ids)
    invalid = worker.get_block_ids_with_load_errors()
    worker.get_kv_connector_stats()
    worker.clear_connector_metadata()
    req_ids = list(output.num_scheduled_tokens)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[100] if h._sampling(r) else [] for r in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            invalid_block_ids=invalid,
        ),
    )
    h.scheduler.update_from_output(output, runner_output)
    return {"meta": meta, "results": results, "invalid": invalid, "output": output}


def _run(h: Harness, *requests: Any, steps: int = 200) -> list[dict[str, Any]]:
    for request in requests:
        h.scheduler.add_request(request)
    seen = []
    for _ in range(steps):
        if not (h.scheduler.requests or h.scheduler.has_requests()):
            break
        seen.append(_engine_step(h))
        if seen[-1]["output"].total_num_scheduled_tokens == 0:
            time.sleep(0.005)
    return seen


def _decode_requests(count: int, prompt_blocks: int = 2, output_tokens: int = 12) -> list[Any]:
    return [
        make_request(
            f"r{i}", prompt_tokens(prompt_blocks * BLOCK_SIZE + 3, salt=i), max_tokens=output_tokens
        )
        for i in range(count)
    ]


def test_decode_steps_after_the_prompts_are_planned_share_one_empty_metadata(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    h = _new(harnesses, tiny_model_dir, tmp_path / "store")
    steps = _run(h, *_decode_requests(3))
    assert steps[0]["meta"].saves  # the prompts' blocks are planned in their step
    idle = [s for s in steps[1:] if not s["output"].finished_req_ids]
    assert idle and all(s["meta"] is NO_WORK for s in idle)
    assert NO_WORK.loads == [] and NO_WORK.saves == []  # nobody wrote into it


def test_a_request_that_never_saves_reaches_the_idle_path(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    h = _new(harnesses, tiny_model_dir, tmp_path / "store", kv_role="kv_consumer")
    steps = _run(h, *_decode_requests(2))
    assert all(not s["meta"].saves for s in steps)
    assert steps[1]["meta"] is NO_WORK


def test_an_idle_worker_step_reports_nothing_and_no_layer_hooks(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    h = _new(harnesses, tiny_model_dir, tmp_path / "store")
    steps = _run(h, *_decode_requests(2))
    assert hf3fsctl_connector.wait_for_saves(10)
    decoding = steps[1:10]  # after the prompts' step, before any request finishes
    assert all(s["meta"] is NO_WORK and not s["output"].finished_req_ids for s in decoding)
    for step in decoding:
        results = step["results"]
        # sets, never None: vLLM's multiprocess aggregator and MultiConnector `|=` them
        for field in ("finished_sending", "finished_recving", "failed_recving"):
            assert getattr(results, field) == set()
        assert step["invalid"] == set()
    # vLLM's per-layer wrapper asks this before wait_for_layer_load / save_kv_layer
    assert h.worker.has_connector_metadata() is False


def test_saved_requests_are_still_reported_finished_sending(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    h = _new(harnesses, tiny_model_dir, tmp_path / "store")
    requests = _decode_requests(2)
    steps = _run(h, *requests)
    sent = {r for s in steps for r in (s["results"].finished_sending or ())}
    assert sent == {r.request_id for r in requests}  # their held blocks were given back
    assert not h.scheduler.requests


def test_every_step_records_one_sample_per_side(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    h = _new(harnesses, tiny_model_dir, tmp_path / "store")
    h.worker.flush_steps()
    h.connector.flush_steps()
    kept: dict[str, list[int]] = {"worker": [], "scheduler": []}
    for side, facade in (("worker", h.worker), ("scheduler", h.connector)):
        original = facade.flush_steps

        def flush(side: str = side, facade: Any = facade, original: Any = original) -> None:
            kept[side].extend(facade._steps)
            original()

        facade.flush_steps = flush
    steps = _run(h, *_decode_requests(2))
    h.worker.flush_steps()
    h.connector.flush_steps()
    assert len(kept["worker"]) == len(steps) == len(kept["scheduler"])
    assert all(ns > 0 for ns in kept["worker"])


def test_the_worker_span_opens_at_start_load_kv_after_the_forward(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """What start_load_kv costs on an idle step is inside the step's sample."""
    h = _new(harnesses, tiny_model_dir, tmp_path / "store")
    worker = h.worker
    worker.bind_connector_metadata(NO_WORK)
    worker.flush_steps()
    worker.start_load_kv(None)
    burn_until = time.thread_time_ns() + 3_000_000  # 3 ms of this thread's CPU
    while time.thread_time_ns() < burn_until:
        pass
    worker.wait_for_save()
    worker.get_transfer_results(set())
    worker.get_block_ids_with_load_errors()
    worker.get_kv_connector_stats()
    assert worker._steps[-1] >= 3_000_000
