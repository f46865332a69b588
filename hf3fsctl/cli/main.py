"""The `hf3fsctl` application: wires the commands and holds `main()`.

Each command lives in its own module (`cli/<command>.py`); this module only registers
them, wrapped by `errors.handle_errors` so known errors become a one-line message, a
hint and a documented exit code (see `hf3fsctl.cli.errors`). Commands import their heavy
dependencies (torch, vLLM, FastAPI, uvicorn, httpx) inside themselves, so `--help`,
`stats` and `evict` start fast.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from hf3fsctl import __version__
from hf3fsctl.cli import (
    backup,
    bench,
    build_ops,
    doctor,
    evict,
    init,
    lookup,
    ls,
    migrate,
    pin,
    serve,
    stats,
    verify,
    vllm_config,
    warm,
)
from hf3fsctl.cli.errors import EXIT_CODES_HELP, EXIT_INTERRUPTED, debug_enabled, handle_errors
from hf3fsctl.cli.errors import report as report_error
from hf3fsctl.cli.options import ConfigOpt
from hf3fsctl.errors import Hf3fsctlError

# What an option's value is called in help when its declaration names no metavar, by
# the type Typer would show: plain words instead of `<str>`, `<int range>` (choices,
# `a|b|c`, are left as they are).
_METAVARS = {
    "<str>": "TEXT",
    "<path>": "PATH",
    "<int>": "N",
    "<int range>": "N",
    "<float>": "NUMBER",
    "<float range>": "NUMBER",
    "<list[str]>": "TEXT",
    "<list[Path]>": "PATH",
}


def _untyped_flags(params: list[Any], ctx: Any) -> list[Any]:
    """Give flags an empty metavar, and other options a plain one, for Rich help.

    Typer's Rich help prints a type for every option, `<bool>` for flags too (`--verbose
    -v <bool>`, even `--help <bool>`), which reads as a flag that takes a value. A flag
    takes none: with an empty metavar its type column is blank, as in Click's plain help.
    An option with a value and no declared metavar shows `TEXT`, `PATH`, `N` or `NUMBER`
    (a range keeps its bounds, `N [x>=1]`) instead of `<str>` or `<int range>`.
    """
    for param in params:
        if isinstance(param, TyperArgument) and param.metavar is not None:
            # an argument with a name of its own (`NAMESPACE`) needs no `<str>` after it;
            # Typer shows one for every argument, whatever its metavar
            param.display_type_rich = _no_type  # type: ignore[method-assign]
            continue
        if not isinstance(param, TyperOption) or param.metavar is not None:
            continue
        if param.is_flag:
            param.metavar = ""
        else:
            param.metavar = _METAVARS.get(param.display_type(ctx))
    return params


def _no_type(ctx: Any) -> None:
    return None


def _plain_usage(pieces: list[str]) -> list[str]:
    """Usage pieces with a required argument shown bare (`NAMESPACE`), as Click and man
    pages do, not in braces (`{NAMESPACE}`, which reads as shell brace expansion)."""
    return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class Hf3fsctlGroup(TyperGroup):
    """The application: its own options' help without `<bool>` after flags."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _untyped_flags(super().get_params(ctx), ctx)


class Hf3fsctlCommand(TyperCommand):
    """A command whose help shows no `<bool>` after flags, no `<str>` after a named
    argument and no braces around it (register every command with it)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _untyped_flags(super().get_params(ctx), ctx)

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return _plain_usage(super().collect_usage_pieces(ctx))


app = typer.Typer(
    name="hf3fsctl",
    cls=Hf3fsctlGroup,
    help="Run a persistent, shareable KV-cache tier for vLLM on 3FS (or any POSIX file system).",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    # `--install-completion` / `--show-completion [bash|zsh|fish|powershell]`.
    add_completion=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hf3fsctl {__version__}")
        raise typer.Exit()


VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Log what is done (to stderr).")]


@app.callback()
def _root(
    ctx: typer.Context,
    config: ConfigOpt = None,
    verbose: VerboseOpt = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Run a persistent, shareable KV-cache tier for vLLM on 3FS (or any POSIX file system)."""
    level = logging.DEBUG if debug_enabled() else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    ctx.obj = {"config": config}


# Help panels, in the order `hf3fsctl --help` shows them.
SETUP = "Set up and run"
OPERATE = "Operate the cache"
PROMPTS = "Prompts (vLLM)"
DIAGNOSE = "Check and measure"


def with_verbose(fn: Callable[..., None]) -> Callable[..., None]:
    """`fn` taking `-v/--verbose` after the command name too (`hf3fsctl stats -v`).

    Typer reads a command's options from its signature, so the wrapper's signature is
    `fn`'s plus `verbose`; given, it lowers the log level the root callback set.
    """
    signature = inspect.signature(fn, eval_str=True)
    if "verbose" in signature.parameters:
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, verbose: bool = False, **kwargs: Any) -> None:
        if verbose and not debug_enabled():
            logging.getLogger().setLevel(logging.INFO)
        fn(*args, **kwargs)

    flag = inspect.Parameter(
        "verbose", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=VerboseOpt
    )
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), flag]
    )
    wrapper.__annotations__ = {**fn.__annotations__, "verbose": VerboseOpt}
    return wrapper


def _command(name: str, fn: Callable[..., None], panel: str = OPERATE) -> None:
    """Register a command under a help panel: errors mapped by `handle_errors`, flags
    untyped, `-v` accepted after the command too."""
    app.command(name, cls=Hf3fsctlCommand, rich_help_panel=panel)(handle_errors(with_verbose(fn)))


_command("init", init.init, SETUP)
_command("serve", serve.serve, SETUP)
_command("vllm-config", vllm_config.vllm_config, SETUP)
_command("build-ops", build_ops.build_ops, SETUP)
_command("stats", stats.stats)
_command("ls", ls.ls)
_command("evict", evict.evict)
_command("pin", pin.pin)
_command("unpin", pin.unpin)
_command("backup", backup.backup)
_command("migrate", migrate.migrate)
_command("warm", warm.warm, PROMPTS)
_command("lookup", lookup.lookup, PROMPTS)
_command("verify", verify.verify, PROMPTS)
_command("doctor", doctor.doctor, DIAGNOSE)
app.add_typer(
    bench.register(Hf3fsctlCommand), name="bench", cls=Hf3fsctlGroup, rich_help_panel=DIAGNOSE
)


def main() -> None:
    """Console-script entry point (`hf3fsctl`, `python -m hf3fsctl`)."""
    try:
        app(prog_name="hf3fsctl")  # also under `python -m hf3fsctl` (usage, completion)
    except Hf3fsctlError as exc:  # raised outside a command (e.g. while parsing)
        sys.exit(report_error(exc))
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
