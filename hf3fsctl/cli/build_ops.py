"""`hf3fsctl build-ops`: compile the staging ops from the installed package's sources.

Thin over `hf3fsctl.ops.build.ensure_built`: the library goes to the per-user cache
entry of the running torch (``$XDG_CACHE_HOME/hf3fsctl/ops/<torch>-cpu`` or
``…/<torch>-cuda<version>-sm<arch>``), where `hf3fsctl.staging` looks for it, unless
``--out`` names a directory. An existing library is reused unless ``--force``. Each
compile step shows as a Rich status line on stderr; the result (path, reused or built)
goes to stdout, or as one JSON document with ``--json``. A missing tool (C++ compiler,
nvcc, a CUDA build of torch) is one error line naming it, exit code 8.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from hf3fsctl.cli import output
from hf3fsctl.cli.options import JsonOpt


def build_ops(
    cuda: Annotated[
        bool | None,
        typer.Option(
            "--cuda/--cpu",
            help="Build the CUDA op too, or the CPU op only "
            "(default: CUDA when torch has CUDA and nvcc is found).",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            metavar="DIR",
            help="Write _ops.so here (default: the per-user cache that staging searches).",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild even when the library is cached.")
    ] = False,
    jobs: Annotated[
        int, typer.Option("--jobs", "-j", min=1, metavar="N", help="Compilers run at once.")
    ] = 3,
    json: JsonOpt = False,
) -> None:
    """Compile the fast staging ops (CPU, or CPU+CUDA) into the per-user cache."""
    from hf3fsctl.errors import OpsBuildError
    from hf3fsctl.ops.build import ensure_built

    status = output.stderr.status("checking the toolchain", spinner="dots")

    def step(message: str) -> None:
        status.update(message)
        output.info(message)

    with nullcontext() if json else status:
        try:
            result = ensure_built(
                cuda, out, force=force, jobs=jobs, progress=None if json else step
            )
        except OpsBuildError as exc:
            if exc.output:
                output.stderr.print(exc.output, markup=False, highlight=False)
            raise
    kind = "cpu+cuda" if result.cuda else "cpu"
    if json:
        output.print_json(
            {
                "path": str(result.path),
                "ops": kind,
                "reused": result.reused,
                "seconds": round(result.seconds, 1),
            }
        )
    elif result.reused:
        output.line(f"reused {result.path} ({kind}; --force rebuilds)")
    else:
        output.line(f"built {result.path} ({kind}) in {result.seconds:.1f} s")
