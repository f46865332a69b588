"""`hf3fsctl bench e2e`: a prefix-repetition workload through real vLLM, against its ceilings.

Thin over `hf3fsctl.bench.e2e` (which says what is measured and how): parse the flags,
run, then print the Rich table (or one JSON document with `--json`), and optionally write
the JSON to a file and a PNG. Progress goes to stderr. vLLM runs only in child processes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import bench_output
from hf3fsctl.cli.options import JsonOpt

if TYPE_CHECKING:
    from rich.console import RenderableType

_W = "Workload"
_E = "Engine"
_R = "Run"
_O = "Output"


def e2e(
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="Tiny model, 2×2 prompts of 512+64 tokens, block 32 (about a minute); "
            "flags given explicitly still win.",
            rich_help_panel=_R,
        ),
    ] = False,
    prefixes: Annotated[
        int | None,
        typer.Option(
            "--prefixes", min=1, help="Shared prefixes, N (default 4).", rich_help_panel=_W
        ),
    ] = None,
    suffixes: Annotated[
        int | None,
        typer.Option(
            "--suffixes",
            min=1,
            help="Distinct suffixes per prefix, M (default 4).",
            rich_help_panel=_W,
        ),
    ] = None,
    prefix_tokens: Annotated[
        int | None,
        typer.Option(
            "--prefix-tokens", min=1, help="Tokens per prefix (default 1024).", rich_help_panel=_W
        ),
    ] = None,
    suffix_tokens: Annotated[
        int | None,
        typer.Option(
            "--suffix-tokens", min=0, help="Tokens per suffix (default 128).", rich_help_panel=_W
        ),
    ] = None,
    output_tokens: Annotated[
        int | None,
        typer.Option(
            "--output-tokens",
            min=1,
            help="Greedy tokens per request (default 16).",
            rich_help_panel=_W,
        ),
    ] = None,
    sequential: Annotated[
        bool,
        typer.Option(
            "--sequential",
            help="Send requests one at a time (default: all at once, one batch).",
            rich_help_panel=_W,
        ),
    ] = False,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the random prompts.", rich_help_panel=_W)
    ] = 0,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="PATH",
            help="Model directory (default: build the tiny 'bench' model, or 'tiny' with "
            "--quick, under --work-dir). With --url: the served model's name.",
            rich_help_panel=_E,
        ),
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(
            "--dtype",
            help="Model dtype (vLLM's auto runs fp32 checkpoints in bfloat16, slow on CPUs).",
            rich_help_panel=_E,
        ),
    ] = "float32",
    block_size: Annotated[
        int | None,
        typer.Option(
            "--block-size",
            help="Tokens per KV block, a multiple of 32 on CPU (default 128; 32 with --quick).",
            rich_help_panel=_E,
        ),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len",
            help="vLLM max_model_len (default: the longest request plus a block).",
            rich_help_panel=_E,
        ),
    ] = None,
    kv_cache_memory: Annotated[
        str | None,
        typer.Option(
            "--kv-cache-memory",
            metavar="SIZE",
            help="vLLM kv_cache_memory_bytes, e.g. 512MiB (default: room for every prompt "
            "of a pass, so the floor pass hits them all).",
            rich_help_panel=_E,
        ),
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-num-batched-tokens",
            help="Chunked-prefill budget per step (default: vLLM's).",
            rich_help_panel=_E,
        ),
    ] = None,
    warmup_tokens: Annotated[
        int | None,
        typer.Option(
            "--warmup-tokens",
            min=0,
            help="Unrelated warm-up request per process, untimed (default 512; 64 with --quick).",
            rich_help_panel=_E,
        ),
    ] = None,
    peer: Annotated[
        list[str] | None,
        typer.Option(
            "--peer",
            help="Also measure a peer: 'example' (vLLM's ExampleConnector) or 'lmcache' "
            "(LMCache's multiprocess server; only when lmcache is importable). Repeatable.",
            rich_help_panel=_R,
        ),
    ] = None,
    drop_page_cache: Annotated[
        bool,
        typer.Option(
            "--warm-dropped",
            help="Also run warm after dropping the store from the page cache.",
            rich_help_panel=_R,
        ),
    ] = False,
    warm_async: Annotated[
        bool,
        typer.Option(
            "--warm-async",
            help="Also run warm with connector.load_mode=async.",
            rich_help_panel=_R,
        ),
    ] = False,
    admission: Annotated[
        int,
        typer.Option(
            "--admission",
            metavar="N",
            help="Also compare connector.store_after_hits N with storing all, on two waves "
            "of repeated and one-off prompts: hit rate and bytes written (0: not run).",
            rich_help_panel=_R,
        ),
    ] = 0,
    repeats: Annotated[
        int,
        typer.Option(
            "--repeats",
            min=1,
            help="Repeat everything on new prompts and stores; samples are pooled.",
            rich_help_panel=_R,
        ),
    ] = 1,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            help="Time budget of the whole benchmark; what does not fit is skipped.",
            rich_help_panel=_R,
        ),
    ] = 1800.0,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            metavar="http://127.0.0.1:PORT",
            help="Drive this running OpenAI-compatible vLLM server (loopback only) instead "
            "of offline engines.",
            rich_help_panel=_R,
        ),
    ] = None,
    work_dir: Annotated[
        Path | None,
        typer.Option(
            "--work-dir",
            metavar="DIR",
            help="Model cache and the run's private stores (default: ~/.cache/hf3fsctl/bench-e2e).",
            rich_help_panel=_R,
        ),
    ] = None,
    keep: Annotated[
        bool,
        typer.Option(
            "--keep", help="Keep the run's stores (path in the JSON).", rich_help_panel=_R
        ),
    ] = False,
    json: JsonOpt = False,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json-out",
            metavar="PATH",
            help="Also write the JSON document here.",
            rich_help_panel=_O,
        ),
    ] = None,
    plot_path: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="PNG",
            help="Write TTFT and prefill throughput bars (floor and no connector as lines).",
            rich_help_panel=_O,
        ),
    ] = None,
) -> None:
    """End to end through vLLM: TTFT, throughput, hit rate vs no connector, peers and floor."""
    from hf3fsctl.bench import e2e as bench
    from hf3fsctl.config import parse_size
    from hf3fsctl.errors import ConfigError, InvalidRequest

    base = bench.quick_settings() if quick else bench.E2ESettings()
    w = base.workload
    workload = bench.Workload(
        prefixes=prefixes if prefixes is not None else w.prefixes,
        suffixes=suffixes if suffixes is not None else w.suffixes,
        prefix_tokens=prefix_tokens if prefix_tokens is not None else w.prefix_tokens,
        suffix_tokens=suffix_tokens if suffix_tokens is not None else w.suffix_tokens,
        output_tokens=output_tokens if output_tokens is not None else w.output_tokens,
    )
    try:
        kv_bytes = parse_size(kv_cache_memory, "--kv-cache-memory") if kv_cache_memory else None
    except ConfigError as exc:
        raise InvalidRequest(exc.message) from None
    settings = replace(
        base,
        workload=workload,
        model=model,
        dtype=dtype,
        block_size=block_size if block_size is not None else base.block_size,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        max_num_batched_tokens=max_num_batched_tokens,
        warmup_tokens=warmup_tokens if warmup_tokens is not None else base.warmup_tokens,
        peers=tuple(dict.fromkeys(p.strip().lower() for p in peer or [])),
        drop_page_cache=drop_page_cache,
        warm_async=warm_async,
        admission=admission,
        repeats=repeats,
        sequential=sequential,
        seed=seed,
        timeout_s=timeout,
        url=url,
        work_dir=work_dir,
        keep=keep,
        quick=quick,
    )
    if url:
        bench.check_loopback_url(url)  # refuse before anything starts
    if plot_path is not None:
        bench_output.require_plotting()
    document = bench.run(settings, progress=bench_output.progress_printer(not json))
    bench_output.publish(
        document,
        render=render,
        plot=plot,
        json_stdout=json,
        json_path=json_out,
        plot_path=plot_path,
    )


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{format(value, spec)}{suffix}"


def _step_cells(entry: dict[str, Any]) -> tuple[str, str]:
    """Our connector's CPU µs per engine step, "scheduler+worker", at p50 and p99."""
    sides = entry.get("connector_step_cpu")
    if not sides:
        return "-", "-"
    cells = []
    for key in ("p50_us", "p99_us"):
        values = [sides[side].get(key) for side in ("scheduler", "worker") if side in sides]
        cells.append("+".join(_fmt(v, ".0f") for v in values))
    return cells[0], cells[1]


def render(document: dict[str, Any]) -> RenderableType:
    """For people: the figures table, the ratios to the ceilings, goals and notes."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    w = document["workload"]
    engine = document["engine"]
    where = (
        f"server {engine['url']}"
        if document["mode"] == "url"
        else f"block {engine.get('block_size')}, {engine.get('dtype')}"
    )
    title = (
        f"e2e: {w['prefixes']} prefixes × {w['suffixes']} suffixes, {w['prefix_tokens']}+"
        f"{w['suffix_tokens']} prompt tokens, {w['output_tokens']} output tokens, "
        f"{w['arrival']}, {where}"
    )
    table = Table(title=title, title_justify="left", header_style="bold")
    columns = (
        "configuration",
        "TTFT p50",
        "TTFT p99",
        "p50 × floor",
        "conn µs/step p50",
        "p99",
        "hit rate",
        "prefill tok/s",
        "× none",
        "tok/s",
        "req/s",
        "outputs",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("configuration",) else "right")
    problems: list[Text] = []
    for name, entry in document["configurations"].items():
        label = f"{name} ({entry['label']})"
        if entry.get("status") != "ok":
            reason = entry.get("error") or entry.get("note") or ""
            last = reason.splitlines()[-1].removeprefix("[rank0]: ") if reason else ""
            table.add_row(label, Text(entry["status"], style="yellow"))
            problems.append(Text(f"{name} {entry['status']}: {last[:200]}", style="yellow"))
            continue
        r = entry.get("ratios", {})
        same = entry.get("outputs_match_none")
        table.add_row(
            label,
            _fmt(entry["ttft_p50_s"], ".3f", " s"),
            _fmt(entry["ttft_p99_s"], ".3f", " s"),
            _fmt(r.get("ttft_p50_over_floor"), ".2f", "×"),
            *_step_cells(entry),
            _fmt(None if entry["hit_rate"] is None else entry["hit_rate"] * 100, ".1f", "%"),
            _fmt(entry["prefill_tokens_per_s"], ",.0f"),
            _fmt(r.get("prefill_tokens_per_s_over_baseline"), ".2f", "×"),
            _fmt(entry["total_tokens_per_s"], ",.0f"),
            _fmt(entry["requests_per_s"], ".2f"),
            Text("same" if same else "DIFFER", style="green" if same else "bold red"),
        )
    out: list[RenderableType] = [table, *problems]
    ratios = Table.grid(padding=(0, 2))
    ratios.title = "ratios (ceilings measured in the same run)"
    ratios.title_justify = "left"
    ratios.add_column(style="bold")
    ratios.add_column()
    for kind, ceiling in document["ceiling"].items():
        if kind != "ratio":
            ratios.add_row(f"{kind} ceiling", ceiling)
    ratios.add_row(
        "conn µs/step",
        "our connector's CPU time in its calls on the engine thread per engine step, "
        "scheduler side + worker side (its own stats)",
    )
    for key, value in document["ratios"].items():
        if value is not None:
            ratios.add_row(key, f"{value:.3f}")
    for key, value in document["goals"].items():
        shown = "n/a" if value is None else ("met" if value else "NOT met")
        ratios.add_row(f"goal {key}", shown)
    out.append(ratios)
    if "admission" in document:
        from hf3fsctl.cli.bench_e2e_admission import render_admission

        out.append(render_admission(document["admission"]))
    for note in document.get("notes", []):
        out.append(Text(f"note: {note}", style="dim"))
    machine = document.get("machine", {})
    load = machine.get("load_average_1min")
    if load:
        out.append(
            Text(
                f"machine: {machine.get('cpus')} CPUs, 1-minute load average "
                f"{load['start']:.1f} at the start, {load['end']:.1f} at the end "
                f"(other work skews every figure); {document.get('seconds', 0):.0f} s in all",
                style="dim",
            )
        )
    return Group(*out)


def plot(document: dict[str, Any], path: Path) -> None:
    """A PNG at `path`: TTFT p50/p99 bars per configuration with the floor as a line, and
    prefill throughput bars with no connector (and the cold goal) as lines."""
    from hf3fsctl.bench.e2e import GOAL_COLD_PREFILL

    ok = {n: e for n, e in document["configurations"].items() if e.get("status") == "ok"}
    names = list(ok)
    xs = list(range(len(names)))
    fig = bench_output.figure(13, 5.2)
    ax_ttft, ax_tput = fig.subplots(1, 2)
    width = 0.38
    p50 = [ok[n]["ttft_p50_s"] for n in names]
    p99 = [ok[n]["ttft_p99_s"] for n in names]
    ax_ttft.bar([x - width / 2 for x in xs], p50, width, label="p50")
    ax_ttft.bar([x + width / 2 for x in xs], p99, width, label="p99")
    for floor, style in (("floor", "-"), ("floor-mp", ":"), ("server-repeat", "-")):
        if floor in ok:
            ax_ttft.axhline(
                ok[floor]["ttft_p50_s"],
                color="black",
                linestyle=style,
                linewidth=1,
                label=f"{floor} p50 (the ceiling)",
            )
    ax_ttft.set_yscale("log")
    if p50:
        ax_ttft.set_ylim(bottom=min(p50) / 2)
    ax_ttft.set_ylabel("time to first token (s, log scale)")
    ax_ttft.set_title("TTFT per configuration")
    tput = [ok[n]["prefill_tokens_per_s"] or 0.0 for n in names]
    ax_tput.bar(xs, tput, color="tab:green")
    for base, style in (("none", "-"), ("none-mp", ":"), ("server", "-")):
        value = ok.get(base, {}).get("prefill_tokens_per_s")
        if value:
            ax_tput.axhline(value, color="black", linestyle=style, linewidth=1, label=base)
            ax_tput.axhline(
                value * GOAL_COLD_PREFILL,
                color="tab:red",
                linestyle=style,
                linewidth=0.8,
                label=f"{base} × {GOAL_COLD_PREFILL:.0%} (the cold goal)",
            )
    ax_tput.set_yscale("log")
    if any(tput):
        ax_tput.set_ylim(bottom=min(t for t in tput if t) / 2)
    ax_tput.set_ylabel("prompt tokens per second of prefill (log scale)")
    ax_tput.set_title("prefill throughput")
    for ax in (ax_ttft, ax_tput):
        ax.set_xticks(xs, names, rotation=30, ha="right")
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=8)
    missing = [f"{n} {e['status']}" for n, e in document["configurations"].items() if n not in ok]
    if missing:
        fig.text(0.01, 0.005, "not shown: " + ", ".join(missing), fontsize=8, color="tab:red")
    w = document["workload"]
    fig.suptitle(
        f"hf3fsctl bench e2e: {w['prefixes']}×{w['suffixes']} prompts of "
        f"{w['prefix_tokens']}+{w['suffix_tokens']} tokens, {w['output_tokens']} out, "
        f"{w['arrival']}"
    )
    bench_output.save(fig, Path(path))
