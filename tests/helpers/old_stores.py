"""Stores in a format older than the code's, built with that format's own DDL.

`SCHEMA_1_DDL` is the schema of format 1 as it shipped; `schema_1_store` writes a real
SQLite database in it (one namespace with a preallocated 16-page file, a committed
chain, a free page), for the tests of `hf3fsctl migrate` and of the refusal to open.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from helpers.meta_builders import PAGE_BYTES, checksum, make_manifest
from hf3fsctl.keys import namespace_id

# The DDL of format 1 (`git show bfe2519~1:hf3fsctl/meta/sqlite/schema.py`), before capacity.
SCHEMA_1_DDL = """
CREATE TABLE store_info (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE namespaces (
    id TEXT PRIMARY KEY,
    manifest TEXT NOT NULL,
    num_ranks INTEGER NOT NULL,
    created REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    lookups INTEGER NOT NULL DEFAULT 0,
    lookup_keys INTEGER NOT NULL DEFAULT 0,
    hit_keys INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE TABLE rank_files (
    namespace TEXT NOT NULL,
    rank INTEGER NOT NULL,
    path TEXT NOT NULL,
    page_bytes INTEGER NOT NULL,
    slot_bytes INTEGER NOT NULL,
    num_pages INTEGER NOT NULL,
    next_unused INTEGER NOT NULL DEFAULT 0,
    used INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (namespace, rank)
) WITHOUT ROWID;
CREATE TABLE entries (
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
    PRIMARY KEY (namespace, rank, page)
) WITHOUT ROWID;
CREATE UNIQUE INDEX entries_by_key ON entries (namespace, key, rank);
CREATE INDEX entries_pending ON entries (namespace, rank, deadline) WHERE state = 0;
CREATE TABLE free_pages (
    namespace TEXT NOT NULL,
    rank INTEGER NOT NULL,
    page INTEGER NOT NULL,
    reusable_after REAL NOT NULL,
    PRIMARY KEY (namespace, rank, page)
) WITHOUT ROWID;
CREATE INDEX free_pages_by_time ON free_pages (namespace, rank, reusable_after);
CREATE TABLE changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    delta INTEGER NOT NULL
);
CREATE TRIGGER changes_on_insert AFTER INSERT ON entries WHEN new.state = 1
BEGIN
    INSERT INTO changes (namespace, key, delta) VALUES (new.namespace, new.key, 1);
END;
CREATE TRIGGER changes_on_commit AFTER UPDATE OF state ON entries
WHEN old.state != 1 AND new.state = 1
BEGIN
    INSERT INTO changes (namespace, key, delta) VALUES (new.namespace, new.key, 1);
END;
CREATE TRIGGER changes_on_delete AFTER DELETE ON entries WHEN old.state = 1
BEGIN
    INSERT INTO changes (namespace, key, delta) VALUES (old.namespace, old.key, -1);
END;
"""

SCHEMA_1_PAGES = 16


def schema_1_store(path: Path, chain: list[str]) -> str:
    """A schema-1 database: one namespace, a 16-page file, `chain` committed, a free page.

    Returns:
        The namespace id.
    """
    manifest = make_manifest(model="old").to_dict()
    ns = namespace_id(manifest)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(SCHEMA_1_DDL)
    conn.execute("PRAGMA journal_mode = WAL")
    now = time.time() - 100
    with conn:
        conn.execute("INSERT INTO store_info VALUES ('schema_version', '1')")
        conn.execute(
            "INSERT INTO namespaces (id, manifest, num_ranks, created) VALUES (?,?,1,?)",
            (ns, json.dumps(manifest, sort_keys=True, separators=(",", ":")), now),
        )
        conn.execute(
            "INSERT INTO rank_files VALUES (?, 0, ?, ?, ?, ?, ?, ?)",
            (
                ns,
                f"{ns}/rank-0000.pages",
                PAGE_BYTES,
                PAGE_BYTES,
                SCHEMA_1_PAGES,
                len(chain) + 1,
                len(chain),
            ),
        )
        conn.executemany(
            "INSERT INTO entries (namespace, key, rank, page, state, checksum, size, depth,"
            " created, last_access) VALUES (?,?,0,?,1,?,?,?,?,?)",
            [(ns, k, i, checksum(k, i), PAGE_BYTES, i, now, now) for i, k in enumerate(chain)],
        )
        conn.execute("INSERT INTO free_pages VALUES (?, 0, ?, ?)", (ns, len(chain), now))
    conn.close()
    return ns
