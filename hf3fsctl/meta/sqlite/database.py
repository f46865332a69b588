"""`SqliteDatabase`: the connections, transactions and writer lock of a SQLite store.

The plumbing under `MetadataStore`'s primitives (`store.py`), apart from them:

- One SQLite connection per thread (`_conn`). Writes (`_write`) take the database's
  `WriterLock` (a mutex plus a kernel `flock` on `<db>.lock`) and then `BEGIN IMMEDIATE`,
  so writers of every thread and process hand over within a fraction of a millisecond
  instead of sleeping in SQLite's busy handler; reads (`_read`) run on WAL snapshots.
- Failure kinds come from SQLite's result code (`sqlite_errorcode`), never its message
  (`_typed_errors`): busy or locked past `busy_timeout_s` → `MetadataUnavailable`;
  read-only or unopenable → `StorageError`; full or I/O → `MetadataUnavailable` with
  the hint to free space (a full file system named as such); corrupt or not a database
  → `MetadataUnavailable` with the fix (a backup, or `hf3fsctl init` again).
- Lookup counters wait in memory and ride with the next write transaction, or are
  written by a lookup once a second when no writer holds the lock (`_flush_if_free`).
- The WAL: checkpointed by whichever commit fills it, or by a background thread
  (`WalCheckpointer`) in a long-running process; `close(truncate_wal=True)` leaves the
  database file complete on its own.
- `read_only`: no writer lock, nothing written; on a read-only file system the file is
  opened immutable.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import util as mp_util
from pathlib import Path

from hf3fsctl.errors import UNREACHABLE_ERRNOS, MetadataUnavailable, NotFound, StorageError
from hf3fsctl.meta.sqlite import migration, schema
from hf3fsctl.meta.sqlite.backup import BackupResult, Progress, backup_database
from hf3fsctl.meta.sqlite.checkpointer import WalCheckpointer
from hf3fsctl.meta.sqlite.writer_lock import WriterLock

logger = logging.getLogger(__name__)

_FLUSH_INTERVAL_S = 1.0
# SQLite's page cache per connection (one connection per thread that touches the store):
# a bound on memory that does not grow with the entries held. Pages beyond it come from
# the OS page cache; the B-trees' inner pages, the hot ones, fit easily. 32 MiB per
# connection made a serve (loop, writer and reader threads) hold up to ~10 × 32 MiB as
# its store grew: 415 B of serve RSS per entry at 10^5 entries; 2 MiB (SQLite's own
# default): 57 B, with full-store saves as fast (`hf3fsctl bench metadata --entries 1e5
# --scale --mode serve --ops full_1ns`: 2,555 keys/s vs 2,160; issue 21).
CACHE_KIB = 2048


def _wal_pages(path: str) -> int:
    """WAL pages between checkpoints: 8192 (32 MiB, fewer checkpoints), but 256 (1 MiB)
    on a small file system, where the WAL would otherwise eat the room left beside the
    page files (the store's capacity is a share of the same file system)."""
    import shutil

    try:
        total = shutil.disk_usage(os.path.dirname(path) or ".").total
    except OSError:
        return 8192
    return 8192 if total >= 4 << 30 else 256


def _read_only_error(path: str) -> StorageError:
    return StorageError(
        f"metadata store {path} is read-only here (read-only mount or no write permission)",
        hint="remount it read-write or fix its permissions (`hf3fsctl doctor` says which); "
        "`stats`, `ls` and `doctor` read it as it is",
    )


def _unwritable_error(path: str, exc: sqlite3.Error) -> MetadataUnavailable:
    """SQLITE_FULL or SQLITE_IOERR, naming a full file system as such: SQLite reports a
    write that failed with ENOSPC as "disk I/O error" on some file systems (btrfs)."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        full = st.f_bavail * st.f_frsize < 1 << 20
    except OSError:
        full = False
    reason = "no space left on its file system" if full else str(exc)
    return MetadataUnavailable(
        f"metadata store {path} cannot be written: {reason}",
        hint="free space on its file system, or check that it is writable",
    )


def _corrupt_error(path: str, exc: sqlite3.Error) -> MetadataUnavailable:
    return MetadataUnavailable(
        f"metadata store {path} is damaged ({exc})",
        hint="restore a backup over it (`hf3fsctl backup` takes one of a sound store), or "
        "move it aside and run `hf3fsctl init` again (the cache starts empty; vLLM serves "
        "misses meanwhile)",
    )


def _open_writer_lock(path: str) -> WriterLock:
    """The writer lock of a store to be written (its directory made if missing, but only
    inside an existing one: as for the storage root, a missing mount must not turn into
    a store on the local disk).

    Raises:
        StorageError: the directory or lock file cannot be written (read-only mount,
            permissions), instead of an `OSError` traceback; or neither the directory
            nor its parent exists.
    """
    directory = Path(path).parent
    if not directory.is_dir() and not directory.parent.is_dir():
        raise StorageError(
            f"metadata store {path}: neither {directory} nor its parent exists "
            "(a file system not mounted?)",
            hint="mount it, or create the store with `hf3fsctl init --storage-path DIR "
            "--create-path`",
        )
    try:
        directory.mkdir(exist_ok=True)
        return WriterLock(path + ".lock")
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise _read_only_error(path) from None
        raise StorageError(
            f"metadata store {path}: cannot open its lock file: {exc.strerror}",
            errno=exc.errno,
        ) from None


class _PendingCounts:
    """Lookup counters not yet written: namespace → [lookups, keys, hits]. Apart from the
    store, so that the flush at exit or collection holds no reference to it."""

    def __init__(self) -> None:
        self.by_namespace: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.last_flush = time.monotonic()

    def add(self, namespace: str, keys: int, hits: int) -> bool:
        """Count one lookup; True when the counters are due to be written."""
        with self.lock:
            counter = self.by_namespace.setdefault(namespace, [0, 0, 0])
            counter[0] += 1
            counter[1] += keys
            counter[2] += hits
            return time.monotonic() - self.last_flush > _FLUSH_INTERVAL_S

    def take(self) -> dict[str, list[int]]:
        """The pending counters, now the caller's to write."""
        with self.lock:
            taken, self.by_namespace = self.by_namespace, {}
            self.last_flush = time.monotonic()
        return taken


def _write_counts(conn: sqlite3.Connection, counts: dict[str, list[int]]) -> None:
    if counts:
        now = time.time()
        conn.executemany(
            "UPDATE namespaces SET lookups = lookups + ?, lookup_keys = lookup_keys + ?,"
            " hit_keys = hit_keys + ?, last_used = MAX(last_used, ?) WHERE id = ?",
            [(c[0], c[1], c[2], now, ns) for ns, c in counts.items()],
        )


def _flush_alone(
    path: str, pending: _PendingCounts, writer: WriterLock | None, busy_timeout_s: float
) -> None:
    """Write a store's pending lookup counters on a connection of its own, at exit or
    collection; never raises (what is lost is logged)."""
    counts = pending.take()
    if not counts or writer is None:
        return
    try:
        with writer.hold(busy_timeout_s) as got:
            if not got:
                raise MetadataUnavailable(f"another writer held it for {busy_timeout_s:g}s")
            conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                _write_counts(conn, counts)
                conn.execute("COMMIT")
            finally:
                conn.close()
    except Exception as exc:  # exiting or collecting: report what is lost, never raise
        logger.warning("metadata store %s: lookup counters not flushed (%s)", path, exc)


class SqliteDatabase:
    """One SQLite database file, shared safely by the threads and processes of a node."""

    path: str

    def _open_database(
        self, *, busy_timeout_s: float, durable: bool, background_checkpoint: bool, read_only: bool
    ) -> None:
        """Open (create) the database at `self.path` and check its format."""
        self.busy_timeout_s = float(busy_timeout_s)
        self.durable = durable
        self.background_checkpoint = background_checkpoint
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        # Bumped when the file the connections opened is gone from its path (its file
        # system went away, or came back as a new mount): each thread then connects anew.
        self._generation = 0
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) it opened
        self.read_only = read_only
        self._immutable = False  # read-only and on a file system that refuses even -shm
        self._writer: WriterLock | None = None if read_only else _open_writer_lock(self.path)
        self._wal_pages = _wal_pages(self.path)
        self._pending = _PendingCounts()
        self._checkpointer: WalCheckpointer | None = None
        try:
            with self._typed_errors():
                self._init_schema()
        except BaseException:  # e.g. a store of another format: leave nothing open
            self._close_connections()
            raise
        self._identity = self._file_identity()
        # A process that only looks up (the connector's scheduler side) may exit without
        # `close`, where a server counts every lookup it answers: the counters are also
        # written when the store is collected and when its process exits (a plain exit,
        # or the end of a multiprocessing child such as vLLM's EngineCore, which runs only
        # these). A forked copy of the store is skipped: it runs in the process that made
        # it. `close` cancels it (and flushes itself).
        self._flush_at_exit = mp_util.Finalize(
            self,
            _flush_alone,
            (self.path, self._pending, self._writer, self.busy_timeout_s),
            exitpriority=0,
        )

    def _start_checkpointer(self) -> None:
        if self.background_checkpoint and not self.read_only:
            self._checkpointer = WalCheckpointer(
                self.path, limit_bytes=self._wal_pages * 4096, writer_lock=self._lock()
            ).start()

    def _lock(self) -> WriterLock:
        if self._writer is None:
            raise _read_only_error(self.path)
        return self._writer

    def _connect(self) -> sqlite3.Connection:
        if not self.read_only:
            return sqlite3.connect(
                self.path,
                timeout=self.busy_timeout_s,
                isolation_level=None,
                check_same_thread=False,
            )
        if not Path(self.path).is_file():
            raise NotFound(f"metadata database {self.path} does not exist")
        uri = Path(self.path).absolute().as_uri()
        if not self._immutable:
            try:
                conn = sqlite3.connect(
                    uri + "?mode=ro",
                    uri=True,
                    timeout=self.busy_timeout_s,
                    isolation_level=None,
                    check_same_thread=False,
                )
                conn.execute("SELECT 1 FROM sqlite_master LIMIT 1")
                return conn
            except sqlite3.OperationalError:
                if os.access(os.path.dirname(self.path) or ".", os.W_OK):
                    raise
            # WAL readers need `-shm`; where it cannot be created (a read-only mount)
            # the file is read as it is, as if nobody wrote it meanwhile.
            self._immutable = True
            logger.info("metadata store %s: read-only file system, opened immutable", self.path)
        return sqlite3.connect(
            uri + "?immutable=1", uri=True, isolation_level=None, check_same_thread=False
        )

    def _file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and self._local.generation != self._generation:
            self._drop(conn)  # opened on a file no longer at its path
            conn = None
        if conn is None:
            conn = self._connect()
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.durable else 'NORMAL'}")
            conn.execute("PRAGMA temp_store = MEMORY")
            conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
            auto = 0 if self.background_checkpoint else self._wal_pages
            conn.execute(f"PRAGMA wal_autocheckpoint = {auto}")
            conn.execute(f"PRAGMA journal_size_limit = {self._wal_pages * 4096}")
            self._local.conn = conn
            self._local.generation = self._generation
            if self._identity is None:  # (re)opened: the file it reaches now
                self._identity = self._file_identity()
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    def _drop(self, conn: sqlite3.Connection) -> None:
        with self._connections_lock:
            if conn in self._connections:
                self._connections.remove(conn)
        self._local.conn = None
        try:
            conn.close()
        except sqlite3.Error:
            pass

    def _lost(self) -> MetadataUnavailable | None:
        """After an I/O error: whether the database's file system is gone from under its
        mount (a FUSE daemon that exited: ENOTCONN) or the file at its path is no longer
        the one the connections opened (the mount came back as a new one). If so every
        thread connects again at its next call, the writer lock is opened again, and
        this is the error to raise; None for another I/O error."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if exc.errno not in UNREACHABLE_ERRNOS:
                return None
            reason = f"its file system is not reachable ({exc.strerror})"
            self._identity = None  # the file's, once a connection opens it again
        else:
            if self._identity is None or (st.st_dev, st.st_ino) == self._identity:
                return None
            reason = "the file at its path is not the one it had open (remounted?)"
            self._identity = (st.st_dev, st.st_ino)
        self._generation += 1
        if self._writer is not None:
            self._writer.reopen()
        return MetadataUnavailable(
            f"metadata store {self.path}: {reason}",
            hint="remount its file system if it is gone (`umount -l MOUNT`, then mount it "
            "again); the store opens the file again by itself",
        )

    def _init_schema(self) -> None:
        """Create the tables of a new store; refuse a store of another format.

        A store is never migrated on open: processes of several hf3fsctl versions may
        share it, so `hf3fsctl migrate` does that, once, on purpose (`meta/sqlite/migration.py`).
        """
        with self._typed_errors():
            conn = self._conn()
            if self.read_only:
                version = schema.stored_version(conn)
                if version is not None and version != schema.SCHEMA_VERSION:
                    raise migration.format_error(self.path, version)
                return
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                logger.warning("metadata store %s: journal_mode is %s, not WAL", self.path, mode)
            with self._exclusive():
                version = schema.stored_version(conn)
                if version is not None and version != schema.SCHEMA_VERSION:
                    raise migration.format_error(self.path, version)
                try:
                    fill_lru = not schema.has_key_lru(conn)
                    conn.executescript(
                        "BEGIN IMMEDIATE;"
                        + schema.DDL
                        + "INSERT OR IGNORE INTO store_info VALUES ('schema_version', "
                        + f"'{schema.SCHEMA_VERSION}');"
                    )
                    schema.add_open_columns(conn)  # expiry, admission (issue 22)
                    if fill_lru:  # a store written before key_lru: its keys' ages, once
                        conn.execute(schema.KEY_LRU_FILL)
                    for statement in schema.LATE_INDEXES:
                        conn.execute(statement)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise

    @contextmanager
    def _typed_errors(self) -> Iterator[None]:
        """SQLite's errors a caller can act on, typed: busy, read-only, full, corrupt."""
        try:
            yield
        except OSError as exc:  # the writer lock's descriptor, on a file system gone
            lost = self._lost() if exc.errno in UNREACHABLE_ERRNOS else None
            if lost is None:
                raise
            raise lost from None
        except sqlite3.DatabaseError as exc:  # OperationalError, and corruption's own
            code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF  # the primary code
            if code in (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN):
                lost = self._lost()
                if lost is not None:
                    raise lost from None
            if code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                raise _corrupt_error(self.path, exc) from None
            if not isinstance(exc, sqlite3.OperationalError):
                raise
            if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise MetadataUnavailable(
                    f"metadata store {self.path} stayed busy for {self.busy_timeout_s:g}s"
                ) from None
            if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN):
                raise _read_only_error(self.path) from None
            if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR):
                raise _unwritable_error(self.path, exc) from None
            raise

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The writer lock of the database (all threads and processes), or unavailable."""
        with self._lock().hold(self.busy_timeout_s) as got:
            if not got:
                raise MetadataUnavailable(
                    f"metadata store {self.path}: another writer held it for "
                    f"{self.busy_timeout_s:g}s"
                )
            yield

    @contextmanager
    def _write(self, *, flush_counters: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE … COMMIT), the pending lookup counters
        flushed within unless `flush_counters` is False."""
        with self._typed_errors(), self._exclusive():
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                if flush_counters:
                    self._flush_counters(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:  # an I/O error has rolled it back already
                    conn.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction on a consistent snapshot."""
        with self._typed_errors():
            conn = self._conn()
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                if conn.in_transaction:  # an I/O error has ended it already
                    conn.execute("COMMIT")

    def _flush_counters(self, conn: sqlite3.Connection) -> None:
        _write_counts(conn, self._pending.take())

    def flush(self) -> None:
        """Write the in-memory lookup counters now (a read-only store drops them)."""
        if self.read_only:
            self._pending.take()
        elif self._pending.by_namespace:
            with self._write():
                pass

    def _count_lookup(self, namespace: str, keys: int, hits: int) -> None:
        """Count a lookup in memory; written with the next write, or now if a second has
        passed and no writer holds the lock (a lookup never waits for one)."""
        if self._pending.add(namespace, keys, hits):
            self._flush_if_free()

    def _flush_if_free(self) -> None:
        """Write the lookup counters if no writer holds the database now; never waits.

        A lookup must not wait for writers (the server answers lookups on its event loop):
        when the lock is taken the counters stay in memory for the next write.
        """
        if self._writer is None:
            return
        try:
            with self._writer.try_hold() as got:
                if not got:
                    return
                conn = self._conn()
                try:
                    conn.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError:  # a writer outside our lock (sqlite3 shell)
                    return
                try:
                    self._flush_counters(conn)
                    conn.execute("COMMIT")
                except sqlite3.Error:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
        except (OSError, sqlite3.Error):  # its file system gone: best effort, as ever
            return

    def close(self, *, truncate_wal: bool = False) -> None:
        """Flush counters and close every connection this store opened.

        Args:
            truncate_wal: first copy the whole WAL into the database and truncate it to
                zero bytes (`wal_checkpoint(TRUNCATE)`), for a server shutting down: the
                database file alone is then complete. Waits at most a second for other
                processes' readers; if they still hold it, the WAL is left to them.
        """
        self._flush_at_exit.cancel()
        try:
            self.flush()
        except MetadataUnavailable:
            logger.warning("metadata store %s: lookup counters not flushed (busy)", self.path)
        if self._checkpointer is not None:
            self._checkpointer.stop()
        if truncate_wal:
            self.checkpoint_wal()
        self._close_connections()

    def shutdown(self) -> None:
        """`close` at the end of a server's life: the WAL truncated into the database."""
        self.close(truncate_wal=True)

    def checkpoint_wal(self, busy_timeout_s: float = 1.0) -> bool:
        """Checkpoint the whole WAL and truncate it; True when it is empty afterwards."""
        conn = self._conn()
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        try:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.Error as exc:
            busy, reason = 1, str(exc)
        else:
            reason = "readers of other processes still use it"
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        if busy:
            logger.warning("metadata store %s: WAL not truncated (%s)", self.path, reason)
        return not busy

    def _close_connections(self) -> None:
        with self._connections_lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()
        if self._writer is not None:
            self._writer.close()

    def backup(
        self, out: str | os.PathLike[str], *, progress: Progress | None = None
    ) -> BackupResult:
        """Write a consistent copy of the store, as of now, to the new file `out`, online
        (writers keep writing; `meta/sqlite/backup.py`)."""
        return backup_database(
            self.path, out, progress=progress, busy_timeout_s=self.busy_timeout_s
        )

    def check_integrity(self) -> list[str]:
        """SQLite's own check of the file (`PRAGMA integrity_check`): B-trees, indexes,
        page links. Empty when sound; reads every page, so it takes a while on a large
        store (doctor runs it, not the hot path)."""
        with self._read() as conn:
            rows = [str(r[0]) for r in conn.execute("PRAGMA integrity_check")]
        return [] if rows == ["ok"] else rows
