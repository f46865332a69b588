"""`hf3fsctl migrate`: bring a metadata store written by an older hf3fsctl to this format.

Stores are never migrated when they are opened (several hf3fsctl versions may share
one), so a store of an older format is refused everywhere with this command as the fix.
It shows the steps (from → to, what changes, the tables touched), takes a backup beside
the database first (`--no-backup` skips it, `--backup-to` names it), then runs the steps
in one transaction under the store's writer lock and verifies every invariant before
committing (`hf3fsctl.meta.sqlite.migration`). `--dry-run` only shows the steps.

Stop the older hf3fsctl processes first: they would keep writing the old format into
the migrated store. Connectors of this version wait, disabled, and pick the store up by
themselves once it is migrated (every `connector.storage_retry_s`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.backup import DbOpt, store_file
from hf3fsctl.cli.options import ConfigOpt, DryRunOpt, JsonOpt, YesOpt
from hf3fsctl.errors import InvalidRequest

if TYPE_CHECKING:
    from hf3fsctl.meta.sqlite.migration import MigrationPlan


def migrate(
    ctx: typer.Context,
    db: DbOpt = None,
    dry_run: DryRunOpt = False,
    no_backup: Annotated[
        bool, typer.Option("--no-backup", help="Do not back the store up first.")
    ] = False,
    backup_to: Annotated[
        Path | None,
        typer.Option(
            "--backup-to",
            metavar="PATH",
            help="Where the backup goes (default: <db>.format-N-<time>.bak beside it).",
        ),
    ] = None,
    yes: YesOpt = False,
    config: ConfigOpt = None,
    json: JsonOpt = False,
) -> None:
    """Migrate the metadata store to this hf3fsctl's format (a backup is taken first)."""
    from hf3fsctl.meta.sqlite import migration
    from hf3fsctl.meta.sqlite.backup import backup_database

    cfg = context.load(ctx, config)
    path = store_file(cfg, db, "migrate")
    plan = migration.plan(path)
    steps = [
        {"from": s.source, "to": s.target, "changes": s.summary, "tables": list(s.tables)}
        for s in plan.steps
    ]
    document: dict[str, object] = {
        "db": str(path),
        "from": plan.source,
        "to": plan.target,
        "steps": steps,
        "dry_run": dry_run,
        "migrated": False,
        "backup": None,
    }
    if not json:
        _show(plan)
    if not plan.steps or dry_run:
        if json:
            output.print_json(document)
        elif plan.steps:
            output.info("dry run: nothing was changed")
        return
    if not yes:
        if not sys.stdin.isatty():
            raise InvalidRequest(
                "refusing to migrate without confirmation: stdin is not a terminal",
                hint="pass --yes to confirm, or --dry-run to only see the steps",
            )
        typer.confirm(f"Migrate {path} to format {plan.target}?", abort=True, err=True)
    if not no_backup:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = backup_to or path.with_name(f"{path.name}.format-{plan.source}-{stamp}.bak")
        with output.progress(not json) as bar:
            task = bar.add_task("backup (pages)", total=None)

            def advance(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            taken = backup_database(path, target, progress=advance)
        document["backup"] = taken.path
        if not json:
            output.info(f"backup: {taken.path}")
    done = migration.migrate(path)
    document["migrated"] = bool(done.steps)
    if json:
        output.print_json(document)
    else:
        output.info(
            f"migrated {path} from format {done.source} to {done.target} in "
            f"{done.seconds:.1f}s; invariants hold"
        )


def _show(plan: MigrationPlan) -> None:
    """The steps as a table (or that there are none)."""
    if not plan.steps:
        output.info(f"{plan.path} is in format {plan.target} already: nothing to do")
        return
    rows = [[f"{s.source} → {s.target}", s.summary, ", ".join(s.tables)] for s in plan.steps]
    output.show(output.table(["step", "what changes", "tables"], rows))
