"""Fixtures of the GPU tests: the compiled CUDA staging ops (built here if not yet built)."""

from __future__ import annotations

import pytest
from helpers.staging_builders import build_compiled_ops

from hf3fsctl.staging import _CompiledOps


@pytest.fixture(scope="session")
def cuda_ops(tmp_path_factory: pytest.TempPathFactory) -> _CompiledOps:
    """The compiled ops with their CUDA kernels loaded (zero-copy host transfer)."""
    devices = build_compiled_ops(tmp_path_factory.mktemp("cuda-ops"), cuda=True)
    assert "cuda" in devices, f"compiled ops lack CUDA kernels (devices: {sorted(devices)})"
    return _CompiledOps(devices, "zero_copy")
