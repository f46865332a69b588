"""`MetadataStore`: the durable, bounded metadata of the KV-page tier, in SQLite.

Contract (decisions 4–5 in docs/design.md; the protocols in `meta/protocol.py`):

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
- Capacity (`meta/sqlite/capacity.py`): one recorded capacity for the whole store; an
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

import logging
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from pydantic import TypeAdapter

from hf3fsctl.errors import InvalidRequest, MetadataUnavailable, NotFound
from hf3fsctl.keys import check_namespace_id
from hf3fsctl.meta.base import Attempt, StoreCore, check_retention, require_keys
from hf3fsctl.meta.giveback import GiveBack
from hf3fsctl.meta.models import (
    INT_MAX,
    Allocation,
    ChangeLog,
    CommitItem,
    DropNamespacesResult,
    EntryInfo,
    EvictRequest,
    EvictResult,
    Location,
    NamespaceInfo,
    PageGrant,
    PageLocation,
    PinInfo,
    PinResult,
    RankFile,
    StoreStats,
    WriterInfo,
)
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite import admission, namespaces, pins, schema
from hf3fsctl.meta.sqlite import capacity as room
from hf3fsctl.meta.sqlite.committed_index import (
    leading_hits,
    padded,
    prepare_leading_hits,
    prune_changes,
    read_changes,
)
from hf3fsctl.meta.sqlite.database import SqliteDatabase
from hf3fsctl.meta.sqlite.eviction import (
    EVICT_BEYOND_NEED,
    admin_cutoff,
    drop_expired,
    evict_entries,
    evict_for_allocation,
    invalidate_pages,
    reclaim_expired,
)
from hf3fsctl.meta.sqlite.lookup_cache import CommittedKeyCache

logger = logging.getLogger(__name__)

T = TypeVar("T")
_LOCATIONS = TypeAdapter(list[Location | None])
_CHUNK = 500  # keys per SQL statement (well under SQLite's variable limit)
# Keys an admin eviction drops per transaction (~36 µs each: ~75 ms of the writer lock;
# Redis takes 1,000 per script call, `redis/store.py: EVICT_BATCH`).
ADMIN_EVICT_KEYS = 2048


def _placeholders(n: int) -> str:
    return ",".join("?" * n)


# The IN-list sizes the lease statement is written for (`committed_index.padded`; a
# step's key count varies, and `prepare_locate_pages` compiles each size ahead).
_IN_SIZES = (8, 32, 128, _CHUNK)


def _lease_sql(size: int) -> str:
    """The lease statement of `locate_pages` for `size` keys (its text is the key of the
    connection's statement cache: `prepare_locate_pages` compiles the same one)."""
    return (
        "UPDATE entries INDEXED BY entries_by_key SET hits = hits + 1,"
        " last_access = ?, lease_until = MAX(lease_until, ?) WHERE namespace = ?"
        f" AND key IN ({_placeholders(size)}) AND rank = ? AND state = 1"
        " AND (expires_at IS NULL OR expires_at > ?)"
        " RETURNING key, page, checksum, size, renew_s"
    )


_COUNT_HITS = "UPDATE namespaces SET hits = hits + ?, last_used = ? WHERE id = ?"
_NUM_RANKS = "SELECT num_ranks FROM namespaces WHERE id = ?"


def _chunks(items: Sequence[T], size: int = _CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class MetadataStore(SqliteDatabase, StoreCore):
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
            f"sqlite://{os.path.abspath(self.path)}",
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            pending_timeout_s=pending_timeout_s,
            policy=policy,
        )
        self._num_ranks: dict[str, int] = {}  # immutable once registered
        self._committed_keys = CommittedKeyCache()  # lookups' recent hits (issue 21)
        self._commits = 0
        self._open_database(
            busy_timeout_s=busy_timeout_s,
            durable=durable,
            background_checkpoint=background_checkpoint,
            read_only=read_only,
        )
        with self._read() as conn:  # False only for a read-only reader of an older store
            self._has_key_lru = schema.has_key_lru(conn)
            self._has_expiry = schema.has_column(conn, "key_lru", "expires_at")
        self._record_default_capacity()
        self._start_checkpointer()

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

    def _record_writer(self, namespace: str, writer: WriterInfo) -> None:
        with self._write() as conn:
            namespaces.insert_writer(conn, namespace, writer)

    def _writers(self, namespace: str | None) -> dict[str, list[WriterInfo]]:
        with self._read() as conn:
            return namespaces.all_writers(conn, namespace)

    def _ranks_of(self, conn: sqlite3.Connection, namespace: str) -> int:
        cached = self._num_ranks.get(namespace)
        if cached is not None:
            return cached
        check_namespace_id(namespace)
        found = conn.execute(_NUM_RANKS, (namespace,)).fetchone()
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
            hits = leading_hits(
                conn,
                namespace,
                keys,
                num_ranks,
                time.time(),
                self._has_key_lru,
                self._has_expiry,
                self._committed_keys,
            )
        self._count_lookup(namespace, len(keys), hits)
        return hits

    def prepare_lookup(self) -> None:
        """Have this thread's connection compile what `lookup` runs (the rank count's
        query, `committed_index.prepare_leading_hits`: the probe at each padded size and
        the key cache's reads of the log), so that a process's first lookups compile
        nothing (issue 23). Reads only: nothing stored, cached or counted changes."""
        with self._read() as conn:
            conn.execute(_NUM_RANKS, ("",)).fetchall()
            prepare_leading_hits(conn, self._has_key_lru, self._has_expiry, self._committed_keys)

    def _locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        found = self._locate_rows(namespace, rank, keys)
        # one validation of the whole list, in pydantic's core: cheaper than building
        # each `Location` unvalidated (`model_construct` runs Python per field)
        return _LOCATIONS.validate_python(
            [
                None
                if row is None
                else {"key": row.key, "page": row.page, "checksum": row.checksum, "size": row.size}
                for row in map(found.get, keys)
            ]
        )

    def locate_pages(
        self, namespace: str, rank: int, keys: Sequence[str]
    ) -> list[PageLocation | None]:
        """`locate` as tuples (`LocatesPages`): the rows the lease statement returned,
        without a model each (what `Tier.load` reads on the engine thread)."""
        require_keys(keys)
        check_namespace_id(namespace)
        return list(map(self._locate_rows(namespace, rank, keys).get, keys))

    def _locate_rows(
        self, namespace: str, rank: int, keys: Sequence[str]
    ) -> dict[str, PageLocation]:
        """The `PageLocation` of each committed, unexpired key of `keys`; takes the
        leases, and renews the expiry of entries committed with `renew_on_read`.

        The leases (with the hit counts and access times) are taken by the statement
        that finds the entries (`UPDATE … RETURNING`, one per chunk of keys): each entry
        is found once, through `entries_by_key`.
        """
        now = time.time()
        found: dict[str, PageLocation] = {}
        renew: list[int] = []
        with self._write() as conn:
            self._ranks_of(conn, namespace)
            # a key named twice is leased (and counted) once, as one statement would
            for chunk in (padded(c, _IN_SIZES) for c in _chunks(list(dict.fromkeys(keys)))):
                for key, page, checksum, size, renew_s in conn.execute(
                    _lease_sql(len(chunk)), (now, now + self.lease_s, namespace, *chunk, rank, now)
                ):
                    found[key] = PageLocation(key, page, checksum, size)
                    if renew_s is not None:
                        renew.append(page)
            for chunk_pages in _chunks(renew):
                conn.execute(
                    "UPDATE entries SET expires_at = ? + renew_s WHERE namespace = ?"
                    f" AND rank = ? AND page IN ({_placeholders(len(chunk_pages))})",
                    (now, namespace, rank, *chunk_pages),
                )
            if found:
                conn.execute(_COUNT_HITS, (len(found), now, namespace))
        return found

    def prepare_locate_pages(self, namespace: str, rank: int) -> None:
        """Have this thread's connection compile what `locate_pages` runs (the lease
        statement at each of `_IN_SIZES`, the hit count) and read the namespace's rank
        count, so that a process's first load pays neither (~0.5 ms, issue 23).

        Changes nothing a reader sees: the statements name a rank no entry has and a
        namespace id no namespace has, so they change no row, and a transaction that
        changed none commits without writing to the WAL (its `COMMIT` is compiled too);
        the pending lookup counters are left for the next real write. A read-only store
        takes no leases: nothing to do.
        """
        if self.read_only:
            return
        check_namespace_id(namespace)
        with self._write(flush_counters=False) as conn:
            self._ranks_of(conn, namespace)
            for size in _IN_SIZES:
                keys = [""] * size
                conn.execute(_lease_sql(size), (0.0, 0.0, namespace, *keys, -1, 0.0))
            conn.execute(_COUNT_HITS, (0, 0.0, ""))

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
                for key, state, page, deadline, expires_at in conn.execute(
                    "SELECT key, state, page, deadline, expires_at FROM entries"
                    " INDEXED BY entries_by_key WHERE namespace = ?"
                    f" AND key IN ({_placeholders(len(chunk))}) AND rank = ?",
                    (namespace, *chunk, rank),
                ):
                    # a pending entry's third field is its writer's deadline, a
                    # committed one's its expiry
                    known[key] = (state, page, deadline if state == schema.PENDING else expires_at)
            regrant: list[tuple[float, int, str]] = []
            new_keys: list[str] = []
            expired = [
                key
                for key, (state, _, expires_at) in known.items()
                if state == schema.COMMITTED and expires_at is not None and expires_at <= now
            ]
            if expired:  # absent for a save too: dropped on every rank, saved anew
                drop_expired(conn, namespace, expired, now)
                for key in expired:
                    del known[key]
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
                    evict_for_allocation(
                        conn, namespace, rank, now, target, limit=need + EVICT_BEYOND_NEED
                    )
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

    def allocate_pages(
        self,
        namespace: str,
        rank: int,
        keys: Sequence[str],
        first_depth: int = 0,
        depths: Sequence[int] | None = None,
    ) -> PageGrant:
        """`allocate` as tuples (`SavesPages`): the same checks and transactions, without a
        model per page (what `Tier.save` calls on the save threads). `depths` gives each
        key its chain position (the chains of several requests in one call)."""
        return PageGrant(*self._allocate_keys(namespace, rank, keys, first_depth, depths))

    def commit_pages(
        self,
        namespace: str,
        rank: int,
        pages: Sequence[tuple[str, int, str]],
        size: int,
        retention_s: float | None = None,
        renew_on_read: bool = False,
    ) -> int:
        """`commit` as tuples (`SavesPages`): `(key, page, checksum)` per written page,
        all of `size` bytes and the same retention; the checks `CommitItem` makes of the
        stored fields, without a model per page."""
        if not pages:
            return 0
        check_namespace_id(namespace)
        if retention_s is not None:
            check_retention(retention_s)
        if type(size) is not int or not 0 <= size <= INT_MAX:
            raise InvalidRequest(f"size must be an integer in 0..{INT_MAX}, got {size!r}")
        for _, _, checksum in pages:
            if type(checksum) is not str or not 0 < len(checksum) <= 64:
                raise InvalidRequest(f"a checksum is 1..64 characters, got {checksum!r}")
        if retention_s is None:
            return self._commit_rows(namespace, rank, [(*p, size) for p in pages], [])
        renew = retention_s if renew_on_read else None
        return self._commit_rows(
            namespace, rank, [], [(*p, size, float(retention_s), renew) for p in pages]
        )

    def _commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        return self._commit_rows(
            namespace,
            rank,
            [(i.key, i.page, i.checksum, i.size) for i in items if i.retention_s is None],
            [
                (
                    i.key,
                    i.page,
                    i.checksum,
                    i.size,
                    float(i.retention_s),
                    i.retention_s if i.renew_on_read else None,
                )
                for i in items
                if i.retention_s is not None
            ],
        )

    def _commit_rows(
        self,
        namespace: str,
        rank: int,
        plain: Sequence[tuple[str, int, str, int]],
        expiring: Sequence[tuple[str, int, str, int, float, float | None]],
    ) -> int:
        """One commit transaction: `plain` rows are (key, page, checksum, size),
        `expiring` ones add (retention_s, renew_s or None)."""
        now = time.time()
        committed = 0
        with self._write() as conn:
            self._rank_file(conn, namespace, rank)
            if plain:  # no expiry named: the expiry triggers are not even considered
                committed += conn.executemany(
                    "UPDATE entries SET state = 1, checksum = ?, size = ?, deadline = NULL,"
                    " last_access = ? WHERE namespace = ? AND rank = ? AND page = ?"
                    " AND key = ? AND state = 0",
                    [
                        (checksum, size, now, namespace, rank, page, key)
                        for key, page, checksum, size in plain
                    ],
                ).rowcount
            if expiring:
                committed += conn.executemany(
                    "UPDATE entries SET state = 1, checksum = ?, size = ?, deadline = NULL,"
                    " last_access = ?, expires_at = ?, renew_s = ? WHERE namespace = ?"
                    " AND rank = ? AND page = ? AND key = ? AND state = 0",
                    [
                        (checksum, size, now, now + retention, renew, namespace, rank, page, key)
                        for key, page, checksum, size, retention, renew in expiring
                    ],
                ).rowcount
            admission.forget_committed(
                conn, namespace, [row[0] for row in plain] + [row[0] for row in expiring]
            )
            self._commits += 1
            if self._commits % 512 == 0:
                prune_changes(conn)
            return max(committed, 0)

    def _admit(self, namespace: str, keys: list[str], after_hits: int) -> list[bool]:
        with self._write() as conn:
            self._ranks_of(conn, namespace)  # NotFound
            return admission.admit_keys(conn, namespace, keys, after_hits, time.time())

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
        """In transactions of at most `ADMIN_EVICT_KEYS` keys (the LRU order, and an
        `older_than_s` cutoff fixed at the first, hold across them; a key another writer
        touches meanwhile may move in it), so that evicting a large store never holds
        the writer lock for long — a store's every save waits on it. A dry run is one
        transaction, rolled back."""
        if request.dry_run:
            return self._evict_batch(request, None)
        before = admin_cutoff(request, time.time())
        keys = pages = freed = 0
        by_namespace: dict[str, int] = {}
        while True:
            left = None if request.max_entries is None else request.max_entries - keys
            budget = ADMIN_EVICT_KEYS if left is None else min(left, ADMIN_EVICT_KEYS)
            done = self._evict_batch(request.model_copy(update={"max_entries": budget}), before)
            keys, pages, freed = keys + done.keys, pages + done.pages, freed + done.bytes
            for namespace, count in done.by_namespace.items():
                by_namespace[namespace] = by_namespace.get(namespace, 0) + count
            if done.keys < budget or budget == left:
                break
        return EvictResult(
            keys=keys, pages=pages, bytes=freed, dry_run=False, by_namespace=by_namespace
        )

    def _evict_batch(self, request: EvictRequest, before: float | None) -> EvictResult:
        """One transaction of `_evict`."""
        marked: list[GiveBack] = []
        with self._typed_errors(), self._exclusive():
            conn = self._conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                if request.namespace is not None:
                    self._ranks_of(conn, request.namespace)
                now = time.time()
                result = evict_entries(conn, request, now, self._stored_capacity(conn), before)
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
                expiry=self._has_expiry,
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
        from hf3fsctl.meta.sqlite.reports import list_entries

        with self._read() as conn:
            return list_entries(
                conn, namespace, limit, offset, now=time.time(), has_expiry=self._has_expiry
            )

    def health(self) -> dict[str, Any]:
        """A cheap liveness check: the database file is reachable and answers a query
        (SQLite may answer from its cache when the file system is gone: a FUSE mount
        whose daemon exited, so the file is looked at first)."""
        lost = self._lost()
        if lost is not None:
            raise lost
        with self._read() as conn:
            count = conn.execute("SELECT COUNT(*) FROM namespaces").fetchone()[0]
        return {"status": "ok", "store": "sqlite", "namespaces": int(count)}

    def check_invariants(self) -> list[str]:
        """Every violated invariant of the database, one line each; empty when sound."""
        problems: list[str] = []
        with self._read() as conn:
            lru = schema.has_key_lru(conn)  # a read-only reader of an older store: none
            for template, query in schema.INVARIANT_QUERIES:
                if not lru and schema.KEY_LRU_TABLE in query:
                    continue
                if not self._has_expiry and any(
                    column in query for column in ("expires_at", "admission", "l.pinned")
                ):
                    continue
                problems.extend(template.format(*row) for row in conn.execute(query))
        return problems

    def _changes(self, since: int, namespace: str | None, limit: int) -> ChangeLog:
        with self._read() as conn:
            return read_changes(conn, since, namespace, limit)
