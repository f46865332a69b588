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
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from rich.console import RenderableType

from hf3fsctl.bench import report
from hf3fsctl.cli import bench_output, context
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
            help="Page sizes, e.g. 256KiB,1MiB,4MiB (a bare number is bytes, as for --capacity). "
            "Default 256KiB,1MiB,4MiB.",
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
    from hf3fsctl.bench import storage as bench
    from hf3fsctl.config import parse_size

    if plot_path is not None:
        bench_output.require_plotting()
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
    bench_output.run_and_publish(
        bench.run,
        bench.StorageSettings,
        quick=quick,
        overrides=overrides,
        fixed=fixed,
        json_stdout=json_output,
        json_path=json_out,
        plot_path=plot_path,
        render=render,
        plot=plot,
    )


def render(document: dict[str, Any]) -> RenderableType:
    """The plain ceiling, then every (page, batch, threads) row as GB/s (ratio)."""
    from rich.console import Group

    from hf3fsctl.bench import storage as bench
    from hf3fsctl.cli import output

    machine = document["machine"]
    where = f"{machine['fstype']} at {machine['mount'] or '?'}"
    plain = output.table(
        ["page", "write", "warm read", "cold read"],
        [
            [report.size_label(r["page_bytes"]), *(f"{r[k]:.2f}" for k in bench.CEILING_FIGURES)]
            for r in document["ceiling"]["rows"]
        ],
        title=f"ceiling: plain dd-style loop on {where} (1 thread, bs = page size), GB/s",
        right=("page", "write", "warm read", "cold read"),
    )
    columns = ["page", "batch", "threads", *(title for title, _ in bench.FIGURES)]
    rows = [
        [
            report.size_label(r["page_bytes"]) + (" D" if r["o_direct"] else ""),
            r["batch"],
            r["threads"],
            *(f"{r[k]:.2f} ({r[k.replace('_gbs', '_ratio')]:.2f})" for _, k in bench.FIGURES),
        ]
        for r in document["results"]
    ]
    table = output.table(
        columns,
        rows,
        title=f"page I/O on {where}, GB/s (ratio to the plain ceiling of this run); "
        f"{document['settings']['statistic']}, {document['machine']['cpus']} cores",
        right=columns,
    )
    return Group(plain, table)


def plot(document: dict[str, Any], path: Path) -> None:
    """GB/s against page size, one panel per direction, the plain ceiling as a dashed line."""
    fig = bench_output.figure(15, 4.8)
    axes = fig.subplots(1, 3, sharex=True)
    ceiling = document["ceiling"]["rows"]
    results = document["results"]
    sizes = [r["page_bytes"] for r in ceiling]
    configs = sorted({(r["batch"], r["threads"], r["o_direct"]) for r in results})
    panels = (
        ("write (xxh3 checksums)", "write_gbs"),
        ("warm read (verified)", "warm_read_gbs"),
        ("cold read (verified)", "cold_read_gbs"),
    )
    for ax, (title, key) in zip(axes, panels, strict=True):
        ax.plot(
            sizes,
            [r[key] for r in ceiling],
            color="black",
            linestyle="--",
            linewidth=2.2,
            marker="s",
            label="plain loop (ceiling)",
        )
        for batch, threads, direct in configs:
            points = [
                (r["page_bytes"], r[key])
                for r in results
                if (r["batch"], r["threads"], r["o_direct"]) == (batch, threads, direct)
            ]
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(
                xs,
                ys,
                marker="o",
                linewidth=1.3,
                linestyle=":" if direct else "-",
                label=f"batch {batch} × {threads} threads" + (" O_DIRECT" if direct else ""),
            )
        best = max(results, key=lambda r: r[key.replace("_gbs", "_ratio")])
        ratio = best[key.replace("_gbs", "_ratio")]
        ax.set_title(
            f"{title}\nbest {ratio:.2f}× plain (batch {best['batch']}, "
            f"{best['threads']} threads, {report.size_label(best['page_bytes'])})",
            fontsize=10,
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [report.size_label(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel("page size")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8, loc="best")
    machine = document["machine"]
    fig.suptitle(
        f"hf3fsctl bench storage: POSIX engine vs the plain loop, {machine['fstype']} at "
        f"{machine['mount'] or '?'}, {machine['cpus']} cores "
        f"({document['settings']['statistic']})",
        fontsize=11,
    )
    bench_output.save(fig, path)
