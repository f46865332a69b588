"""Fixtures of the unit tests: a tiny model directory built once per session (no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model: Path) -> Path:
    """A random-weight Llama + tokenizer on disk: the session's one (tests/conftest.py)."""
    return tiny_model
