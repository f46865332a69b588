"""Read-only reports over the store's tables: usage and traffic per namespace.

`store_stats` runs inside one read transaction of `MetadataStore.stats`; it scans the
entries once per call, which is fine for `stats`, `/metrics` scrapes and `doctor`, and
never runs on the data path.
"""

from __future__ import annotations

import json
import sqlite3

from hf3fsctl.meta.models import NamespaceStats, StoreStats


def store_stats(conn: sqlite3.Connection) -> StoreStats:
    """Usage and traffic of every namespace, and totals."""
    usage = {
        row[0]: row[1:]
        for row in conn.execute(
            "SELECT namespace, SUM(used), SUM(num_pages), SUM(used * slot_bytes),"
            " SUM(num_pages * slot_bytes) FROM rank_files GROUP BY namespace"
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
    namespaces = []
    for ns, manifest, num_ranks, hits, lookups, lookup_keys, hit_keys in conn.execute(
        "SELECT id, manifest, num_ranks, hits, lookups, lookup_keys, hit_keys"
        " FROM namespaces ORDER BY created"
    ):
        used, total, bytes_used, bytes_total = usage.get(ns, (0, 0, 0, 0))
        namespaces.append(
            NamespaceStats(
                id=ns,
                manifest=json.loads(manifest),
                num_ranks=num_ranks,
                keys=complete.get(ns, 0),
                pages_used=used or 0,
                pages_total=total or 0,
                bytes_used=bytes_used or 0,
                bytes_total=bytes_total or 0,
                hits=hits,
                lookups=lookups,
                lookup_keys=lookup_keys,
                hit_keys=hit_keys,
                last_access=last_access.get(ns),
            )
        )
    return StoreStats(
        namespaces=namespaces,
        pages_used=sum(n.pages_used for n in namespaces),
        pages_total=sum(n.pages_total for n in namespaces),
        bytes_used=sum(n.bytes_used for n in namespaces),
        bytes_total=sum(n.bytes_total for n in namespaces),
    )
