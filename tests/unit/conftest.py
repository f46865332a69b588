"""Fixtures of the unit tests: a tiny model directory built once per session (no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama + tokenizer on disk (~2 s), shared by the whole session."""
    from hf3fsctl.vllm_tools.tiny_model import build_tiny_model

    return Path(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))
