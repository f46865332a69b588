"""Fixtures of the unit tests: a tiny model directory built once per session (no hub)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the harness imports vLLM: not at collection of every unit test
    from helpers.connector_harness import Harness


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model: Path) -> Path:
    """A random-weight Llama + tokenizer on disk: the session's one (tests/conftest.py)."""
    return tiny_model


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    """Connector harnesses a test makes (`harnesses.append(make_harness(...))`), closed after it."""
    made: list[Harness] = []
    yield made
    for harness in made:
        harness.close()
