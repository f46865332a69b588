"""`hf3fsctl bench storage`: page write/read GB/s against the file system's own ceiling.

The measurement is `hf3fsctl.bench.storage` (one implementation; the
`benchmarks/bench_storage.py` script calls this command). Output: Rich tables on stdout
(progress on stderr); `--json` prints the one JSON document on stdout instead, and
`--json-out PATH` writes it to a file as well; `--plot PATH` writes a PNG of GB/s
against page size with the plain ceiling line.

The files go to `--dir`, by default the configured `storage.path` when it exists here
(the file system the cache really uses), else the system's temporary directory; a fresh
`hf3fsctl-bench-storage-*` directory is made inside and removed afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from hf3fsctl.cli import context
from hf3fsctl.cli.options import ConfigOpt, JsonOpt

QuickOpt = Annotated[bool, typer.Option("--quick", help="A small grid that runs in a few seconds.")]
JsonOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--json-out",
        metavar="PATH",
        help="Also write the JSON document to PATH (tables still print unless --json).",
    ),
]
PlotOpt = Annotated[
    Path | None,
    typer.Option("--plot", metavar="PATH", help="Write a PNG chart to PATH (needs matplotlib)."),
]


def storage(
    ctx: typer.Context,
    config: ConfigOpt = None,
    quick: QuickOpt = False,
    sizes: Annotated[
        str | None,
        typer.Option(
            "--sizes",
            metavar="LIST",
            help="Page sizes, e.g. 256k,1MiB,4MiB (a bare number is KiB). Default 256k,1MiB,4MiB.",
        ),
    ] = None,
    batches: Annotated[
        str | None,
        typer.Option(
            "--batches",
            metavar="LIST",
            help="Pages per engine call. Default 1,16,64 (quick: 1,64).",
        ),
    ] = None,
    threads: Annotated[
        str | None,
        typer.Option(
            "--threads",
            metavar="LIST",
            help="I/O threads of the engines measured. Default 1, 2x cores (at most 16), 16 "
            "(quick: 1,16).",
        ),
    ] = None,
    total: Annotated[
        str | None,
        typer.Option(
            "--total",
            metavar="SIZE",
            help="Bytes moved per measurement, e.g. 256MiB (quick: 64MiB).",
        ),
    ] = None,
    repeats: Annotated[
        int | None,
        typer.Option(
            "--repeats", min=1, help="Timed runs per figure; the best is kept (3, quick 2)."
        ),
    ] = None,
    fsync: Annotated[
        bool, typer.Option("--fsync", help="fsync inside the write timings (ours and plain).")
    ] = False,
    o_direct: Annotated[
        bool, typer.Option("--o-direct", help="Also measure O_DIRECT engines.")
    ] = False,
    max_task: Annotated[
        str,
        typer.Option("--max-task", metavar="SIZE", help="Most bytes one vectored call moves."),
    ] = "4MiB",
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            metavar="DIR",
            help="Where the work directory goes (default: storage.path if it exists here, "
            "else the temporary directory).",
        ),
    ] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the work directory.")] = False,
    json_output: JsonOpt = False,
    json_out: JsonOutOpt = None,
    plot_path: PlotOpt = None,
) -> None:
    """Page write/read GB/s across page sizes, batches and I/O threads, as ratios of a
    plain sequential loop on the same file system measured in the same run."""
    from hf3fsctl.bench import report
    from hf3fsctl.bench import storage as bench
    from hf3fsctl.config import parse_size

    if plot_path is not None:
        report.require_plotting()
    if directory is None:
        configured = Path(context.load(ctx, config).storage.path)
        if configured.is_dir() and os.access(configured, os.W_OK):
            directory = configured
    overrides: dict[str, Any] = {
        "page_sizes": tuple(report.parse_sizes(sizes, "--sizes")) if sizes else None,
        "batches": tuple(report.parse_ints(batches, "--batches")) if batches else None,
        "threads": tuple(report.parse_ints(threads, "--threads")) if threads else None,
        "total_bytes": parse_size(total, "--total") if total else None,
        "repeats": repeats,
    }
    fixed: dict[str, Any] = {
        "fsync": fsync,
        "o_direct": o_direct,
        "max_task_bytes": parse_size(max_task, "--max-task"),
        "directory": directory,
        "keep": keep,
    }
    report.run_and_publish(
        bench,
        bench.StorageSettings,
        quick=quick,
        overrides=overrides,
        fixed=fixed,
        json_stdout=json_output,
        json_path=json_out,
        plot_path=plot_path,
    )
