"""Read-only reports over the store's tables: usage and traffic per namespace.

`list_entries` (for `ls`) and `store_stats` run inside one read transaction of the
`MetadataStore`; `store_stats` it scans the
entries once per call, which is fine for `stats`, `/metrics` scrapes and `doctor`, and
never runs on the data path.
"""

from __future__ import annotations

import json
import sqlite3

from hf3fsctl.meta.models import EntryInfo, NamespaceStats, StoreStats
from hf3fsctl.meta.sqlite.capacity import quota_scopes
from hf3fsctl.meta.sqlite.pins import key_bytes, pinned_among, pinned_counts
from hf3fsctl.meta.sqlite.schema import COMMITTED


def store_stats(
    conn: sqlite3.Connection,
    *,
    capacity: int | None,
    quotas: dict[str, int],
    max_pinned: int | None,
    now: float,
    expiry: bool = True,
) -> StoreStats:
    """Usage and traffic of every namespace, and totals against the capacity (`expiry`
    False: a read-only store written before expiry and admission, which has neither)."""
    usage = {
        row[0]: row[1:]
        for row in conn.execute(
            "SELECT namespace, SUM(used), SUM(used * slot_bytes),"
            " SUM(CASE WHEN preallocated THEN num_pages * slot_bytes"
            " ELSE (next_unused - holes) * slot_bytes END)"
            " FROM rank_files GROUP BY namespace"
        )
    }
    complete = dict(
        conn.execute(
            "SELECT e.namespace, COUNT(*) FROM (SELECT namespace, key, COUNT(*) AS n"
            " FROM entries WHERE state = 1 GROUP BY namespace, key) e"
            " JOIN namespaces ns ON ns.id = e.namespace WHERE e.n = ns.num_ranks"
            " GROUP BY e.namespace"
        ).fetchall()
    )
    last_access = dict(
        conn.execute("SELECT namespace, MAX(last_access) FROM entries GROUP BY namespace")
    )
    pins = pinned_counts(conn, now)
    evicted: dict[str, dict[str, list[int]]] = {}
    for ns, reason, keys, nbytes in conn.execute(
        "SELECT namespace, reason, keys, bytes FROM evictions"
    ):
        evicted.setdefault(ns, {})[reason] = [keys, nbytes]
    expiring: dict[str, tuple[int, int]] = {}
    skipped: dict[str, int] = {}
    if expiry:  # the keys with an expiry: `key_lru_by_expiry` (only those are in it)
        expiring = {
            ns: (count, expired or 0)
            for ns, count, expired in conn.execute(
                "SELECT namespace, COUNT(*), SUM(expires_at <= ?) FROM key_lru"
                " INDEXED BY key_lru_by_expiry WHERE expires_at IS NOT NULL GROUP BY namespace",
                (now,),
            )
        }
        skipped = dict(conn.execute("SELECT id, admission_skipped FROM namespaces").fetchall())
    sizes = key_bytes(conn)
    quota_of: dict[str, int] = {}
    for scope, limit in quota_scopes(conn, quotas):
        for ns in scope:
            quota_of[ns] = min(limit, quota_of.get(ns, limit))
    namespaces = []
    for ns, manifest, num_ranks, hits, lookups, lookup_keys, hit_keys, last_used in conn.execute(
        "SELECT id, manifest, num_ranks, hits, lookups, lookup_keys, hit_keys, last_used"
        " FROM namespaces ORDER BY created"
    ):
        used, live, held = usage.get(ns, (0, 0, 0))
        accessed = last_access.get(ns)
        namespaces.append(
            NamespaceStats(
                id=ns,
                manifest=json.loads(manifest),
                num_ranks=num_ranks,
                keys=complete.get(ns, 0),
                pages_used=used or 0,
                bytes_live=live or 0,
                bytes_used=held or 0,
                quota_bytes=quota_of.get(ns),
                pinned_keys=pins.get(ns, 0),
                pinned_bytes=pins.get(ns, 0) * sizes.get(ns, 0),
                hits=hits,
                lookups=lookups,
                lookup_keys=lookup_keys,
                hit_keys=hit_keys,
                last_access=accessed,
                last_used=max(last_used, accessed or 0.0),
                evicted=evicted.get(ns, {}),
                admission_skipped=skipped.get(ns, 0),
                expiring_keys=expiring.get(ns, (0, 0))[0],
                expired_keys=expiring.get(ns, (0, 0))[1],
            )
        )
    return StoreStats.summed(namespaces, capacity, max_pinned)


def list_entries(
    conn: sqlite3.Connection,
    namespace: str | None,
    limit: int,
    offset: int,
    *,
    now: float,
    has_expiry: bool = True,
) -> list[EntryInfo]:
    """Entries (one per key and rank), most recently used first, with pins and expiries
    (`has_expiry` False: a read-only store written before expiry, whose entries never
    expire)."""
    where, args = ("WHERE namespace = ?", [namespace]) if namespace else ("", [])
    expires = "expires_at" if has_expiry else "NULL"
    rows = conn.execute(
        "SELECT namespace, key, rank, page, size, checksum, state, depth, created,"
        f" last_access, hits, {expires} FROM entries {where}"
        " ORDER BY last_access DESC, depth ASC, key, rank LIMIT ? OFFSET ?",
        (*args, limit, offset),
    ).fetchall()
    pinned = pinned_among(conn, [(r[0], r[1]) for r in rows], now)
    return [
        EntryInfo.model_construct(
            namespace=r[0],
            key=r[1],
            rank=r[2],
            page=r[3],
            size=r[4],
            checksum=r[5],
            state="committed" if r[6] == COMMITTED else "pending",
            depth=r[7],
            created=r[8],
            last_access=r[9],
            hits=r[10],
            pinned=(r[0], r[1]) in pinned,
            expires_at=r[11],
        )
        for r in rows
    ]
