"""`CommittedKeyCache`: a bounded cache of keys a lookup found committed, kept exact by
the `changes` log (issue 21).

A lookup probes `key_lru` once per key (`committed_index.leading_hits`): ~3 µs of
SQLite CPU a key on two shared cores, ~3 ms for a 1,000-key prefix that all hits. The
prefixes asked again and again (system prompts, a conversation's history) are few, so
each store keeps the last `CACHED_KEYS` keys its lookups found committed on every rank,
with their expiry, and answers those from memory (~0.1 µs a key); memory stays bounded
(~150 B a key: ~2.5 MiB), not proportional to the entries held.

Exact: a key loses a committed rank only by deleting an entry, and every such delete
writes a `-1` row of `changes` (a trigger, whoever writes). Before it answers, a lookup
brings the cache to its own snapshot's end of the log (`sync`): keys with a `-1` row
since are dropped, and when rows were pruned before they were read (a follower that
fell more than `KEEP_CHANGES` behind) the whole cache is. A key is added only from a
snapshot whose log end is the cache's, so no removal is ever skipped. An expiry is
kept with its key and checked at each use; one that passed is asked of SQLite again
(a renewal moves an expiry without a `changes` row: the store's answer, not the
cached one, counts once it passes). Keys leave the cache oldest-added first, half a
namespace's at a time.
"""

from __future__ import annotations

import itertools
import sqlite3
import threading
from collections.abc import Iterable

CACHED_KEYS = 16_384  # keys kept across namespaces (~150 B each)
NEVER = float("inf")  # the expiry of a key that does not expire (one shared object)
# What `sync` reads (one text each: a connection compiles a statement once per text).
_LOG_END = "SELECT seq FROM sqlite_sequence WHERE name = 'changes'"
_LOG_START = "SELECT MIN(seq) FROM changes"
_DROPPED = "SELECT namespace, key FROM changes WHERE seq > ? AND seq <= ? AND delta = -1"


class CommittedKeyCache:
    """Keys found committed on every rank, by namespace, with their expiry."""

    def __init__(self, bound: int = CACHED_KEYS) -> None:
        self.bound = bound
        self._lock = threading.Lock()
        self._keys: dict[str, dict[str, float]] = {}  # namespace → key → expiry
        self._size = 0
        self._seq: int | None = None  # the log position the cache reflects

    def sync(self, conn: sqlite3.Connection) -> int:
        """Bring the cache to the end of the log in `conn`'s snapshot; returns that end."""
        row = conn.execute(_LOG_END).fetchone()
        end = int(row[0]) if row else 0
        with self._lock:
            start = self._seq
            if start is not None and end <= start:
                return end
        if start is None:
            dropped: Iterable[tuple[str, str]] | None = None
        else:
            oldest = conn.execute(_LOG_START).fetchone()[0]
            dropped = (
                None  # pruned before read: every key may be stale
                if oldest is None or oldest > start + 1
                else conn.execute(_DROPPED, (start, end)).fetchall()
            )
        with self._lock:
            if self._seq != start:  # another thread synced meanwhile: start over
                pass
            elif dropped is None:
                self._keys.clear()
                self._size = 0
                self._seq = end
            else:
                for namespace, key in dropped:
                    held = self._keys.get(namespace)
                    if held is not None and held.pop(key, None) is not None:
                        self._size -= 1
                self._seq = end
        return end

    def prepare(self, conn: sqlite3.Connection) -> None:
        """Have `conn` compile what `sync` reads (an empty range of the log); the cache
        is left as it was."""
        for sql, args in ((_LOG_END, ()), (_LOG_START, ()), (_DROPPED, (0, -1))):
            conn.execute(sql, args).fetchall()

    def cached(self, namespace: str) -> dict[str, float] | None:
        """The namespace's cached keys (read them under no lock: a racing drop only
        makes a lookup ask SQLite)."""
        return self._keys.get(namespace)

    def add(self, namespace: str, found: dict[str, float], at: int) -> None:
        """Keys found committed on every rank (→ expiry, `NEVER`) in a snapshot whose log
        ends at `at`; kept only if the cache reflects that same position."""
        if not found or self.bound <= 0:
            return
        with self._lock:
            if self._seq != at:
                return
            held = self._keys.setdefault(namespace, {})
            for key, expires_at in found.items():
                if key not in held:
                    self._size += 1
                held[key] = expires_at
            while self._size > self.bound:  # the oldest half of the largest namespace goes
                namespace, victims = max(self._keys.items(), key=lambda item: len(item[1]))
                drop = max(len(victims) // 2, self._size - self.bound)
                # one copy per half emptied (popping the oldest one by one is quadratic:
                # a dict walks its deleted slots from the front)
                self._keys[namespace] = dict(itertools.islice(victims.items(), drop, None))
                self._size -= drop

    def clear(self) -> None:
        """Forget every key (the next lookup asks SQLite)."""
        with self._lock:
            self._keys.clear()
            self._size = 0
            self._seq = None

    def __len__(self) -> int:
        return self._size
