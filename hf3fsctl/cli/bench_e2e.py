"""`hf3fsctl bench e2e`: a prefix-repetition workload through real vLLM, against its ceilings.

Thin over `hf3fsctl.bench.e2e` (which says what is measured and how): parse the flags,
run, then print the Rich table (or one JSON document with `--json`), and optionally write
the JSON to a file and a PNG. Progress goes to stderr. vLLM runs only in child processes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from hf3fsctl.cli.options import JsonOpt

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
    from hf3fsctl.bench import report
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
        report.require_plotting()
    document = bench.run(settings, progress=report.progress_printer(not json))
    report.publish(
        document,
        render=bench.render,
        plot=bench.plot,
        json_stdout=json,
        json_path=json_out,
        plot_path=plot_path,
    )
