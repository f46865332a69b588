"""Store formats: refusing a store of another format, and `hf3fsctl migrate`.

Contract:

- Every store records its format (`store_info.schema_version`, `schema.SCHEMA_VERSION`
  for this code). `MetadataStore` opens only its own format: a newer store raises
  `StoreFormatError` ("upgrade hf3fsctl"), an older one `StoreFormatError` naming
  `hf3fsctl migrate`. Nothing is migrated on open: processes of several hf3fsctl
  versions may share one store (a fleet upgrades node by node), and an older process
  writing into a store migrated under it would write rows the new format reads wrongly.
  The connector treats the error as an unavailable store: misses, disabled with the fix.
- `plan(db)` reads the recorded format and lists the steps (`schema.FORMAT_STEPS`);
  it changes nothing.
- `migrate(db)` runs those steps in one write transaction under the store's writer lock
  (no writer of this package, of any version that takes the lock, and no SQLite writer
  at all can interleave), checks every invariant inside that transaction and rolls
  back if one fails, so a store is either fully migrated and sound or left as it was.
  The caller takes a backup first (`meta/sqlite/backup.py`; the CLI does by default).
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf3fsctl.errors import InvalidRequest, MetadataUnavailable, NotFound, StoreFormatError
from hf3fsctl.meta.sqlite import schema
from hf3fsctl.meta.sqlite.writer_lock import WriterLock


def format_error(path: str, version: int) -> StoreFormatError:
    """The refusal to open the store at `path`, recorded in format `version`."""
    current = schema.SCHEMA_VERSION
    if version > current:
        return StoreFormatError(
            f"metadata store {path} was written by a newer hf3fsctl (format {version}); "
            f"this hf3fsctl reads format {current}",
            hint="upgrade hf3fsctl on this node to the release that wrote the store",
            stored=version,
            supported=current,
        )
    return StoreFormatError(
        f"metadata store {path} is in format {version}, older than this hf3fsctl's "
        f"format {current}, and is not migrated implicitly: run `hf3fsctl migrate`",
        hint=f"stop the older hf3fsctl processes using it, then run `hf3fsctl migrate --db "
        f"{path}` (`--dry-run` first shows the steps)",
        stored=version,
        supported=current,
    )


@dataclass(frozen=True)
class MigrationPlan:
    """The steps between a store's format and this code's."""

    path: str  # the database file
    source: int  # the format it records
    target: int  # this code's format
    steps: list[schema.FormatStep] = field(default_factory=list)  # empty: nothing to do
    seconds: float = 0.0  # time the migration took (0 for a plan)


def _stored(conn: sqlite3.Connection, path: str) -> int:
    try:
        version = schema.stored_version(conn)
    except sqlite3.DatabaseError as exc:
        raise InvalidRequest(f"{path} is not an SQLite database: {exc}") from None
    if version is None:
        raise NotFound(f"{path} holds no hf3fsctl metadata store")
    return version


def plan(db: str | os.PathLike[str]) -> MigrationPlan:
    """The migration `migrate(db)` would run; reads the store, changes nothing.

    Raises:
        NotFound: no store at `db`.
        StoreFormatError: the store is newer than this code.
    """
    path = str(db)
    if not Path(path).is_file():
        raise NotFound(f"metadata database {path} does not exist")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    try:
        version = _stored(conn, path)
    finally:
        conn.close()
    if version > schema.SCHEMA_VERSION:
        raise format_error(path, version)
    return MigrationPlan(path, version, schema.SCHEMA_VERSION, schema.steps_from(version))


def migrate(db: str | os.PathLike[str], *, busy_timeout_s: float = 30.0) -> MigrationPlan:
    """Bring the store at `db` to this code's format, atomically, under the writer lock.

    Returns:
        The steps that ran (none when the store was current already).

    Raises:
        NotFound: no store at `db`.
        StoreFormatError: the store is newer than this code.
        MetadataUnavailable: another writer held the store for `busy_timeout_s`.
        InvalidRequest: the migrated store broke an invariant (rolled back: unchanged).
    """
    path = str(db)
    if not Path(path).is_file():
        raise NotFound(f"metadata database {path} does not exist")
    started = time.monotonic()
    lock = WriterLock(path + ".lock")
    try:
        with lock.hold(busy_timeout_s) as got:
            if not got:
                raise MetadataUnavailable(
                    f"metadata store {path}: another writer held it for {busy_timeout_s:g}s",
                    hint="try again when the load is lower, or stop the writers first",
                )
            conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
            try:
                found = _migrate(conn, path)
            finally:
                conn.close()
    finally:
        lock.close()
    return MigrationPlan(
        path, found, schema.SCHEMA_VERSION, schema.steps_from(found), time.monotonic() - started
    )


def _migrate(conn: sqlite3.Connection, path: str) -> int:
    """Run the steps in one transaction; the format the store had."""
    version = _stored(conn, path)
    if version > schema.SCHEMA_VERSION:
        raise format_error(path, version)
    if version == schema.SCHEMA_VERSION:
        return version
    conn.execute("PRAGMA journal_mode = WAL")
    columns = {
        table: {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for table in ("namespaces", "rank_files", "free_pages")
    }
    try:
        fill_lru = not schema.has_key_lru(conn)
        conn.executescript("BEGIN IMMEDIATE;" + schema.DDL)  # tables and indexes added since
        schema.add_open_columns(conn)
        if fill_lru:
            conn.execute(schema.KEY_LRU_FILL)
        sql = schema.migration_sql(version, columns)
        for statement in filter(None, (part.strip() for part in sql.split(";"))):
            conn.execute(statement)
        for statement in schema.LATE_INDEXES:
            conn.execute(statement)
        problems = [
            template.format(*row)
            for template, query in schema.INVARIANT_QUERIES
            for row in conn.execute(query)
        ]
        if problems:
            raise InvalidRequest(
                f"metadata store {path}: format {version} migrated to "
                f"{schema.SCHEMA_VERSION} breaks {len(problems)} invariants "
                f"({'; '.join(problems[:3])}); rolled back, the store is unchanged",
                hint="run `hf3fsctl doctor` on it, and report this with the backup",
            )
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return version
