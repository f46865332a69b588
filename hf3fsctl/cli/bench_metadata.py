"""`hf3fsctl bench metadata`: ops/s and p50/p99/p99.9 latency of the store's hot calls.

The measurement is `hf3fsctl.bench.metadata` (one implementation; the
`benchmarks/bench_metadata.py` script calls this command): lookup, locate and
allocate+commit under N concurrent client processes, embedded (`sqlite:///`) and/or
against an `hf3fsctl serve` it starts on loopback (`--mode`), or against a running
server (`--url http://127.0.0.1:PORT --token-file F`, loopback only); every store
pre-filled with `--entries` committed keys; each cell timed for `--seconds`. It also
reports RSS bytes per entry, and allocate+commit on a full store over 8 namespaces
against 1 (the ratio, goal ≤ 1.5). Each figure is also a ratio of `ping` (a 1-key
lookup over the same path, measured in the same run).

Output: Rich tables on stdout (progress on stderr); `--json` prints the one JSON
document on stdout instead, `--json-out PATH` writes it to a file as well, `--plot PATH`
writes a PNG (ops/s per operation and client count, p99 on each bar).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from hf3fsctl.cli.bench_storage import JsonOutOpt, PlotOpt
from hf3fsctl.cli.options import JsonOpt

QuickOpt = Annotated[
    bool,
    typer.Option("--quick", help="Short cells on a small store (about 15 s on 2 cores)."),
]


def metadata(
    quick: QuickOpt = False,
    mode: Annotated[
        str,
        typer.Option(
            "--mode",
            metavar="LIST",
            help="embedded (sqlite:///, clients share one file), serve (an hf3fsctl serve "
            "this starts on loopback), or both.",
        ),
    ] = "embedded,serve",
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            metavar="URL",
            help="Measure this running server instead (http://127.0.0.1:PORT, loopback "
            "only). Its namespaces are added, then dropped; no full-store cells.",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", metavar="PATH", help="Bearer token of the --url server."),
    ] = None,
    ops: Annotated[
        str,
        typer.Option(
            "--ops",
            metavar="LIST",
            help="Operations: ping, lookup, locate, alloc_commit, full_1ns, full_8ns "
            "(ping, the ceiling, is always measured).",
        ),
    ] = "lookup,locate,alloc_commit,full_1ns,full_8ns",
    clients: Annotated[
        str | None,
        typer.Option(
            "--clients", metavar="LIST", help="Concurrent client processes (1,16; quick 1,4)."
        ),
    ] = None,
    seconds: Annotated[
        float | None,
        typer.Option(
            "--seconds",
            min=0.01,
            help="Timed seconds of each cell (3; quick 0.3). A call still running "
            "max(5, 2 x seconds) later is cut off and counted as unfinished.",
        ),
    ] = None,
    entries: Annotated[
        int | None,
        typer.Option(
            "--entries",
            min=1,
            help="Committed entries every store is pre-filled with (200000; quick 10000).",
        ),
    ] = None,
    workers: Annotated[
        int, typer.Option("--workers", min=1, help="Server processes of the server it starts.")
    ] = 1,
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir", metavar="DIR", help="Where the work directory goes (default: temporary)."
        ),
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the work directory (and --url namespaces).")
    ] = False,
    json_output: JsonOpt = False,
    json_out: JsonOutOpt = None,
    plot_path: PlotOpt = None,
) -> None:
    """Ops/s and latency of lookup, locate and allocate+commit under concurrent clients,
    embedded or over HTTP, plus memory per entry and the full-store 8-vs-1 namespaces."""
    from hf3fsctl.bench import metadata as bench
    from hf3fsctl.bench import report
    from hf3fsctl.errors import InvalidRequest

    if plot_path is not None:
        report.require_plotting()
    token = None
    if token_file is not None:
        if url is None:
            raise InvalidRequest("--token-file is for --url (a server it starts has its own)")
        from hf3fsctl.cli.serve import read_token

        token = read_token(str(token_file))
    overrides: dict[str, Any] = {
        "clients": tuple(report.parse_ints(clients, "--clients")) if clients else None,
        "seconds": seconds,
        "entries": entries,
    }
    fixed: dict[str, Any] = {
        "modes": tuple(report.parse_choices(mode, "--mode", bench.MODES)),
        "ops": tuple(report.parse_choices(ops, "--ops", bench.OPS)),
        "url": url,
        "token": token,
        "workers": workers,
        "directory": directory,
        "keep": keep,
    }
    report.run_and_publish(
        bench,
        bench.MetadataSettings,
        quick=quick,
        overrides=overrides,
        fixed=fixed,
        json_stdout=json_output,
        json_path=json_out,
        plot_path=plot_path,
    )
