"""`hf3fsctl evict`: free space by namespace, age, target usage, count, or all.

At least one criterion (`--older-than`, `--target-usage`, `--max-entries`, `--all`) is
required; `--namespace` narrows any of them. Criteria combine (AND), as in
`EvictRequest`. Without `--dry-run` or `--yes` it shows what would go and asks at a
terminal; when nobody is at a terminal it refuses. Evicted pages still under a read
lease are not reused until the lease ends (the store guarantees it).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import (
    ConfigOpt,
    DryRunOpt,
    JsonOpt,
    NamespaceOpt,
    YesOpt,
    parse_duration,
)
from hf3fsctl.errors import InvalidRequest

if TYPE_CHECKING:
    from hf3fsctl.meta.models import EvictResult


def show_result(result: EvictResult) -> None:
    """What was (or would be) evicted, for people."""
    from hf3fsctl.config import format_size

    verb = "would evict" if result.dry_run else "evicted"
    output.line(
        f"{verb} {result.keys} keys, {result.pages} pages, {format_size(result.bytes)}",
        style="bold",
    )
    if result.by_namespace:
        rows = [[ns, keys] for ns, keys in sorted(result.by_namespace.items())]
        output.show(output.table(["namespace", "keys"], rows, right=("keys",)))


def confirm_or_refuse(what: str) -> None:
    """Ask at a terminal; refuse when stdin is not one. Raises typer.Abort on 'no'."""
    if not sys.stdin.isatty():
        raise InvalidRequest(
            f"refusing to {what} without confirmation: stdin is not a terminal",
            hint="pass --yes to confirm, or --dry-run to only see what would go",
        )
    typer.confirm(f"{what[0].upper()}{what[1:]}?", abort=True, err=True)


def evict(
    ctx: typer.Context,
    config: ConfigOpt = None,
    namespace: NamespaceOpt = None,
    older_than: Annotated[
        float | None,
        typer.Option(
            "--older-than",
            parser=parse_duration,
            metavar="DURATION",
            help="Entries last used longer ago than this (90s, 30m, 2h, 7d).",
        ),
    ] = None,
    target_usage: Annotated[
        float | None,
        typer.Option(
            "--target-usage",
            min=0.0,
            max=1.0,
            metavar="FRACTION",
            help="Evict least recently used entries until usage is at most this (0.5).",
        ),
    ] = None,
    max_entries: Annotated[
        int | None, typer.Option("--max-entries", min=0, help="Evict at most N keys.")
    ] = None,
    everything: Annotated[
        bool, typer.Option("--all", help="Evict every entry (of --namespace, if given).")
    ] = False,
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    json: JsonOpt = False,
) -> None:
    """Free space: evict entries by namespace, age, target usage, count or all."""
    from hf3fsctl.meta.models import EvictRequest

    if older_than is None and target_usage is None and max_entries is None and not everything:
        raise InvalidRequest(
            "evict needs a criterion",
            hint="pass --older-than, --target-usage, --max-entries or --all "
            "(with --namespace to narrow it); add --dry-run to preview",
        )
    cfg = context.load(ctx, config)
    with context.open_client(cfg) as client:
        request = EvictRequest(
            namespace=context.resolve_namespace(client, namespace),
            older_than_s=older_than,
            target_usage=target_usage,
            max_entries=max_entries,
            all=everything,
            dry_run=True,
        )
        if not dry_run and not yes:
            preview = client.evict(request)
            if preview.keys == 0:
                result = preview
            else:
                if not json:
                    show_result(preview)
                confirm_or_refuse(f"evict {preview.keys} keys")
                result = client.evict(request.model_copy(update={"dry_run": False}))
        else:
            result = client.evict(request.model_copy(update={"dry_run": dry_run}))
    if json:
        output.print_json(result.model_dump())
    else:
        show_result(result)
