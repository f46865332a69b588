"""Test-suite wide settings: environment for vLLM, and where markers are skipped."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _connector_status_files(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Connector status files (`hf3fsctl.health`) go to a private directory per session."""
    os.environ["HF3FSCTL_STATE_DIR"] = str(tmp_path_factory.getbasetemp() / "connector-state")


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
