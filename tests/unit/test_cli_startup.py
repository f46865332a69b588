"""The CLI starts fast: `--help`, `stats`, `evict`, `ls` and the help of every command
import no torch, vLLM, FastAPI, uvicorn or httpx (checked in a fresh interpreter, as the
console script runs). What is imported is what is meant; a wall-clock bound would only
measure how loaded the machine is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.cli_store import make_store

HEAVY = ["torch", "vllm", "fastapi", "uvicorn", "httpx", "numpy"]

PROBE = """
import json, sys
sys.argv = ["hf3fsctl", *json.loads(sys.argv[1])]
from hf3fsctl.cli.main import main
try:
    main()
except SystemExit as exc:
    code = exc.code
heavy = [m for m in {heavy!r} if m in sys.modules]
sys.stderr.write("HEAVY=" + json.dumps(heavy) + "\\n")
sys.exit(code or 0)
"""


def _heavy_imports(args: list[str], cwd: Path) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("HEAVY="))
    return json.loads(line[len("HEAVY=") :])


@pytest.fixture(scope="module")
def store_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store(tmp_path_factory.mktemp("startup")).config_file


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["stats"],
        ["stats", "--json"],
        ["evict", "--all", "--dry-run"],
        ["ls"],
        ["warm", "--help"],
        ["lookup", "--help"],
        ["bench", "--help"],
        ["pin", "--help"],
    ],
    ids=["help", "stats", "stats-json", "evict", "ls", "warm", "lookup", "bench", "pin"],
)
def test_command_imports_no_heavy_module(args: list[str], store_config: Path) -> None:
    full = args if "--help" in args else ["--config", str(store_config), *args]
    assert _heavy_imports(full, store_config.parent) == []
