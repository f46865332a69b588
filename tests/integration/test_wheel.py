"""The wheel works without the repository: built by `python -m build`, installed into a
fresh venv, and run from a directory outside the tree.

The fresh venv sees the dependencies through a `.pth` naming a directory of links to
.venv's site-packages entries, less this project's editable install (its `__editable__`
finder and `.pth`, its dist-info): so `hf3fsctl` and `hf3fsctl_connector` can only come
from the wheel, which the tests assert by their `__file__`. One module-scoped build
(sdist, then the wheel from the sdist, offline: `--no-isolation`) serves every test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]
# The distribution's trees: import package -> its directory in the repository.
TREES = {"hf3fsctl": REPO / "hf3fsctl", "hf3fsctl_connector": REPO / "connector"}
NOT_SHIPPED = ("__pycache__", ".so", ".pyc", ".partial")
PIP = [sys.executable, "-m", "pip", "--no-input", "--disable-pip-version-check"]
# The ops' sources as the repository holds them (every one must ship), and the files the
# build cannot do without, so an empty or moved directory fails too.
CSRC = tuple(
    sorted(
        p.name
        for p in (REPO / "hf3fsctl" / "ops" / "csrc").iterdir()
        if p.suffix in {".cpp", ".cu", ".h"}
    )
)
assert {"registration.cpp", "staging_cpu.cpp", "staging_cuda.cu", "staging_ops.h"} <= set(CSRC)


@dataclass(frozen=True)
class Installed:
    """A fresh venv with the wheel installed, and a working directory outside the repo."""

    dist: Path  # the sdist and the wheel
    venv: Path
    site: Path  # the venv's site-packages, where the wheel went
    cwd: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`hf3fsctl ARGS` through the venv's console script."""
        return subprocess.run(
            [str(self.venv / "bin" / "hf3fsctl"), *args],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def python(self, code: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """The venv's interpreter running `code`."""
        return subprocess.run(
            [str(self.venv / "bin" / "python"), "-c", code],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def _copy_source(target: Path) -> Path:
    """What `python -m build` needs, copied out of the shared tree (no stale build/)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "*.egg-info", "build")
    target.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, target / name)
    for tree in TREES.values():
        shutil.copytree(tree, target / tree.name, ignore=ignore)
    return target


def _deps_view(target: Path) -> Path:
    """Links to .venv's site-packages entries, without this project's own install."""
    site = Path(sysconfig.get_paths()["purelib"])
    target.mkdir()
    for entry in site.iterdir():
        name = entry.name
        if name.startswith(("__editable__", "hf3fsctl", "__pycache__")) or name.endswith(".pth"):
            continue
        (target / name).symlink_to(entry)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("wheel")
    source = _copy_source(root / "src")
    dist = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "_hf3fsctl_test_deps.pth").write_text(f"{_deps_view(root / 'deps')}\n")
    (wheel,) = dist.glob("*.whl")
    subprocess.run(
        [
            *PIP,
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    cwd = root / "elsewhere"
    (cwd / "home").mkdir(parents=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF3FSCTL_", "PYTHON", "VIRTUAL_ENV", "XDG_"))
    }
    env.update(
        HOME=str(cwd / "home"),
        HF3FSCTL_STATE_DIR=str(cwd / "state"),
        COLUMNS="200",
        PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    yield Installed(dist, venv, site, cwd, env)


def _shipped(directory: Path) -> set[str]:
    return {
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if path.is_file()
        and not any(part in NOT_SHIPPED for part in path.parts)
        and not path.name.endswith(NOT_SHIPPED)
    }


def test_build_makes_an_sdist_and_a_wheel_holding_every_file_of_the_tree(
    installed: Installed,
) -> None:
    (sdist,) = installed.dist.glob("hf3fsctl-*.tar.gz")
    (wheel,) = installed.dist.glob("hf3fsctl-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(
        f"{package}/{name}"
        for package, tree in TREES.items()
        for name in _shipped(tree)
        if f"{package}/{name}" not in names
    )
    assert missing == []  # a new subpackage or data file not declared in pyproject.toml
    with tarfile.open(sdist) as archive:  # the wheel was built from it: it holds the sources
        in_sdist = {Path(n).name for n in archive.getnames() if "/ops/csrc/" in n}
    assert in_sdist == set(CSRC)


def test_the_installed_packages_come_from_the_wheel_not_the_repository(
    installed: Installed,
) -> None:
    probe = (
        "import json, hf3fsctl, hf3fsctl_connector\n"
        "print(json.dumps([hf3fsctl.__file__, hf3fsctl_connector.__file__]))\n"
    )
    done = installed.python(probe)
    assert done.returncode == 0, done.stderr
    files = [Path(f) for f in json.loads(done.stdout)]
    assert [f.is_relative_to(installed.site) for f in files] == [True, True]


def test_the_ops_sources_ship_inside_the_package(installed: Installed) -> None:
    probe = "from hf3fsctl.ops.build import SOURCES; print(SOURCES)"
    done = installed.python(probe)
    sources = Path(done.stdout.strip())
    assert sources.is_relative_to(installed.site)
    assert sorted(p.name for p in sources.iterdir()) == sorted(CSRC)


def test_the_builder_runs_with_none_of_the_service_dependencies(installed: Installed) -> None:
    """What a GPU node with only torch has: the builder gets as far as the compiler."""
    blocked = ("typer", "rich", "pydantic", "yaml", "fastapi", "httpx", "click", "setuptools")
    probe = (
        "import runpy, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError(f'blocked: {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = ['build', '--cpu', '--out', 'ops']\n"
        "runpy.run_module('hf3fsctl.ops.build', run_name='__main__')\n"
    )
    env = {**installed.env, "CXX": "false"}  # fail at the first compile: nothing is built
    done = subprocess.run(
        [str(installed.venv / "bin" / "python"), "-c", probe],
        cwd=installed.cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 8, done.stderr
    assert "error: compiling " in done.stderr and "blocked" not in done.stderr


def test_version_is_the_package_metadata_version(installed: Installed) -> None:
    metadata = installed.python("import importlib.metadata as m; print(m.version('hf3fsctl'))")
    done = installed.run("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"hf3fsctl {metadata.stdout.strip()}"


def test_help_init_vllm_config_and_doctor_run_from_the_wheel(installed: Installed) -> None:
    helped = installed.run("--help")
    assert helped.returncode == 0 and "build-ops" in helped.stdout
    config = installed.cwd / "hf3fs.yaml"
    store = installed.cwd / "store"
    init = installed.run(
        "init", "--storage-path", str(store), "--create-path", "--write-config", str(config)
    )
    assert init.returncode == 0, init.stderr
    vllm = installed.run("--config", str(config), "vllm-config", "--compact")
    assert vllm.returncode == 0, vllm.stderr
    assert json.loads(vllm.stdout)["kv_connector"] == "Hf3fsctlConnector"
    doctor = installed.run("--config", str(config), "doctor", "--json")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["storage.path"]["status"] == "ok"
    assert checks["staging"]["detail"].startswith(("pure torch", "compiled ops"))


def test_serve_answers_healthz_and_stops(installed: Installed) -> None:
    config = installed.cwd / "serve.yaml"
    config.write_text(
        f"storage:\n  path: {installed.cwd / 'serve-store'}\n"
        f"metadata:\n  url: sqlite:///{installed.cwd / 'serve.db'}\n"
    )
    port = free_port()
    address = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(
        [str(installed.venv / "bin" / "hf3fsctl"), "--config", str(config), "serve", *address],
        cwd=installed.cwd,
        env=installed.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        body, deadline = None, time.monotonic() + 60
        while body is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    body = json.loads(r.read())
            except OSError:
                time.sleep(0.2)
        assert body is not None, server.communicate(timeout=10)[0]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_the_vllm_plugin_entry_point_registers_the_connector(installed: Installed) -> None:
    probe = (
        "import json, sys\n"
        "from importlib.metadata import entry_points\n"
        "(ep,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'hf3fsctl']\n"
        "ep.load()()\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "cls = KVConnectorFactory._registry['Hf3fsctlConnector']()\n"
        "print(json.dumps([ep.value, cls.__name__, sys.modules[cls.__module__].__file__]))\n"
    )
    done = installed.python(probe)
    assert done.returncode == 0, done.stderr
    value, name, module_file = json.loads(done.stdout.strip().splitlines()[-1])
    assert (value, name) == ("hf3fsctl_connector.plugin:register", "Hf3fsctlConnector")
    assert Path(module_file).is_relative_to(installed.site)
