"""`hf3fsctl --help` reads cleanly (commands in panels, plain value names), and shell
completion works: `--show-completion` prints a script, and the script's protocol
completes command names and options."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hf3fsctl.cli.main import DIAGNOSE, OPERATE, PROMPTS, SETUP, app

runner = CliRunner()
WIDE = {"COLUMNS": "200"}
PANELS = [SETUP, OPERATE, PROMPTS, DIAGNOSE]
COMMANDS = [c.name for c in app.registered_commands] + [
    f"{g.name} {c.name}"
    for g in app.registered_groups
    if g.typer_instance is not None
    for c in g.typer_instance.registered_commands
]
TYPER_TYPE = re.compile(r"<(str|int|float|path|bool|list)[^>]*>")


def _hf3fsctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hf3fsctl", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
        check=False,
    )


def test_commands_are_grouped_in_panels_in_order() -> None:
    result = runner.invoke(app, ["--help"], env=WIDE)
    assert result.exit_code == 0
    titles = re.findall(r"╭─ (.+?) ─", result.stdout)
    assert titles == ["Options", *PANELS]  # no catch-all "Commands" panel
    assert all(c.rich_help_panel in PANELS for c in app.registered_commands)


@pytest.mark.parametrize("command", COMMANDS, ids=COMMANDS)
def test_help_names_option_values_in_words_not_typer_types(command: str) -> None:
    result = runner.invoke(app, [*command.split(), "--help"], env=WIDE)
    assert result.exit_code == 0
    option_rows = [r for r in result.stdout.splitlines() if r.lstrip("│ *").startswith("-")]
    assert option_rows  # every command has options (--help at least)
    assert [r for r in option_rows if TYPER_TYPE.search(r)] == []


def test_show_completion_prints_a_bash_script() -> None:
    # Typer makes `--show-completion` a bare flag that detects the shell from the process
    # tree (shellingham), which depends on what started pytest; its own switch
    # `_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION` makes it take the shell named.
    done = _hf3fsctl(
        "--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    )
    assert done.returncode == 0, done.stderr
    assert "complete -o default -F _hf3fsctl_completion hf3fsctl" in done.stdout
    assert "_HF3FSCTL_COMPLETE=complete_bash" in done.stdout


def test_the_completion_protocol_completes_commands_and_options() -> None:
    protocol = {"_HF3FSCTL_COMPLETE": "complete_bash", "COMP_CWORD": "1"}
    commands = _hf3fsctl(env={**protocol, "COMP_WORDS": "hf3fsctl bu"})
    assert commands.stdout.split() == ["build-ops"]
    options = _hf3fsctl(
        env={**protocol, "COMP_WORDS": "hf3fsctl build-ops --fo", "COMP_CWORD": "2"}
    )
    assert options.stdout.split() == ["--force"]
