"""`hf3fsctl lookup`: how much of each prompt is cached — what the next vLLM run will load.

No engine starts: prompts are tokenized as vLLM does, their block keys recomputed
offline, and the store asked (`hf3fsctl.offline.lookup`). The namespace is the one the
model (its content fingerprint), `--dtype`, `--block-size` and `--tensor-parallel-size`
(else the config's `vllm:` section, the serving engines' args warm also takes)
fit; when several do, they are listed and `--namespace` picks one. `--json` prints
`{"namespace": …, "prompts": [{"origin", "tokens", "cached_tokens", "fraction", …}],
"totals": {…}, "malformed": […]}`, prompts in input order.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import (
    BlockSizeOpt,
    ConfigOpt,
    DtypeOpt,
    FormatOpt,
    JsonOpt,
    ModelOpt,
    NamespaceOpt,
    PromptsOpt,
    TensorParallelOpt,
)
from hf3fsctl.cli.prompt_set import read_prompt_set, show_candidates


def lookup(
    ctx: typer.Context,
    model: ModelOpt,
    prompt: Annotated[
        list[str] | None,
        typer.Option("--prompt", "-p", help="A prompt (repeatable)."),
    ] = None,
    prompts: PromptsOpt = None,
    format: FormatOpt = "auto",
    dtype: DtypeOpt = "auto",
    block_size: BlockSizeOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    namespace: NamespaceOpt = None,
    config: ConfigOpt = None,
    json: JsonOpt = False,
) -> None:
    """Show how much of each prompt is cached (what the next vLLM run loads), no engine."""
    from hf3fsctl.offline.engine_args import engine_options, resolve_engine_args
    from hf3fsctl.offline.lookup import lookup_prompts
    from hf3fsctl.offline.namespaces import AmbiguousNamespace, resolve_namespace
    from hf3fsctl.offline.prompts import token_ids
    from hf3fsctl.prompt_keys import load_tokenizer

    cfg = context.load(ctx, config)
    items, problems = read_prompt_set(prompts, prompt, format)
    # The serving engines' args (the config's vllm: section, as warm takes them) decide
    # the namespace; a flag given here wins.
    flags = {
        "dtype": None if dtype == "auto" else dtype,
        "block_size": block_size,
        "tensor_parallel_size": None if tensor_parallel_size == 1 else tensor_parallel_size,
    }
    query = engine_options(model, resolve_engine_args(cfg.vllm, None, flags)).query()
    # Reads only (as `stats` and `ls`): works on a read-only mount, and an operator's
    # question is not counted among the engines' lookups.
    with context.open_client(cfg, read_only=True) as client:
        try:
            info = resolve_namespace(client.namespaces(), query, namespace)
        except AmbiguousNamespace as exc:
            show_candidates(exc)
            raise
        if info is None and not json:
            output.warning(f"no registered namespace fits {query.describe()}: nothing is cached")
        tokenizer = load_tokenizer(model)
        started = time.perf_counter()
        tokenized = [(item.origin, token_ids(tokenizer, item)) for item in items]
        results = lookup_prompts(
            client, info, tokenized, min_hit_blocks=cfg.connector.min_hit_blocks
        )
        elapsed = time.perf_counter() - started
    tokens = sum(r.tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    totals: dict[str, Any] = {
        "prompts": len(results),
        "tokens": tokens,
        "cached_tokens": cached,
        "fraction": cached / tokens if tokens else 0.0,
        "fully_cached": sum(1 for r in results if r.blocks and r.stored_blocks >= r.blocks),
        "seconds": elapsed,
        "prompts_per_s": len(results) / elapsed if elapsed > 0 else 0.0,
    }
    if json:
        output.print_json(
            {
                "namespace": info.id if info else None,
                "prompts": [r.to_dict() for r in results],
                "totals": totals,
                "malformed": [{"origin": p.origin, "reason": p.reason} for p in problems],
            }
        )
        return
    rows = [
        [r.origin, r.tokens, r.cached_tokens, f"{r.fraction:.0%}", f"{r.stored_blocks}/{r.blocks}"]
        for r in results
    ]
    title = f"namespace {info.id}" if info else "no namespace"
    output.show(
        output.table(
            ["prompt", "tokens", "cached", "share", "blocks stored"],
            rows,
            title=title,
            right=("tokens", "cached", "share", "blocks stored"),
        )
    )
    output.line(
        f"{cached} of {tokens} prompt tokens cached ({totals['fraction']:.0%}) in "
        f"{len(results)} prompts; looked up at {totals['prompts_per_s']:.0f} prompts/s"
    )
