"""`hf3fsctl bench storage | metadata | e2e`: the sub-application that wires them.

Each sub-command lives in its own module (`cli/bench_<name>.py`) over `hf3fsctl.bench`;
this module only registers them, the same way `cli/main.py` registers commands.
"""

from __future__ import annotations

from collections.abc import Callable

import typer

from hf3fsctl.cli import bench_e2e, bench_metadata, bench_storage
from hf3fsctl.cli.errors import handle_errors

bench_app = typer.Typer(
    name="bench",
    help="Load-test storage, metadata and vLLM end to end (tables, --json, --plot).",
    no_args_is_help=True,
)


def register(command_cls: type) -> typer.Typer:
    """The sub-application with every sub-command registered with `command_cls`."""
    commands: dict[str, Callable[..., None]] = {
        "storage": bench_storage.storage,
        "metadata": bench_metadata.metadata,
        "e2e": bench_e2e.e2e,
    }
    for name, fn in commands.items():
        bench_app.command(name, cls=command_cls)(handle_errors(fn))
    return bench_app
