"""Online backups of the SQLite metadata store, taken while writers keep writing.

Contract: `backup_database(db, out)` writes a consistent copy of the store as it was when
the call began — every transaction committed before it is in the copy, none that
commits later is — without stopping anyone: it holds one WAL read snapshot on the
source (readers never block writers) and copies it page by page with SQLite's online
backup API (`sqlite3.Connection.backup`), reporting progress between steps. Holding the
snapshot across steps is what keeps the copy from restarting under a write load: the
backup API restarts whenever the source changes under a connection without an open read
transaction. While it runs, checkpoints cannot go past the snapshot, so the WAL grows by
what is written meanwhile; it shrinks again at the next checkpoint.

The copy is one self-contained file (rollback journal, no `-wal`): restore it by
copying it into place while no process has the store open. It is written beside the
target as `<out>.partial`, synced, then renamed, so `out` never holds half a backup.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hf3fsctl.errors import InvalidRequest, MetadataUnavailable, NotFound
from hf3fsctl.meta.sqlite import schema

PAGES_PER_STEP = 4096  # 16 MiB of 4 KiB pages between progress reports
Progress = Callable[[int, int], None]  # (pages copied, pages in all)


@dataclass(frozen=True)
class BackupResult:
    """What a backup wrote."""

    path: str  # the backup file
    pages: int  # database pages copied
    bytes: int  # size of the backup file
    format: int  # the store format it holds (`store_info.schema_version`)
    seconds: float  # time taken


def backup_database(
    db: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    pages_per_step: int = PAGES_PER_STEP,
    busy_timeout_s: float = 30.0,
) -> BackupResult:
    """Copy the store at `db` to the new file `out`, online.

    Args:
        db: the store's database file.
        out: the backup file to create (must not exist; its directory must).
        progress: called after each step with (pages copied, pages in all).
        pages_per_step: pages copied between two progress calls.
        busy_timeout_s: how long to wait if the database is locked by a schema change.

    Raises:
        NotFound: `db` does not exist or holds no store.
        InvalidRequest: `out` exists already, or its directory does not.
        MetadataUnavailable: the copy failed (e.g. no space for it).
    """
    source, target = Path(db), Path(out)
    if not source.is_file():
        raise NotFound(f"metadata database {source} does not exist")
    if target.exists():
        raise InvalidRequest(
            f"backup target {target} exists already",
            hint="name a new file (e.g. with the date in it), or remove the old one",
        )
    if not target.parent.is_dir():
        raise InvalidRequest(f"backup directory {target.parent} does not exist")
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    started = time.monotonic()
    src = sqlite3.connect(source, timeout=busy_timeout_s, isolation_level=None)
    try:
        src.execute("BEGIN")  # one snapshot for the whole copy (see the module docstring)
        version = schema.stored_version(src)
        if version is None:
            raise NotFound(f"{source} holds no hf3fsctl metadata store")
        dst = sqlite3.connect(partial, isolation_level=None)
        try:

            def report(status: int, remaining: int, total: int) -> None:
                if progress is not None:
                    progress(total - remaining, total)

            src.backup(dst, pages=max(1, pages_per_step), progress=report)
            src.execute("COMMIT")
            dst.execute("PRAGMA journal_mode = DELETE")  # one file, no -wal to carry along
            pages = int(dst.execute("PRAGMA page_count").fetchone()[0])
        finally:
            dst.close()
        _sync(partial)
        os.replace(partial, target)
        _sync(target.parent)
    except sqlite3.Error as exc:
        partial.unlink(missing_ok=True)
        raise MetadataUnavailable(
            f"backup of {source} to {target} failed: {exc}",
            hint="check the free space and permissions of the backup's directory",
        ) from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        src.close()
    return BackupResult(
        path=str(target),
        pages=pages,
        bytes=target.stat().st_size,
        format=version,
        seconds=time.monotonic() - started,
    )


def _sync(path: Path) -> None:
    """fsync a file or a directory (so a rename survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
