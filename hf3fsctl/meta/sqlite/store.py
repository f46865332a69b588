"""`MetadataStore`: the durable, bounded metadata of the KV-page tier, in SQLite.

Contract (decisions 4–5 in docs/design.md; the `MetadataClient` protocol in `meta/client.py`):

- Every operation is one SQLite transaction. Writes take `BEGIN IMMEDIATE` (one writer
  at a time, across threads *and* processes: the scheduler and workers of a node share
  one file); a writer that cannot get the lock within `busy_timeout_s` raises
  `MetadataUnavailable`. Reads run on WAL snapshots and never block writers.
- Durability: WAL with `synchronous=NORMAL` survives any process crash (kill -9): a
  committed transaction is in the WAL before `COMMIT` returns. Only a power loss or
  OS crash can drop the last transactions; `durable=True` selects `synchronous=FULL`
  for that too. A crash never leaves a page owned twice: ownership moves only inside
  transactions, and `entries (namespace, rank, page)` is a unique index.
- `invalidate` drops keys a reader proved corrupt (exact page and checksum only, every
  rank at once, leases honoured), so no later request is offered them again.
- Pages: each rank file hands out pages from a high-water counter (`next_unused`) and
  a free list; a page freed while a read lease holds it is reusable only once the lease
  ends. A file with a fixed number of pages evicts its own LRU keys when fuller than
  `high_watermark`.
- Capacity (`meta/capacity.py`): one recorded capacity for the whole store; an
  allocation that would take the store's page files above `high_watermark` of it evicts
  least-recently-used keys of any namespace (chain tails before heads, a key on all ranks
  at once, never pending, leased or pinned keys) down to `low_watermark`, and gives the
  freed space back to the file system; quotas cap a namespace's or a model's share.
- Traffic counters of `lookup` (read-only calls) are accumulated in memory and written
  with the next write transaction, or by the next lookup once a second has passed, so a
  lookup never pays for a write; a crash loses at most about a second of counts.

Thread- and process-safe: one SQLite connection per thread; writers take the database's
`WriterLock` (a mutex plus a kernel `flock` on `<db>.lock`) before `BEGIN IMMEDIATE`, so
they hand over within a fraction of a millisecond instead of sleeping in SQLite's busy
handler (16 embedded writer processes: p99 seconds → milliseconds).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter

from hf3fsctl.errors import MetadataUnavailable, NotFound, StorageError
from hf3fsctl.keys import check_namespace_id
from hf3fsctl.meta.base import Attempt, StoreCore
from hf3fsctl.meta.giveback import GiveBack
from hf3fsctl.meta.models import (
    Allocation,
    ChangeLog,
    CommitItem,
    DropNamespacesResult,
    EntryInfo,
    EvictRequest,
    EvictResult,
    Location,
    NamespaceInfo,
    PinInfo,
    PinResult,
    RankFile,
    StoreStats,
)
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite import capacity as room
from hf3fsctl.meta.sqlite import migration, namespaces, pins, schema
from hf3fsctl.meta.sqlite.backup import BackupResult, Progress, backup_database
from hf3fsctl.meta.sqlite.checkpointer import WalCheckpointer
from hf3fsctl.meta.sqlite.committed_index import CommittedIndex, prune_changes, read_changes
from hf3fsctl.meta.sqlite.eviction import (
    evict_entries,
    evict_for_allocation,
    invalidate_pages,
    reclaim_expired,
)
from hf3fsctl.meta.sqlite.writer_lock import WriterLock

logger = logging.getLogger(__name__)

T = TypeVar("T")
_LOCATIONS = TypeAdapter(list[Location | None])
_CHUNK = 500  # keys per SQL statement (well under SQLite's variable limit)
_FLUSH_INTERVAL_S = 1.0


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


def _open_writer_lock(path: str) -> WriterLock:
    """The writer lock of a store to be written (its directory made if missing).

    Raises:
        StorageError: the directory or lock file cannot be written (read-only mount,
            permissions), instead of an `OSError` traceback.
    """
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return WriterLock(path + ".lock")
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise _read_only_error(path) from None
        raise StorageError(
            f"metadata store {path}: cannot open its lock file: {exc.strerror}",
            errno=exc.errno,
        ) from None


def _placeholders(n: int) -> str:
    return ",".join("?" * n)


def _chunks(items: Sequence[T], size: int = _CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class MetadataStore(StoreCore):
    """The SQLite metadata store: the `Store` protocol (`meta/protocol.py`), on the
    store core (`meta/base.py`: validation, the allocate loop), with SQL primitives.

    Args:
        path: the database file (created with its directory if missing).
        lease_s: how long a located page stays unreusable, even if evicted.
        high_watermark: a rank file fuller than this evicts on allocate.
        low_watermark: … down to this usage.
        busy_timeout_s: how long a call waits for another writer before it raises
            `MetadataUnavailable`.
        pending_timeout_s: a pending allocation older than this belongs to a dead
            writer and may be reclaimed (`policy.pending_timeout_s`, the configured
            `metadata.pending_timeout_s`, wins when set).
        durable: `synchronous=FULL` (survive power loss) instead of NORMAL.
        background_checkpoint: checkpoint the WAL in a background thread
            (`WalCheckpointer`) rather than inside whichever commit fills it; for
            long-running processes (the server).
        policy: capacity, pins, quotas and the storage root (`StorePolicy`). Without
            one the store is unbounded, as are pins, and freed space stays in its files.
        read_only: open an existing store for reading only (`stats`, `ls`, `doctor`):
            no writer lock, no schema or capacity written, every write refused with
            `StorageError`; on a read-only file system the file is opened immutable.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lease_s: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        busy_timeout_s: float = 5.0,
        pending_timeout_s: float = 120.0,
        durable: bool = False,
        background_checkpoint: bool = False,
        policy: StorePolicy | None = None,
        read_only: bool = False,
    ) -> None:
        self.path = str(path)
        self._init_core(
            f"sqlite:///{os.path.abspath(self.path)}",
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            pending_timeout_s=pending_timeout_s,
            policy=policy,
        )
        self.busy_timeout_s = float(busy_timeout_s)
        self.durable = durable
        self.background_checkpoint = background_checkpoint
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self.read_only = read_only
        self._immutable = False  # read-only and on a file system that refuses even -shm
        self._writer: WriterLock | None = None if read_only else _open_writer_lock(self.path)
        self._wal_pages = _wal_pages(self.path)
        self._counters: dict[str, list[int]] = {}  # namespace → [lookups, keys, hits]
        self._counters_lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._num_ranks: dict[str, int] = {}  # immutable once registered
        self._index = CommittedIndex()
        self._commits = 0
        try:
            self._init_schema()
        except BaseException:  # e.g. a store of another format: leave nothing open
            self._close_connections()
            raise
        self._record_default_capacity()
        self._checkpointer = (
            WalCheckpointer(
                self.path, limit_bytes=self._wal_pages * 4096, writer_lock=self._lock()
            ).start()
            if background_checkpoint and not read_only
            else None
        )

    # --- connections and transactions ------------------------------------------------

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

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            conn.execute(f"PRAGMA synchronous = {'FULL' if self.durable else 'NORMAL'}")
            conn.execute("PRAGMA temp_store = MEMORY")
            conn.execute("PRAGMA cache_size = -32768")
            auto = 0 if self.background_checkpoint else self._wal_pages
            conn.execute(f"PRAGMA wal_autocheckpoint = {auto}")
            conn.execute(f"PRAGMA journal_size_limit = {self._wal_pages * 4096}")
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    def _init_schema(self) -> None:
        """Create the tables of a new store; refuse a store of another format.

        A store is never migrated on open: processes of several hf3fsctl versions may
        share it, so `hf3fsctl migrate` does that, once, on purpose (`meta/migration.py`).
        """
        with self._unavailable_on_busy():
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
                    conn.executescript(
                        "BEGIN IMMEDIATE;"
                        + schema.DDL
                        + "INSERT OR IGNORE INTO store_info VALUES ('schema_version', "
                        + f"'{schema.SCHEMA_VERSION}');"
                    )
                    for statement in schema.LATE_INDEXES:
                        conn.execute(statement)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise

    # --- capacity ----------------------------------------------------------------------

    def _record_default_capacity(self) -> int | None:
        """The recorded capacity; records the policy's default when there is none yet."""
        with self._read() as conn:
            recorded = self._stored_capacity(conn)
            held = room.held_bytes(conn)
            marked = room.marked_give_back(conn)
        if self.read_only:
            return recorded
        if marked and self._can_punch():
            self._finish_marks()  # a crash came between marking and punching
        if recorded is not None:
            return recorded
        return self._default_capacity(held)

    def _record_capacity_if_none(self, capacity_bytes: int) -> int | None:
        with self._write() as conn:
            if self._stored_capacity(conn) is None:
                self._store_capacity(conn, capacity_bytes)
            return self._stored_capacity(conn)

    @staticmethod
    def _stored_capacity(conn: sqlite3.Connection) -> int | None:
        row = conn.execute("SELECT value FROM store_info WHERE name = 'capacity_bytes'")
        found = row.fetchone()
        return int(found[0]) if found else None

    @staticmethod
    def _store_capacity(conn: sqlite3.Connection, value: int) -> None:
        conn.execute(
            "INSERT INTO store_info VALUES ('capacity_bytes', ?)"
            " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            (str(int(value)),),
        )

    def _set_capacity(self, capacity_bytes: int) -> None:
        with self._write() as conn:
            self._store_capacity(conn, capacity_bytes)

    def _capacity_held(self) -> tuple[int | None, int]:
        with self._read() as conn:
            return self._stored_capacity(conn), room.held_bytes(conn)

    def _bounds(self, conn: sqlite3.Connection) -> room.Bounds:
        cap = self._stored_capacity(conn)
        return room.Bounds(
            capacity=cap,
            high=self.high_watermark,
            low=self.low_watermark,
            quotas=room.quota_scopes(conn, self.policy.quota_bytes(cap)),
            can_punch=self._can_punch(),
        )

    def _can_punch(self) -> bool:
        """Whether freed pages' space can go back to the file system from this process
        (`giveback.HolePuncher`: the storage root is here and punches holes)."""
        return self._puncher.available()

    def _punch(self, marked: Sequence[GiveBack]) -> tuple[list[GiveBack], list[GiveBack]]:
        """Punch marked pages; returns (punched, refused)."""
        return self._puncher.punch(marked)

    def _give_back(self, marked: Sequence[GiveBack]) -> None:
        """Punch pages marked in a committed transaction, then settle their marks."""
        if not marked or self.policy.storage_root is None:
            return
        done, refused = self._punch(marked)
        try:
            with self._write() as conn:
                room.settle_give_back(conn, done, refused)
        except MetadataUnavailable as exc:  # settled by the next store that opens
            logger.warning("pages given back but not yet settled: %s", exc)

    def _finish_marks(self) -> None:
        """Punch and settle marks a crashed process left, under the writer lock (so no
        other process settles and reuses those pages meanwhile)."""
        with self._write() as conn:
            marked = room.marked_give_back(conn)
            if marked:
                done, refused = self._punch(marked)
                room.settle_give_back(conn, done, refused)

    @contextmanager
    def _unavailable_on_busy(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF  # the primary code
            if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise MetadataUnavailable(
                    f"metadata store {self.path} stayed busy for {self.busy_timeout_s:g}s"
                ) from None
            if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN):
                raise _read_only_error(self.path) from None
            if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR):
                raise MetadataUnavailable(
                    f"metadata store {self.path} cannot be written: {exc}",
                    hint="free space on its file system, or check that it is writable",
                ) from None
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
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE … COMMIT), counters flushed within."""
        conn = self._conn()
        with self._unavailable_on_busy(), self._exclusive():
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                self._flush_counters(conn)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction on a consistent snapshot."""
        conn = self._conn()
        with self._unavailable_on_busy():
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")

    def _flush_counters(self, conn: sqlite3.Connection) -> None:
        with self._counters_lock:
            counters, self._counters = self._counters, {}
            self._last_flush = time.monotonic()
        if counters:
            now = time.time()
            conn.executemany(
                "UPDATE namespaces SET lookups = lookups + ?, lookup_keys = lookup_keys + ?,"
                " hit_keys = hit_keys + ?, last_used = MAX(last_used, ?) WHERE id = ?",
                [(c[0], c[1], c[2], now, ns) for ns, c in counters.items()],
            )

    def flush(self) -> None:
        """Write the in-memory lookup counters now (a read-only store drops them)."""
        if self.read_only:
            self._counters = {}
        elif self._counters:
            with self._write():
                pass

    def close(self, *, truncate_wal: bool = False) -> None:
        """Flush counters and close every connection this store opened.

        Args:
            truncate_wal: first copy the whole WAL into the database and truncate it to
                zero bytes (`wal_checkpoint(TRUNCATE)`), for a server shutting down: the
                database file alone is then complete. Waits at most a second for other
                processes' readers; if they still hold it, the WAL is left to them.
        """
        try:
            self.flush()
        except MetadataUnavailable:
            logger.warning("metadata store %s: lookup counters not flushed (busy)", self.path)
        if self._checkpointer is not None:
            self._checkpointer.stop()
        if truncate_wal:
            self.checkpoint_wal()
        self._close_connections()

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
        (writers keep writing; `meta/backup.py`)."""
        return backup_database(
            self.path, out, progress=progress, busy_timeout_s=self.busy_timeout_s
        )

    # --- namespaces --------------------------------------------------------------------

    def _register_namespace(
        self, namespace: str, manifest: dict[str, Any], num_ranks: int
    ) -> NamespaceInfo:
        with self._write() as conn:
            return namespaces.insert_namespace(conn, namespace, manifest, num_ranks)

    def _register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        with self._write() as conn:
            return namespaces.insert_rank_file(conn, namespace, rank_file)

    def _get_namespace(self, namespace: str) -> NamespaceInfo:
        with self._read() as conn:
            return namespaces.namespace_info(conn, namespace)

    def namespaces(self) -> list[NamespaceInfo]:
        """Every registered namespace, oldest first."""
        with self._read() as conn:
            return namespaces.all_namespaces(conn)

    def _ranks_of(self, conn: sqlite3.Connection, namespace: str) -> int:
        cached = self._num_ranks.get(namespace)
        if cached is not None:
            return cached
        check_namespace_id(namespace)
        row = conn.execute("SELECT num_ranks FROM namespaces WHERE id = ?", (namespace,))
        found = row.fetchone()
        if found is None:
            raise NotFound(f"namespace {namespace} is not registered")
        self._num_ranks[namespace] = int(found[0])
        return int(found[0])

    def _rank_file(self, conn: sqlite3.Connection, namespace: str, rank: int) -> tuple[int, ...]:
        """(num_pages, next_unused, used) of a registered rank file, else `NotFound`."""
        self._ranks_of(conn, namespace)
        row = conn.execute(
            "SELECT num_pages, next_unused, used FROM rank_files WHERE namespace = ? AND rank = ?",
            (namespace, rank),
        ).fetchone()
        if row is None:
            raise NotFound(f"rank {rank} of namespace {namespace} has no registered page file")
        return tuple(row)

    # --- data path ---------------------------------------------------------------------

    def _lookup(self, namespace: str, keys: Sequence[str]) -> int:
        with self._read() as conn:
            num_ranks = self._ranks_of(conn, namespace)
            hits = self._index.leading_hits(conn, namespace, keys, num_ranks)
        with self._counters_lock:
            counter = self._counters.setdefault(namespace, [0, 0, 0])
            counter[0] += 1
            counter[1] += len(keys)
            counter[2] += hits
            due = time.monotonic() - self._last_flush > _FLUSH_INTERVAL_S
        if due:
            self._flush_if_free()
        return hits

    def _flush_if_free(self) -> None:
        """Write the lookup counters if no writer holds the database now; never waits.

        A lookup must not wait for writers (the server answers lookups on its event loop):
        when the lock is taken the counters stay in memory for the next write.
        """
        if self._writer is None:
            return
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
                conn.execute("ROLLBACK")

    def _locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        found = self._locate_rows(namespace, rank, keys)
        return _LOCATIONS.validate_python(
            [
                None
                if row is None
                else {"key": key, "page": row[0], "checksum": row[1], "size": row[2]}
                for key in keys
                for row in (found.get(key),)
            ]
        )

    def _locate_rows(
        self, namespace: str, rank: int, keys: Sequence[str]
    ) -> dict[str, tuple[int, str, int]]:
        """`(page, checksum, size)` of each committed key of `keys`; takes the leases."""
        now = time.time()
        found: dict[str, tuple[int, str, int]] = {}
        with self._write() as conn:
            self._ranks_of(conn, namespace)
            for chunk in _chunks(keys):
                for key, page, checksum, size in conn.execute(
                    "SELECT key, page, checksum, size FROM entries INDEXED BY entries_by_key"
                    " WHERE namespace = ?"
                    f" AND key IN ({_placeholders(len(chunk))}) AND rank = ? AND state = 1",
                    (namespace, *chunk, rank),
                ):
                    found[key] = (page, checksum, size)
            pages = sorted({row[0] for row in found.values()})
            for chunk_pages in _chunks(pages):
                conn.execute(
                    "UPDATE entries SET hits = hits + 1, last_access = ?,"
                    " lease_until = MAX(lease_until, ?) WHERE namespace = ? AND rank = ?"
                    f" AND page IN ({_placeholders(len(chunk_pages))})",
                    (now, now + self.lease_s, namespace, rank, *chunk_pages),
                )
            if found:
                conn.execute(
                    "UPDATE namespaces SET hits = hits + ?, last_used = ? WHERE id = ?",
                    (len(found), now, namespace),
                )
        return found

    def _giving_back_elsewhere(self) -> bool:
        """Whether some writer's freed pages are marked and not yet punched."""
        with self._read() as conn:
            row = conn.execute(
                f"SELECT 1 FROM free_pages WHERE punched = {room.GIVING_BACK} LIMIT 1"
            ).fetchone()
        return row is not None

    def _allocate_once(
        self, namespace: str, rank: int, unique: list[str], depth_of: dict[str, int]
    ) -> Attempt:
        """One allocation transaction: regrant dead writers' pending keys, make room
        (`eviction.evict_for_allocation` for a full file, `capacity.room_for` for the
        store's capacity and quotas), take pages."""
        now = time.time()
        marked: list[GiveBack] = []
        allocated: list[tuple[str, int]] = []
        existing: list[str] = []
        with self._write() as conn:
            num_pages, _, used = self._rank_file(conn, namespace, rank)
            known: dict[str, tuple[int, int, float | None]] = {}
            for chunk in _chunks(unique):
                for key, state, page, deadline in conn.execute(
                    "SELECT key, state, page, deadline FROM entries INDEXED BY entries_by_key"
                    " WHERE namespace = ?"
                    f" AND key IN ({_placeholders(len(chunk))}) AND rank = ?",
                    (namespace, *chunk, rank),
                ):
                    known[key] = (state, page, deadline)
            regrant: list[tuple[float, int, str]] = []
            new_keys: list[str] = []
            for key in unique:
                entry = known.get(key)
                if entry is None:
                    new_keys.append(key)
                elif entry[0] == schema.PENDING and (entry[2] or 0) < now:
                    regrant.append((now + self.pending_timeout_s, depth_of[key], key))
                    allocated.append((key, entry[1]))
                else:
                    existing.append(key)
            if regrant:
                conn.executemany(
                    "UPDATE entries SET deadline = ?, depth = ?, created = MAX(created, ?)"
                    " WHERE namespace = ? AND key = ? AND rank = ? AND state = 0",
                    [(d, depth, now, namespace, key, rank) for d, depth, key in regrant],
                )
            need = len(new_keys)
            pages: list[tuple[int, float]] = []
            if need:
                if used + need > self.high_watermark * num_pages:  # the file itself is full
                    reclaim_expired(conn, namespace, rank, now)
                    target = int(self.low_watermark * num_pages) - need
                    evict_for_allocation(conn, namespace, rank, now, target)
                bounds = self._bounds(conn)
                marked = bounds.given_back
                row = room.rank_file_row(conn, namespace, rank)
                assert row is not None
                grant = room.room_for(conn, row, need, now, bounds)
                row = room.rank_file_row(conn, namespace, rank)
                assert row is not None
                pages = room.take_pages(conn, row, grant, now, bounds.capacity)
            granted = new_keys[: len(pages)]
            deadline = now + self.pending_timeout_s
            conn.executemany(
                "INSERT INTO entries (namespace, key, rank, page, state, depth, created,"
                " last_access, deadline, page_free_at) VALUES (?,?,?,?,0,?,?,?,?,?)",
                [
                    (namespace, key, rank, page, depth_of[key], now, now, deadline, free_at)
                    for key, (page, free_at) in zip(granted, pages, strict=False)
                ],
            )
            if granted:
                conn.execute(
                    "UPDATE rank_files SET used = used + ? WHERE namespace = ? AND rank = ?",
                    (len(granted), namespace, rank),
                )
            allocated.extend((key, page) for key, (page, _) in zip(granted, pages, strict=False))
        return allocated, existing, new_keys[len(pages) :], marked

    def _commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        now = time.time()
        with self._write() as conn:
            self._rank_file(conn, namespace, rank)
            cursor = conn.executemany(
                "UPDATE entries SET state = 1, checksum = ?, size = ?, deadline = NULL,"
                " last_access = ? WHERE namespace = ? AND rank = ? AND page = ? AND key = ?"
                " AND state = 0",
                [
                    (item.checksum, item.size, now, namespace, rank, item.page, item.key)
                    for item in items
                ],
            )
            self._commits += 1
            if self._commits % 512 == 0:
                prune_changes(conn)
            return max(cursor.rowcount, 0)

    def _release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        now = time.time()
        released = 0
        with self._write() as conn:
            self._rank_file(conn, namespace, rank)
            for key, page in ((a.key, a.page) for a in allocations):
                cursor = conn.execute(
                    "DELETE FROM entries WHERE namespace = ? AND rank = ? AND page = ?"
                    " AND key = ? AND state = 0",
                    (namespace, rank, page, key),
                )
                if cursor.rowcount:
                    conn.execute(
                        "INSERT INTO free_pages (namespace, rank, page, reusable_after)"
                        " VALUES (?,?,?,?)",
                        (namespace, rank, page, now),
                    )
                    released += 1
            if released:
                conn.execute(
                    "UPDATE rank_files SET used = used - ? WHERE namespace = ? AND rank = ?",
                    (released, namespace, rank),
                )
        return released

    def _invalidate(self, namespace: str, rank: int, triples: list[tuple[str, int, str]]) -> int:
        with self._write() as conn:
            self._rank_file(conn, namespace, rank)
            return invalidate_pages(conn, namespace, rank, triples, time.time())

    # --- admin -------------------------------------------------------------------------

    def _evict(self, request: EvictRequest) -> EvictResult:
        conn = self._conn()
        marked: list[GiveBack] = []
        with self._unavailable_on_busy(), self._exclusive():
            conn.execute("BEGIN IMMEDIATE")
            try:
                if request.namespace is not None:
                    self._ranks_of(conn, request.namespace)
                now = time.time()
                result = evict_entries(conn, request, now, self._stored_capacity(conn))
                if request.dry_run:
                    conn.execute("ROLLBACK")
                else:
                    if self._can_punch():  # the space goes back to the store
                        marked = room.mark_give_back(conn, now)
                    self._flush_counters(conn)
                    conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        self._give_back(marked)
        return result

    def stats(self) -> StoreStats:
        """Usage and traffic of every namespace and of the whole store."""
        self.flush()
        from hf3fsctl.meta.sqlite.reports import store_stats

        with self._read() as conn:
            cap = self._stored_capacity(conn)
            return store_stats(
                conn,
                capacity=cap,
                quotas=self.policy.quota_bytes(cap),
                max_pinned=self.policy.max_pinned_bytes(cap),
                now=time.time(),
            )

    # --- pins and namespace clean-up ---------------------------------------------------

    def _pin(self, namespace: str, keys: Sequence[str], ttl_s: float | None) -> PinResult:
        with self._write() as conn:
            self._ranks_of(conn, namespace)
            cap = self._stored_capacity(conn)
            return pins.pin_keys(
                conn, namespace, keys, ttl_s, time.time(), self.policy.max_pinned_bytes(cap)
            )

    def _unpin(self, namespace: str, keys: Sequence[str] | None) -> int:
        with self._write() as conn:
            return pins.unpin_keys(conn, namespace, keys)

    def _list_pins(self, namespace: str | None, limit: int) -> list[PinInfo]:
        with self._read() as conn:
            return pins.list_pins(conn, namespace, time.time(), limit)

    def _drop_namespaces(self, namespace_ids: list[str], dry_run: bool) -> DropNamespacesResult:
        with self._write() as conn:
            now = time.time()
            dropped = [
                namespaces.drop_namespace(conn, ns, now, dry_run=dry_run) for ns in namespace_ids
            ]
            if dry_run:
                conn.execute("ROLLBACK")
                conn.execute("BEGIN IMMEDIATE")  # `_write` commits an empty transaction
        for item in dropped:
            if item.skipped is None and not dry_run:
                self._num_ranks.pop(item.id, None)
        return DropNamespacesResult(namespaces=dropped, dry_run=dry_run)

    def _list_entries(self, namespace: str | None, limit: int, offset: int) -> list[EntryInfo]:
        where, args = ("WHERE namespace = ?", [namespace]) if namespace else ("", [])
        with self._read() as conn:
            rows = conn.execute(
                "SELECT namespace, key, rank, page, size, checksum, state, depth, created,"
                f" last_access, hits FROM entries {where}"
                " ORDER BY last_access DESC, depth ASC, key, rank LIMIT ? OFFSET ?",
                (*args, limit, offset),
            ).fetchall()
            pinned = pins.pinned_among(conn, [(r[0], r[1]) for r in rows], time.time())
        return [
            EntryInfo.model_construct(
                namespace=r[0],
                key=r[1],
                rank=r[2],
                page=r[3],
                size=r[4],
                checksum=r[5],
                state="committed" if r[6] == schema.COMMITTED else "pending",
                depth=r[7],
                created=r[8],
                last_access=r[9],
                hits=r[10],
                pinned=(r[0], r[1]) in pinned,
            )
            for r in rows
        ]

    def health(self) -> dict[str, Any]:
        """A cheap liveness check: the database answers a query."""
        with self._read() as conn:
            count = conn.execute("SELECT COUNT(*) FROM namespaces").fetchone()[0]
        return {"status": "ok", "store": "sqlite", "namespaces": int(count)}

    def check_invariants(self) -> list[str]:
        """Every violated invariant of the database, one line each; empty when sound."""
        problems: list[str] = []
        with self._read() as conn:
            for template, query in schema.INVARIANT_QUERIES:
                problems.extend(template.format(*row) for row in conn.execute(query))
        return problems

    def _changes(self, since: int, namespace: str | None, limit: int) -> ChangeLog:
        with self._read() as conn:
            return read_changes(conn, since, namespace, limit)

    def check_integrity(self) -> list[str]:
        """SQLite's own check of the file (`PRAGMA integrity_check`): B-trees, indexes,
        page links. Empty when sound; reads every page, so it takes a while on a large
        store (doctor runs it, not the hot path)."""
        with self._read() as conn:
            rows = [str(r[0]) for r in conn.execute("PRAGMA integrity_check")]
        return [] if rows == ["ok"] else rows
