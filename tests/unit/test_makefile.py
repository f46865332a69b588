"""`make setup` re-installs the venv when pyproject.toml's content changed, never because
of file times (a fresh clone's pyproject.toml is newer than an existing venv's stamp).

Runs `make -n setup` (print, do not run: the recursive `make install` only prints its
commands) in a copy of the Makefile and pyproject.toml beside a fake venv.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return tmp_path


def _setup_installs(tree: Path) -> bool:
    done = subprocess.run(
        ["make", "-n", "setup"], cwd=tree, capture_output=True, text=True, check=True
    )
    return "pip install" in done.stdout


def _stamp(tree: Path) -> None:
    digest = hashlib.sha256((tree / "pyproject.toml").read_bytes()).hexdigest()
    (tree / ".venv" / ".installed").write_text(digest + "\n")


def test_a_venv_without_a_stamp_is_installed(tree: Path) -> None:
    assert _setup_installs(tree)


def test_a_stamp_of_this_pyproject_skips_pip_even_when_the_file_is_newer(tree: Path) -> None:
    _stamp(tree)
    future = time.time() + 3600
    os.utime(tree / "pyproject.toml", (future, future))  # as a fresh clone's would be
    assert not _setup_installs(tree)


def test_a_changed_pyproject_reinstalls(tree: Path) -> None:
    _stamp(tree)
    with (tree / "pyproject.toml").open("a") as file:
        file.write("\n# a dependency changed\n")
    assert _setup_installs(tree)


def test_an_old_empty_stamp_reinstalls_once(tree: Path) -> None:
    (tree / ".venv" / ".installed").write_text("")  # made by `touch` before this rule
    assert _setup_installs(tree)
