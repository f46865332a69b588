"""`CommittedIndex`: an in-memory copy of the committed key set, for fast `lookup`.

`lookup` asks, for up to thousands of keys, how many leading ones are committed on
every rank: a B-tree search per key in SQLite costs ~4 µs, a dict probe ~50 ns. Each
store instance (each process) therefore keeps `namespace → key → committed ranks` in
memory and keeps it exact by replaying the `changes` log that triggers append on every
commit and every removal of a committed entry — whoever wrote them (this process,
another worker process, `hf3fsctl evict`).

Every lookup first reads the log's last sequence number in its read transaction
(one point query); only when it moved are the new rows applied. A reader that fell
behind the pruned part of the log reloads the whole set. The log keeps its newest
`KEEP_CHANGES` rows.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Sequence
from itertools import repeat

from hf3fsctl.meta.models import Change, ChangeLog

logger = logging.getLogger(__name__)

KEEP_CHANGES = 200_000


def prune_changes(conn: sqlite3.Connection, keep: int = KEEP_CHANGES) -> None:
    """Drop all but the newest `keep` rows of the log (inside a write transaction)."""
    conn.execute(
        "DELETE FROM changes WHERE seq <= (SELECT seq FROM sqlite_sequence"
        " WHERE name = 'changes') - ?",
        (keep,),
    )


class CommittedIndex:
    """`namespace → key → number of ranks committed`, replayed from the `changes` log."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = -1  # last applied log sequence; -1 = not loaded
        self._counts: dict[str, dict[str, int]] = {}

    def _last_seq(self, conn: sqlite3.Connection) -> int:
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
        return int(row[0]) if row else 0

    def _reload(self, conn: sqlite3.Connection, last: int) -> None:
        counts: dict[str, dict[str, int]] = {}
        for namespace, key, ranks in conn.execute(
            "SELECT namespace, key, COUNT(*) FROM entries WHERE state = 1 GROUP BY namespace, key"
        ):
            counts.setdefault(namespace, {})[key] = ranks
        self._counts = counts
        self._seq = last
        logger.debug("committed index loaded: %d keys", sum(map(len, counts.values())))

    def _refresh(self, conn: sqlite3.Connection) -> None:
        """Bring the index to the snapshot of `conn`'s open read transaction."""
        last = self._last_seq(conn)
        if last == self._seq:
            return
        if self._seq < 0 or last < self._seq:
            self._reload(conn, last)
            return
        rows = conn.execute(
            "SELECT namespace, key, delta FROM changes WHERE seq > ? AND seq <= ? ORDER BY seq",
            (self._seq, last),
        ).fetchall()
        if len(rows) != last - self._seq:  # the log was pruned past us
            self._reload(conn, last)
            return
        counts = self._counts
        for namespace, key, delta in rows:
            keys = counts.setdefault(namespace, {})
            value = keys.get(key, 0) + delta
            if value > 0:
                keys[key] = value
            else:
                keys.pop(key, None)
        self._seq = last

    def leading_hits(
        self, conn: sqlite3.Connection, namespace: str, keys: Sequence[str], num_ranks: int
    ) -> int:
        """How many leading `keys` are committed on `num_ranks` ranks (in `conn`'s snapshot)."""
        with self._lock:
            self._refresh(conn)
            committed = self._counts.get(namespace)
            if not committed:
                return 0
            # C-speed passes (~4x faster than a Python loop over 1,000 keys)
            enough = list(map(num_ranks.__le__, map(committed.get, keys, repeat(0))))
            try:
                return enough.index(False)
            except ValueError:
                return len(enough)


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
