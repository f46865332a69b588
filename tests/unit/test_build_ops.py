"""`hf3fsctl build-ops`: builds into (or reuses) the per-user cache that staging searches,
and names what is missing in one line with exit code 8.

The CPU op is compiled once per session (`session_ops_dir`, shared with
test_staging_kernels.py); the other tests copy that library or fail before compiling.
The command runs in this process (`CliRunner`, the environment patched); what staging
loads is asked of fresh processes, since this one may have a library loaded already.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.staging_builders import session_ops_dir
from typer.testing import CliRunner, Result

from hf3fsctl.cli.main import app
from hf3fsctl.errors import OpsBuildError
from hf3fsctl.ops.locate import build_tag

runner = CliRunner()
WIDE = {"COLUMNS": "200"}


def _build_ops(*args: str) -> Result:
    return runner.invoke(app, ["build-ops", *args], env=WIDE)


def _bin_dir(tmp_path: Path, **tools: str) -> Path:
    """A PATH directory holding only the named tools (name -> target)."""
    directory = tmp_path / "bin"
    directory.mkdir()
    for name, target in tools.items():
        (directory / name).symlink_to(target)
    return directory


def _probe(code: str, env: dict[str, str]) -> str:
    """Run `code` in a fresh interpreter without $HF3FSCTL_OPS_LIB (plus `env`); its stdout."""
    clean = {k: v for k, v in os.environ.items() if k != "HF3FSCTL_OPS_LIB"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**clean, **env},
        check=True,
        timeout=120,
    )
    return done.stdout.strip()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's CPU library, built through the CLI unless a module already did."""
    out = session_ops_dir(tmp_path_factory)
    result = _build_ops("--cpu", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(("built ", "reused ")), result.stdout
    return out / "_ops.so"


@pytest.mark.slow  # compiles the CPU op once per session (`built`)
def test_a_cached_library_is_reused_and_nothing_compiles(
    built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = built.stat().st_mtime_ns
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails: no rebuild could pass
    result = _build_ops("--cpu", "--out", str(built.parent))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == f"reused {built} (cpu; --force rebuilds)"
    assert built.stat().st_mtime_ns == before


@pytest.mark.slow  # compiles the CPU op once per session (`built`)
def test_force_rebuilds_and_a_failing_compiler_is_one_error(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(built, out / "_ops.so")
    monkeypatch.setenv("CXX", "false")
    result = _build_ops("--cpu", "--force", "--out", str(out))
    assert result.exit_code == OpsBuildError.exit_code == 8
    assert "compiling registration.cpp, staging_cpu.cpp" in result.stderr  # progress shown
    assert "Error: compiling " in result.stderr and "failed (exit 1)" in result.stderr
    assert (out / "_ops.so").read_bytes() == built.read_bytes()  # the old one left intact


@pytest.mark.slow  # compiles the CPU op once per session (`built`)
def test_the_default_target_is_the_per_user_cache_that_staging_loads(
    built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "xdg"
    target = cache / "hf3fsctl" / "ops" / build_tag(torch.__version__, None) / "_ops.so"
    target.parent.mkdir(parents=True)
    shutil.copyfile(built, target)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("CXX", "false")
    result = _build_ops("--cpu")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == f"reused {target} (cpu; --force rebuilds)"
    probe = (
        "from hf3fsctl.ops.status import staging_path\n"
        "path = staging_path()\n"
        "print(sorted(path.compiled), path.library, repr(path.fix))\n"
    )
    assert _probe(probe, {"XDG_CACHE_HOME": str(cache)}).split() == [
        "['cpu']",
        str(target),
        "''",
    ]


def test_without_a_library_staging_is_pure_torch_and_names_the_fix(tmp_path: Path) -> None:
    probe = "from hf3fsctl.ops.status import describe_staging_path; print(describe_staging_path())"
    missing = tmp_path / "none" / "_ops.so"
    assert _probe(probe, {"HF3FSCTL_OPS_LIB": str(missing)}) == (
        "pure torch (no compiled hf3fsctl ops loaded) — `hf3fsctl build-ops --cpu` builds the "
        "faster one"
    )


def test_no_nvcc_is_named_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(_bin_dir(tmp_path, **{"c++": shutil.which("c++") or "c++"})))
    empty_cuda = tmp_path / "cuda"
    empty_cuda.mkdir()
    monkeypatch.setenv("CUDA_HOME", str(empty_cuda))
    result = _build_ops("--cuda", "--out", str(tmp_path / "out"))
    assert result.exit_code == 8
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Error: cannot build the CUDA staging ops: nvcc not found")
    assert "install the CUDA toolkit or set CUDA_HOME" in lines[1]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch")
def test_cuda_on_a_cpu_only_torch_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvcc = tmp_path / "fake-nvcc"  # found, so only torch is left to complain about
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    tools = {"c++": shutil.which("c++") or "c++", "nvcc": str(nvcc)}
    monkeypatch.setenv("PATH", str(_bin_dir(tmp_path, **tools)))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    result = _build_ops("--cuda")
    assert result.exit_code == 8
    assert result.stderr.strip().splitlines()[0] == (
        f"Error: cannot build the CUDA staging ops: torch {torch.__version__} is a CPU-only build"
    )


def test_no_cxx_compiler_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(_bin_dir(tmp_path)))
    monkeypatch.delenv("CXX", raising=False)
    result = _build_ops("--cpu", "--out", str(tmp_path / "out"))
    assert result.exit_code == 8
    lines = result.stderr.strip().splitlines()
    assert (
        lines[0] == "Error: cannot build the CPU staging ops: no C++ compiler (c++, g++, clang++)"
    )
    assert "set CXX" in lines[1]
    assert not (tmp_path / "out").exists()


def test_no_torch_is_one_error_not_a_traceback() -> None:
    probe = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError('No module named torch')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hf3fsctl.cli.main import main\n"
        "sys.argv = ['hf3fsctl', 'build-ops', '--cpu']\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, **WIDE},
        timeout=120,
        check=False,
    )
    assert done.returncode == 8, done.stderr
    assert done.stderr.startswith("Error: cannot build the staging ops: torch is not importable")
    assert "Traceback" not in done.stderr
