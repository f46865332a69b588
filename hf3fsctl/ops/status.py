"""Which staging path a process uses (compiled ops or pure torch), in words, with the fix.

`staging_path()` asks `hf3fsctl.staging` which devices have compiled ops (loading the
library as `staging._ops()` would on a first gather; nothing is built) and says what it is, where
the library came from, and, when the fast path is not active where it matters, the
command that builds it. `doctor` shows it as a check; the connector logs it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf3fsctl.ops.locate import BUILD_COMMAND, LIBRARY_NAME


@dataclass(frozen=True)
class StagingPath:
    """The active staging gather/scatter implementation."""

    compiled: frozenset[str]  # devices with compiled ops ("cpu", "cuda"); empty: pure torch
    library: Path | None  # the loaded library, when one is
    cuda_visible: bool  # a CUDA device is usable by this torch
    fix: str  # the command that gets the fast path; "" when it is active

    @property
    def fast(self) -> bool:
        """The compiled ops cover the device that matters (the GPU when there is one)."""
        return ("cuda" if self.cuda_visible else "cpu") in self.compiled

    def describe(self) -> str:
        """One line: the path, and where the library came from."""
        if not self.compiled:
            return "pure torch (no compiled hf3fsctl ops loaded)"
        where = f" from {self.library}" if self.library is not None else ""
        text = f"compiled ops for {', '.join(sorted(self.compiled))}{where}"
        if self.cuda_visible and "cuda" not in self.compiled:
            text += "; pure torch on cuda"
        return text


def staging_path() -> StagingPath:
    """The staging path of this process (loads the compiled library if one is found)."""
    import torch

    from hf3fsctl import staging

    devices = staging.load_compiled_ops()
    loaded = [Path(p) for p in sorted(torch.ops.loaded_libraries) if Path(p).name == LIBRARY_NAME]
    cuda_visible = torch.version.cuda is not None and torch.cuda.is_available()
    wanted = "cuda" if cuda_visible else "cpu"
    fix = "" if wanted in devices else f"{BUILD_COMMAND} --{wanted}"
    return StagingPath(devices, loaded[0] if loaded else None, cuda_visible, fix)


def describe_staging_path() -> str:
    """`staging_path()` as one log-line fragment, with the fix when there is one."""
    path = staging_path()
    if path.fast:
        return path.describe()
    return f"{path.describe()} — `{path.fix}` builds the faster one"
