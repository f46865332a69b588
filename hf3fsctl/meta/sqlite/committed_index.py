"""`lookup` from the committed rank counts of `key_lru`, and the `changes` log.

`lookup` asks how many leading keys are committed on every rank. Until issue 21 each
process held `namespace → key → committed ranks` in memory (~300 B per key of Python
objects, replayed from the `changes` log); now each key is one primary-key probe of
`key_lru` (kept by triggers, `meta/sqlite/schema.py`), in chunks, stopping at the first
miss, so memory does not grow with the entries held — but for the keys a bounded cache
of recently found ones answers (`lookup_cache.CommittedKeyCache`: exact, kept by the
log below; a 1,000-key prefix asked again costs ~0.1 ms instead of ~3 ms). The `changes` log stays for its
followers (KV events, `read_changes`) and keeps its newest `KEEP_CHANGES` rows.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence

from hf3fsctl.meta.models import Change, ChangeLog
from hf3fsctl.meta.sqlite.lookup_cache import NEVER, CommittedKeyCache

logger = logging.getLogger(__name__)

KEEP_CHANGES = 200_000


def prune_changes(conn: sqlite3.Connection, keep: int = KEEP_CHANGES) -> None:
    """Drop all but the newest `keep` rows of the log (inside a write transaction)."""
    conn.execute(
        "DELETE FROM changes WHERE seq <= (SELECT seq FROM sqlite_sequence"
        " WHERE name = 'changes') - ?",
        (keep,),
    )


# Keys probed per statement: a lookup usually stops at its first miss, so the first
# chunk is small; later ones grow (a long hit run costs few statements).
_FIRST_CHUNK = 64
_MAX_CHUNK = 512
# The IN-list sizes the probe is written for (`padded`; compiled by `prepare_leading_hits`).
_IN_SIZES = (8, 32, _FIRST_CHUNK, 256, _MAX_CHUNK)


def padded(chunk: Sequence[str], sizes: Sequence[int]) -> Sequence[str]:
    """`chunk` (1 to `sizes[-1]` keys) repeated at its end up to the next of `sizes`.

    A statement's IN list is written for a few sizes, the keys padded by repeating the
    last one (IN matches each row once), so a connection compiles a handful of
    statements, not one per key count (a first use costs ~100-270 us more than a cached
    one, issue 23), and they can be compiled ahead of the first request."""
    size = next(n for n in sizes if n >= len(chunk))
    return chunk if size == len(chunk) else [*chunk, *[chunk[-1]] * (size - len(chunk))]


def _probe_sql(has_key_lru: bool, has_expiry: bool) -> str:
    """The probe of `leading_hits`, its IN list left as `{}` (a store without `key_lru`,
    read only and written before it, is asked its entries; one without expiry columns
    has no entry that expires)."""
    if not has_key_lru:
        return (
            "SELECT key, COUNT(*), NULL FROM entries INDEXED BY entries_by_key"
            " WHERE namespace = ? AND key IN ({}) AND state = 1 GROUP BY key"
        )
    if has_expiry:
        return "SELECT key, committed, expires_at FROM key_lru WHERE namespace = ? AND key IN ({})"
    return "SELECT key, committed, NULL FROM key_lru WHERE namespace = ? AND key IN ({})"


def prepare_leading_hits(
    conn: sqlite3.Connection,
    has_key_lru: bool = True,
    has_expiry: bool = True,
    cache: CommittedKeyCache | None = None,
) -> None:
    """Have `conn` compile what `leading_hits` runs (the probe at each of `_IN_SIZES`,
    and `cache`'s reads of the log), so that a first lookup compiles nothing. Reads
    only (inside a read transaction): the probes name the empty namespace, which no
    namespace id is, and `cache` is left as it was."""
    query = _probe_sql(has_key_lru, has_expiry)
    for size in _IN_SIZES:
        conn.execute(query.format(",".join("?" * size)), ("", *[""] * size)).fetchall()
    if cache is not None and has_key_lru:
        cache.prepare(conn)


def leading_hits(
    conn: sqlite3.Connection,
    namespace: str,
    keys: Sequence[str],
    num_ranks: int,
    now: float,
    has_key_lru: bool = True,
    has_expiry: bool = True,
    cache: CommittedKeyCache | None = None,
) -> int:
    """How many leading `keys` are committed and unexpired on `num_ranks` ranks (in
    `conn`'s snapshot): keys `cache` holds unexpired are answered from memory, the others
    by one primary-key probe of `key_lru` per key, in chunks, stopping at the first miss
    (and added to `cache`). Nothing of the whole key set is held in memory. A store
    without `key_lru` (read only, written before it) is asked its entries instead, with
    no cache; one without expiry columns (likewise) has no entry that expires."""
    if not has_key_lru:
        cache = None
    query = _probe_sql(has_key_lru, has_expiry)
    at = cache.sync(conn) if cache is not None else 0
    cached = (cache.cached(namespace) if cache is not None else None) or {}
    hits = 0
    size = _FIRST_CHUNK
    total = len(keys)
    while hits < total:
        while hits < total and cached.get(keys[hits], 0.0) > now:  # answered from memory
            hits += 1
        if hits == total:
            break
        chunk = keys[hits : hits + size]
        probe = padded(chunk, _IN_SIZES)
        marks = ",".join("?" * len(probe))
        held = {
            key: (ranks, expires_at)
            for key, ranks, expires_at in conn.execute(query.format(marks), (namespace, *probe))
        }
        found: dict[str, float] = {}
        for key in chunk:
            ranks, expires_at = held.get(key, (0, None))
            if ranks < num_ranks or (expires_at is not None and expires_at <= now):
                break
            found[key] = NEVER if expires_at is None else float(expires_at)
            hits += 1
        if cache is not None:
            cache.add(namespace, found, at)
            cached = cache.cached(namespace) or {}
        if len(found) < len(chunk):
            return hits
        size = min(size * 4, _MAX_CHUNK)
    return hits


def read_changes(
    conn: sqlite3.Connection, since: int, namespace: str | None, limit: int
) -> ChangeLog:
    """Rows of the log after `since` (at most `limit`), for followers such as KV events.

    `since = -1` starts at the log's end: no rows, and `next_seq` is where to read next.
    `missed` says rows after `since` were already pruned.
    """
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
    last = int(row[0]) if row else 0
    if since < 0 or since >= last:
        return ChangeLog(changes=[], next_seq=max(since, last) if since >= 0 else last)
    oldest = conn.execute("SELECT MIN(seq) FROM changes").fetchone()[0]
    missed = oldest is None or oldest > since + 1
    # Read seq-ordered rows up to `limit` of the whole log, then filter by namespace:
    # `next_seq` then advances over other namespaces' rows too.
    rows = conn.execute(
        "SELECT seq, namespace, key, delta FROM changes WHERE seq > ? ORDER BY seq LIMIT ?",
        (since, limit),
    ).fetchall()
    next_seq = rows[-1][0] if rows else last
    return ChangeLog(
        changes=[
            Change(seq=seq, namespace=ns, key=key, delta=delta)
            for seq, ns, key, delta in rows
            if namespace is None or ns == namespace
        ],
        next_seq=next_seq,
        missed=missed,
    )
