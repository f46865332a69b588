"""Saves under preemption, through real vLLM.

A KV cache too small for the batch makes vLLM preempt running requests and hand their
freed blocks to others, while the connector's saves — written from the blocks themselves
on a host cache (docs/design.md, Data paths) — may still be reading them. The cold run
must give the tokens of a run without the connector on the same small cache and count
the preemptions; every page it committed must be its block's: a warm run in a fresh
process, with a cache large enough for the batch, loads them and must give the tokens of
a run without the connector on that cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_scenario import BLOCK, DTYPE, RUN_TIMEOUT_S, E2EStore, make_store

from hf3fsctl.vllm_tools.runner import EngineResult, EngineRun, run_engine, shared_prefix_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4  # tiny model: layers x K,V x heads x dim x block x fp32
PROMPT_BLOCKS, OUTPUT_TOKENS = 6, 4 * BLOCK
# Six requests of 6 prompt blocks and 4 of output each need ~66 blocks at once: 40 make
# vLLM preempt; a request alone (max_model_len) still fits.
SMALL_CACHE = 40 * PAGE_BYTES
MAX_MODEL_LEN = 1024
PROMPTS = [  # distinct (no shared prefix: every request holds its own blocks)
    shared_prefix_prompts(1, 0, PROMPT_BLOCKS * BLOCK + 5, seed=40 + n)[0] for n in range(6)
]


def _run(
    model: Path, store: E2EStore | None, kv_cache_memory_bytes: int = 64 << 20
) -> EngineResult:
    return run_engine(
        EngineRun(
            model=str(model),
            prompts=PROMPTS,
            max_tokens=OUTPUT_TOKENS,
            block_size=BLOCK,
            dtype=DTYPE,
            kv_transfer_config=None if store is None else store.kv_config(),
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_model_len=MAX_MODEL_LEN,
            batch=True,
            warmup_tokens=0,
            timeout_s=RUN_TIMEOUT_S,
        )
    )


def test_pages_saved_while_vllm_preempts_are_right(tiny_model: Path, tmp_path: Path) -> None:
    store = make_store(tmp_path / "store")
    small_baseline = _run(tiny_model, None, SMALL_CACHE)
    cold = _run(tiny_model, store, SMALL_CACHE)
    assert cold.outputs == small_baseline.outputs
    assert cold.connector is not None
    assert cold.connector["preempted"] > 0  # the cache was too small: vLLM preempted
    assert cold.connector["blocks_saved"] >= len(PROMPTS)
    baseline = _run(tiny_model, None)
    warm = _run(tiny_model, store)
    assert warm.outputs == baseline.outputs
    assert warm.connector is not None
    assert warm.connector["blocks_loaded"] > 0 and warm.connector["failed_blocks"] == 0
    # every prompt that was saved whole loads whole (what a preempted save did not
    # commit is recomputed: fewer hits, never a wrong one)
    hits = [r.num_cached_tokens for r in warm.requests]
    assert sum(h > 0 for h in hits) >= len(PROMPTS) // 2
    assert all(h % BLOCK == 0 and h <= PROMPT_BLOCKS * BLOCK for h in hits)
