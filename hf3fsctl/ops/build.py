"""Build the hf3fsctl staging ops into a shared library that `torch.ops.load_library` loads.

Usage: ``python -m hf3fsctl.ops.build [--cuda|--cpu] [--out DIR] [--jobs N]``

Contract:
    * Compiles `registration.cpp` + `staging_cpu.cpp` (always) and `staging_cuda.cu`
      (with ``--cuda``; the default when torch has CUDA and nvcc is found) against the
      running interpreter's torch, with plain ``c++``/``nvcc`` calls (no ninja, no
      Python extension module), and links ``<out>/_ops.so`` (default: the `hf3fsctl`
      package directory, where `hf3fsctl.staging` looks for it).
    * CUDA code is built for sm_90 (Hopper) plus compute_90 PTX for newer GPUs; set
      ``HF3FSCTL_CUDA_ARCH`` (e.g. ``80``) to target another architecture instead.
    * Prints the library's path on success; exits non-zero with the compiler's output
      on failure. Nothing here runs at import time of the package.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "csrc"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
LIBRARY_NAME = "_ops.so"


def _torch_flags(cuda: bool) -> tuple[list[str], list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    device = "cuda" if cuda else "cpu"
    includes = [f"-I{path}" for path in cpp_extension.include_paths(device)]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=hf3fsctl_ops"]
    lib_dirs = cpp_extension.library_paths(device)
    libs = ["-lc10", "-ltorch_cpu", "-ltorch"]
    if cuda:
        libs += ["-lc10_cuda", "-ltorch_cuda", "-lcudart"]
    link = [f"-L{d}" for d in lib_dirs] + [f"-Wl,-rpath,{d}" for d in lib_dirs] + libs
    return includes, defines, link


def _nvcc() -> str:
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    candidate = Path(home, "bin", "nvcc") if home else None
    if candidate is not None and candidate.exists():
        return str(candidate)
    found = shutil.which("nvcc")
    if found is None:
        raise SystemExit("nvcc not found: set CUDA_HOME or build with --cpu")
    return found


def _commands(
    cuda: bool, objdir: Path, cxx: str, openmp: bool = True
) -> tuple[list[list[str]], list[Path]]:
    includes, defines, _ = _torch_flags(cuda)
    python_include = f"-I{sysconfig.get_path('include')}"
    cxxflags = ["-O3", "-std=c++20", "-fPIC", "-Wall", *defines, *includes]
    if openmp:
        cxxflags.append("-fopenmp")
    cxxflags.append(python_include)
    commands, objects = [], []
    for name in ("registration.cpp", "staging_cpu.cpp"):
        obj = objdir / (name + ".o")
        commands.append([cxx, *cxxflags, "-c", str(SOURCES / name), "-o", str(obj)])
        objects.append(obj)
    if cuda:
        arch = os.environ.get("HF3FSCTL_CUDA_ARCH", "90")
        obj = objdir / "staging_cuda.cu.o"
        commands.append(
            [
                _nvcc(),
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
                str(SOURCES / "staging_cuda.cu"),
                "-o",
                str(obj),
            ]
        )
        objects.append(obj)
    return commands, objects


def _run(command: list[str]) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    return command, subprocess.run(command, capture_output=True, text=True, check=False)


def build(cuda: bool, out_dir: Path, jobs: int = 3, openmp: bool = True) -> Path:
    """Compile and link the ops library; returns its path.

    Args:
        cuda: also build the CUDA implementation.
        out_dir: where `_ops.so` goes.
        jobs: compilers run at once.
        openmp: parallelise the CPU op with OpenMP (at::parallel_for runs serially without).

    Raises:
        SystemExit: a compiler or the linker failed (its output is printed).
    """
    cxx = os.environ.get("CXX", "c++")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hf3fsctl-ops-") as tmp:
        commands, objects = _commands(cuda, Path(tmp), cxx, openmp)
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(_run, commands))
        for command, result in results:
            if result.returncode != 0:
                sys.stderr.write(" ".join(command) + "\n" + result.stdout + result.stderr)
                raise SystemExit(f"compile failed: {Path(command[-3]).name}")
            if result.stderr.strip():
                sys.stderr.write(result.stderr)
        _, _, link = _torch_flags(cuda)
        staged = Path(tmp) / LIBRARY_NAME
        omp = ["-fopenmp"] if openmp else []
        link_cmd = [cxx, "-shared", *omp, *map(str, objects), "-o", str(staged), *link]
        _, result = _run(link_cmd)
        if result.returncode != 0:
            sys.stderr.write(" ".join(link_cmd) + "\n" + result.stdout + result.stderr)
            raise SystemExit("link failed")
        target = out_dir / LIBRARY_NAME
        # Replace atomically: a process may have the old library mapped.
        partial = out_dir / (LIBRARY_NAME + ".partial")
        shutil.copyfile(staged, partial)
        os.replace(partial, target)
    print(f"built {target} ({'cpu+cuda' if cuda else 'cpu'}) in {time.monotonic() - started:.1f} s")
    return target


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: parse flags and build."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cuda", action="store_true", help="build CPU and CUDA ops")
    group.add_argument("--cpu", action="store_true", help="build the CPU op only")
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR, help="output directory")
    parser.add_argument("--jobs", type=int, default=3, help="compilers run at once")
    parser.add_argument("--no-openmp", action="store_true", help="serial CPU op, no libgomp")
    args = parser.parse_args(argv)
    if args.cuda or args.cpu:
        cuda = bool(args.cuda)
    else:
        import torch

        cuda = torch.version.cuda is not None and (
            shutil.which("nvcc") is not None or bool(os.environ.get("CUDA_HOME"))
        )
    build(cuda, args.out, args.jobs, openmp=not args.no_openmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
