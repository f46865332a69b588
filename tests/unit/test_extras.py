"""Optional extras: a connector-only install pulls neither the server nor Redis, and a
command that needs a missing extra says which one in one line (exit code 2).

The "missing" modules are blocked in a child interpreter (a `sys.meta_path` finder that
refuses them), so the test runs in the full dev environment.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
SERVER = ("fastapi", "starlette", "uvicorn", "prometheus_client")
REDIS = ("redis", "hiredis")

BLOCKING = """
import sys
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""


def _python(code: str, blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKING.format(blocked=blocked) + code],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=120,
    )


def _cli(tmp_path: Path, blocked: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess[str]:
    code = f"sys.argv = ['hf3fsctl', *{list(argv)!r}]\nfrom hf3fsctl.cli.main import main\nmain()\n"
    return _python(code, blocked)


def _requirement_names(requirements: list[str]) -> set[str]:
    names = set()
    for item in requirements:
        name = item.split(";")[0]
        for stop in "<>=![ ":
            name = name.split(stop)[0]
        names.add(name.strip().lower())
    return names


def test_the_core_dependencies_pull_neither_the_server_nor_redis() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert core.isdisjoint({"fastapi", "starlette", "uvicorn", "prometheus-client", "redis"})
    assert {"fastapi", "uvicorn", "prometheus-client"} <= _requirement_names(extras["server"])
    assert _requirement_names(extras["redis"]) == {"redis"}
    assert "hf3fsctl[server,redis]" in extras["dev"]  # the tests run a real serve and Redis


def test_the_connector_worker_and_the_cli_import_without_either_extra() -> None:
    done = _python(
        "import hf3fsctl_connector.worker, hf3fsctl.tier, hf3fsctl.meta.client\n"
        "import hf3fsctl.cli.main\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{SERVER + REDIS!r}))\n",
        SERVER + REDIS,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("blocked", "config", "argv", "extra"),
    [
        (SERVER, "storage:\n  path: {root}\n", ["serve", "--port", "0"], "server"),
        (
            REDIS,
            "storage:\n  path: {root}\nmetadata:\n  url: redis://127.0.0.1:9/0\n",
            ["stats"],
            "redis",
        ),
    ],
    ids=["serve-without-server", "redis-store-without-redis"],
)
def test_a_command_needing_a_missing_extra_names_it_in_one_line(
    tmp_path: Path, blocked: tuple[str, ...], config: str, argv: list[str], extra: str
) -> None:
    config_file = tmp_path / "hf3fs.yaml"
    config_file.write_text(config.format(root=tmp_path))
    done = _cli(tmp_path, blocked, *argv, "--config", str(config_file))
    assert done.returncode == 2, done.stderr
    first, *rest = done.stderr.strip().splitlines()
    assert first.startswith("Error: this command needs ") and first.endswith(
        f"install hf3fsctl[{extra}]"
    )
    assert rest == [f"Hint: pip install 'hf3fsctl[{extra}]'"]
    assert "Traceback" not in done.stderr


def test_a_missing_module_of_no_extra_is_not_dressed_up_as_one() -> None:
    from hf3fsctl.extras import missing_extra

    assert missing_extra(ModuleNotFoundError("No module named 'torch'", name="torch")) is None
    found = missing_extra(ModuleNotFoundError("x", name="redis.sentinel"))
    assert found is not None and (found.module, found.extra, found.exit_code) == (
        "redis",
        "redis",
        2,
    )
