"""Cold run then warm run in a new process, embedded metadata, batched chunked prefill.

The warm process has nothing in vLLM's own prefix cache, so every cached token of its
first request came through the connector.
"""

from __future__ import annotations

import pytest
from e2e_scenario import BLOCK, EXACT_BLOCKS, EXACT_IDX, LONG, PREFIX, SHORT_IDX, SUFFIX

from hf3fsctl.vllm_tools.runner import EngineResult

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FULL_BLOCKS = (PREFIX + SUFFIX) // BLOCK


def test_cold_run_outputs_match_no_connector(cold: EngineResult, baseline: EngineResult) -> None:
    assert cold.outputs == baseline.outputs


def test_cold_run_saves_blocks(cold: EngineResult) -> None:
    assert cold.connector is not None
    assert cold.connector["blocks_saved"] >= FULL_BLOCKS


def test_warm_run_outputs_match_no_connector(warm: EngineResult, baseline: EngineResult) -> None:
    assert warm.outputs == baseline.outputs


def test_warm_run_vllm_counts_external_hits(warm: EngineResult) -> None:
    # The first request of a fresh process: only the connector can have supplied these.
    assert warm.requests[LONG[0]].num_cached_tokens == FULL_BLOCKS * BLOCK


def test_warm_run_connector_counts_hits(warm: EngineResult) -> None:
    assert warm.connector is not None
    assert warm.connector["hit_tokens"] >= FULL_BLOCKS * BLOCK
    assert warm.connector["blocks_loaded"] >= FULL_BLOCKS


def test_warm_run_has_no_failed_blocks(warm: EngineResult) -> None:
    assert warm.connector is not None
    assert warm.connector["failed_blocks"] == 0


def test_every_long_prompt_hits_on_the_warm_run(warm: EngineResult) -> None:
    assert all(warm.requests[i].num_cached_tokens >= FULL_BLOCKS * BLOCK for i in LONG)


def test_prompt_shorter_than_a_block_gets_no_hit(warm: EngineResult) -> None:
    assert warm.requests[SHORT_IDX].num_cached_tokens == 0


def test_prompt_of_exact_blocks_never_loads_its_last_token(warm: EngineResult) -> None:
    cached = warm.requests[EXACT_IDX].num_cached_tokens
    assert 0 < cached < EXACT_BLOCKS * BLOCK
