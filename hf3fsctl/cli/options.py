"""Options shared by several commands, declared once as `Annotated` aliases.

Every command that reads the configuration takes `ConfigOpt`; commands with a machine
readable result take `JsonOpt`; destructive ones take `YesOpt` and `DryRunOpt`; commands that can be narrowed to one
namespace take `NamespaceOpt`. The
duration parser for `--older-than`-style flags lives here too, so every flag that takes
a duration accepts the same spellings (`90`, `90s`, `30m`, `2h`, `7d`, `1w`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

# No `envvar="HF3FSCTL_CONFIG"` here: Click would hand the variable's value in as if it
# were the flag, and errors would blame `--config` for it. `find_config_file` reads the
# variable itself, after the flag, and names it.
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        metavar="PATH",
        help="Config file. Default: $HF3FSCTL_CONFIG, else ./hf3fs.yaml, else config.yaml "
        "in ~/.config/hf3fsctl or /etc/hf3fsctl, else the packaged defaults.",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print one JSON document on stdout (no tables, no progress)."),
]
YesOpt = Annotated[
    bool,
    typer.Option("--yes", "-y", help="Do it without asking (required when stdin is not a TTY)."),
]
NamespaceOpt = Annotated[
    str | None,
    typer.Option("--namespace", "-n", help="Only this namespace (id or unique prefix)."),
]
DryRunOpt = Annotated[
    bool,
    typer.Option("--dry-run", help="Show what would happen; change nothing."),
]

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: str) -> float:
    """Parse `90`, `90s`, `30m`, `2h`, `7d` or `1w` into seconds.

    Raises:
        typer.BadParameter: when the value is not a duration (a usage error, exit 2).
    """
    match = _DURATION_RE.match(str(value).lower())
    if match is None:
        raise typer.BadParameter(f"{value!r} is not a duration; use e.g. 90s, 30m, 2h, 7d")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


# --- the engine a `lookup` or `warm` is about (vLLM's own flag names) ------------------

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help="The model as vLLM is given it (directory or hub id)."),
]
DtypeOpt = Annotated[
    str,
    typer.Option("--dtype", help="vLLM --dtype (auto, float16, bfloat16, float32)."),
]
BlockSizeOpt = Annotated[
    int | None,
    typer.Option("--block-size", min=1, help="vLLM --block-size (default: vLLM's)."),
]
TensorParallelOpt = Annotated[
    int,
    typer.Option("--tensor-parallel-size", "-tp", min=1, help="vLLM's tensor parallel size."),
]
PromptsOpt = Annotated[
    str | None,
    typer.Option(
        "--prompts",
        metavar="FILE|DIR|-",
        help="Text file (a prompt per line), .jsonl ({'prompt'} or {'messages'}), a "
        "directory of .txt/.md documents, or - for stdin.",
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option("--format", help="How to read --prompts: auto, text or jsonl."),
]
