"""`hf3fsctl backup OUT`: an online copy of the metadata store, taken while it serves.

Which store: `--db PATH`, else the file of a `sqlite:///` `metadata.url`. A store behind
`hf3fsctl serve` (an `http(s)://` URL) is backed up on the server's node, against its
file (SQLite's WAL can only be shared by processes of one host), so an http URL is
refused with that command; a Redis store is backed up by Redis itself (`redis-cli --rdb`).
`store_file` is that choice, shared with `hf3fsctl migrate`.
The copy is consistent as of the moment the command starts and never stops writers
(`hf3fsctl.meta.sqlite.backup`); check it with `HF3FSCTL_METADATA_URL=sqlite:///OUT hf3fsctl
doctor`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt, JsonOpt
from hf3fsctl.errors import InvalidRequest

if TYPE_CHECKING:
    from hf3fsctl.config import Config

DbOpt = Annotated[
    Path | None,
    typer.Option(
        "--db",
        metavar="PATH",
        help="The store's database file (default: metadata.url's sqlite:/// path; behind "
        "`hf3fsctl serve`, its <storage.path>/metadata.db, on the server's node).",
    ),
]


def store_file(cfg: Config, db: Path | None, command: str) -> Path:
    """The database file a maintenance command works on.

    Raises:
        InvalidRequest: the configured store is not a local SQLite file (`http(s)://`:
            run `command` on the server's node with `--db`; `redis://`: Redis's own tools).
    """
    if db is not None:
        return db.expanduser()
    target = cfg.metadata_target
    if target.redis:
        raise InvalidRequest(
            f"metadata.url is a Redis store ({target.url}): `hf3fsctl {command.split()[0]}` "
            "works on SQLite stores only",
            hint="back Redis up with its own tools: `redis-cli -u URL --rdb FILE` against "
            "the master (or BGSAVE there and copy dump.rdb); Redis stores have no migrations yet",
        )
    path = context.sqlite_path(target)
    if path is None:
        served = Path(cfg.storage.path) / "metadata.db"
        raise InvalidRequest(
            f"metadata.url is {target.url}: the store lives with `hf3fsctl serve`, "
            "whose SQLite WAL can only be read safely on that host",
            hint=f"on the server's node: `hf3fsctl {command} --db {served}` "
            "(the file serve prints when it starts)",
        )
    return path


def backup(
    ctx: typer.Context,
    out: Annotated[
        Path, typer.Argument(metavar="OUT", help="The backup file to create (must not exist).")
    ],
    db: DbOpt = None,
    config: ConfigOpt = None,
    json: JsonOpt = False,
) -> None:
    """Copy the metadata store to OUT while it keeps serving (SQLite online backup)."""
    from hf3fsctl.config import format_size
    from hf3fsctl.meta.sqlite.backup import backup_database

    cfg = context.load(ctx, config)
    source = store_file(cfg, db, "backup OUT")
    with output.progress(not json) as bar:
        task = bar.add_task(f"backup {source.name} (pages)", total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = backup_database(source, out, progress=advance)
    if json:
        output.print_json(
            {
                "source": str(source),
                "path": result.path,
                "bytes": result.bytes,
                "pages": result.pages,
                "format": result.format,
                "seconds": round(result.seconds, 3),
            }
        )
        return
    output.info(
        f"backed up {source} to {result.path}: {format_size(result.bytes)} (format "
        f"{result.format}) in {result.seconds:.1f}s; check it with "
        f"`HF3FSCTL_METADATA_URL=sqlite:///{Path(result.path).resolve()} hf3fsctl doctor`"
    )
