"""Namespaces: another model, or the same model in another dtype, never loads these pages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from e2e_scenario import LONG, E2EStore

from hf3fsctl.vllm_tools.runner import EngineResult

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module", params=["other-weights", "other-dtype"])
def other_model_run(
    request: pytest.FixtureRequest,
    engine: Callable[..., EngineResult],
    embedded_store: E2EStore,
    cold: EngineResult,
    tmp_path_factory: pytest.TempPathFactory,
) -> EngineResult:
    """The same prompts on the same (filled) store, with a model that must not match."""
    from hf3fsctl.vllm_tools.tiny_model import SIZES, build_tiny_model

    if request.param == "other-weights":
        other = build_tiny_model(
            tmp_path_factory.mktemp("models") / "tiny-seed1", replace(SIZES["tiny"], seed=1)
        )
        return engine(embedded_store.kv_config(), model=str(other))
    result = engine(embedded_store.kv_config(), dtype="bfloat16")
    # Guard the premise: the engine really ran another dtype than the one that saved.
    assert result.engine_info["dtype"] != cold.engine_info["dtype"]
    return result


def test_other_model_gets_no_connector_hits(other_model_run: EngineResult) -> None:
    assert other_model_run.connector is not None
    assert other_model_run.connector["hit_tokens"] == 0


def test_other_model_gets_no_cached_tokens_on_its_first_request(
    other_model_run: EngineResult,
) -> None:
    assert other_model_run.requests[LONG[0]].num_cached_tokens == 0
