"""All terminal output of the CLI goes through this module.

- Results for people: Rich tables and lines on stdout.
- Results for programs: `--json` prints exactly one JSON document on stdout, and
  nothing else goes to stdout (progress bars are off).
- Diagnostics, warnings, errors and hints: stderr, never mixed into a result; or, for
  a service whose stderr is a log stream (`serve --log-format json`), log records
  (`log_instead`).

Rich consoles resolve `sys.stdout`/`sys.stderr` when they write, so test runners that
swap the streams see everything.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.progress import Progress
    from rich.table import Table

# Piped output is for people reading a file or a pager: do not squeeze tables into 80
# columns there (programs should use --json). COLUMNS still wins.
_PIPE_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
stdout = Console(highlight=False, width=_PIPE_WIDTH)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)
_log: logging.Logger | None = None  # set by `log_instead`


def log_instead(logger: logging.Logger | None) -> None:
    """Send `info`, `warning` and `error` to `logger` (None: back to the terminal)."""
    global _log
    _log = logger


def print_json(document: Any) -> None:
    """Print one JSON document on stdout (the whole `--json` output of a command)."""
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def show(renderable: RenderableType) -> None:
    """Print a result (a table, a panel) for people on stdout."""
    stdout.print(renderable)


def line(message: str, style: str | None = None) -> None:
    """Print one plain result line on stdout (no markup interpretation)."""
    stdout.print(Text(message, style=style or ""), soft_wrap=True)


def info(message: str) -> None:
    """A diagnostic for people, on stderr."""
    if _log is not None:
        _log.info("%s", message)
        return
    stderr.print(Text(message, style="dim"))


def warning(message: str) -> None:
    """A warning, on stderr."""
    if _log is not None:
        _log.warning("%s", message)
        return
    stderr.print(Text.assemble(("Warning: ", "bold yellow"), message))


def error(message: str, hint: str = "") -> None:
    """An error and the next step to try, on stderr."""
    if _log is not None:
        _log.error("%s%s", message, f" (hint: {hint})" if hint else "")
        return
    stderr.print(Text.assemble(("Error: ", "bold red"), message))
    if hint:
        stderr.print(Text.assemble(("Hint: ", "bold"), hint))


def table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    right: Sequence[str] = (),
) -> Table:
    """A Rich table; columns named in `right` are right-aligned (numbers)."""
    from rich.table import Table

    result = Table(title=title, title_justify="left", header_style="bold")
    for name in columns:
        result.add_column(name, justify="right" if name in right else "left")
    for row in rows:
        result.add_row(*(cell if isinstance(cell, Text) else Text(str(cell)) for cell in row))
    return result


def key_values(pairs: Mapping[str, Any], *, title: str | None = None) -> Table:
    """A two-column table of labelled values."""
    from rich.table import Table

    result = Table.grid(padding=(0, 2))
    result.title = title
    result.title_justify = "left"
    result.add_column(style="bold")
    result.add_column()
    for name, value in pairs.items():
        result.add_row(name, Text(str(value)))
    return result


@contextmanager
def progress(enabled: bool = True, *, in_bytes: bool = False) -> Iterator[Progress]:
    """A Rich progress bar on stderr; `enabled=False` (e.g. under `--json`) draws nothing.

    Args:
        enabled: draw it at all.
        in_bytes: show completed/total as sizes (else as counts).
    """
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True) if in_bytes else MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=stderr,
        disable=not enabled,
        transient=False,
    ) as bar:
        yield bar


def format_age(seconds: float | None) -> str:
    """Format an age for people: `12s`, `5m`, `3h`, `2d`; `-` when unknown."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def format_ratio(part: float, whole: float) -> str:
    """`part / whole` as a percentage for people; `-` when `whole` is 0."""
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


@contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """Send whatever a library prints to stdout (file descriptor 1) to stderr meanwhile.

    For `--json` commands that run chatty libraries (vLLM logs and prints to stdout):
    stdout must carry exactly one JSON document.
    """
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
