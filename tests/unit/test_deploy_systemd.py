"""The systemd unit in deploy/systemd: systemd accepts it, and it matches the CLI.

`systemd-analyze verify` checks the unit as systemd would load it (every directive
parsed, ExecStart executable) without systemd running as PID 1; the unit's ExecStart
path is pointed at this installation's `hf3fsctl` first. Its flags must be flags of
`hf3fsctl serve`, its example config must load, and stopping must outwait the drain.
"""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.config import load_config
from hf3fsctl.meta.server.run import DRAIN_TIMEOUT_S

SYSTEMD = Path(__file__).parents[2] / "deploy" / "systemd"
UNIT = SYSTEMD / "hf3fsctl-serve.service"


def service() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(UNIT.read_text())
    return parser["Service"]


def exec_start() -> list[str]:
    return shlex.split(service()["ExecStart"])


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd)")
    installed = Path(sys.executable).with_name("hf3fsctl")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(exec_start()[0], str(installed)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    # a directive systemd cannot parse is only a warning ("…, ignoring"): none allowed
    assert (result.returncode, result.stderr.strip()) == (0, ""), result.stderr


def test_the_units_command_uses_only_flags_serve_has() -> None:
    command = exec_start()
    assert command[1] == "serve"
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).stdout
    flags = [arg for arg in command[2:] if arg.startswith("--")]
    assert flags and [f for f in flags if f not in help_text] == []


def test_stopping_outwaits_the_drain_with_sigterm_and_restarts_only_on_failure() -> None:
    unit = service()
    assert (unit["KillSignal"], unit["Restart"], unit["Type"]) == ("SIGTERM", "on-failure", "exec")
    assert int(unit["TimeoutStopSec"]) > DRAIN_TIMEOUT_S


def test_the_example_config_serves_loopback_with_the_units_token_and_writable_store() -> None:
    config = load_config(SYSTEMD / "config.yaml", environ={})
    command = exec_start()
    token_file = command[command.index("--token-file") + 1]
    writable = [Path(p) for p in service()["ReadWritePaths"].split()]
    store = [Path(config.storage.path), Path(str(config.metadata_target.path)).parent]
    assert (config.server.host, config.server.token_file) == ("127.0.0.1", token_file)
    assert all(any(p == w or w in p.parents for w in writable) for p in store), writable
