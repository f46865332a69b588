"""The metadata service over HTTP (a real `hf3fsctl serve`), and what happens when it dies.

One sequence, each step a fresh engine process on the same store: cold, warm, the
service killed (SIGKILL) → a run without it, the service restarted on its database →
warm again. A dead service must cost hits, never outputs, errors or a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from e2e_scenario import BLOCK, BOUNDED_RUN_S, LONG, PREFIX, SUFFIX, E2EStore, make_store
from helpers.servers import TOKEN, ServerProcess, start_server

from hf3fsctl.vllm_tools.runner import EngineResult

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.integration]

TIMEOUT_S = 1.0  # metadata.timeout_s of the connector
# A run without the service may be slower than the baseline by at most this much: with
# one call per lookup/allocate, a hang on any call would blow it.
DOWN_SLACK_S = 20.0
FULL_BLOCKS = (PREFIX + SUFFIX) // BLOCK


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real `hf3fsctl serve` with a bearer token; stopped at the end of the module."""
    process = start_server(tmp_path_factory.mktemp("http") / "server", token=TOKEN)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def http_store(server: ServerProcess) -> E2EStore:
    """Connector settings that reach `server` (token, short timeout and backoff)."""
    directory = server.config.parent
    assert server.token_file is not None
    return make_store(
        directory.parent / "client",
        root=directory / "storage",
        metadata={
            "url": server.url,
            "token_file": server.token_file,
            "timeout_s": TIMEOUT_S,
            "retry_backoff_s": 1.0,
        },
    )


@pytest.fixture(scope="module")
def http_cold(engine: Callable[..., EngineResult], http_store: E2EStore) -> EngineResult:
    return engine(http_store.kv_config())


@pytest.fixture(scope="module")
def http_warm(
    engine: Callable[..., EngineResult], http_store: E2EStore, http_cold: EngineResult
) -> EngineResult:
    return engine(http_store.kv_config())


@pytest.fixture(scope="module")
def service_down(
    engine: Callable[..., EngineResult],
    http_store: E2EStore,
    server: ServerProcess,
    http_warm: EngineResult,
) -> EngineResult:
    """A fresh engine while the service is killed (it starts with the service dead)."""
    server.kill()
    return engine(http_store.kv_config(), timeout_s=BOUNDED_RUN_S)


@pytest.fixture(scope="module")
def service_back(
    engine: Callable[..., EngineResult],
    http_store: E2EStore,
    server: ServerProcess,
    service_down: EngineResult,
) -> EngineResult:
    """A fresh engine after the service restarted on the same database."""
    server.start()
    return engine(http_store.kv_config())


def test_http_cold_run_outputs_match_no_connector(
    http_cold: EngineResult, baseline: EngineResult
) -> None:
    assert http_cold.outputs == baseline.outputs


def test_http_warm_run_outputs_match_no_connector(
    http_warm: EngineResult, baseline: EngineResult
) -> None:
    assert http_warm.outputs == baseline.outputs


def test_http_warm_run_vllm_counts_external_hits(http_warm: EngineResult) -> None:
    assert http_warm.requests[LONG[0]].num_cached_tokens == FULL_BLOCKS * BLOCK


def test_http_warm_run_connector_counts_hits(http_warm: EngineResult) -> None:
    assert http_warm.connector is not None
    assert http_warm.connector["hit_tokens"] >= FULL_BLOCKS * BLOCK


def test_service_down_outputs_match_no_connector(
    service_down: EngineResult, baseline: EngineResult
) -> None:
    assert service_down.outputs == baseline.outputs


def test_service_down_ends_no_request_in_error(service_down: EngineResult) -> None:
    assert all(r.finish_reason == "length" for r in service_down.requests)


def test_service_down_does_not_stall_the_engine(
    service_down: EngineResult, baseline: EngineResult
) -> None:
    assert service_down.generate_s < baseline.generate_s + DOWN_SLACK_S


def test_service_down_serves_misses(service_down: EngineResult) -> None:
    assert service_down.connector is not None
    assert service_down.connector["hit_tokens"] == 0
    assert service_down.requests[LONG[0]].num_cached_tokens == 0


def test_service_down_counts_misses(service_down: EngineResult) -> None:
    assert service_down.connector is not None
    counted = service_down.connector["misses"] + service_down.connector["failed_metadata_down"]
    assert counted > 0


def test_service_back_returns_hits(service_back: EngineResult) -> None:
    assert service_back.requests[LONG[0]].num_cached_tokens == FULL_BLOCKS * BLOCK


def test_service_back_outputs_match_no_connector(
    service_back: EngineResult, baseline: EngineResult
) -> None:
    assert service_back.outputs == baseline.outputs
