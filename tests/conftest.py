"""Test-suite wide settings: environment for vLLM, where markers are skipped, and the one
tiny model every directory's tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _connector_status_files(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Connector status files (`hf3fsctl.health`) go to a private directory per session."""
    os.environ["HF3FSCTL_STATE_DIR"] = str(tmp_path_factory.getbasetemp() / "connector-state")


@pytest.fixture(scope="session", autouse=True)
def _engine_zygote(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Two engine zygotes per session that runs vLLM engines (tests using `tiny_model`),
    each importing vLLM once and forking a child per run (hf3fsctl.vllm_tools.zygote)
    instead of a `python -m` start that spends ~6-12 s importing: one for `run_engine`
    (its socket in ENGINE_ZYGOTE_SOCKET, started with `runner.child_env()`), one for the
    CLI (`helpers.cli_runner.run_hf3fsctl`, CLI_ZYGOTE_SOCKET, `cli_env()`). Off with
    ENGINE_ZYGOTE_SOCKET=0; never on outside the test suite.
    """
    from helpers.cli_runner import CLI_ZYGOTE_ENV, cli_env

    from hf3fsctl.vllm_tools.runner import child_env
    from hf3fsctl.vllm_tools.zygote import ZYGOTE_ENV, Zygote

    wanted = os.environ.get(ZYGOTE_ENV, "1") != "0"
    engines = any("tiny_model" in item.fixturenames for item in request.session.items)
    if not (wanted and engines):
        os.environ.pop(ZYGOTE_ENV, None)
        os.environ.pop(CLI_ZYGOTE_ENV, None)
        yield
        return
    directory = tmp_path_factory.mktemp("zygote")
    started = {
        ZYGOTE_ENV: Zygote.start(directory / "engine.sock", child_env()),
        CLI_ZYGOTE_ENV: Zygote.start(directory / "cli.sock", cli_env()),
    }
    os.environ.update({name: str(zygote.path) for name, zygote in started.items()})
    try:
        yield
    finally:
        for name, zygote in started.items():
            os.environ.pop(name, None)
            zygote.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama (seed 0, fp32) and its tokenizer, built once per session for
    every directory (unit `tiny_model_dir`, e2e `tiny_model`, reliability `fault_model`).

    Read-only: a test that needs another model (other weights, another dtype) builds its
    own. Building it costs ~5-10 s on 2 cores; it used to be built once per directory.
    """
    from hf3fsctl.vllm_tools.tiny_model import SIZES, build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-model", SIZES["tiny"])


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests without CUDA (the only marker that is ever skipped)."""
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
