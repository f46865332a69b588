"""The SQLite schema of the metadata store, and the invariants it must keep.

Tables:

- `namespaces`: one row per namespace (manifest JSON, rank count, durable traffic
  counters).
- `store_info`: `schema_version`, and `capacity_bytes` (the store's one budget, shared by
  every namespace and rank; absent = unbounded).
- `namespaces`: … plus `last_used` (registration, lookups, loads), for `evict --stale`.
- `writers`: one row per (namespace, writer id): the numerics of an engine that wrote
  pages to it (`Registry.record_writer`). Added without a format step: a store opened
  for writing creates it; a read-only reader of a store without it sees no writers.
- `rank_files`: one row per (namespace, rank) page file; `next_unused` is the high-water
  mark of pages ever handed out, `used` the pages held by entries, `holes` the free pages
  whose disk space was given back (punched). A growing file holds
  `(next_unused - holes) * slot_bytes` of disk; a `preallocated` one its whole size.
- `entries`: one row per (namespace, key, rank): the page, its state (0 pending,
  1 committed), checksum, size, chain depth, times, hits, the pending writer's
  `deadline`, the read `lease_until`, and `page_free_at` (when the page it took from the
  free list became reusable; 0 for a never-used page).
- `free_pages`: pages given back, each reusable only after `reusable_after` (the latest
  read lease of the entry that held it); `punched` 1 once its disk space was returned,
  2 while it is being given back (`meta/sqlite/capacity.py`).
- `pins`: (namespace, key) kept out of LRU eviction until `expires` (0 = no TTL).
- `evictions`: keys and bytes evicted per namespace and reason (capacity, quota,
  file_full, admin, corrupt), cumulative, for `stats` and Prometheus.
- `key_lru`: one row per (namespace, key) with entries: its latest last access,
  greatest depth, committed rank count and earliest expiry, indexed by (namespace,
  last_access, depth DESC) for eviction and by (namespace, expires_at) for the expired
  keys eviction takes first; `lookup` probes it by key.
- `entries.expires_at` / `renew_s` (issue 22): when a committed entry expires (commit
  time + `retention_s`; NULL never) and the retention a `locate` renews it by
  (`renew_on_read`; NULL: reads never renew).
- `admission` / `admission_size`: `admit`'s sighting counts per (namespace, key), at
  most `admission.ADMISSION_TRACKED_KEYS` rows (least recently seen dropped first);
  `namespaces.admission_skipped` counts the keys it answered False.
- `changes`: an append-only log, written by triggers, of every (namespace, key) that
  gained (+1) or lost (-1) a committed rank, for followers (KV events); old rows are
  pruned.

Entries are clustered by (namespace, rank, page), not by key: the pages of one prefix
chain are allocated together, so a `locate` or `commit` of a chain rewrites a couple of
adjacent B-tree leaves instead of one random leaf per key (random block hashes). Keys
are found through the `entries_by_key` index, which those updates never touch. There is
no index on `entries.last_access`: every `locate` of every rank would rewrite it. The
LRU order is kept per key instead (`key_lru`, below: one row per key, written by
triggers), which eviction walks from the oldest key with a LIMIT.

`INVARIANT_QUERIES` are the checks `MetadataStore.check_invariants` runs: each query
returns one row per violation, rendered with its message template.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

# The store's format: recorded as `store_info.schema_version`. A store of another format
# is not opened (`meta/sqlite/migration.py`: a newer one needs a newer hf3fsctl, an older one
# `hf3fsctl migrate`).
SCHEMA_VERSION = 2

PENDING = 0
COMMITTED = 1

DDL = """
CREATE TABLE IF NOT EXISTS store_info (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS namespaces (
    id TEXT PRIMARY KEY,
    manifest TEXT NOT NULL,
    num_ranks INTEGER NOT NULL,
    created REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    lookups INTEGER NOT NULL DEFAULT 0,
    lookup_keys INTEGER NOT NULL DEFAULT 0,
    hit_keys INTEGER NOT NULL DEFAULT 0,
    last_used REAL NOT NULL DEFAULT 0,
    admission_skipped INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS writers (
    namespace TEXT NOT NULL,
    id TEXT NOT NULL,
    numerics TEXT NOT NULL,
    first_seen REAL NOT NULL,
    PRIMARY KEY (namespace, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rank_files (
    namespace TEXT NOT NULL,
    rank INTEGER NOT NULL,
    path TEXT NOT NULL,
    page_bytes INTEGER NOT NULL,
    slot_bytes INTEGER NOT NULL,
    num_pages INTEGER NOT NULL,
    next_unused INTEGER NOT NULL DEFAULT 0,
    used INTEGER NOT NULL DEFAULT 0,
    preallocated INTEGER NOT NULL DEFAULT 0,
    holes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, rank)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS entries (
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    rank INTEGER NOT NULL,
    page INTEGER NOT NULL,
    state INTEGER NOT NULL,
    checksum TEXT,
    size INTEGER NOT NULL DEFAULT 0,
    depth INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    deadline REAL,
    lease_until REAL NOT NULL DEFAULT 0,
    page_free_at REAL NOT NULL DEFAULT 0,
    expires_at REAL,
    renew_s REAL,
    PRIMARY KEY (namespace, rank, page)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS entries_by_key ON entries (namespace, key, rank);
CREATE INDEX IF NOT EXISTS entries_pending ON entries (namespace, rank, deadline)
    WHERE state = 0;
CREATE TABLE IF NOT EXISTS free_pages (
    namespace TEXT NOT NULL,
    rank INTEGER NOT NULL,
    page INTEGER NOT NULL,
    reusable_after REAL NOT NULL,
    punched INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, rank, page)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS evictions (
    namespace TEXT NOT NULL,
    reason TEXT NOT NULL,
    keys INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, reason)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS pins (
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    expires REAL NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    PRIMARY KEY (namespace, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS free_pages_by_time ON free_pages (namespace, rank, reusable_after);
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    delta INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS changes_on_insert AFTER INSERT ON entries WHEN new.state = 1
BEGIN
    INSERT INTO changes (namespace, key, delta) VALUES (new.namespace, new.key, 1);
END;
CREATE TRIGGER IF NOT EXISTS changes_on_commit AFTER UPDATE OF state ON entries
WHEN old.state != 1 AND new.state = 1
BEGIN
    INSERT INTO changes (namespace, key, delta) VALUES (new.namespace, new.key, 1);
END;
CREATE TRIGGER IF NOT EXISTS changes_on_delete AFTER DELETE ON entries WHEN old.state = 1
BEGIN
    INSERT INTO changes (namespace, key, delta) VALUES (old.namespace, old.key, -1);
END;
"""

# The LRU order of keys (`key_lru`), kept by triggers so that every writer of the store,
# of this version or an older one, keeps it: one row per (namespace, key) that has
# entries, with the latest `last_access` and the greatest `depth` of its entries (an
# access time only moves forward: a clock stepping back leaves the later one) and how
# many ranks hold it committed (`lookup` reads that: no copy of the key set in memory).
# Eviction walks the LRU order (`key_lru_unpinned`, below) from the oldest key and stops
# after the victims it needs: O(k log n). Created, and filled from `entries`, by any writable open of a store
# that lacks it (no format step: older processes keep writing the store, and the
# triggers keep the table right under them).
KEY_LRU_TABLE = "key_lru"
KEY_LRU_DDL = """
CREATE TABLE IF NOT EXISTS key_lru (
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    last_access REAL NOT NULL,
    depth INTEGER NOT NULL,
    committed INTEGER NOT NULL,
    expires_at REAL,
    pinned INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, key)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS key_lru_on_insert AFTER INSERT ON entries
BEGIN
    INSERT INTO key_lru (namespace, key, last_access, depth, committed)
    VALUES (new.namespace, new.key, new.last_access, new.depth, new.state = 1)
    ON CONFLICT (namespace, key) DO UPDATE
    SET last_access = MAX(last_access, excluded.last_access), depth = MAX(depth, excluded.depth),
        committed = committed + excluded.committed;
END;
CREATE TRIGGER IF NOT EXISTS key_lru_on_touch AFTER UPDATE OF last_access, depth ON entries
WHEN new.last_access > old.last_access OR new.depth > old.depth
BEGIN
    UPDATE key_lru
    SET last_access = MAX(last_access, new.last_access), depth = MAX(depth, new.depth)
    WHERE namespace = new.namespace AND key = new.key
      AND (last_access < new.last_access OR depth < new.depth);
END;
CREATE TRIGGER IF NOT EXISTS key_lru_on_shallower AFTER UPDATE OF depth ON entries
WHEN new.depth < old.depth
BEGIN
    UPDATE key_lru SET depth = (
        SELECT MAX(e.depth) FROM entries e
        WHERE e.namespace = new.namespace AND e.key = new.key)
    WHERE namespace = new.namespace AND key = new.key;
END;
CREATE TRIGGER IF NOT EXISTS key_lru_on_state AFTER UPDATE OF state ON entries
WHEN (old.state = 1) != (new.state = 1)
BEGIN
    UPDATE key_lru SET committed = committed + (new.state = 1) - (old.state = 1)
    WHERE namespace = new.namespace AND key = new.key;
END;
CREATE TRIGGER IF NOT EXISTS key_lru_on_delete AFTER DELETE ON entries
BEGIN
    DELETE FROM key_lru WHERE namespace = old.namespace AND key = old.key
      AND NOT EXISTS (SELECT 1 FROM entries e
                      WHERE e.namespace = old.namespace AND e.key = old.key);
    UPDATE key_lru SET
        last_access = (SELECT MAX(e.last_access) FROM entries e
                       WHERE e.namespace = old.namespace AND e.key = old.key),
        depth = (SELECT MAX(e.depth) FROM entries e
                 WHERE e.namespace = old.namespace AND e.key = old.key),
        committed = committed - (old.state = 1)
    WHERE namespace = old.namespace AND key = old.key;
END;
"""
KEY_LRU_FILL = (
    "INSERT OR IGNORE INTO key_lru (namespace, key, last_access, depth, committed, expires_at)"
    " SELECT namespace, key, MAX(last_access), MAX(depth), SUM(state = 1),"
    " MIN(CASE WHEN state = 1 THEN expires_at END) FROM entries GROUP BY namespace, key"
)
DDL += KEY_LRU_DDL


# Issue 22, added on a writable open without a format step (nullable or defaulted
# columns: an older process writing the store leaves them NULL, which means "never
# expires"): (table, column, declaration).
OPEN_COLUMNS = [
    ("entries", "expires_at", "REAL"),  # commit time + retention_s; NULL: never expires
    ("entries", "renew_s", "REAL"),  # the retention a locate renews by (renew_on_read)
    ("key_lru", "expires_at", "REAL"),  # the earliest expiry of the key's committed entries
    ("namespaces", "admission_skipped", "INTEGER NOT NULL DEFAULT 0"),
    ("key_lru", "pinned", "INTEGER NOT NULL DEFAULT 0"),  # a pins row exists (issue 21)
]
# Expiry and admission (issue 22), created once `OPEN_COLUMNS` exist:
# - `key_lru.expires_at` is the earliest `expires_at` of the key's committed entries
#   (kept by the two triggers below; a key is expired once any rank's entry is), and
#   `key_lru_by_expiry` lists the keys that have one, soonest first: eviction takes the
#   expired ones first by walking it (O(k log n)), lookups read the column per key.
# - `admission`: one row per (namespace, key) seen by `admit`, its sightings and when it
#   was last seen; `admission_by_age` finds the least recently seen to drop past the bound
#   (`meta/sqlite/admission.py`), `admission_size` counts the rows (triggers) so the bound
#   is checked without a scan.
# - `key_lru.pinned` (issue 21): 1 while a `pins` row names the key (kept by triggers on
#   `pins` and on new `key_lru` rows), and `key_lru_unpinned`, the LRU order of the keys
#   without one: LRU eviction walks it, so pinned keys at the head of the LRU order are
#   not walked again by every eviction swing (O(k log n) however many are pinned). A
#   pin past its TTL keeps its row until eviction drops expired pins first
#   (`pins_by_expiry`; `eviction.drop_expired_pins`). `key_lru_pinned` is the same order
#   of the pinned keys: an admin `evict --include-pinned` walks both, merged. Each key is
#   in one of the two, so a `locate` moves each key it touches in one LRU index (issue
#   23: the touch trigger's cost); stores written before kept a third, `key_lru_by_age`,
#   of every key, which a writable open drops (`add_open_columns`).
EXPIRY_DDL = """
CREATE INDEX IF NOT EXISTS key_lru_by_expiry ON key_lru (namespace, expires_at)
    WHERE expires_at IS NOT NULL;
CREATE TRIGGER IF NOT EXISTS key_lru_on_expiry AFTER UPDATE OF expires_at ON entries
WHEN new.expires_at IS NOT old.expires_at
BEGIN
    UPDATE key_lru SET expires_at = (
        SELECT MIN(e.expires_at) FROM entries e INDEXED BY entries_by_key
        WHERE e.namespace = new.namespace AND e.key = new.key AND e.state = 1)
    WHERE namespace = new.namespace AND key = new.key;
END;
CREATE TRIGGER IF NOT EXISTS key_lru_expiry_on_delete AFTER DELETE ON entries
WHEN old.expires_at IS NOT NULL
BEGIN
    UPDATE key_lru SET expires_at = (
        SELECT MIN(e.expires_at) FROM entries e INDEXED BY entries_by_key
        WHERE e.namespace = old.namespace AND e.key = old.key AND e.state = 1)
    WHERE namespace = old.namespace AND key = old.key;
END;
CREATE INDEX IF NOT EXISTS key_lru_unpinned ON key_lru (namespace, last_access, depth DESC)
    WHERE pinned = 0;
CREATE INDEX IF NOT EXISTS key_lru_pinned ON key_lru (namespace, last_access, depth DESC)
    WHERE pinned = 1;
CREATE INDEX IF NOT EXISTS pins_by_expiry ON pins (expires) WHERE expires != 0;
CREATE TRIGGER IF NOT EXISTS key_lru_on_pin AFTER INSERT ON pins
BEGIN
    UPDATE key_lru SET pinned = 1 WHERE namespace = new.namespace AND key = new.key;
END;
CREATE TRIGGER IF NOT EXISTS key_lru_on_unpin AFTER DELETE ON pins
BEGIN
    UPDATE key_lru SET pinned = 0 WHERE namespace = old.namespace AND key = old.key;
END;
CREATE TRIGGER IF NOT EXISTS key_lru_pinned_on_insert AFTER INSERT ON key_lru
WHEN EXISTS (SELECT 1 FROM pins p WHERE p.namespace = new.namespace AND p.key = new.key)
BEGIN
    UPDATE key_lru SET pinned = 1 WHERE namespace = new.namespace AND key = new.key;
END;
CREATE TABLE IF NOT EXISTS admission (
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    seen INTEGER NOT NULL,
    last_seen REAL NOT NULL,
    PRIMARY KEY (namespace, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS admission_by_age ON admission (last_seen);
CREATE TABLE IF NOT EXISTS admission_size (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    tracked INTEGER NOT NULL
);
INSERT OR IGNORE INTO admission_size VALUES (0, (SELECT COUNT(*) FROM admission));
CREATE TRIGGER IF NOT EXISTS admission_on_insert AFTER INSERT ON admission
BEGIN
    UPDATE admission_size SET tracked = tracked + 1 WHERE id = 0;
END;
CREATE TRIGGER IF NOT EXISTS admission_on_delete AFTER DELETE ON admission
BEGIN
    UPDATE admission_size SET tracked = tracked - 1 WHERE id = 0;
END;
"""


def has_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    """Whether `table` has `column` (False for a missing table)."""
    return any(row[1] == column for row in conn.execute(f"PRAGMA table_info({table})"))


def add_open_columns(conn: sqlite3.Connection) -> None:
    """Add `OPEN_COLUMNS` a store lacks, then `EXPIRY_DDL` (inside a write transaction)."""
    added = set()
    for table, column, declaration in OPEN_COLUMNS:
        if not has_column(conn, table, column):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            added.add((table, column))
    if ("key_lru", "pinned") in added:  # the keys pinned already
        conn.execute(
            "UPDATE key_lru SET pinned = 1 WHERE EXISTS (SELECT 1 FROM pins p"
            " WHERE p.namespace = key_lru.namespace AND p.key = key_lru.key)"
        )
    # The LRU order of every key, pinned or not, in one more index (stores written before
    # issue 23's fourth round): `key_lru_unpinned` and `key_lru_pinned` hold it now. An
    # older process that opens the store for writing creates it again (its DDL names it)
    # and keeps it up to date meanwhile; its `evict --include-pinned` needs it.
    conn.execute("DROP INDEX IF EXISTS key_lru_by_age")
    for statement in _statements(EXPIRY_DDL):
        conn.execute(statement)


def _statements(script: str) -> list[str]:
    """The statements of a DDL script (triggers kept whole: they end with END;)."""
    parts: list[str] = []
    current = ""
    for piece in script.split(";"):
        current += piece + ";"
        if sqlite3.complete_statement(current):
            if current.strip(" \n;"):
                parts.append(current.strip())
            current = ""
    return parts


def has_key_lru(conn: sqlite3.Connection) -> bool:
    """Whether the store keeps `key_lru` already (before `DDL` runs: fill it if not)."""
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (KEY_LRU_TABLE,)
    ).fetchone()
    return row is not None


# Indexes on columns a migration may have just added: created after `migration_sql`.
LATE_INDEXES = [
    # The pages being given back (few at any time): found without scanning the free list.
    "CREATE INDEX IF NOT EXISTS free_pages_giving_back ON free_pages (namespace, rank, page)"
    " WHERE punched = 2",
]

# Columns added since schema 1, as (table, column, declaration, value for existing rows).
# Files registered by schema 1 were preallocated at their full size.
_ADDED_IN_2 = [
    ("namespaces", "last_used", "REAL NOT NULL DEFAULT 0", "created"),
    ("rank_files", "preallocated", "INTEGER NOT NULL DEFAULT 0", "1"),
    ("rank_files", "holes", "INTEGER NOT NULL DEFAULT 0", "0"),
    ("free_pages", "punched", "INTEGER NOT NULL DEFAULT 0", "0"),
]


@dataclass(frozen=True)
class FormatStep:
    """One step of `hf3fsctl migrate`: what it changes, for the dry run and the log."""

    source: int  # the format it starts from
    target: int  # … and the one it leaves
    summary: str  # what changes, in a sentence
    tables: tuple[str, ...]  # the tables it alters or creates


FORMAT_STEPS = (
    FormatStep(
        1,
        2,
        "one capacity per store: adds namespaces.last_used (= created), "
        "rank_files.preallocated (= 1: format-1 files were preallocated), rank_files.holes "
        "and free_pages.punched (= 0); creates the pins and evictions tables and the index "
        "of pages being given back",
        ("namespaces", "rank_files", "free_pages", "pins", "evictions", "store_info"),
    ),
)


def stored_version(conn: sqlite3.Connection) -> int | None:
    """The format a database records; None for a database with no store in it yet."""
    has_info = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'store_info'"
    ).fetchone()
    if has_info is None:
        return None
    row = conn.execute("SELECT value FROM store_info WHERE name = 'schema_version'").fetchone()
    return None if row is None else int(row[0])


def steps_from(version: int) -> list[FormatStep]:
    """The steps that bring a store of format `version` to `SCHEMA_VERSION` (in order)."""
    return [step for step in FORMAT_STEPS if step.source >= version]


def migration_sql(version: int, columns: dict[str, set[str]]) -> str:
    """The statements that bring a store of schema `version` to `SCHEMA_VERSION`.

    Args:
        version: the stored `schema_version`.
        columns: each existing table's column names (from `PRAGMA table_info`).

    Returns:
        SQL to run inside the schema transaction (empty when already current).
    """
    statements: list[str] = []
    if version < 2:
        for table, column, declaration, value in _ADDED_IN_2:
            if column not in columns.get(table, set()):
                statements.append(f"ALTER TABLE {table} ADD COLUMN {column} {declaration};")
                statements.append(f"UPDATE {table} SET {column} = {value};")
    if version < SCHEMA_VERSION:
        statements.append(
            f"UPDATE store_info SET value = '{SCHEMA_VERSION}' WHERE name = 'schema_version';"
        )
    return "".join(statements)


# (message template, query returning the template's fields, one row per violation)
INVARIANT_QUERIES: list[tuple[str, str]] = [
    (
        "key {}/{} has entries but no row in key_lru (eviction would never see it)",
        """SELECT DISTINCT e.namespace, e.key FROM entries e
           WHERE NOT EXISTS (SELECT 1 FROM key_lru l
                             WHERE l.namespace = e.namespace AND l.key = e.key)""",
    ),
    (
        "key_lru row {}/{} has no entries",
        """SELECT l.namespace, l.key FROM key_lru l
           WHERE NOT EXISTS (SELECT 1 FROM entries e INDEXED BY entries_by_key
                             WHERE e.namespace = l.namespace AND e.key = l.key)""",
    ),
    (
        "key_lru row {}/{} counts {} committed ranks but {} entries are committed",
        """SELECT namespace, key, committed, actual FROM (
               SELECT l.namespace, l.key, l.committed,
                      (SELECT COUNT(*) FROM entries e INDEXED BY entries_by_key
                       WHERE e.namespace = l.namespace AND e.key = l.key
                         AND e.state = 1) AS actual
               FROM key_lru l)
           WHERE committed != actual""",
    ),
    (
        "key_lru row {}/{} is older ({}) than its latest entry access ({})",
        """SELECT namespace, key, last_access, latest FROM (
               SELECT l.namespace, l.key, l.last_access,
                      (SELECT MAX(e.last_access) FROM entries e INDEXED BY entries_by_key
                       WHERE e.namespace = l.namespace AND e.key = l.key) AS latest
               FROM key_lru l)
           WHERE last_access < latest""",
    ),
    (
        "key_lru row {}/{} expires at {} but its committed entries' earliest expiry is {}",
        """SELECT namespace, key, expires_at, earliest FROM (
               SELECT l.namespace, l.key, l.expires_at,
                      (SELECT MIN(e.expires_at) FROM entries e INDEXED BY entries_by_key
                       WHERE e.namespace = l.namespace AND e.key = l.key
                         AND e.state = 1) AS earliest
               FROM key_lru l)
           WHERE expires_at IS NOT earliest""",
    ),
    (
        "key_lru row {}/{} says pinned={} but a pin row exists={}",
        """SELECT namespace, key, pinned, held FROM (
               SELECT l.namespace, l.key, l.pinned,
                      EXISTS (SELECT 1 FROM pins p WHERE p.namespace = l.namespace
                              AND p.key = l.key) AS held
               FROM key_lru l)
           WHERE pinned != held""",
    ),
    (
        "admission_size counts {} tracked keys but admission holds {}",
        """SELECT s.tracked, (SELECT COUNT(*) FROM admission) FROM admission_size s
           WHERE s.tracked != (SELECT COUNT(*) FROM admission)""",
    ),
    (
        "entry {}/{} rank {} has no registered rank file",
        """SELECT e.namespace, e.key, e.rank FROM entries e
           LEFT JOIN rank_files r ON r.namespace = e.namespace AND r.rank = e.rank
           WHERE r.rank IS NULL""",
    ),
    (
        "entry {}/{} rank {}: page {} is outside the rank file's {} pages",
        """SELECT e.namespace, e.key, e.rank, e.page, r.num_pages FROM entries e
           JOIN rank_files r ON r.namespace = e.namespace AND r.rank = e.rank
           WHERE e.page < 0 OR e.page >= r.num_pages OR e.page >= r.next_unused""",
    ),
    (
        "page {} of {} rank {} is owned by {} entries",
        """SELECT page, namespace, rank, COUNT(*) FROM entries
           GROUP BY namespace, rank, page HAVING COUNT(*) > 1""",
    ),
    (
        "page {} of {} rank {} is both free and owned by key {}",
        """SELECT f.page, f.namespace, f.rank, e.key FROM free_pages f
           JOIN entries e ON e.namespace = f.namespace AND e.rank = f.rank
                         AND e.page = f.page""",
    ),
    (
        "free page {} of {} rank {} is beyond the high-water mark {}",
        """SELECT f.page, f.namespace, f.rank, r.next_unused FROM free_pages f
           JOIN rank_files r ON r.namespace = f.namespace AND r.rank = f.rank
           WHERE f.page < 0 OR f.page >= r.next_unused""",
    ),
    (
        "committed entry {}/{} rank {} has no checksum",
        """SELECT namespace, key, rank FROM entries
           WHERE state = 1 AND (checksum IS NULL OR checksum = '')""",
    ),
    (
        "pending entry {}/{} rank {} has no writer deadline",
        "SELECT namespace, key, rank FROM entries WHERE state = 0 AND deadline IS NULL",
    ),
    (
        "entry {}/{} rank {} has unknown state {}",
        "SELECT namespace, key, rank, state FROM entries WHERE state NOT IN (0, 1)",
    ),
    (
        "entry {}/{} rank {} reused page {} at {} while its last lease ran until {}",
        """SELECT namespace, key, rank, page, created, page_free_at FROM entries
           WHERE created < page_free_at""",
    ),
    (
        "entry {}/{} has rank {} but the namespace has {} ranks",
        """SELECT e.namespace, e.key, e.rank, n.num_ranks FROM entries e
           JOIN namespaces n ON n.id = e.namespace WHERE e.rank >= n.num_ranks""",
    ),
    (
        "rank file {} rank {} counts {} used pages but {} entries hold pages",
        """SELECT r.namespace, r.rank, r.used, COUNT(e.page) FROM rank_files r
           LEFT JOIN entries e ON e.namespace = r.namespace AND e.rank = r.rank
           GROUP BY r.namespace, r.rank HAVING r.used != COUNT(e.page)""",
    ),
    (
        "rank file {} rank {}: high-water mark {} != {} owned + {} free pages (leak)",
        """SELECT r.namespace, r.rank, r.next_unused,
                  (SELECT COUNT(*) FROM entries e
                   WHERE e.namespace = r.namespace AND e.rank = r.rank),
                  (SELECT COUNT(*) FROM free_pages f
                   WHERE f.namespace = r.namespace AND f.rank = r.rank)
           FROM rank_files r
           WHERE r.next_unused != (SELECT COUNT(*) FROM entries e
                                   WHERE e.namespace = r.namespace AND e.rank = r.rank)
                               + (SELECT COUNT(*) FROM free_pages f
                                  WHERE f.namespace = r.namespace AND f.rank = r.rank)""",
    ),
    (
        "rank file {} rank {}: high-water mark {} exceeds its {} pages",
        "SELECT namespace, rank, next_unused, num_pages FROM rank_files "
        "WHERE next_unused > num_pages OR next_unused < 0",
    ),
    (
        "rank file {} rank {} counts {} holes but {} free pages are punched",
        """SELECT r.namespace, r.rank, r.holes,
                  (SELECT COUNT(*) FROM free_pages f WHERE f.namespace = r.namespace
                   AND f.rank = r.rank AND f.punched = 1)
           FROM rank_files r
           WHERE r.holes != (SELECT COUNT(*) FROM free_pages f WHERE f.namespace = r.namespace
                             AND f.rank = r.rank AND f.punched = 1)""",
    ),
    (
        "pin {}/{} belongs to no registered namespace",
        """SELECT p.namespace, p.key FROM pins p
           LEFT JOIN namespaces n ON n.id = p.namespace WHERE n.id IS NULL""",
    ),
    (
        "rank file {} rank {} belongs to no registered namespace",
        """SELECT r.namespace, r.rank FROM rank_files r
           LEFT JOIN namespaces n ON n.id = r.namespace WHERE n.id IS NULL""",
    ),
]
