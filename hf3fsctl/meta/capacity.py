"""One capacity for the whole store: accounting, room for an allocation, giving space back.

Every function runs inside a store write transaction (`BEGIN IMMEDIATE`) and never
commits. The rules (DESIGN decision 5b, `docs/design.md#store-capacity`):

- **Held bytes.** A growing page file holds `(next_unused - holes) * slot_bytes` of disk
  (every page ever handed out, minus free pages whose space was punched back); a
  preallocated file holds its whole size. The store holds the sum over every namespace
  and rank, and that sum never passes the recorded capacity: pages that would take it
  further are not granted (`no_space`).
- **Room.** An allocation that would take the store above `high_watermark * capacity`
  first reclaims dead writers' pending pages, then gives back free pages of other files
  (no data lost), then evicts least-recently-used keys of *any* namespace — chain tails
  before heads, on every rank at once, never pinned, pending or leased keys — until the
  store would be at `low_watermark * capacity` after the allocation. Pages freed in the
  allocating file are reused at once; pages freed elsewhere are punched back to the file
  system so the allocating file can grow into the space.
- **Quotas.** A namespace (or every namespace of a model) with a quota first evicts its
  own LRU keys when its live bytes would pass `high_watermark * quota`, down to
  `low_watermark * quota`, and never gets pages beyond the quota.
- Without the storage root (a server without the mount), freed space cannot be given
  back, so room is made only by evicting the allocating namespace's own keys.

Pages a reader still holds under a lease are neither reused nor punched until the lease
ends; they are given back by a later pass.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hf3fsctl.meta.eviction import evict_lru, free_pages_of_rows

# `punch(relpath, slot_bytes, pages) -> bool`: give free pages' disk space back.
Puncher = Callable[[str, int, Sequence[int]], bool]

_HELD_SQL = (
    "SUM(CASE WHEN preallocated THEN num_pages * slot_bytes"
    " ELSE (next_unused - holes) * slot_bytes END)"
)


@dataclass
class RankFileRow:
    """One rank file's accounting row."""

    namespace: str
    rank: int
    path: str
    slot: int
    num_pages: int
    next_unused: int
    used: int
    preallocated: bool
    holes: int

    @property
    def held_bytes(self) -> int:
        """Disk the file holds."""
        if self.preallocated:
            return self.num_pages * self.slot
        return (self.next_unused - self.holes) * self.slot


@dataclass(frozen=True)
class Bounds:
    """What limits an allocation, resolved for this transaction."""

    capacity: int | None  # bytes of the whole store; None = unbounded
    high: float  # watermarks, as shares of the capacity (or a quota)
    low: float
    quotas: Sequence[tuple[Sequence[str], int]]  # (namespaces it covers, bytes) per quota
    punch: Puncher | None  # None: freed space cannot be given back here


def rank_file_row(conn: sqlite3.Connection, namespace: str, rank: int) -> RankFileRow | None:
    """The accounting row of one rank file, or None when not registered."""
    row = conn.execute(
        "SELECT namespace, rank, path, slot_bytes, num_pages, next_unused, used, preallocated,"
        " holes FROM rank_files WHERE namespace = ? AND rank = ?",
        (namespace, rank),
    ).fetchone()
    if row is None:
        return None
    ns, rank_, path, slot, num_pages, next_unused, used, preallocated, holes = row
    return RankFileRow(
        ns, rank_, path, slot, num_pages, next_unused, used, bool(preallocated), holes
    )


def held_bytes(conn: sqlite3.Connection, namespaces: Sequence[str] | None = None) -> int:
    """Disk held by the page files of the store (or of `namespaces`)."""
    if namespaces is None:
        row = conn.execute(f"SELECT {_HELD_SQL} FROM rank_files").fetchone()
    else:
        marks = ",".join("?" * len(namespaces))
        row = conn.execute(
            f"SELECT {_HELD_SQL} FROM rank_files WHERE namespace IN ({marks})", tuple(namespaces)
        ).fetchone()
    return int(row[0] or 0)


def live_bytes(conn: sqlite3.Connection, namespaces: Sequence[str]) -> int:
    """Bytes of the pages held by entries (committed or pending) of `namespaces`."""
    marks = ",".join("?" * len(namespaces))
    row = conn.execute(
        f"SELECT SUM(used * slot_bytes) FROM rank_files WHERE namespace IN ({marks})",
        tuple(namespaces),
    ).fetchone()
    return int(row[0] or 0)


def reusable_free(conn: sqlite3.Connection, namespace: str, rank: int, now: float) -> int:
    """Free pages of a rank file reusable now that still hold their disk space."""
    row = conn.execute(
        "SELECT COUNT(*) FROM free_pages WHERE namespace = ? AND rank = ?"
        " AND reusable_after <= ? AND punched = 0",
        (namespace, rank, now),
    ).fetchone()
    return int(row[0])


def reclaim_all_expired(conn: sqlite3.Connection, now: float) -> int:
    """Free the pages of every pending entry whose writer's deadline passed."""
    rows = conn.execute(
        "DELETE FROM entries WHERE state = 0 AND deadline < ? RETURNING namespace, rank, page",
        (now,),
    ).fetchall()
    free_pages_of_rows(conn, [(ns, rank, page, now) for ns, rank, page in rows])
    return len(rows)


def give_back_free(
    conn: sqlite3.Connection,
    punch: Puncher,
    now: float,
    keep: tuple[str, int] | None = None,
) -> int:
    """Punch the free, lease-free pages of growing files (but `keep`'s); returns bytes."""
    files: dict[tuple[str, int], tuple[str, int, list[int]]] = {}
    for ns, rank, page, path, slot in conn.execute(
        "SELECT f.namespace, f.rank, f.page, r.path, r.slot_bytes FROM free_pages f"
        " JOIN rank_files r ON r.namespace = f.namespace AND r.rank = f.rank"
        " WHERE f.punched = 0 AND f.reusable_after <= ? AND r.preallocated = 0",
        (now,),
    ):
        if (ns, rank) != keep:
            files.setdefault((ns, rank), (path, slot, []))[2].append(page)
    given = 0
    for (ns, rank), (path, slot, pages) in files.items():
        if not punch(path, slot, pages):
            continue
        conn.executemany(
            "UPDATE free_pages SET punched = 1 WHERE namespace = ? AND rank = ? AND page = ?",
            [(ns, rank, page) for page in pages],
        )
        conn.execute(
            "UPDATE rank_files SET holes = holes + ? WHERE namespace = ? AND rank = ?",
            (len(pages), ns, rank),
        )
        given += len(pages) * slot
    return given


def _slots(conn: sqlite3.Connection) -> dict[tuple[str, int], tuple[int, bool]]:
    return {
        (ns, rank): (slot, bool(pre))
        for ns, rank, slot, pre in conn.execute(
            "SELECT namespace, rank, slot_bytes, preallocated FROM rank_files"
        )
    }


def _fit_quota(
    conn: sqlite3.Connection,
    row: RankFileRow,
    need: int,
    now: float,
    bounds: Bounds,
    scope: Sequence[str],
    quota: int,
) -> int:
    """Evict within `scope` for a quota; returns the most pages the quota still allows."""
    live = live_bytes(conn, scope)
    if live + need * row.slot > bounds.high * quota:
        slots = _slots(conn)
        state = {"live": live}

        def freed(ns: str, rank: int, page: int) -> None:
            state["live"] -= slots.get((ns, rank), (0, False))[0]

        evict_lru(
            conn,
            now,
            scope=scope,
            satisfied=lambda: state["live"] + need * row.slot <= bounds.low * quota,
            on_free=freed,
            batch=max(256, need),
        )
        live = live_bytes(conn, scope)
    return max(0, (quota - live) // row.slot)


def _fit_capacity(
    conn: sqlite3.Connection, row: RankFileRow, need: int, now: float, bounds: Bounds
) -> int:
    """Make room in the store for `need` pages of `row`; returns the most it can grant."""
    assert bounds.capacity is not None
    capacity = bounds.capacity
    if row.preallocated:  # its pages hold their space already
        return need
    mine = (row.namespace, row.rank)
    held = held_bytes(conn)
    backed = reusable_free(conn, *mine, now)

    def over(limit: float) -> bool:
        return held + max(0, need - backed) * row.slot > limit

    if over(bounds.high * capacity):
        reclaim_all_expired(conn, now)
        if bounds.punch is not None:
            give_back_free(conn, bounds.punch, now, keep=mine)
        held, backed = held_bytes(conn), reusable_free(conn, *mine, now)
    if over(bounds.high * capacity):
        slots = _slots(conn)
        can_punch = bounds.punch is not None

        def freed(ns: str, rank: int, page: int) -> None:
            nonlocal held, backed
            if (ns, rank) == mine:
                backed += 1
            else:
                slot, preallocated = slots.get((ns, rank), (0, True))
                if can_punch and not preallocated:
                    held -= slot

        evict_lru(
            conn,
            now,
            scope=None if can_punch else [row.namespace],
            satisfied=lambda: not over(bounds.low * capacity),
            on_free=freed,
            batch=max(256, need),
        )
        if bounds.punch is not None:
            give_back_free(conn, bounds.punch, now, keep=mine)
        held, backed = held_bytes(conn), reusable_free(conn, *mine, now)
    return backed + max(0, (capacity - held) // row.slot)


def room_for(
    conn: sqlite3.Connection, row: RankFileRow, need: int, now: float, bounds: Bounds
) -> int:
    """Make room for `need` new pages of `row`; returns how many may be granted (<= need).

    Quotas first (they evict only their own namespaces), then the store's capacity.
    """
    limit = need
    for scope, quota in bounds.quotas:
        if row.namespace in scope:
            limit = min(limit, _fit_quota(conn, row, need, now, bounds, scope, quota))
    if bounds.capacity is not None and limit > 0:
        limit = min(limit, _fit_capacity(conn, row, limit, now, bounds))
    return max(0, limit)


def take_pages(
    conn: sqlite3.Connection, row: RankFileRow, count: int, now: float, capacity: int | None
) -> list[tuple[int, float]]:
    """Up to `count` (page, reusable_after) pairs for `row`: free pages, then fresh ones.

    Free pages that still hold their space come first; a punched one or a fresh one
    grows the file, so those stop where the store would pass `capacity`.
    """
    if count <= 0:
        return []
    grow_room: int | None = None
    if capacity is not None and not row.preallocated:
        grow_room = max(0, (capacity - held_bytes(conn)) // row.slot)
    taken = conn.execute(
        "SELECT page, reusable_after, punched FROM free_pages WHERE namespace = ? AND rank = ?"
        " AND reusable_after <= ? ORDER BY punched, reusable_after LIMIT ?",
        (row.namespace, row.rank, now, count),
    ).fetchall()
    pages: list[tuple[int, float]] = []
    reused_holes = 0
    for page, after, punched in taken:
        if punched and grow_room is not None:
            if grow_room <= 0:
                break
            grow_room -= 1
        reused_holes += int(punched)
        pages.append((int(page), float(after)))
    if pages:
        conn.executemany(
            "DELETE FROM free_pages WHERE namespace = ? AND rank = ? AND page = ?",
            [(row.namespace, row.rank, page) for page, _ in pages],
        )
    fresh = min(count - len(pages), row.num_pages - row.next_unused)
    if grow_room is not None:
        fresh = min(fresh, grow_room)
    if fresh > 0:
        pages.extend((page, 0.0) for page in range(row.next_unused, row.next_unused + fresh))
    if fresh > 0 or reused_holes:
        conn.execute(
            "UPDATE rank_files SET next_unused = next_unused + ?, holes = holes - ?"
            " WHERE namespace = ? AND rank = ?",
            (max(fresh, 0), reused_holes, row.namespace, row.rank),
        )
    return pages


def quota_scopes(conn: sqlite3.Connection, quotas: dict[str, int]) -> list[tuple[list[str], int]]:
    """Each quota as (the namespaces it covers, bytes): by namespace id or by model name."""
    if not quotas:
        return []
    by_model: dict[str, list[str]] = defaultdict(list)
    ids = set()
    for ns, model in conn.execute("SELECT id, json_extract(manifest, '$.model') FROM namespaces"):
        ids.add(ns)
        by_model[str(model)].append(ns)
    scopes: list[tuple[list[str], int]] = []
    for name, limit in quotas.items():
        if name in ids:
            scopes.append(([name], limit))
        elif name in by_model:
            scopes.append((by_model[name], limit))
    return scopes
