"""Build the hf3fsctl staging ops into a shared library that `torch.ops.load_library` loads.

Usage: ``python -m hf3fsctl.ops.build [--cuda|--cpu] [--out DIR] [--force] [--jobs N]``
(``hf3fsctl build-ops`` is the same with progress shown; this entry point needs nothing
but torch, for GPU nodes without the service's dependencies).

Contract:
    * Compiles `registration.cpp`, `staging_cpu.cpp`, `one_block.cpp` (always) and
      `staging_cuda.cu` (with ``--cuda``; the default when torch has CUDA and nvcc is
      found) from the installed package's `csrc/` against the running interpreter's
      torch, with plain ``c++``/``nvcc`` calls (no ninja, no Python extension module),
      and links ``<out>/_ops.so``. The default ``<out>`` is this torch's entry in the
      per-user cache (`hf3fsctl.ops.locate`), where `hf3fsctl.staging` looks for it.
    * A library already at the target is reused (nothing is compiled) unless ``force``.
    * CUDA code is built for the current GPU's architecture (sm_90 when no GPU is
      visible) plus its PTX for newer GPUs; ``HF3FSCTL_CUDA_ARCH`` (e.g. ``80``) overrides.
    * A missing tool (C++ compiler, nvcc, a CUDA build of torch) raises `OpsBuildError`
      naming every missing piece before anything runs; a failing compiler or linker
      raises it with the tool's output in `OpsBuildError.output`. Nothing here runs at
      import time of the package, and only the standard library is imported at module
      level (torch inside the functions).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from hf3fsctl.errors import OpsBuildError
from hf3fsctl.ops import locate

SOURCES = Path(__file__).resolve().parent / "csrc"
LIBRARY_NAME = locate.LIBRARY_NAME
DEFAULT_CUDA_ARCH = "90"
CPU_SOURCES = ("registration.cpp", "staging_cpu.cpp", "one_block.cpp")
CUDA_SOURCE = "staging_cuda.cu"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Toolchain:
    """The tools one build uses."""

    cxx: str  # the C++ compiler (`$CXX`, else c++ / g++ / clang++ on PATH)
    nvcc: str | None  # the CUDA compiler; None for a CPU-only build
    arch: str | None  # CUDA architecture without the dot ("90"); None for a CPU-only build


@dataclass(frozen=True)
class BuildResult:
    """What `ensure_built` did."""

    path: Path  # the library
    cuda: bool  # it holds the CUDA op too
    reused: bool  # it was already there; nothing was compiled
    seconds: float  # time spent compiling and linking (0 when reused)


def cuda_home(nvcc: str | None = None) -> Path | None:
    """The CUDA toolkit's root: the first of `$CUDA_HOME`, `$CUDA_PATH`, the directory
    above nvcc's `bin/`, and /usr/local/cuda that holds `include/cuda_runtime.h`."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc is not None:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and Path(home, "include", "cuda_runtime.h").is_file():
            return Path(home)
    return None


def _torch_flags(cuda: bool, nvcc: str | None = None) -> tuple[list[str], list[str], list[str]]:
    """Include flags, defines and link flags for the running torch (and the CUDA toolkit).

    The paths are torch's own layout (what `torch.utils.cpp_extension` computes), worked
    out here because that module imports setuptools, which a GPU node may not have.
    """
    import torch

    torch_dir = Path(torch.__file__).resolve().parent
    include_dirs = [
        torch_dir / "include",
        torch_dir / "include" / "torch" / "csrc" / "api" / "include",
    ]
    lib_dirs = [torch_dir / "lib"]
    home = cuda_home(nvcc) if cuda else None
    if home is not None:
        if home / "include" != Path("/usr/include"):  # gcc dislikes -I/usr/include
            include_dirs.append(home / "include")
        lib64 = home / "lib64"
        lib_dirs.append(lib64 if lib64.is_dir() or not (home / "lib").is_dir() else home / "lib")
    includes = [f"-I{path}" for path in include_dirs]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=hf3fsctl_ops"]
    libs = ["-lc10", "-ltorch_cpu", "-ltorch"]
    if cuda:
        libs += ["-lc10_cuda", "-ltorch_cuda", "-lcudart"]
    link = [f"-L{d}" for d in lib_dirs] + [f"-Wl,-rpath,{d}" for d in lib_dirs] + libs
    return includes, defines, link


def find_cxx() -> str | None:
    """The C++ compiler: `$CXX` (a name on PATH or a path), else c++, g++ or clang++."""
    named = os.environ.get("CXX", "").strip()
    for candidate in [named] if named else ["c++", "g++", "clang++"]:
        found = shutil.which(candidate)
        if found is not None:
            return found
    return None


def find_nvcc() -> str | None:
    """nvcc: `$CUDA_HOME/bin/nvcc` (or `$CUDA_PATH`) when that is set, and nowhere else;
    otherwise the one on PATH, else /usr/local/cuda/bin/nvcc (as torch looks for it)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        named = Path(home, "bin", "nvcc")
        return str(named) if named.is_file() else None
    found = shutil.which("nvcc")
    if found is not None:
        return found
    fallback = Path("/usr/local/cuda/bin/nvcc")
    return str(fallback) if fallback.is_file() else None


def require_torch() -> None:
    """Raise `OpsBuildError` when torch cannot be imported (the ops build against it)."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise OpsBuildError(
            f"cannot build the staging ops: torch is not importable ({exc})",
            hint="install torch (vLLM brings it) in this environment, then run build-ops again",
        ) from None


def cuda_available_to_build() -> bool:
    """Whether a CUDA build can be the default: torch has CUDA and nvcc is found."""
    require_torch()
    import torch

    return torch.version.cuda is not None and find_nvcc() is not None


def check_toolchain(cuda: bool) -> Toolchain:
    """The tools for a build, or one error naming every missing piece.

    Raises:
        OpsBuildError: no torch; no C++ compiler; with `cuda`, no nvcc or a CPU-only torch.
    """
    require_torch()
    import torch

    missing: list[str] = []
    hints: list[str] = []
    cxx = find_cxx()
    if cxx is None:
        named = os.environ.get("CXX", "").strip()
        missing.append(f"no C++ compiler ({'$CXX=' + named if named else 'c++, g++, clang++'})")
        hints.append("install g++ (Debian/Ubuntu: build-essential) or set CXX")
    nvcc = arch = None
    if cuda:
        nvcc = find_nvcc()
        if nvcc is None:
            home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
            missing.append(f"nvcc not found{f' in {home}/bin' if home else ''}")
            hints.append("install the CUDA toolkit or set CUDA_HOME")
        if torch.version.cuda is None:
            missing.append(f"torch {torch.__version__} is a CPU-only build")
            hints.append("install a CUDA build of torch, or build the CPU op with --cpu")
        else:
            arch = locate.target_arch() or DEFAULT_CUDA_ARCH
    if missing or cxx is None:
        what = "CUDA" if cuda else "CPU"
        raise OpsBuildError(
            f"cannot build the {what} staging ops: {'; '.join(missing)}", hint="; ".join(hints)
        )
    return Toolchain(cxx, nvcc, arch)


def default_output(cuda: bool, arch: str | None = None) -> Path:
    """The per-user cache directory of the running torch's build (CUDA: for `arch`)."""
    if cuda:
        arch = arch or locate.target_arch() or DEFAULT_CUDA_ARCH
    return locate.cached_library(cuda, arch if cuda else None).parent


def _commands(
    tools: Toolchain, objdir: Path, openmp: bool = True
) -> list[tuple[str, list[str], Path]]:
    """(source name, command, object file) for every compile step."""
    cuda = tools.nvcc is not None
    includes, defines, _ = _torch_flags(cuda, tools.nvcc)
    python_include = f"-I{sysconfig.get_path('include')}"
    cxxflags = ["-O3", "-std=c++20", "-fPIC", "-Wall", *defines, *includes]
    if openmp:
        cxxflags.append("-fopenmp")
    cxxflags.append(python_include)
    steps = []
    for name in CPU_SOURCES:
        obj = objdir / (name + ".o")
        steps.append((name, [tools.cxx, *cxxflags, "-c", str(SOURCES / name), "-o", str(obj)], obj))
    if tools.nvcc is not None:
        arch = tools.arch or DEFAULT_CUDA_ARCH
        obj = objdir / (CUDA_SOURCE + ".o")
        command = [
            tools.nvcc,
            "-O3",
            "-std=c++20",
            "-Xcompiler",
            "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}",
            f"-gencode=arch=compute_{arch},code=compute_{arch}",
            "--expt-relaxed-constexpr",
            "-Xptxas=-v",
            *defines,
            *includes,
            python_include,
            "-c",
            str(SOURCES / CUDA_SOURCE),
            "-o",
            str(obj),
        ]
        steps.append((CUDA_SOURCE, command, obj))
    return steps


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False)


def _failed(what: str, command: list[str], result: subprocess.CompletedProcess[str]) -> None:
    error = OpsBuildError(
        f"{what} failed (exit {result.returncode})",
        hint="the compiler's output is above; HF3FSCTL_DEBUG=1 shows the command",
    )
    error.output = " ".join(command) + "\n" + result.stdout + result.stderr
    raise error


def build(
    cuda: bool,
    out_dir: Path,
    jobs: int = 3,
    openmp: bool = True,
    progress: Progress | None = None,
) -> Path:
    """Compile and link the ops library (always: no reuse); returns its path.

    Args:
        cuda: also build the CUDA implementation.
        out_dir: where `_ops.so` goes (created when missing).
        jobs: compilers run at once.
        openmp: parallelise the CPU op with OpenMP (at::parallel_for runs serially without).
        progress: called with a one-line description before and after each step.

    Raises:
        OpsBuildError: a tool is missing, or a compiler or the linker failed.
    """
    say = progress or (lambda _message: None)
    tools = check_toolchain(cuda)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf3fsctl-ops-") as tmp:
        steps = _commands(tools, Path(tmp), openmp)
        say(f"compiling {', '.join(name for name, _, _ in steps)}")
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {pool.submit(_run, command): (name, command) for name, command, _ in steps}
            for done, future in enumerate(as_completed(futures), start=1):
                name, command = futures[future]
                result = future.result()
                if result.returncode != 0:
                    _failed(f"compiling {name}", command, result)
                if result.stderr.strip():
                    sys.stderr.write(result.stderr)
                say(f"compiled {name} ({done}/{len(steps)})")
        _, _, link = _torch_flags(cuda, tools.nvcc)
        staged = Path(tmp) / LIBRARY_NAME
        omp = ["-fopenmp"] if openmp else []
        objects = [str(obj) for _, _, obj in steps]
        link_cmd = [tools.cxx, "-shared", *omp, *objects, "-o", str(staged), *link]
        say(f"linking {LIBRARY_NAME}")
        result = _run(link_cmd)
        if result.returncode != 0:
            _failed("linking", link_cmd, result)
        target = out_dir / LIBRARY_NAME
        # Replace atomically: a process may have the old library mapped.
        partial = out_dir / f"{LIBRARY_NAME}.{os.getpid()}.partial"
        shutil.copyfile(staged, partial)
        os.replace(partial, target)
    return target


def ensure_built(
    cuda: bool | None = None,
    out_dir: Path | None = None,
    *,
    force: bool = False,
    jobs: int = 3,
    openmp: bool = True,
    progress: Progress | None = None,
) -> BuildResult:
    """The library for the running torch: reused from `out_dir` when there, else built.

    Args:
        cuda: build the CUDA op too; None picks CUDA when torch has it and nvcc is found.
        out_dir: where `_ops.so` goes; default the per-user cache (`default_output`).
        force: rebuild even when the library exists.
        jobs, openmp, progress: as for `build`.

    Raises:
        OpsBuildError: a tool is missing, or a compiler or the linker failed.
    """
    if cuda is None:
        cuda = cuda_available_to_build()
    if out_dir is None:
        check_toolchain(cuda)  # name what is missing before asking for an architecture
        out_dir = default_output(cuda)
    target = out_dir / LIBRARY_NAME
    if target.is_file() and not force:
        return BuildResult(target, cuda, reused=True, seconds=0.0)
    started = time.monotonic()
    path = build(cuda, out_dir, jobs, openmp, progress)
    return BuildResult(path, cuda, reused=False, seconds=time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry (torch only): parse flags, build or reuse, print the path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cuda", action="store_true", help="build CPU and CUDA ops")
    group.add_argument("--cpu", action="store_true", help="build the CPU op only")
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: the per-user cache)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild an existing library")
    parser.add_argument("--jobs", type=int, default=3, help="compilers run at once")
    parser.add_argument("--no-openmp", action="store_true", help="serial CPU op, no libgomp")
    args = parser.parse_args(argv)
    cuda = True if args.cuda else False if args.cpu else None
    try:
        result = ensure_built(
            cuda,
            args.out,
            force=args.force,
            jobs=args.jobs,
            openmp=not args.no_openmp,
            progress=lambda message: print(message, file=sys.stderr, flush=True),
        )
    except OpsBuildError as exc:
        if exc.output:
            sys.stderr.write(exc.output)
        print(f"error: {exc.message}\nhint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    kind = "cpu+cuda" if result.cuda else "cpu"
    if result.reused:
        print(f"reused {result.path} ({kind}; --force rebuilds)")
    else:
        print(f"built {result.path} ({kind}) in {result.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
