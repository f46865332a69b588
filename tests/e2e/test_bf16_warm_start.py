"""A fresh bf16 engine whose first forward is a prefix loaded from the store.

vLLM 0.32's CPU attention runs AMX tile instructions for a bf16 model on a CPU with AMX
without asking Linux for them; only oneDNN's first AMX matmul does. A cold engine's first
forward is a long prefill, whose matmuls ask before any attention runs; a warm engine's
is the loaded prompts and a few new tokens each, and it died of SIGILL there until the
connector asked for the tile state itself (`connector.worker.allow_amx_tiles`). On a CPU
without AMX this checks the bf16 warm path only (the same tokens, the loads counted).

It shows when the first forward's matmuls are too small for oneDNN to take AMX: here a
narrow model (hidden size 128), blocks of 128 tokens and one request of 4 new tokens
first (without the connector's call this test dies of SIGILL on this machine's AMX CPU;
a batch of 3 such requests, or the session's tiny model, did not).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from e2e_scenario import RUN_TIMEOUT_S, E2EStore, make_store

from hf3fsctl.vllm_tools.runner import EngineResult, EngineRun, run_engine, shared_prefix_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 128
# Three prompts of 6 full blocks and 4 tokens that part inside their 4th block, one at a
# time: the warm process's first forward computes 4 tokens.
PROMPTS = shared_prefix_prompts(3, 4 * BLOCK - 3, 2 * BLOCK + 7, seed=41)
FULL_BLOCKS = len(PROMPTS[0]) // BLOCK


def _run(model: Path, store: E2EStore | None) -> EngineResult:
    return run_engine(
        EngineRun(
            model=str(model),
            prompts=PROMPTS,
            max_tokens=6,
            block_size=BLOCK,
            dtype="bfloat16",
            kv_transfer_config=None if store is None else store.kv_config(),
            kv_cache_memory_bytes=64 << 20,
            max_model_len=1024,
            batch=False,
            warmup_tokens=0,  # the loaded step is the process's first forward
            timeout_s=RUN_TIMEOUT_S,
        )
    )


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hf3fsctl.vllm_tools.tiny_model import SIZES, build_tiny_model

    spec = replace(SIZES["tiny"], hidden_size=128, intermediate_size=256)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-narrow", spec)


def test_a_warm_bf16_engine_starts_on_loaded_pages(narrow_model: Path, tmp_path: Path) -> None:
    store = make_store(tmp_path / "store")
    baseline = _run(narrow_model, None)
    assert len(set(map(tuple, baseline.outputs))) > 1  # the prompts' outputs differ
    cold = _run(narrow_model, store)
    assert cold.outputs == baseline.outputs
    warm = _run(narrow_model, store)
    assert warm.outputs == baseline.outputs
    assert [r.num_cached_tokens for r in warm.requests] == [FULL_BLOCKS * BLOCK] * len(PROMPTS)
    assert warm.connector is not None
    assert warm.connector["blocks_loaded"] >= FULL_BLOCKS
    assert warm.connector["failed_blocks"] == 0
