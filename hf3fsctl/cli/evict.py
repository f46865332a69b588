"""`hf3fsctl evict`: free space by namespace, age, target usage, count, or all; or drop
stale namespaces.

At least one criterion (`--older-than`, `--target-usage`, `--max-entries`, `--all`) is
required; `--namespace` narrows any of them. Criteria combine (AND), as in
`EvictRequest`. Pinned keys are left alone unless `--include-pinned`. Without
`--dry-run` or `--yes` it shows what would go and asks at a terminal; when nobody is at
a terminal it refuses. Evicted pages still under a read lease are not reused until the
lease ends (the store guarantees it).

`--stale` instead removes whole namespaces, metadata and page files: those unused
(no registration, lookup, save or load) for `--unused-for` (default 7d), and those whose
model is a local directory (its recorded revision is a content fingerprint) that now
fingerprints differently, so its pages can never be loaded again. A model directory
that is not found here is not judged by fingerprint (it may live on another node; a
relative path is taken from the current directory), and the listing says so. A stale
namespace holding pins is kept unless `--include-pinned` (or its model changed).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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
from hf3fsctl.errors import InvalidRequest, StorageError

if TYPE_CHECKING:
    from hf3fsctl.config import Config
    from hf3fsctl.meta.models import EvictResult, NamespaceStats

DEFAULT_UNUSED_FOR_S = 7 * 86400.0


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


# --- stale namespaces ----------------------------------------------------------------


def fingerprint_check(manifest: dict[str, Any]) -> tuple[str | None, str | None]:
    """`(why the namespace is stale, a note)` from its model directory's fingerprint.

    Only a namespace whose recorded revision is a local fingerprint (`local-…`, or
    `REV+local-…`) is judged: its model directory is fingerprinted again here
    (`keys.model_revision`). A directory not found here gives a note, not a verdict.
    """
    from hf3fsctl.keys import model_revision

    model, recorded = manifest.get("model"), manifest.get("revision")
    if not isinstance(model, str) or not isinstance(recorded, str):
        return None, None
    head, sep, _ = recorded.rpartition("+local-")
    if not sep and not recorded.startswith("local-"):
        return None, None  # a hub revision: nothing to fingerprint
    if not Path(model).is_dir():
        return None, f"model directory {model} not found here: fingerprint not checked"
    try:
        current = model_revision(model, head if sep else None)
    except OSError as exc:
        return None, f"cannot fingerprint {model}: {exc.strerror or exc}"
    if current != recorded:
        return f"model changed (now {current}, recorded {recorded})", None
    return None, None


def stale_rows(
    namespaces: list[NamespaceStats], unused_for: float, include_pinned: bool, now: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`(stale, unchecked)`: one row per stale namespace, and the fresh ones whose model
    directory could not be fingerprinted here (with the note why)."""
    stale: list[dict[str, Any]] = []
    unchecked: list[dict[str, Any]] = []
    for ns in namespaces:
        model = str(ns.manifest.get("model", "-"))
        changed, note = fingerprint_check(ns.manifest)
        reasons = [changed] if changed else []
        if ns.last_used < now - unused_for:
            reasons.append(f"unused for {output.format_age(now - ns.last_used)}")
        if not reasons:
            if note:
                unchecked.append({"id": ns.id, "model": model, "note": note})
            continue
        kept = None
        if ns.pinned_keys and not include_pinned and not changed:
            kept = f"holds {ns.pinned_keys} pinned keys (pass --include-pinned)"
        stale.append(
            {
                "id": ns.id,
                "model": model,
                "reasons": reasons,
                "note": note,
                "last_used": ns.last_used,
                "keys": ns.keys,
                "bytes": ns.bytes_used,
                "skipped": kept,
                "removed": False,
                "bytes_freed": None,
                "error": None,
            }
        )
    return stale, unchecked


def show_stale(document: dict[str, Any]) -> None:
    """The stale namespaces that were (or would be) removed, for people."""
    from hf3fsctl.config import format_size

    dry_run = document["dry_run"]
    verb = "would remove" if dry_run else "removed"
    summary = (
        f"{verb} {document['removed']} stale namespaces: {document['keys']} keys, "
        f"{format_size(document['bytes'])}"
    )
    if not dry_run and document["removed"]:
        summary += f" ({format_size(document['bytes_freed'])} of disk returned)"
    output.line(summary, style="bold")
    if document["namespaces"]:
        rows = []
        for row in document["namespaces"]:
            if row["error"]:
                status = f"error: {row['error']}"
            elif row["skipped"]:
                status = f"kept: {row['skipped']}"
            else:
                status = "removed" if row["removed"] else verb
            reason = "; ".join([*row["reasons"], *([row["note"]] if row["note"] else [])])
            rows.append(
                [row["id"], row["model"], reason, row["keys"], format_size(row["bytes"]), status]
            )
        output.show(
            output.table(
                ["namespace", "model", "reason", "keys", "size", "status"],
                rows,
                right=("keys", "size"),
            )
        )
    for row in document["unchecked"]:
        output.info(f"namespace {row['id']}: {row['note']}")


def evict_stale(
    cfg: Config,
    namespace: str | None,
    unused_for: float,
    *,
    include_pinned: bool,
    dry_run: bool,
    yes: bool,
    json: bool,
) -> None:
    """`evict --stale`: find stale namespaces, drop their metadata, remove their files."""
    from hf3fsctl.config import format_size
    from hf3fsctl.storage.layout import remove_namespace_files

    with context.open_client(cfg) as client:
        only = context.resolve_namespace(client, namespace)
        namespaces = [ns for ns in client.stats().namespaces if only in (None, ns.id)]
        stale, unchecked = stale_rows(namespaces, unused_for, include_pinned, time.time())
        by_id = {row["id"]: row for row in stale}
        wanted = [row["id"] for row in stale if row["skipped"] is None]
        if wanted:
            preview = client.drop_namespaces(wanted, dry_run=True)
            for item in preview.namespaces:
                by_id[item.id].update(keys=item.keys, bytes=item.bytes, skipped=item.skipped)
        document: dict[str, Any] = {
            "dry_run": dry_run,
            "unused_for_s": unused_for,
            "namespaces": stale,
            "unchecked": unchecked,
        }
        droppable = [row["id"] for row in stale if row["skipped"] is None]
        if droppable and not dry_run:
            if not yes:
                if not json:
                    show_stale(_totals(document | {"dry_run": True}))
                held = sum(by_id[ns]["bytes"] for ns in droppable)
                confirm_or_refuse(f"remove {len(droppable)} stale namespaces ({format_size(held)})")
            root = Path(cfg.storage.path)
            if not root.is_dir():
                raise StorageError(
                    f"storage path {str(root)!r} is not mounted here: page files cannot be removed",
                    hint="run `hf3fsctl evict --stale` on a node that mounts the store",
                )
            result = client.drop_namespaces(droppable)
            for item in result.namespaces:
                row = by_id[item.id]
                row.update(keys=item.keys, bytes=item.bytes, skipped=item.skipped)
                if item.skipped is not None:
                    continue
                row["removed"] = True
                try:
                    row["bytes_freed"] = remove_namespace_files(root, item.id)
                except StorageError as exc:
                    row["error"] = exc.message
    document = _totals(document)
    if json:
        output.print_json(document)
    else:
        show_stale(document)
    failed = [row for row in stale if row["error"]]
    if failed:
        raise StorageError(
            f"{len(failed)} namespaces were dropped from the metadata but their "
            f"directories could not be removed: {failed[0]['error']}",
            hint="remove those directories under the storage path by hand",
        )


def _totals(document: dict[str, Any]) -> dict[str, Any]:
    """The document with its totals: namespaces removed (or to remove), keys, bytes."""
    dry_run = document["dry_run"]
    going = [
        row
        for row in document["namespaces"]
        if row["skipped"] is None and (dry_run or row["removed"])
    ]
    return document | {
        "removed": len(going),
        "keys": sum(row["keys"] for row in going),
        "bytes": sum(row["bytes"] for row in going),
        "bytes_freed": sum(row["bytes_freed"] or 0 for row in going),
    }


# --- the command ---------------------------------------------------------------------


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
    include_pinned: Annotated[
        bool,
        typer.Option("--include-pinned", help="Evict pinned keys too (else they are left alone)."),
    ] = False,
    stale: Annotated[
        bool,
        typer.Option(
            "--stale",
            help="Remove whole stale namespaces (metadata and page files): unused for "
            "--unused-for, or their local model directory changed.",
        ),
    ] = False,
    unused_for: Annotated[
        float | None,
        typer.Option(
            "--unused-for",
            parser=parse_duration,
            metavar="DURATION",
            help="With --stale: namespaces not used (registered, looked up, saved to or "
            "loaded from) for this long (default 7d).",
            show_default=False,
        ),
    ] = None,
    dry_run: DryRunOpt = False,
    yes: YesOpt = False,
    json: JsonOpt = False,
) -> None:
    """Free space: evict entries by namespace, age, target usage, count or all; or --stale."""
    from hf3fsctl.meta.models import EvictRequest

    entry_criteria = (
        older_than is not None or target_usage is not None or max_entries is not None or everything
    )
    if stale and entry_criteria:
        raise InvalidRequest(
            "--stale removes whole namespaces and cannot be combined with "
            "--older-than, --target-usage, --max-entries or --all",
            hint="run two commands: `evict --stale` and `evict` with the entry criteria",
        )
    if unused_for is not None and not stale:
        raise InvalidRequest(
            "--unused-for applies to --stale only",
            hint="pass --stale --unused-for DURATION, or --older-than DURATION for entries",
        )
    if not stale and not entry_criteria:
        raise InvalidRequest(
            "evict needs a criterion",
            hint="pass --older-than, --target-usage, --max-entries or --all "
            "(with --namespace to narrow it), or --stale; add --dry-run to preview",
        )
    cfg = context.load(ctx, config)
    if stale:
        evict_stale(
            cfg,
            namespace,
            DEFAULT_UNUSED_FOR_S if unused_for is None else unused_for,
            include_pinned=include_pinned,
            dry_run=dry_run,
            yes=yes,
            json=json,
        )
        return
    with context.open_client(cfg) as client:
        request = EvictRequest(
            namespace=context.resolve_namespace(client, namespace),
            older_than_s=older_than,
            target_usage=target_usage,
            max_entries=max_entries,
            all=everything,
            include_pinned=include_pinned,
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
