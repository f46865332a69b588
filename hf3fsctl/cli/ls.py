"""`hf3fsctl ls`: list stored entries, most recently used first.

One row per (key, rank) entry: namespace, key prefix, rank, page, size, state
(committed/pending), hits and the age of the last access. `--json` prints the entries
in full (whole keys, checksums, timestamps).
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt, JsonOpt, NamespaceOpt

KEY_PREFIX_CHARS = 16


def ls(
    ctx: typer.Context,
    config: ConfigOpt = None,
    namespace: NamespaceOpt = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Show at most N entries.")] = 50,
    json: JsonOpt = False,
) -> None:
    """List entries: key, rank, page, size, state, hits, last access."""
    from hf3fsctl.config import format_size

    cfg = context.load(ctx, config)
    with context.open_client(cfg) as client:
        ns = context.resolve_namespace(client, namespace)
        entries = client.list_entries(ns, limit=limit)
    if json:
        output.print_json({"entries": [entry.model_dump() for entry in entries]})
        return
    now = time.time()
    rows = [
        [
            entry.namespace,
            entry.key[:KEY_PREFIX_CHARS],
            entry.rank,
            entry.page,
            format_size(entry.size),
            entry.state,
            entry.depth,
            entry.hits,
            output.format_age(now - entry.last_access),
        ]
        for entry in entries
    ]
    output.show(
        output.table(
            ["namespace", "key", "rank", "page", "size", "state", "depth", "hits", "last use"],
            rows,
            right=("rank", "page", "size", "depth", "hits", "last use"),
        )
    )
    if len(entries) == limit:
        output.info(f"showing the first {limit}; pass --limit for more")
