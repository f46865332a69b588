"""One capacity for the whole store: accounting, room for an allocation, giving space back.

Every function runs inside a store write transaction (`BEGIN IMMEDIATE`) and never
commits. The rules (docs/design.md decision 5b, `docs/design.md#store-capacity`):

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
- **Quotas.** A namespace (or every namespace of a model) with a quota is held to it the
  same way, within itself: above `high_watermark * quota` of held bytes it gives back its
  other files' free pages and evicts its own LRU keys down to `low_watermark * quota`,
  and never holds more than the quota.
- Without the storage root (a server without the mount), freed space cannot be given
  back, so room is made only by evicting the allocating namespace's own keys.

Pages a reader still holds under a lease are neither reused nor punched until the lease
ends; they are given back by a later pass.

Giving space back is two-phase, so a transaction that fails never leaves a committed key
over a hole: inside the transaction free pages are only *marked* (`punched = 2`: never
handed out, still counted as held); the store punches them after the transaction commits
and then settles them (`punched = 1`, counted in `holes` from then on), or unmarks them
if the file system refused. Space is only counted as free once it really is, so a
refused punch can never take the store past its capacity; the allocation that made the
room asks again once it is settled. Marks left by a crash between the two phases are
finished, under the writer lock, when a store opens.
"""

from __future__ import annotations

import logging
import math
import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from hf3fsctl.meta.giveback import GiveBack
from hf3fsctl.meta.sqlite.eviction import EVICT_BEYOND_NEED, evict_lru, free_pages_of_rows

PUNCHED = 1  # free_pages.punched: its disk space went back to the file system
GIVING_BACK = 2  # marked inside a transaction; punched once that transaction committed


logger = logging.getLogger(__name__)


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
    can_punch: bool  # False: freed space cannot be given back here (no storage root)
    given_back: list[GiveBack] = field(default_factory=list)  # marked; punch after commit


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


def giving_back_bytes(conn: sqlite3.Connection, scope: Sequence[str] | None = None) -> int:
    """Bytes of free pages marked to give back and not yet punched (of `scope`)."""
    rows = conn.execute(
        "SELECT f.namespace, r.slot_bytes FROM free_pages f JOIN rank_files r"
        " ON r.namespace = f.namespace AND r.rank = f.rank"
        f" WHERE f.punched = {GIVING_BACK}",  # a literal: the partial index applies
    )
    allowed = None if scope is None else set(scope)
    return sum(slot for ns, slot in rows if allowed is None or ns in allowed)


def reusable_free(conn: sqlite3.Connection, namespace: str, rank: int, now: float) -> int:
    """Free pages of a rank file reusable now that still hold their disk space.

    Counted from the file's row (its free pages are `next_unused - used`, `holes` of them
    punched) less the few free pages that are not: being given back (`punched = 2`) or
    still under a read lease (`reusable_after > now`). A count of the reusable ones
    themselves read every free page: after one watermark swing, every allocate counted
    the swing (10% of the store) twice.
    """
    free, holes = conn.execute(
        "SELECT next_unused - used, holes FROM rank_files WHERE namespace = ? AND rank = ?",
        (namespace, rank),
    ).fetchone()
    marked = conn.execute(
        "SELECT COUNT(*) FROM free_pages INDEXED BY free_pages_giving_back"
        f" WHERE namespace = ? AND rank = ? AND punched = {GIVING_BACK}",
        (namespace, rank),
    ).fetchone()[0]
    leased = conn.execute(
        "SELECT COUNT(*) FROM free_pages WHERE namespace = ? AND rank = ?"
        " AND reusable_after > ? AND punched = 0",
        (namespace, rank, now),
    ).fetchone()[0]
    return int(free - holes - marked - leased)


def reclaim_all_expired(conn: sqlite3.Connection, now: float) -> int:
    """Free the pages of every pending entry whose writer's deadline passed."""
    rows = conn.execute(
        "DELETE FROM entries WHERE state = 0 AND deadline < ? RETURNING namespace, rank, page",
        (now,),
    ).fetchall()
    free_pages_of_rows(conn, [(ns, rank, page, now) for ns, rank, page in rows])
    return len(rows)


def mark_give_back(
    conn: sqlite3.Connection,
    now: float,
    keep: tuple[str, int] | None = None,
    scope: Sequence[str] | None = None,
) -> list[GiveBack]:
    """Mark the free, lease-free pages of growing files of `scope` (but `keep`'s) to give
    back; they are never handed out until settled (and still count as held)."""
    files: dict[tuple[str, int], tuple[str, int, list[int]]] = {}
    allowed = None if scope is None else set(scope)
    for ns, rank, page, path, slot in conn.execute(
        "SELECT f.namespace, f.rank, f.page, r.path, r.slot_bytes FROM free_pages f"
        " JOIN rank_files r ON r.namespace = f.namespace AND r.rank = f.rank"
        " WHERE f.punched = 0 AND f.reusable_after <= ? AND r.preallocated = 0",
        (now,),
    ):
        if (ns, rank) != keep and (allowed is None or ns in allowed):
            files.setdefault((ns, rank), (path, slot, []))[2].append(page)
    for (ns, rank), (_, _, pages) in files.items():
        conn.executemany(
            "UPDATE free_pages SET punched = ? WHERE namespace = ? AND rank = ? AND page = ?",
            [(GIVING_BACK, ns, rank, page) for page in pages],
        )
    return [(ns, rank, path, slot, pages) for (ns, rank), (path, slot, pages) in files.items()]


def marked_give_back(conn: sqlite3.Connection) -> list[GiveBack]:
    """Pages marked to give back whose punch never settled (a crash between the phases)."""
    files: dict[tuple[str, int], tuple[str, int, list[int]]] = {}
    for ns, rank, page, path, slot in conn.execute(
        "SELECT f.namespace, f.rank, f.page, r.path, r.slot_bytes FROM free_pages f"
        " JOIN rank_files r ON r.namespace = f.namespace AND r.rank = f.rank"
        f" WHERE f.punched = {GIVING_BACK}",  # a literal: the partial index applies
    ):
        files.setdefault((ns, rank), (path, slot, []))[2].append(page)
    return [(ns, rank, path, slot, pages) for (ns, rank), (path, slot, pages) in files.items()]


def settle_give_back(
    conn: sqlite3.Connection, done: Sequence[GiveBack], refused: Sequence[GiveBack]
) -> None:
    """After the punches: `done` pages are holes now; `refused` ones are plain free pages."""
    for ns, rank, _, _, pages in done:
        settled = sum(
            conn.execute(
                "UPDATE free_pages SET punched = ? WHERE namespace = ? AND rank = ?"
                " AND page = ? AND punched = ?",
                (PUNCHED, ns, rank, page, GIVING_BACK),
            ).rowcount
            for page in pages
        )
        conn.execute(
            "UPDATE rank_files SET holes = holes + ? WHERE namespace = ? AND rank = ?",
            (settled, ns, rank),
        )
    for ns, rank, _, _, pages in refused:
        conn.executemany(
            "UPDATE free_pages SET punched = 0 WHERE namespace = ? AND rank = ? AND page = ?"
            " AND punched = ?",
            [(ns, rank, page, GIVING_BACK) for page in pages],
        )


def _slots(conn: sqlite3.Connection) -> dict[tuple[str, int], tuple[int, bool]]:
    return {
        (ns, rank): (slot, bool(pre))
        for ns, rank, slot, pre in conn.execute(
            "SELECT namespace, rank, slot_bytes, preallocated FROM rank_files"
        )
    }


def _evictable_scope(
    slots: dict[tuple[str, int], tuple[int, bool]],
    namespace: str,
    scope: Sequence[str] | None,
    can_punch: bool,
) -> list[str]:
    """Namespaces whose evicted keys give space to `namespace`: its own, and — where freed
    pages can be punched — those with growing files (a preallocated file keeps its size)."""
    if not can_punch:
        return [namespace]
    growing = {ns for (ns, _), (_, preallocated) in slots.items() if not preallocated}
    allowed = growing if scope is None else growing & set(scope)
    return sorted(allowed | {namespace})


def _pages_short(room: float, need: int, swing: float, slot: int) -> int:
    """Pages of `slot` bytes that `room` lacks for `need` pages and a watermark swing."""
    return max(1, math.ceil((need * slot + swing - room) / slot))


def _fit(
    conn: sqlite3.Connection,
    row: RankFileRow,
    need: int,
    now: float,
    bounds: Bounds,
    scope: Sequence[str] | None,
    limit: int,
) -> int:
    """Make room for `need` pages of `row` within `limit` bytes held by `scope`.

    `scope` None is the whole store (the capacity); a list of namespaces is a quota.
    Returns the most pages that may be granted: reusable free pages of the file plus
    what fits under `limit`.
    """
    if row.preallocated:  # its pages hold their space already
        return need
    mine = (row.namespace, row.rank)
    backed = reusable_free(conn, *mine, now)
    # What the store will hold once the pages being given back are punched: eviction
    # stops there, but pages are granted only against what it holds now (a punch may
    # still be refused); the allocation asks again once the marks are settled.
    expected = held_bytes(conn, scope) - giving_back_bytes(conn, scope)

    def over(ceiling: float) -> bool:
        # Reusable pages of the file beyond this allocation are room for the next ones
        # (not clamped at zero): a store kept full by its own free pages does not
        # evict on every allocation.
        return expected + (need - backed) * row.slot > ceiling

    def refresh() -> None:
        nonlocal expected, backed
        expected = held_bytes(conn, scope) - giving_back_bytes(conn, scope)
        backed = reusable_free(conn, *mine, now)

    if over(bounds.high * limit):
        reclaim_all_expired(conn, now)
        if bounds.can_punch:
            bounds.given_back.extend(mark_give_back(conn, now, keep=mine, scope=scope))
        refresh()
    if over(bounds.high * limit):
        slots = _slots(conn)
        can_punch = bounds.can_punch

        swing = (bounds.high - bounds.low) * limit

        def done() -> bool:
            # Room this allocation and the next ones have without evicting again: what
            # the store may still grow under its high watermark, plus the file's own
            # reusable pages. Enough for this allocation and one watermark swing (high
            # to low) — whether it comes from other files' space given back or from
            # this file's own freed pages, which it keeps for reuse instead of punching.
            room = bounds.high * limit - expected + backed * row.slot
            return room >= need * row.slot + swing

        def freed(ns: str, rank: int, page: int) -> None:
            nonlocal expected, backed
            if (ns, rank) == mine:
                backed += 1
            else:
                slot, preallocated = slots.get((ns, rank), (0, True))
                if can_punch and not preallocated:
                    expected -= slot

        evict_lru(
            conn,
            now,
            scope=_evictable_scope(slots, row.namespace, scope, can_punch),
            satisfied=done,
            on_free=freed,
            reason="capacity" if scope is None else "quota",
            # As many candidates as pages of this file are short (one scan when each
            # victim frees a page of its size; another scan for the rest otherwise):
            # each candidate read costs its walk and its pages' probe.
            batch=_pages_short(
                bounds.high * limit - expected + backed * row.slot, need, swing, row.slot
            ),
            limit=need + EVICT_BEYOND_NEED,
        )
        if bounds.can_punch:
            bounds.given_back.extend(mark_give_back(conn, now, keep=mine, scope=scope))
        refresh()
    return backed + max(0, (limit - held_bytes(conn, scope)) // row.slot)


def room_for(
    conn: sqlite3.Connection, row: RankFileRow, need: int, now: float, bounds: Bounds
) -> int:
    """Make room for `need` new pages of `row`; returns how many may be granted (<= need).

    Quotas first (they evict only their own namespaces), then the store's capacity.
    """
    limit = need
    for scope, quota in bounds.quotas:
        if row.namespace in scope:
            limit = min(limit, _fit(conn, row, need, now, bounds, scope, quota))
    if bounds.capacity is not None and limit > 0:
        limit = min(limit, _fit(conn, row, limit, now, bounds, None, bounds.capacity))
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
    # Pages that hold their space first, then punched ones; each by reusable time, then
    # page, in `free_pages_by_time`'s order (no sort of every free page).
    taken: list[tuple[int, float, int]] = []
    for punched in (0, PUNCHED):
        taken += conn.execute(
            "SELECT page, reusable_after, punched FROM free_pages WHERE namespace = ?"
            " AND rank = ? AND reusable_after <= ? AND punched = ?"
            " ORDER BY reusable_after, page LIMIT ?",
            (row.namespace, row.rank, now, punched, count - len(taken)),
        ).fetchall()
        if len(taken) >= count:
            break
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
