"""Shared engine runs of the end-to-end tests (real vLLM on CPU, tiny random Llama).

Every engine start costs seconds, so the runs every module compares against are made
once per session, on the session's `tiny_model` (tests/conftest.py): `baseline` (no
connector), `cold` (our connector, empty embedded store) and `warm` (a fresh process on
that store). Modules add only the runs their own invariant needs. Prompts are batched under chunked prefill (a step budget smaller than
one prompt) — the case where vLLM's `ExampleConnector` fails — and include a prompt
shorter than a block and one exactly `N` blocks long.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import (
    BLOCK,
    DTYPE,
    EXACT_BLOCKS,
    LONG,
    PREFIX,
    RESERVED_CPU,
    RUN_TIMEOUT_S,
    SHORT,
    STEP_BUDGET,
    SUFFIX,
    E2EStore,
    make_store,
)

from hf3fsctl.vllm_tools.runner import (
    EngineResult,
    EngineRun,
    child_env,
    run_engine,
    shared_prefix_prompts,
)
from hf3fsctl.vllm_tools.zygote import ZYGOTE_ENV, Zygote


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Three long prompts sharing a prefix, one short prompt, one exactly N blocks."""
    long = shared_prefix_prompts(len(LONG), PREFIX, SUFFIX, seed=7)
    short = shared_prefix_prompts(1, SHORT, 0, seed=8)
    exact = shared_prefix_prompts(1, EXACT_BLOCKS * BLOCK, 0, seed=9)
    return [*long, *short, *exact]


@pytest.fixture(scope="session")
def engine(tiny_model: Path, prompts: list[list[int]]) -> Callable[..., EngineResult]:
    """Run the session's prompts, batched, in a fresh engine process."""

    def run(kv_transfer_config: dict[str, Any] | None, **overrides: Any) -> EngineResult:
        spec: dict[str, Any] = {
            "model": str(tiny_model),
            "prompts": prompts,
            "max_tokens": 8,
            "block_size": BLOCK,
            "dtype": DTYPE,
            "kv_transfer_config": kv_transfer_config,
            "kv_cache_memory_bytes": 64 << 20,
            "max_model_len": 4096,
            "batch": True,
            "max_num_batched_tokens": STEP_BUDGET,
            "warmup_tokens": 2 * BLOCK,
            "timeout_s": RUN_TIMEOUT_S,
        }
        return run_engine(EngineRun(**(spec | overrides)))

    return run


@pytest.fixture(scope="session")
def baseline(engine: Callable[..., EngineResult]) -> EngineResult:
    """The prompts without any connector: the outputs every run must reproduce."""
    return engine(None)


@pytest.fixture(scope="session")
def embedded_store(tmp_path_factory: pytest.TempPathFactory) -> E2EStore:
    """An empty store with embedded SQLite metadata."""
    return make_store(tmp_path_factory.mktemp("embedded"))


@pytest.fixture(scope="session")
def cold(engine: Callable[..., EngineResult], embedded_store: E2EStore) -> EngineResult:
    """Our connector on the empty store: prefill and save."""
    return engine(embedded_store.kv_config())


@pytest.fixture(scope="session")
def warm(
    engine: Callable[..., EngineResult], embedded_store: E2EStore, cold: EngineResult
) -> EngineResult:
    """A fresh process on the store `cold` filled."""
    return engine(embedded_store.kv_config())


@pytest.fixture(scope="session")
def reserved_cpu_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    """The socket of an engine zygote started with `child_env(RESERVED_CPU)`, or None when
    the session's zygotes are off. The session's engine zygote cannot take runs with that
    `VLLM_` variable (an import-time prefix to `zygote.eligible`), so each was a `python -m`
    start spending ~10-15 s importing vLLM: `bench e2e`'s five engines and the OpenAI test's
    no-connector engine. A caller names it in `ENGINE_ZYGOTE_SOCKET` for those runs only."""
    if not os.environ.get(ZYGOTE_ENV):
        yield None
        return
    started = Zygote.start(
        tmp_path_factory.mktemp("reserved-cpu-zygote") / "zygote.sock", child_env(RESERVED_CPU)
    )
    try:
        yield str(started.path)
    finally:
        started.stop()
