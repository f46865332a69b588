"""Stored pages overwritten on disk: checksums catch it, the store drops them, vLLM
recomputes, output holds."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from e2e_scenario import BOUNDED_RUN_S, E2EStore, corrupt_committed_pages

from hf3fsctl.vllm_tools.runner import EngineResult

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def corrupted_run(
    engine: Callable[..., EngineResult], embedded_store: E2EStore, warm: EngineResult
) -> EngineResult:
    """A fresh process on the store after every committed page had bytes flipped."""
    assert corrupt_committed_pages(embedded_store) > 0
    # A failed load that is offered again and again never finishes: bound the run.
    return engine(embedded_store.kv_config(), timeout_s=BOUNDED_RUN_S)


def test_corrupted_pages_do_not_change_outputs(
    corrupted_run: EngineResult, baseline: EngineResult
) -> None:
    assert corrupted_run.outputs == baseline.outputs


def test_corrupted_pages_are_counted_as_checksum_failures(corrupted_run: EngineResult) -> None:
    assert corrupted_run.connector is not None
    assert corrupted_run.connector["failed_checksum"] > 0


def test_corrupted_pages_are_dropped_from_the_store(corrupted_run: EngineResult) -> None:
    assert corrupted_run.connector is not None
    assert corrupted_run.connector["invalidated"] > 0


def test_corrupted_pages_end_no_request_in_error(corrupted_run: EngineResult) -> None:
    assert all(r.finish_reason == "length" for r in corrupted_run.requests)
