"""The `hf3fsctl` application: wires the commands and holds `main()`.

Each command lives in its own module (`cli/<command>.py`); this module only registers
them, wrapped by `errors.handle_errors` so known errors become a one-line message, a
hint and a documented exit code (see `hf3fsctl.cli.errors`). Commands import their heavy
dependencies (torch, vLLM, FastAPI, uvicorn, httpx) inside themselves, so `--help`,
`stats` and `evict` start fast.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from hf3fsctl import __version__
from hf3fsctl.cli import doctor, evict, init, ls, serve, stats, vllm_config
from hf3fsctl.cli.errors import EXIT_CODES_HELP, EXIT_INTERRUPTED, debug_enabled, handle_errors
from hf3fsctl.cli.errors import report as report_error
from hf3fsctl.cli.options import ConfigOpt
from hf3fsctl.errors import Hf3fsctlError

app = typer.Typer(
    name="hf3fsctl",
    help="Run a persistent, shareable KV-cache tier for vLLM on 3FS (or any POSIX file system).",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hf3fsctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    config: ConfigOpt = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log what is done (to stderr).")
    ] = False,
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


# Set-up and service.
app.command("init")(handle_errors(init.init))
app.command("serve")(handle_errors(serve.serve))
# Operating the cache.
app.command("stats")(handle_errors(stats.stats))
app.command("ls")(handle_errors(ls.ls))
app.command("evict")(handle_errors(evict.evict))
app.command("doctor")(handle_errors(doctor.doctor))
app.command("vllm-config")(handle_errors(vllm_config.vllm_config))
# Commands that need vLLM register here, each from its own module, the same way:
#   app.command("warm")(handle_errors(warm.warm))    # hf3fsctl/cli/warm.py
#   app.command("bench")(handle_errors(bench.bench))  # hf3fsctl/cli/bench.py


def main() -> None:
    """Console-script entry point (`hf3fsctl`, `python -m hf3fsctl`)."""
    try:
        app()
    except Hf3fsctlError as exc:  # raised outside a command (e.g. while parsing)
        sys.exit(report_error(exc))
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
