"""Fixtures of the GPU tests: the compiled CUDA staging ops (built here if not yet built).

The GPU machine runs these tests from a plain checkout (`PYTHONPATH=.`, nothing
installed, no vLLM). `connector/` installs as the package `hf3fsctl_connector`; where it
is not installed, it is mapped here to that name from the checkout, so the worker side's
tests import it exactly as an installed one would be imported.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _map_connector_package() -> None:
    """Import `connector/` as `hf3fsctl_connector` when that package is not installed."""
    if "hf3fsctl_connector" in sys.modules or importlib.util.find_spec("hf3fsctl_connector"):
        return
    directory = Path(__file__).resolve().parents[2] / "connector"
    spec = importlib.util.spec_from_file_location(
        "hf3fsctl_connector",
        directory / "__init__.py",
        submodule_search_locations=[str(directory)],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf3fsctl_connector"] = module
    spec.loader.exec_module(module)


_map_connector_package()

from helpers.staging_builders import build_compiled_ops  # noqa: E402

from hf3fsctl.staging import _CompiledOps  # noqa: E402


@pytest.fixture(scope="session")
def cuda_ops(tmp_path_factory: pytest.TempPathFactory) -> _CompiledOps:
    """The compiled ops with their CUDA kernels loaded (zero-copy host transfer)."""
    devices = build_compiled_ops(tmp_path_factory.mktemp("cuda-ops"), cuda=True)
    assert "cuda" in devices, f"compiled ops lack CUDA kernels (devices: {sorted(devices)})"
    return _CompiledOps(devices, "zero_copy")
