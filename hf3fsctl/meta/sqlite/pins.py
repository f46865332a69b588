"""Pins: keys kept out of LRU eviction, optionally for a time, within a byte cap.

Functions over an open SQLite connection (writes inside `BEGIN IMMEDIATE`); the
`MetadataStore` runs them. A pin names a (namespace, key), whether or not the key is
stored yet, so pinning a prompt before `warm` writes it works. A pin counts its key's
full size (page slot × ranks) against `storage.max_pinned` whether stored or not, so
pins can never hold more than the cap. Expired pins are dropped whenever pins change.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.meta.models import PinInfo, PinResult
from hf3fsctl.storage.layout import slot_bytes

_LIVE = "(expires = 0 OR expires > ?)"


def key_bytes(conn: sqlite3.Connection) -> dict[str, int]:
    """Bytes one key of each namespace holds: its page slot times its ranks."""
    out: dict[str, int] = {}
    for ns, page_bytes, ranks in conn.execute(
        "SELECT id, json_extract(manifest, '$.page_bytes'), num_ranks FROM namespaces"
    ):
        if isinstance(page_bytes, int) and page_bytes > 0:
            out[ns] = slot_bytes(page_bytes) * ranks
    return out


def pinned_counts(conn: sqlite3.Connection, now: float) -> dict[str, int]:
    """Live pins per namespace."""
    return dict(
        conn.execute(
            f"SELECT namespace, COUNT(*) FROM pins WHERE {_LIVE} GROUP BY namespace", (now,)
        ).fetchall()
    )


def pinned_bytes(conn: sqlite3.Connection, now: float) -> int:
    """Bytes all live pins of the store hold."""
    sizes = key_bytes(conn)
    return sum(count * sizes.get(ns, 0) for ns, count in pinned_counts(conn, now).items())


def pin_keys(
    conn: sqlite3.Connection,
    namespace: str,
    keys: Sequence[str],
    ttl_s: float | None,
    now: float,
    max_pinned: int | None,
) -> PinResult:
    """Pin (or refresh the TTL of) `keys`; refuses what would pass `max_pinned`."""
    conn.execute("DELETE FROM pins WHERE expires != 0 AND expires <= ?", (now,))
    unique = list(dict.fromkeys(keys))
    size = key_bytes(conn).get(namespace, 0)
    known = {
        key
        for (key,) in conn.execute(
            "SELECT key FROM pins WHERE namespace = ?", (namespace,)
        ).fetchall()
    }
    new = [key for key in unique if key not in known]
    total = pinned_bytes(conn, now) + len(new) * size
    if max_pinned is not None and total > max_pinned:
        raise InvalidRequest(
            f"pinning {len(new)} more keys ({len(new) * size} bytes) would pin {total} bytes,"
            f" more than storage.max_pinned ({max_pinned} bytes)",
            hint="unpin something (`hf3fsctl unpin`), pin fewer prompts, or raise "
            "storage.max_pinned",
        )
    expires = 0.0 if ttl_s is None else now + ttl_s
    conn.executemany(
        "INSERT INTO pins (namespace, key, expires, created) VALUES (?,?,?,?)"
        " ON CONFLICT (namespace, key) DO UPDATE SET expires = excluded.expires",
        [(namespace, key, expires, now) for key in unique],
    )
    stored = stored_keys(conn, namespace, unique)
    return PinResult(
        pinned=len(unique),
        stored=len(stored),
        pinned_bytes=total,
        max_pinned_bytes=max_pinned,
    )


def stored_keys(conn: sqlite3.Connection, namespace: str, keys: Sequence[str]) -> set[str]:
    """Which of `keys` are committed on every rank of the namespace."""
    found: set[str] = set()
    ranks_row = conn.execute("SELECT num_ranks FROM namespaces WHERE id = ?", (namespace,))
    ranks = (ranks_row.fetchone() or (0,))[0]
    for start in range(0, len(keys), 500):
        chunk = list(keys[start : start + 500])
        found.update(
            key
            for key, count in conn.execute(
                "SELECT key, COUNT(*) FROM entries INDEXED BY entries_by_key WHERE namespace = ?"
                f" AND key IN ({','.join('?' * len(chunk))}) AND state = 1 GROUP BY key",
                (namespace, *chunk),
            )
            if count == ranks
        )
    return found


def unpin_keys(conn: sqlite3.Connection, namespace: str, keys: Sequence[str] | None) -> int:
    """Drop pins of `keys` (every pin of the namespace when None); returns how many."""
    if keys is None:
        return conn.execute("DELETE FROM pins WHERE namespace = ?", (namespace,)).rowcount
    return sum(
        conn.execute("DELETE FROM pins WHERE namespace = ? AND key = ?", (namespace, key)).rowcount
        for key in dict.fromkeys(keys)
    )


def list_pins(
    conn: sqlite3.Connection, namespace: str | None, now: float, limit: int
) -> list[PinInfo]:
    """Live pins, newest first."""
    where, args = (
        (f"WHERE {_LIVE}", [now])
        if namespace is None
        else (
            f"WHERE namespace = ? AND {_LIVE}",
            [namespace, now],
        )
    )
    rows = conn.execute(
        f"SELECT namespace, key, created, expires FROM pins {where}"
        " ORDER BY created DESC, namespace, key LIMIT ?",
        (*args, limit),
    ).fetchall()
    stored: dict[str, set[str]] = {}
    for ns in {row[0] for row in rows}:
        stored[ns] = stored_keys(conn, ns, [row[1] for row in rows if row[0] == ns])
    return [
        PinInfo(
            namespace=ns,
            key=key,
            created=created,
            expires=expires or None,
            stored=key in stored[ns],
        )
        for ns, key, created, expires in rows
    ]


def pinned_among(
    conn: sqlite3.Connection, pairs: Sequence[tuple[str, str]], now: float
) -> set[tuple[str, str]]:
    """Which (namespace, key) pairs are pinned now."""
    if not pairs:
        return set()
    wanted = set(pairs)
    return {
        (ns, key)
        for ns, key in conn.execute(f"SELECT namespace, key FROM pins WHERE {_LIVE}", (now,))
        if (ns, key) in wanted
    }
