"""The one place where errors become messages and exit codes.

Every `hf3fsctl.errors.Hf3fsctlError` carries its exit code and a hint; here it becomes
one line on stderr (`Error: …`), the hint (`Hint: …`) and that exit code. With
`HF3FSCTL_DEBUG=1` the traceback is printed too. An `OSError` that reaches a command
(a path on a file system that is gone, full or refuses) is a `StorageError` line too
(`StorageError.from_os_error`). Anything else is a bug and keeps its traceback.

Exit codes (also in `hf3fsctl --help`):

| code | meaning |
| ---- | ------- |
| 0 | success |
| 1 | a check failed (`doctor`), or an unexpected error |
| 2 | usage, configuration or invalid request (`ConfigError`, `InvalidRequest`), or an extra not installed (`MissingExtra`) |
| 3 | not found (`NotFound`) |
| 4 | namespace conflict (`NamespaceConflict`) |
| 5 | storage error (`StorageError`) |
| 6 | metadata service unavailable (`MetadataUnavailable`) |
| 7 | authentication refused (`AuthError`) |
| 8 | the staging ops could not be built (`OpsBuildError`: a tool missing, a compile failed) |
| 9 | `serve` cannot listen: the port is in use, or the address is not this machine's (`AddressInUse`) |
| 130 | interrupted (Ctrl-C) |
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer

from hf3fsctl.cli import output
from hf3fsctl.errors import Hf3fsctlError, StorageError
from hf3fsctl.extras import missing_extra

P = ParamSpec("P")
R = TypeVar("R")

EXIT_CHECK_FAILED = 1
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = (
    "Exit codes: 0 ok · 1 a check failed or unexpected error · 2 usage, config or "
    "invalid request · 3 not found · 4 namespace conflict · 5 storage error · "
    "6 metadata service unavailable · 7 authentication refused · 8 build-ops failed · "
    "9 serve cannot listen (port in use) · 130 interrupted. "
    "Set HF3FSCTL_DEBUG=1 for tracebacks."
)


def debug_enabled() -> bool:
    """Whether `HF3FSCTL_DEBUG` asks for tracebacks."""
    return os.environ.get("HF3FSCTL_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def report(error: Hf3fsctlError) -> int:
    """Print a known error (message, hint, traceback in debug mode); return its exit code."""
    if debug_enabled():
        output.stderr.print(
            "".join(traceback.format_exception(error)), markup=False, highlight=False
        )
    output.error(error.message, error.hint)
    return error.exit_code


def handle_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Wrap a command so known errors exit with their message, hint and code.

    Applied to every command where `main.py` registers it, so `CliRunner` tests see the
    same mapping as the console script.
    """

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except Hf3fsctlError as exc:
            raise typer.Exit(report(exc)) from None
        except ModuleNotFoundError as exc:  # an optional extra not installed: one line
            missing = missing_extra(exc)
            if missing is None:
                raise
            raise typer.Exit(report(missing)) from None
        except OSError as exc:  # a path on a file system gone or refusing: one line
            if debug_enabled():
                raise
            raise typer.Exit(report(StorageError.from_os_error(exc))) from None
        except KeyboardInterrupt:
            output.info("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper
