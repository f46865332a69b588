"""Where the compiled staging ops library lives: one per-user cache keyed by the build target.

Contract:
    * `build_tag(torch_version, cuda_version, arch)` names one build target:
      ``<torch>-cpu`` for the CPU op, ``<torch>-cuda<cuda>-sm<arch>`` for the CPU+CUDA
      library (a library is only ever loaded into the torch it was compiled against).
    * `cache_root()` is ``$XDG_CACHE_HOME/hf3fsctl/ops`` (``~/.cache/hf3fsctl/ops`` when
      the variable is unset); `hf3fsctl build-ops` writes ``<root>/<tag>/_ops.so``.
    * `library_candidates()` is the search order `hf3fsctl.staging` loads from:
      ``$HF3FSCTL_OPS_LIB`` alone when set; else the cache entry of the running torch's
      CUDA build for the visible GPU, then its CPU build, then ``_ops.so`` in the package
      directory (where builds before the cache went).
    * `target_arch()` is the CUDA architecture a build targets and a load looks for:
      ``$HF3FSCTL_CUDA_ARCH``, else the current GPU's compute capability, else None.

Imports only the standard library at module level (torch inside the functions that read
its versions), so the builder runs on a node with nothing but torch installed.
"""

from __future__ import annotations

import os
from pathlib import Path

LIBRARY_ENV = "HF3FSCTL_OPS_LIB"
ARCH_ENV = "HF3FSCTL_CUDA_ARCH"
LIBRARY_NAME = "_ops.so"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
BUILD_COMMAND = "hf3fsctl build-ops"


def build_tag(torch_version: str, cuda_version: str | None, arch: str | None = None) -> str:
    """The cache directory name of one build target.

    Args:
        torch_version: ``torch.__version__`` of the interpreter the library is built for.
        cuda_version: ``torch.version.cuda``; None for the CPU op only.
        arch: compute capability without the dot (``"90"``); required with a CUDA version.

    Raises:
        ValueError: a CUDA version without an architecture.
    """
    if cuda_version is None:
        return f"{torch_version}-cpu"
    if not arch:
        raise ValueError("a CUDA build target needs an architecture (e.g. '90')")
    return f"{torch_version}-cuda{cuda_version}-sm{arch}"


def cache_root() -> Path:
    """The per-user directory that holds one subdirectory per build target."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf3fsctl" / "ops"


def target_arch() -> str | None:
    """The CUDA architecture to build for / load: the override, else the current GPU's."""
    override = os.environ.get(ARCH_ENV, "").strip()
    if override:
        return override
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def cached_library(cuda: bool, arch: str | None = None) -> Path:
    """The cache path of the running torch's library (CUDA build: for `arch`).

    Raises:
        ValueError: `cuda` with a CPU-only torch, or with no architecture known.
    """
    import torch

    if cuda and torch.version.cuda is None:
        raise ValueError(f"torch {torch.__version__} has no CUDA")
    tag = build_tag(torch.__version__, torch.version.cuda if cuda else None, arch)
    return cache_root() / tag / LIBRARY_NAME


def library_candidates() -> list[Path]:
    """Libraries to try, in order (see the module contract); they may not exist."""
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        return [Path(explicit)]
    import torch

    found: list[Path] = []
    if torch.version.cuda is not None:
        arch = target_arch()
        if arch is not None:
            found.append(cached_library(True, arch))
    found.append(cached_library(False))
    found.append(PACKAGE_DIR / LIBRARY_NAME)
    return found
