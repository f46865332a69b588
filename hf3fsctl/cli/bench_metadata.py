"""`hf3fsctl bench metadata`: ops/s and p50/p99/p99.9 latency of the store's hot calls.

The measurement is `hf3fsctl.bench.metadata` (one implementation; the
`benchmarks/bench_metadata.py` script calls this command): lookup, locate and
allocate+commit under N concurrent client processes, embedded (`sqlite:///`) and/or
against an `hf3fsctl serve` it starts on loopback (`--mode`), or against a running
server (`--url http://127.0.0.1:PORT --token-file F`, loopback only); every store
pre-filled with `--entries` committed keys; each cell timed for `--seconds`. It also
reports RSS bytes per entry, and allocate+commit on a full store over 8 namespaces
against 1 (the ratio, goal ≤ 1.5). Each figure is also a ratio of `ping` (a 1-key
lookup over the same path, measured in the same run), and of vLLM's in-tree metadata
server (mode `in-tree`, on by default) measured in the same run too: a cell without an
in-tree twin in this run leaves those columns empty, and the table's caption says why.
No figure recorded elsewhere is ever shown as a reference.

Output: Rich tables on stdout (progress on stderr); `--json` prints the one JSON
document on stdout instead, `--json-out PATH` writes it to a file as well, `--plot PATH`
writes a PNG (ops/s per operation and client count, p99 on each bar).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from rich.console import RenderableType

from hf3fsctl.bench import report
from hf3fsctl.cli import bench_output
from hf3fsctl.cli.bench_storage import JsonOutOpt, PlotOpt
from hf3fsctl.cli.options import JsonOpt

IN_TREE = "in-tree"
QuickOpt = Annotated[
    bool,
    typer.Option(
        "--quick",
        help="Short cells on a small store (about 1.5 min on 2 cores with the in-tree server).",
    ),
]


def metadata(
    quick: QuickOpt = False,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            metavar="LIST",
            help="embedded (sqlite:///, clients share one file), serve (an hf3fsctl serve "
            "this starts on loopback), in-tree (vLLM's own metadata server: the ÷ in-tree "
            "columns compare only with it, measured in this run; skipped where vLLM is "
            "missing), redis, serve-redis, redis-cluster (the one-slot store on a private "
            "3-master Redis Cluster), redis-sharded (that store split into --shards shards "
            "over the cluster). Default embedded,serve,in-tree; with several "
            "--entries (or --scale): embedded,serve,redis,in-tree.",
        ),
    ] = None,
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
        str | None,
        typer.Option(
            "--entries",
            metavar="N[,N…]",
            help="Committed entries every store is pre-filled with (200000; quick 10000; "
            "1e5 notation). Several sizes (1e5,1e6) run the scale study: each backend's "
            "store FULL at each N (every allocate evicts), keys saved/s, lookups/s, "
            "bytes/entry and server CPU µs/call per N, and the rate ratio smallest ÷ "
            "largest N (goal ≤ 1.5).",
        ),
    ] = None,
    scale: Annotated[
        bool,
        typer.Option("--scale", help="Run the scale study even with one --entries size."),
    ] = False,
    fleet: Annotated[
        int | None,
        typer.Option(
            "--fleet",
            metavar="NODES",
            min=1,
            help="Size a fleet of NODES nodes: its calls per second per route (lookup per "
            "scheduled request, locate + allocate + commit per prompt's hit/missed pages), "
            "each route's server CPU per call measured here on full stores, and the serve "
            "replicas / Redis shards it needs (docs/design.md, Fleet sizing).",
        ),
    ] = None,
    gpus_per_node: Annotated[
        int, typer.Option("--gpus-per-node", min=1, help="--fleet: GPUs per node.")
    ] = 8,
    requests_per_gpu: Annotated[
        float,
        typer.Option("--requests-per-gpu", help="--fleet: scheduled requests/s per GPU."),
    ] = 4.0,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", min=1, help="--fleet: prompt length in tokens.")
    ] = 4096,
    block_size: Annotated[
        int, typer.Option("--block-size", min=1, help="--fleet: tokens per stored page.")
    ] = 16,
    hit_ratio: Annotated[
        float,
        typer.Option("--hit-ratio", help="--fleet: share of a prompt's pages found stored."),
    ] = 0.5,
    workers: Annotated[
        int, typer.Option("--workers", min=1, help="Server processes of the server it starts.")
    ] = 1,
    shards: Annotated[
        int,
        typer.Option(
            "--shards",
            min=1,
            help="--mode redis-sharded: shards of the store (?shards=N) over the cluster's "
            "3 masters (3: one per master, the count docs/operations.md advises).",
        ),
    ] = 3,
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
    from hf3fsctl.errors import InvalidRequest

    if plot_path is not None:
        bench_output.require_plotting()
    sizes = parse_entries(entries) if entries else None
    if fleet is not None:
        from hf3fsctl.cli import bench_metadata_scale

        if sizes is not None and len(sizes) > 1:
            raise InvalidRequest("--fleet measures one store size: give one --entries")
        counts = report.parse_ints(clients, "--clients") if clients else None
        if counts is not None and len(counts) > 1:
            raise InvalidRequest("--fleet takes one --clients count, e.g. --clients 2")
        bench_output.run_and_publish(
            bench.run_fleet,
            bench.FleetSettings,
            quick=quick,
            overrides={
                "entries": sizes[0] if sizes else None,
                "clients": counts[0] if counts else None,
                "seconds": seconds,
                "modes": tuple(report.parse_choices(mode, "--mode", bench.FLEET_MODES))
                if mode
                else None,
            },
            fixed={
                "nodes": fleet,
                "gpus_per_node": gpus_per_node,
                "requests_per_gpu": requests_per_gpu,
                "prompt_tokens": prompt_tokens,
                "block_size": block_size,
                "hit_ratio": hit_ratio,
                "workers": workers,
                "directory": directory,
                "keep": keep,
                "shards": shards,
            },
            json_stdout=json_output,
            json_path=json_out,
            plot_path=None,
            render=bench_metadata_scale.render_fleet,
            plot=lambda document, path: None,
        )
        return
    if scale or (sizes is not None and len(sizes) > 1):
        from hf3fsctl.cli import bench_metadata_scale

        if plot_path is not None or url is not None:
            raise InvalidRequest("--plot and --url are not for the scale study (--entries N,N…)")
        counts = report.parse_ints(clients, "--clients") if clients else None
        if counts is not None and len(counts) > 1:
            raise InvalidRequest("the scale study takes one --clients count, e.g. --clients 2")
        bench_output.run_and_publish(
            bench.run_scale,
            bench.ScaleSettings,
            quick=quick,
            overrides={
                "entries": tuple(sizes) if sizes else None,
                "clients": counts[0] if counts else None,
                "seconds": seconds,
                "modes": tuple(report.parse_choices(mode, "--mode", bench.SCALE_MODES))
                if mode
                else None,
            },
            fixed={"workers": workers, "directory": directory, "keep": keep, "shards": shards},
            json_stdout=json_output,
            json_path=json_out,
            plot_path=None,
            render=bench_metadata_scale.render_scale,
            plot=lambda document, path: None,
        )
        return
    token = None
    if token_file is not None:
        if url is None:
            raise InvalidRequest("--token-file is for --url (a server it starts has its own)")
        from hf3fsctl.cli.serve import read_token

        token = read_token(str(token_file))
    overrides: dict[str, Any] = {
        "clients": tuple(report.parse_ints(clients, "--clients")) if clients else None,
        "seconds": seconds,
        "entries": sizes[0] if sizes else None,
    }
    fixed: dict[str, Any] = {
        "modes": tuple(
            report.parse_choices(mode or "embedded,serve,in-tree", "--mode", bench.MODES)
        ),
        "ops": tuple(report.parse_choices(ops, "--ops", bench.OPS)),
        "url": url,
        "token": token,
        "workers": workers,
        "directory": directory,
        "keep": keep,
        "shards": shards,
    }
    bench_output.run_and_publish(
        bench.run,
        bench.MetadataSettings,
        quick=quick,
        overrides=overrides,
        fixed=fixed,
        json_stdout=json_output,
        json_path=json_out,
        plot_path=plot_path,
        render=render,
        plot=plot,
    )


def parse_entries(text: str) -> list[int]:
    """`"1e5,1e6"` or `"100000,1000000"` → store sizes.

    Raises:
        InvalidRequest: naming --entries when an item is not a whole positive number.
    """
    from hf3fsctl.errors import InvalidRequest

    sizes: list[int] = []
    for item in text.split(","):
        try:
            value = float(item.strip().replace("_", ""))
        except ValueError:
            value = -1.0
        if value < 1 or value != int(value):
            raise InvalidRequest(
                f"--entries: {item.strip()!r} is not a whole positive number; give e.g. 1e5,1e6"
            )
        if int(value) not in sizes:
            sizes.append(int(value))
    return sizes


def full_columns(goal: float) -> list[str]:
    """The full-store table's columns."""
    return [
        "mode",
        "clients",
        "1 ns ops/s",
        "8 ns ops/s",
        "1 ns saved/s",
        "8 ns saved/s",
        "1 ns ÷ 8 ns",
        "p99 ms 1 ns",
        "p99 ms 8 ns",
        "evicted/call 1 ns",
        "evicted/call 8 ns",
        "no space 1 ns",
        "no space 8 ns",
        f"goal ≤ {goal:g}",
    ]


def in_tree_absence(document: dict[str, Any]) -> str:
    """Why a cell has no in-tree figure in this run, in words (for the tables' captions)."""
    skipped = (document.get("skipped_modes") or {}).get(IN_TREE)
    if skipped:
        return f"mode in-tree was skipped: {skipped}"
    if not any(m["mode"] == IN_TREE for m in document["modes"]):
        return "mode in-tree was not asked for (--mode)"
    return "the in-tree server has no such cell (full-store cells need capacity and eviction)"


def render(document: dict[str, Any]) -> RenderableType:
    """The cells (with ratios to ping and to the in-tree server), memory, full store."""
    from rich.console import Group

    from hf3fsctl.bench.metadata import FULL_GOAL, OP_LABELS, cutoff_s
    from hf3fsctl.cli import output
    from hf3fsctl.config import format_size

    machine = document["machine"]
    absent = in_tree_absence(document)
    columns = ["mode", "op", "clients", "ops/s", "p50 ms", "p99 ms", "p99.9 ms", "÷ ping"]
    columns += ["in-tree", "÷ in-tree", "CPU µs/call", "in-tree CPU ÷"]
    clustered = any(r.get("busiest_master_cpu_share") is not None for r in document["rows"])
    if clustered:
        columns.append("busiest master")
    rows = []
    for r in document["rows"]:
        bar = r.get("in_tree") or {}
        in_tree = ", ".join(
            f"{report.fmt(v, 1 if k == 'ops' else 2)} {k.replace('_ms', ' ms').replace('ops', '/s')}"
            for k, v in bar.items()
            if v is not None
        )
        rows.append(
            [
                r["mode"],
                OP_LABELS[r["op"]],
                r["clients"],
                report.fmt(r["ops"], 1)
                + (f" ({r['unfinished_calls']} cut off)" if r.get("unfinished_calls") else "")
                + (f" ({r['failed_calls']} failed)" if r.get("failed_calls") else ""),
                *(
                    ("≥ " if r.get("truncated") else "") + report.fmt(r[k])
                    for k in ("p50_ms", "p99_ms", "p999_ms")
                ),
                report.fmt(r["ratio_to_ping"]),
                in_tree,
                f"{r['in_tree_ratio']:.1f}×" if r.get("in_tree_ratio") else "",
                report.fmt(r.get("cpu_us_per_call"), 0)
                + (" (clients)" if r.get("cpu_of") == "clients" else ""),
                f"{r['in_tree_cpu_ratio']:.1f}×" if r.get("in_tree_cpu_ratio") else "",
            ]
        )
        if clustered:
            rows[-1].append(_share(r.get("busiest_master_cpu_share")))
    right: tuple[str, ...] = ("clients", "ops/s", "p50 ms", "p99 ms", "p99.9 ms", "÷ ping")
    right = (*right, "÷ in-tree", "CPU µs/call", "in-tree CPU ÷", "busiest master")
    cells = output.table(
        columns,
        rows,
        title=f"metadata calls, client processes on {machine['cpus']} cores, "
        f"{document['settings']['seconds']:g} s per cell; ÷ ping = ops/s over a 1-key "
        "lookup on the same path in this run (the ceiling)",
        right=right,
    )
    unmeasured = [r for r in document["rows"] if r["mode"] != IN_TREE and not r.get("in_tree")]
    cells.caption = (
        (
            "CPU µs/call: the server processes' CPU time (user + system) per call "
            "(embedded: the client processes', where the store runs); in-tree CPU ÷: the "
            "in-tree server's CPU per call ÷ this row's; "
        )
        + (
            "busiest master: its share of the cluster masters' CPU (summed in CPU µs/call); "
            if clustered
            else ""
        )
        + "in-tree, ÷ in-tree: vLLM's in-tree metadata server, measured in this run"
        + (f"; empty: not measured in this run ({absent})" if unmeasured else "")
    )
    cells.caption_justify = "left"
    parts: list[Any] = [cells]
    reference = (document.get("reference") or {}).get("rss_bytes_per_key")
    in_tree_column = "÷ in-tree" + (f" {reference:.0f} B" if reference else "")
    memory_rows = []
    for mode in document["modes"]:
        memory = mode.get("memory")
        fill = mode.get("fill") or {}
        if memory is None:
            continue
        memory_rows.append(
            [
                mode["mode"],
                f"{memory['entries']:,}",
                report.fmt(fill.get("entries_per_s"), 0),
                format_size(memory["rss_before_bytes"]),
                format_size(memory["rss_after_bytes"]),
                f"{memory['bytes_per_entry']:.0f}",
                ""
                if memory.get("ratio_to_in_tree") is None
                else f"{memory['ratio_to_in_tree']:.2f}",
                report.fmt(memory.get("db_bytes_per_entry"), 0),
            ]
        )
    if memory_rows:
        memory_table = output.table(
            [
                "mode",
                "entries",
                "fill/s",
                "RSS before",
                "RSS after",
                "B/entry",
                in_tree_column,
                "disk B/entry",
            ],
            memory_rows,
            title="store memory: RSS of a fresh store process before/after loading the entries",
            right=(
                "entries",
                "fill/s",
                "RSS before",
                "RSS after",
                "B/entry",
                in_tree_column,
                "disk B/entry",
            ),
        )
        if reference is None:
            memory_table.caption = f"÷ in-tree empty: not measured in this run ({absent})"
            memory_table.caption_justify = "left"
        parts.append(memory_table)
    full = document["full_store"]
    if full:
        parts.append(
            output.table(
                full_columns(FULL_GOAL),
                [
                    [
                        f["mode"],
                        f["clients"],
                        report.fmt(f["ops_1ns"], 1),
                        report.fmt(f["ops_8ns"], 1),
                        report.fmt(f["saved_keys_per_s_1ns"], 0),
                        report.fmt(f["saved_keys_per_s_8ns"], 0),
                        _ratio(f["ratio_1ns_over_8ns"]),
                        report.fmt(f["p99_ms_1ns"]),
                        report.fmt(f["p99_ms_8ns"]),
                        report.fmt(f["evicted_per_call_1ns"], 1),
                        report.fmt(f["evicted_per_call_8ns"], 1),
                        _share(f["no_space_share_1ns"]),
                        _share(f["no_space_share_8ns"]),
                        {True: "met", False: "missed", None: "unknown"}[f["met"]],
                    ]
                    for f in full
                ],
                title="allocate + commit 64 on a full store, 8 namespaces against 1; "
                "1 ns ÷ 8 ns = keys saved (committed) per second, 1 namespace over 8 "
                f"(goal ≤ {FULL_GOAL:g}); no space = share of keys refused (a skipped save); "
                "each cell starts from the same full store",
                right=full_columns(FULL_GOAL)[1:-1],
            )
        )
    truncated = [r for r in document["rows"] if r.get("truncated")]
    if truncated:
        parts.append(
            "≥: a call was still running when the cell was cut off "
            f"({cutoff_s(document['settings']['seconds']):g} s after its window): its time so "
            "far is counted, so those percentiles are lower bounds"
        )
    for r in document["rows"]:
        if r.get("first_failure"):
            parts.append(
                f"{r['mode']} {r['op']} x{r['clients']}: {r['failed_calls']} calls failed, "
                f"e.g. {r['first_failure'][:200]}"
            )
    for f in full:
        if f.get("note"):
            plural = "s" if f["clients"] > 1 else ""
            parts.append(f"full store, {f['mode']}, {f['clients']} client{plural}: {f['note']}")
    if document.get("skipped"):
        parts.append(
            f"skipped with --url: {', '.join(document['skipped'])} (need a store of their own)"
        )
    return Group(*parts)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2g}"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


def plot(document: dict[str, Any], path: Path) -> None:
    """Ops/s per operation and client count (log scale), p99 written on each bar; one
    panel per mode; the full-store ratio and bytes/entry in the titles."""
    from hf3fsctl.bench.metadata import FULL_GOAL, OP_LABELS, OPS

    modes = [m["mode"] for m in document["modes"]]
    fig = bench_output.figure(max(7.5, 6.5 * len(modes)), 5.6)
    axes = fig.subplots(1, len(modes), sharey=True, squeeze=False)[0]
    clients = document["settings"]["clients"]
    width = 0.8 / len(clients)
    measured = [r["ops"] for r in document["rows"] if r["ops"]] or [1.0]
    highest, lowest = max(measured), min(measured)
    for ax, mode in zip(axes, modes, strict=True):
        rows = [r for r in document["rows"] if r["mode"] == mode]
        ops = [op for op in OPS if any(r["op"] == op for r in rows)]
        for i, count in enumerate(clients):
            xs, ys, notes = [], [], []
            for j, op in enumerate(ops):
                cell = next((r for r in rows if r["op"] == op and r["clients"] == count), None)
                if cell is None:
                    continue
                if not cell["ops"]:  # nothing finished before the cut-off
                    ax.annotate(
                        f"cut off, ≥ {_ms(cell['p50_ms'])} ms",
                        (j + (i - (len(clients) - 1) / 2) * width, lowest / 2.5),
                        ha="center",
                        va="bottom",
                        rotation=90,
                        fontsize=7,
                        color="firebrick",
                    )
                    continue
                xs.append(j + (i - (len(clients) - 1) / 2) * width)
                ys.append(cell["ops"])
                notes.append(f"p99 {'≥ ' if cell.get('truncated') else ''}{_ms(cell['p99_ms'])} ms")
            bars = ax.bar(xs, ys, width * 0.92, label=f"{count} client{'s' if count > 1 else ''}")
            for bar, note in zip(bars, notes, strict=True):
                ax.annotate(
                    note,
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    rotation=90,
                    fontsize=7,
                )
        ax.set_yscale("log")
        ax.set_xticks(
            range(len(ops)),
            [OP_LABELS[op].replace(", ", ",\n") for op in ops],
            rotation=30,
            ha="right",
            fontsize=8,
        )
        memory = next((m.get("memory") for m in document["modes"] if m["mode"] == mode), None)
        title = mode
        if memory:
            title += f" — {memory['bytes_per_entry']:.0f} B/entry of RSS"
            reference = (document.get("reference") or {}).get("rss_bytes_per_key")
            if reference and mode != IN_TREE:
                title += f" (in-tree {reference:.0f}, this run)"
        full = [f for f in document["full_store"] if f["mode"] == mode]
        if full:
            title += (
                "\nfull store 1 ns ÷ 8 ns: "
                + ", ".join(
                    f"{_ratio(f['ratio_1ns_over_8ns'])} at {f['clients']} client"
                    + ("s" if f["clients"] > 1 else "")
                    for f in full
                )
                + f" (goal ≤ {FULL_GOAL:g})"
            )
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(bottom=lowest / 3, top=highest * 60)
        ax.legend(fontsize=8, loc="upper right")
    axes[0].set_ylabel("ops/s (log scale)")
    machine = document["machine"]
    fig.suptitle(
        f"hf3fsctl bench metadata: {document['settings']['entries']:,} entries, "
        f"{document['settings']['seconds']:g} s per cell, client processes on "
        f"{machine['cpus']} cores (ping = 1-key lookup, the ceiling)",
        fontsize=10,
    )
    bench_output.save(fig, path)
