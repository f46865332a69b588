"""Namespace and rank-file registration: the rows of `namespaces` and `rank_files`.

Functions over an open SQLite connection; `MetadataStore` runs them inside its
transactions (writes in `BEGIN IMMEDIATE`). A namespace is immutable once registered:
registering it again with the same manifest returns it, with another manifest raises
`NamespaceConflict`; the same holds for each rank's page file.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from typing import Any

from hf3fsctl.errors import NamespaceConflict, NotFound
from hf3fsctl.meta.base import check_rank_file
from hf3fsctl.meta.models import DroppedNamespace, NamespaceInfo, RankFile, WriterInfo

logger = logging.getLogger(__name__)


def insert_namespace(
    conn: sqlite3.Connection, namespace: str, manifest: dict[str, Any], num_ranks: int
) -> NamespaceInfo:
    """Create `namespace` from its manifest (checked by the store core: its id, its
    `num_ranks`), or return it if identical (write transaction)."""
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), default=str)
    row = conn.execute("SELECT manifest FROM namespaces WHERE id = ?", (namespace,))
    existing = row.fetchone()
    if existing is None:
        conn.execute(
            "INSERT INTO namespaces (id, manifest, num_ranks, created, last_used)"
            " VALUES (?,?,?,?,?)",
            (namespace, text, num_ranks, time.time(), time.time()),
        )
        logger.info("registered namespace %s (%d ranks)", namespace, num_ranks)
    elif existing[0] != text:
        raise NamespaceConflict(f"namespace {namespace} exists with another manifest")
    else:
        conn.execute("UPDATE namespaces SET last_used = ? WHERE id = ?", (time.time(), namespace))
    return namespace_info(conn, namespace)


def insert_rank_file(
    conn: sqlite3.Connection, namespace: str, rank_file: RankFile
) -> NamespaceInfo:
    """Record one rank's page file, or return the namespace if identical (write transaction)."""
    info = namespace_info(conn, namespace)
    check_rank_file(info, rank_file)
    for existing in info.rank_files:
        if existing.rank == rank_file.rank:
            if existing != rank_file:
                raise NamespaceConflict(
                    f"rank {rank_file.rank} of namespace {namespace} is registered "
                    f"as {existing.model_dump()}, not {rank_file.model_dump()}"
                )
            return info
    conn.execute(
        "INSERT INTO rank_files (namespace, rank, path, page_bytes, slot_bytes,"
        " num_pages, preallocated) VALUES (?,?,?,?,?,?,?)",
        (
            namespace,
            rank_file.rank,
            rank_file.path,
            rank_file.page_bytes,
            rank_file.slot_bytes,
            rank_file.num_pages,
            int(rank_file.preallocated),
        ),
    )
    return namespace_info(conn, namespace)


def all_namespaces(conn: sqlite3.Connection) -> list[NamespaceInfo]:
    """Every registered namespace, oldest first."""
    ids = [r[0] for r in conn.execute("SELECT id FROM namespaces ORDER BY created")]
    return [namespace_info(conn, ns) for ns in ids]


def namespace_info(conn: sqlite3.Connection, namespace: str) -> NamespaceInfo:
    """One namespace and its rank files; `NotFound` if absent."""
    row = conn.execute(
        "SELECT manifest, num_ranks, created FROM namespaces WHERE id = ?", (namespace,)
    ).fetchone()
    if row is None:
        raise NotFound(f"namespace {namespace} is not registered")
    ranks = conn.execute(
        "SELECT rank, path, page_bytes, slot_bytes, num_pages, preallocated FROM rank_files"
        " WHERE namespace = ? ORDER BY rank",
        (namespace,),
    ).fetchall()
    return NamespaceInfo(
        id=namespace,
        manifest=json.loads(row[0]),
        num_ranks=row[1],
        created=row[2],
        rank_files=[
            RankFile(
                rank=r[0],
                path=r[1],
                page_bytes=r[2],
                slot_bytes=r[3],
                num_pages=r[4],
                preallocated=bool(r[5]),
            )
            for r in ranks
        ],
    )


def drop_namespace(
    conn: sqlite3.Connection, namespace: str, now: float, *, dry_run: bool
) -> DroppedNamespace:
    """Remove a namespace's rows (write transaction); skipped while a writer is active."""
    info = namespace_info(conn, namespace)
    keys = conn.execute(
        "SELECT COUNT(DISTINCT key) FROM entries WHERE namespace = ? AND state = 1", (namespace,)
    ).fetchone()[0]
    held = conn.execute(
        "SELECT SUM(CASE WHEN preallocated THEN num_pages * slot_bytes"
        " ELSE (next_unused - holes) * slot_bytes END) FROM rank_files WHERE namespace = ?",
        (namespace,),
    ).fetchone()[0]
    writing = conn.execute(
        "SELECT COUNT(*) FROM entries WHERE namespace = ? AND state = 0 AND deadline >= ?",
        (namespace, now),
    ).fetchone()[0]
    result = DroppedNamespace(
        id=namespace,
        keys=keys,
        bytes=int(held or 0),
        rank_files=[rf.path for rf in info.rank_files],
        skipped=f"{writing} pages are being written" if writing else None,
    )
    if writing or dry_run:
        return result
    for table, column in (
        ("entries", "namespace"),
        ("free_pages", "namespace"),
        ("rank_files", "namespace"),
        ("pins", "namespace"),
        ("evictions", "namespace"),
        ("writers", "namespace"),
        ("admission", "namespace"),
        ("namespaces", "id"),
    ):
        conn.execute(f"DELETE FROM {table} WHERE {column} = ?", (namespace,))
    logger.info("dropped namespace %s (%d keys, %d bytes)", namespace, keys, result.bytes)
    return result


def insert_writer(conn: sqlite3.Connection, namespace: str, writer: WriterInfo) -> None:
    """Record a writer of `namespace` unless its id is recorded (write transaction)."""
    conn.execute(
        "INSERT OR IGNORE INTO writers (namespace, id, numerics, first_seen) VALUES (?,?,?,?)",
        (namespace, writer.id, json.dumps(writer.numerics, sort_keys=True), writer.first_seen),
    )


def all_writers(conn: sqlite3.Connection, namespace: str | None) -> dict[str, list[WriterInfo]]:
    """Recorded writers by namespace (a store made before the table existed: none)."""
    query = "SELECT namespace, id, numerics, first_seen FROM writers"
    args: tuple[str, ...] = ()
    if namespace is not None:
        query, args = query + " WHERE namespace = ?", (namespace,)
    try:
        rows = conn.execute(query, args).fetchall()
    except sqlite3.OperationalError as exc:  # read-only open of an older store
        if "no such table" in str(exc):
            return {}
        raise
    out: dict[str, list[WriterInfo]] = {}
    for ns, writer_id, numerics, first_seen in rows:
        out.setdefault(ns, []).append(
            WriterInfo(id=writer_id, numerics=json.loads(numerics), first_seen=first_seen)
        )
    return out
