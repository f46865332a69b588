"""Admission counts (issue 22): store a block the Nth time its key is seen, in SQLite.

`admit_keys` runs inside the store's write transaction (`MetadataStore._admit`): one
sighting of each key (an upsert of `admission`), the keys seen fewer than `after_hits`
times counted in `namespaces.admission_skipped`, and the table held to
`ADMISSION_TRACKED_KEYS` rows by dropping the least recently seen (`admission_by_age`;
`admission_size` counts the rows, so the bound costs no scan). `forget_committed` drops
the counts of keys that were just committed (a key evicted later starts again from one
sighting). The Redis twin is the Redis store's own `admit` (docs/design.md, "Eviction").
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

ADMISSION_TRACKED_KEYS = 1_000_000  # seen-counts kept per store, least recently seen dropped
_CHUNK = 500


def admit_keys(
    conn: sqlite3.Connection,
    namespace: str,
    keys: Sequence[str],
    after_hits: int,
    now: float,
    bound: int | None = None,
) -> list[bool]:
    """Record one sighting of each of `keys` (distinct); per key, seen >= `after_hits`."""
    conn.executemany(
        "INSERT INTO admission (namespace, key, seen, last_seen) VALUES (?,?,1,?)"
        " ON CONFLICT (namespace, key) DO UPDATE SET seen = seen + 1,"
        " last_seen = MAX(last_seen, excluded.last_seen)",
        [(namespace, key, now) for key in keys],
    )
    seen: dict[str, int] = {}
    for start in range(0, len(keys), _CHUNK):
        chunk = keys[start : start + _CHUNK]
        seen.update(
            conn.execute(
                "SELECT key, seen FROM admission WHERE namespace = ?"
                f" AND key IN ({','.join('?' * len(chunk))})",
                (namespace, *chunk),
            ).fetchall()
        )
    admitted = [seen.get(key, 0) >= after_hits for key in keys]
    skipped = admitted.count(False)
    if skipped:
        conn.execute(
            "UPDATE namespaces SET admission_skipped = admission_skipped + ? WHERE id = ?",
            (skipped, namespace),
        )
    limit = ADMISSION_TRACKED_KEYS if bound is None else bound
    (tracked,) = conn.execute("SELECT tracked FROM admission_size WHERE id = 0").fetchone()
    if tracked > limit:
        conn.execute(
            "DELETE FROM admission WHERE (namespace, key) IN (SELECT namespace, key"
            " FROM admission INDEXED BY admission_by_age ORDER BY last_seen LIMIT ?)",
            (tracked - limit,),
        )
    return admitted


def forget_committed(conn: sqlite3.Connection, namespace: str, keys: Sequence[str]) -> None:
    """Drop the counts of `keys`, just committed (nothing to do while none are tracked)."""
    (tracked,) = conn.execute("SELECT tracked FROM admission_size WHERE id = 0").fetchone()
    if tracked:
        conn.executemany(
            "DELETE FROM admission WHERE namespace = ? AND key = ?",
            [(namespace, key) for key in dict.fromkeys(keys)],
        )
