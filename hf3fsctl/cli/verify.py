"""`hf3fsctl verify`: prove that the store holds the model's KV for a prompt set.

Thin over `hf3fsctl.offline.verify`: the prompt set is planned as `warm` plans it (same
engine args: the config's `vllm:` section < `--engine-args-file` < flags), the prompts
with stored blocks are recomputed by vLLM with the connector in capture mode (nothing
loaded, nothing saved), and each stored page is compared with its recomputed twin:
`identical`, `other numerics` (rounding-level differences: written by an engine with
other numerics; a warning), `wrong` (another page's content) or `corrupt` (its checksum
fails). A progress bar shows the comparison; `--json` prints one document. `--fix`
invalidates the wrong and corrupt entries (they become misses, recomputed and saved
again by the next engine that needs them).

Exit codes: 0 when no page is wrong or corrupt (also with other numerics), 1 when any is
(with `--fix` too: the exit says what was found, the output what was fixed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.errors import EXIT_CHECK_FAILED
from hf3fsctl.cli.options import (
    BlockSizeOpt,
    ConfigOpt,
    FormatOpt,
    JsonOpt,
    ModelOpt,
    NamespaceOpt,
    PromptsOpt,
)
from hf3fsctl.cli.prompt_set import read_prompt_set
from hf3fsctl.cli.warm import (
    EngineArgOpt,
    EngineArgsFileOpt,
    FlagDtypeOpt,
    engine_args_of,
    plan_or_show_candidates,
    quiet_vllm_logs,
)

if TYPE_CHECKING:
    from hf3fsctl.offline.verify import VerifyReport

LABELS = {
    "identical": "identical",
    "other_numerics": "other numerics",
    "wrong": "WRONG",
    "corrupt": "CORRUPT",
}


def verify(
    ctx: typer.Context,
    model: ModelOpt,
    prompts: PromptsOpt = None,
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", "-p", help="A prompt (repeatable).")
    ] = None,
    format: FormatOpt = "auto",
    dtype: FlagDtypeOpt = None,
    block_size: BlockSizeOpt = None,
    kv_cache_memory: Annotated[
        str | None,
        typer.Option("--kv-cache-memory", metavar="SIZE", help="vLLM's KV cache size (e.g. 4GiB)."),
    ] = None,
    engine_args_file: EngineArgsFileOpt = None,
    engine_arg: EngineArgOpt = None,
    namespace: NamespaceOpt = None,
    fix: Annotated[
        bool, typer.Option("--fix", help="Invalidate the wrong and corrupt entries.")
    ] = False,
    config: ConfigOpt = None,
    json: JsonOpt = False,
) -> None:
    """Recompute a prompt set's KV with vLLM and compare it with the stored pages."""
    from hf3fsctl.config import parse_size
    from hf3fsctl.config.connector import kv_transfer_config
    from hf3fsctl.offline.engine_args import engine_options
    from hf3fsctl.offline.verify import fix_pages, run_verify, stored_items
    from hf3fsctl.storage.factory import open_engine

    cfg = context.load(ctx, config)
    flags = {
        "dtype": dtype,
        "block_size": block_size,
        "kv_cache_memory_bytes": parse_size(kv_cache_memory, "--kv-cache-memory")
        if kv_cache_memory
        else None,
    }
    args = engine_args_of(cfg, engine_args_file, flags, engine_arg)
    options = engine_options(model, args)
    items, problems = read_prompt_set(prompts, prompt, format)
    with context.open_client(cfg) as client:
        plan = plan_or_show_candidates(client, model, items, problems, options, namespace)
        document: dict[str, Any] = {"engine_args": args.to_dict()}
        if not stored_items(plan):
            document["message"] = "nothing of these prompts is stored: nothing to verify"
            document["result"] = None
            _finish(document, json)
            return
        quiet_vllm_logs()
        with output.progress(not json) as bar:
            task = bar.add_task("recomputing with vLLM (capture mode)", total=None)

            def engine_done(pages: int) -> None:
                bar.reset(task, description="comparing pages", total=pages)

            with output.stdout_to_stderr(json):
                report = run_verify(
                    client,
                    plan,
                    options,
                    kv_transfer_config(cfg),
                    cfg.storage.path,
                    lambda: open_engine(
                        cfg.storage.engine, io_threads=cfg.storage.io_threads, root=cfg.storage.path
                    ),
                    on_engine=engine_done,
                    on_progress=lambda n: bar.advance(task, n),
                )
        if fix:
            report.fixed = fix_pages(client, report)
    document["result"] = report.to_dict()
    _finish(document, json, report)
    counts = report.counts()
    if counts["wrong"] or counts["corrupt"]:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _finish(document: dict[str, Any], json: bool, report: VerifyReport | None = None) -> None:
    if json:
        output.print_json(document)
        return
    if report is None:
        output.line(document.get("message", ""), style="bold")
        return
    counts = report.counts()
    figures = report.figures()
    rows: dict[str, Any] = {
        "namespaces": ", ".join(report.namespaces) or "-",
        **{LABELS[v]: n for v, n in counts.items()},
        "captured, not stored": report.not_stored,
    }
    if figures:
        rows["mean |Δ| / mean |x|"] = (
            f"{figures['rel_diff_mean']:.3g} mean, {figures['rel_diff_max']:.3g} max"
        )
        rows["max |Δ|"] = f"{figures['max_abs_max']:.3g}"
        rows["min correlation"] = f"{figures['correlation_min']:.4f}"
    if report.fixed is not None:
        rows["invalidated (--fix)"] = report.fixed
    output.show(output.key_values(rows, title="verify"))
    output.show(output.key_values(report.numerics, title="numerics (the recomputing engine's)"))
    bad = report.worst("wrong") + report.worst("corrupt")
    if bad:
        output.show(
            output.table(
                ["namespace", "key", "verdict", "mean |Δ|/|x|", "correlation"],
                [
                    [
                        p.namespace,
                        p.key[:16] + "…",
                        LABELS[p.verdict],
                        f"{p.rel_diff:.3g}",
                        f"{p.correlation:.3f}",
                    ]
                    for p in bad
                ],
                title="pages that are not the model's KV",
            )
        )
    if counts["other_numerics"]:
        output.warning(
            f"{counts['other_numerics']} pages were computed with other numerics than this "
            "engine's (compiled vs eager, another attention backend or device): loads give "
            "KV that can change greedy tokens; run warm and serving with the same args "
            "(config vllm:), or set connector.strict_numerics: true"
        )
    if counts["wrong"] or counts["corrupt"]:
        fix = "" if report.fixed is not None else "; `hf3fsctl verify --fix` invalidates them"
        output.warning(
            f"{counts['wrong'] + counts['corrupt']} pages are not the model's KV for their "
            f"keys{fix}"
        )
