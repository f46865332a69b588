"""`hf3fsctl warm`: prefill a prompt set into the cache before traffic arrives.

Plans without an engine (`hf3fsctl.offline.warm.plan_warm`): prompts already fully
cached are skipped, prompts longer than `--max-model-len` and malformed lines are
reported and skipped; `--dry-run` stops there and shows the plan (prompts, tokens, new
blocks, bytes, what is cached, whether it fits the store's free capacity). When nothing
is left, no engine starts. Otherwise vLLM runs offline with the connector of this
configuration (`hf3fsctl vllm-config`), so the pages land in the namespace a `vllm
serve` with the same options will hit; a progress bar shows prompts, tokens/s, bytes
written and the time left, and a summary (table, or one JSON document with `--json`)
what was done. Ctrl-C stops it: what was committed stays valid, a re-run does the rest
(exit 130).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.errors import EXIT_INTERRUPTED
from hf3fsctl.cli.options import (
    BlockSizeOpt,
    ConfigOpt,
    DryRunOpt,
    FormatOpt,
    JsonOpt,
    ModelOpt,
    NamespaceOpt,
    PromptsOpt,
)
from hf3fsctl.cli.prompt_set import read_prompt_set, show_candidates

if TYPE_CHECKING:
    from hf3fsctl.offline.engine_args import EngineArgs
    from hf3fsctl.offline.warm import WarmPlan, WarmProgress

EngineArgsFileOpt = Annotated[
    str | None,
    typer.Option(
        "--engine-args-file",
        metavar="FILE",
        help="The serving engines' args: the YAML/JSON file `vllm serve --config` reads "
        "(over the config's vllm: section; flags win).",
    ),
]
EngineArgOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-arg", metavar="KEY=VALUE", help="Any other vllm.LLM argument (repeatable)."
    ),
]
FlagDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype", help="vLLM --dtype (auto, float16, bfloat16, float32); default: the config's."
    ),
]
FlagTensorParallelOpt = Annotated[
    int | None,
    typer.Option("--tensor-parallel-size", "-tp", min=1, help="vLLM's tensor parallel size."),
]


def engine_args_of(
    cfg: Any, engine_args_file: str | None, flags: dict[str, Any], pairs: list[str] | None
) -> EngineArgs:
    """The serving engines' args (config `vllm:` < file < flags), for warm and verify."""
    from hf3fsctl.offline.engine_args import parse_engine_arg_pairs, resolve_engine_args

    return resolve_engine_args(
        cfg.vllm, engine_args_file, {**flags, **parse_engine_arg_pairs(pairs)}
    )


def plan_or_show_candidates(
    client: Any, model: str, items: Any, problems: Any, options: Any, namespace: str | None
) -> Any:
    """warm's plan of a prompt set (for warm and verify); when several namespaces fit,
    they are listed before `AmbiguousNamespace` goes on to the error mapping."""
    from hf3fsctl.offline.namespaces import AmbiguousNamespace
    from hf3fsctl.offline.warm import plan_warm
    from hf3fsctl.prompt_keys import load_tokenizer

    try:
        return plan_warm(
            client, load_tokenizer(model), items, problems, options, namespace=namespace
        )
    except AmbiguousNamespace as exc:
        show_candidates(exc)
        raise


def _plan_rows(summary: dict[str, Any]) -> dict[str, Any]:
    from hf3fsctl.config import format_size

    fits = {True: "yes", False: "NO", None: "unbounded store"}[summary["fits"]]
    return {
        "namespace": summary["namespace"] or "not registered yet (the engine will create it)",
        "prompts": summary["prompts"],
        "to warm": f"{summary['to_warm']} prompts, {summary['to_warm_tokens']} tokens",
        "already cached": f"{summary['already_cached']} prompts "
        f"({summary['cached_blocks']} blocks)",
        "shorter than a block": summary["shorter_than_a_block"],
        "too long": len(summary["too_long"]),
        "malformed": len(summary["malformed"]),
        "new blocks": summary["new_blocks"],
        "bytes to write": format_size(summary["new_bytes"])
        + (" (estimated)" if summary["block_bytes_estimated"] else ""),
        "store free": "-"
        if summary["store_free_bytes"] is None
        else format_size(summary["store_free_bytes"]),
        "fits": fits,
    }


def warm(
    ctx: typer.Context,
    model: ModelOpt,
    prompts: PromptsOpt = None,
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", "-p", help="A prompt (repeatable).")
    ] = None,
    format: FormatOpt = "auto",
    dtype: FlagDtypeOpt = None,
    block_size: BlockSizeOpt = None,
    max_model_len: Annotated[
        int | None, typer.Option("--max-model-len", min=1, help="vLLM --max-model-len.")
    ] = None,
    tensor_parallel_size: FlagTensorParallelOpt = None,
    kv_cache_memory: Annotated[
        str | None,
        typer.Option("--kv-cache-memory", metavar="SIZE", help="vLLM's KV cache size (e.g. 4GiB)."),
    ] = None,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(
            "--gpu-memory-utilization",
            metavar="SHARE",
            callback=_gpu_share,
            help="vLLM's share of GPU memory (0.01-1), on GPUs.",
        ),
    ] = None,
    engine_args_file: EngineArgsFileOpt = None,
    engine_arg: EngineArgOpt = None,
    namespace: NamespaceOpt = None,
    dry_run: DryRunOpt = False,
    config: ConfigOpt = None,
    json: JsonOpt = False,
) -> None:
    """Prefill prompts into the cache (vLLM offline, one output token), skipping what is cached."""
    from hf3fsctl.cli.init import check_writable
    from hf3fsctl.config import parse_size
    from hf3fsctl.offline.engine_args import engine_options
    from hf3fsctl.storage.layout import root_problem

    cfg = context.load(ctx, config)
    flags = {
        "dtype": dtype,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "tensor_parallel_size": tensor_parallel_size,
        "kv_cache_memory_bytes": parse_size(kv_cache_memory, "--kv-cache-memory")
        if kv_cache_memory
        else None,
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    args = engine_args_of(cfg, engine_args_file, flags, engine_arg)
    options = engine_options(model, args)
    items, problems = read_prompt_set(prompts, prompt, format)
    with context.open_client(cfg) as client:
        plan = plan_or_show_candidates(client, model, items, problems, options, namespace)
        for item in plan.by_status("too_long"):
            output.warning(
                f"{item.origin}: {item.tokens} tokens, longer than max_model_len "
                f"{plan.max_model_len} (skipped)"
            )
        document: dict[str, Any] = {
            "plan": plan.summary(),
            "dry_run": dry_run,
            "engine_args": args.to_dict(),
        }
        if dry_run or not plan.by_status("todo"):
            if not dry_run:
                document["result"] = None
                document["message"] = "nothing to do: every prompt is cached; no engine started"
            _finish(document, plan, json)
            return
        # Before an engine starts (a minute on a large model): a root it cannot write
        # would only end as an engine that saved nothing. A missing root the connector
        # makes inside an existing directory: that one must be writable.
        root = Path(cfg.storage.path)
        problem = root_problem(root, creatable=True)
        if problem is not None:
            raise problem
        check_writable(root if root.is_dir() else root.parent)
        if plan.fits is False and not json:
            output.warning(
                "the new blocks are more than the store's free capacity: older entries "
                "will be evicted (least recently used first) to make room"
            )
        _run(cfg, client, plan, options, document, json)


def _gpu_share(value: float | None) -> float | None:
    """`--gpu-memory-utilization` within 0.01-1 (checked here, not with `min`/`max`, whose
    range Typer's help prints in the type column and which then cuts option names at 80
    columns)."""
    if value is not None and not 0.01 <= value <= 1.0:
        raise typer.BadParameter(f"{value:g} is not a share between 0.01 and 1")
    return value


def quiet_vllm_logs() -> str:
    """Keep vLLM's log lines from drowning the progress bar: vLLM logs errors only, unless
    `-v` (then info) or `VLLM_LOGGING_LEVEL` says otherwise. hf3fsctl's own warnings
    (a degraded or disabled cache) stay visible. Returns the level vLLM logs at.

    Set in the environment, so the engine's worker processes inherit it, and on the
    `vllm` logger, for a vLLM this process has imported already.
    """
    import logging
    import os

    verbose = logging.getLogger().getEffectiveLevel() <= logging.INFO
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    logging.getLogger("vllm").setLevel(level.upper())
    return level


def _run(
    cfg: Any, client: Any, plan: WarmPlan, options: Any, document: dict[str, Any], json: bool
) -> None:
    from hf3fsctl.config.connector import kv_transfer_config
    from hf3fsctl.offline.warm import WarmInterrupted, run_warm

    todo = plan.by_status("todo")
    total_tokens = sum(item.tokens for item in todo)
    quiet_vllm_logs()
    with output.progress(not json) as bar:
        task = bar.add_task("starting vLLM", total=len(todo))
        prefill_started = [time.monotonic()]

        def engine_up(count: int) -> None:
            prefill_started[0] = time.monotonic()
            bar.reset(task, description="prefilling", total=count)

        def advance(progress: WarmProgress) -> None:
            elapsed = time.monotonic() - prefill_started[0]
            rate = progress.tokens / elapsed if elapsed > 0 else 0.0
            bar.update(
                task,
                completed=progress.prompts,
                description=f"prefilling {rate:,.0f} tok/s, "
                f"{progress.bytes_saved / 1e9:.2f} GB written, "
                f"{progress.tokens}/{total_tokens} tokens",
            )

        try:
            with output.stdout_to_stderr(json):  # `--json`: one document, nothing else
                result = run_warm(
                    client,
                    plan,
                    options,
                    kv_transfer_config(cfg),
                    on_progress=advance,
                    on_engine=engine_up,
                )
        except WarmInterrupted as stop:
            document["result"] = stop.result.to_dict()
            document["interrupted"] = True
            _finish(document, plan, json)
            output.warning(
                "interrupted: what was saved is committed and valid; run warm again for the rest"
            )
            sys.exit(EXIT_INTERRUPTED)
    document["result"] = result.to_dict()
    _finish(document, plan, json)


def _finish(document: dict[str, Any], plan: WarmPlan, json: bool) -> None:
    from hf3fsctl.config import format_size

    if json:
        output.print_json(document)
        return
    output.show(output.key_values(_plan_rows(document["plan"]), title="warm plan"))
    if document["engine_args"]:
        output.show(output.key_values(_shown_args(document["engine_args"]), title="engine args"))
    result = document.get("result")
    if result is None:
        if document.get("message"):
            output.line(document["message"], style="bold")
        return
    failures = ", ".join(f"{k} {v}" for k, v in result["save_failures"].items()) or "none"
    output.show(
        output.key_values(
            {
                "namespace": result["namespace"],
                "prompts prefilled": result["prompts"],
                "tokens": result["tokens"],
                "found cached once the engine was up": result["skipped_after_start"],
                "blocks written": result["blocks_saved"],
                "bytes written": format_size(result["bytes_saved"]),
                "write GB/s": f"{result['gb_per_s']:.2f}",
                "prefill tokens/s": f"{result['tokens_per_s']:,.0f}",
                "save failures": failures,
                "engine start": f"{result['engine_start_s']:.1f} s",
                "wall time": f"{result['wall_s']:.1f} s",
            },
            title="warm result",
        )
    )
    if result.get("numerics"):
        output.show(output.key_values(result["numerics"], title="numerics (the engine's)"))
    if result.get("dropped_args"):
        output.warning(
            "not engine args, left to `vllm serve`: " + ", ".join(result["dropped_args"])
        )


def _shown_args(engine_args: dict[str, Any]) -> dict[str, str]:
    from hf3fsctl.offline.engine_args import EngineArgs

    merged = EngineArgs(
        {k: v["value"] for k, v in engine_args.items()},
        {k: v["source"] for k, v in engine_args.items()},
    )
    return merged.shown()
