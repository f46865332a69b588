"""Eviction and reclamation inside a store write transaction (`MetadataStore` calls these).

Where eviction is decided — the three `choose_*` functions, each one query:
`choose_victims` (allocate: the store's capacity and quotas, via `capacity.room_for` →
`evict_lru`), `choose_file_victims` (allocate: a full fixed-size file, via
`evict_for_allocation`) and `choose_admin_victims` (`hf3fsctl evict`, via
`evict_entries`). The rest of this module carries the decision out (drop the key on every
rank, free its pages, count the eviction). docs/design.md, "Eviction", pairs each with
its Redis twin.

Rules (docs/design.md decision 5):

- A key is evicted on every rank at once: a key missing on one rank is useless.
- Pending entries are never evicted (a writer holds them); an expired pending entry
  (its writer's deadline passed) is reclaimed instead.
- A page a reader proved corrupt (`invalidate`) drops its key on every rank, but only
  while the reported rank still holds that exact page and checksum: a key re-saved
  since under a new page is never dropped by a stale report.
- On the allocate path, least-recently-used keys go first, and among equally old keys
  the chain tails (greatest depth) before their heads; keys under a read lease are
  skipped. `evict_lru` picks across the namespaces it is given (all of them for the
  store's capacity, see `meta/sqlite/capacity.py`). Admin eviction may take leased keys, but
  their pages only become reusable once the lease ends (`free_pages.reusable_after`).
- Pinned keys (`pins`, until their TTL) are never evicted by LRU, and by admin
  eviction only when asked to (`include_pinned`).

Every function takes an open connection inside `BEGIN IMMEDIATE` and never commits.
"""

from __future__ import annotations

import heapq
import itertools
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from hf3fsctl.meta.models import EvictRequest, EvictResult

_BATCH = 256
# Keys one allocation may evict beyond its own pages (Redis: `EVICT_BEYOND_NEED` in
# `redis/lua/allocate.lua`): one watermark swing is 10% of the store at the defaults, and
# evicting it in one transaction held the writer lock ~4 s at 10⁶ entries (~36 µs a key;
# `busy_timeout` is 5 s) — a larger swing is spread over the allocations that follow.
EVICT_BEYOND_NEED = 2048
_IN_CHUNK = 500  # keys per IN list (well under SQLite's variable limit)
# A key is pinned while a pin row exists that has not expired (expires 0 = no TTL).
NOT_PINNED = (
    "NOT EXISTS (SELECT 1 FROM pins p WHERE p.namespace = e.namespace AND p.key = e.key"
    " AND (p.expires = 0 OR p.expires > :now))"
)


def free_pages_of_rows(
    conn: sqlite3.Connection, rows: Sequence[tuple[str, int, int, float]]
) -> None:
    """Put `(namespace, rank, page, reusable_after)` on the free list; `used` goes down."""
    if not rows:
        return
    conn.executemany(
        "INSERT INTO free_pages (namespace, rank, page, reusable_after) VALUES (?,?,?,?)", rows
    )
    counts: dict[tuple[str, int], int] = defaultdict(int)
    for ns, rank, _, _ in rows:
        counts[(ns, rank)] += 1
    _apply_used(conn, counts)


def _drop_key(
    conn: sqlite3.Connection, namespace: str, key: str, now: float
) -> list[tuple[int, int]]:
    """Delete a key's committed entries on every rank; pages go to the free list.

    Pending entries stay (their writer owns the page). A page under a read lease becomes
    reusable only when the lease ends. Returns the freed (rank, page) pairs.
    """
    rows = conn.execute(
        "DELETE FROM entries INDEXED BY entries_by_key WHERE namespace = ? AND key = ?"
        " AND state = 1 RETURNING rank, page, lease_until",
        (namespace, key),
    ).fetchall()
    conn.executemany(
        "INSERT INTO free_pages (namespace, rank, page, reusable_after) VALUES (?,?,?,?)",
        [(namespace, rank, page, max(now, lease)) for rank, page, lease in rows],
    )
    return [(rank, page) for rank, page, _ in rows]


def _apply_used(conn: sqlite3.Connection, freed: dict[tuple[str, int], int]) -> None:
    conn.executemany(
        "UPDATE rank_files SET used = used - ? WHERE namespace = ? AND rank = ?",
        [(count, ns, rank) for (ns, rank), count in freed.items() if count],
    )


def _finish(
    conn: sqlite3.Connection,
    freed: dict[tuple[str, int], int],
    keys_by_namespace: dict[str, int],
    reason: str,
) -> None:
    """Apply freed pages to the rank files' counts and count the evictions by reason
    (`evictions`: capacity, quota, file_full, admin, corrupt; Prometheus reads them)."""
    _apply_used(conn, freed)
    if not keys_by_namespace:
        return
    slots = {
        (ns, rank): slot
        for ns, rank, slot in conn.execute("SELECT namespace, rank, slot_bytes FROM rank_files")
    }
    freed_bytes: dict[str, int] = defaultdict(int)
    for (ns, rank), count in freed.items():
        freed_bytes[ns] += count * slots.get((ns, rank), 0)
    conn.executemany(
        "INSERT INTO evictions (namespace, reason, keys, bytes) VALUES (?,?,?,?)"
        " ON CONFLICT (namespace, reason) DO UPDATE SET keys = keys + excluded.keys,"
        " bytes = bytes + excluded.bytes",
        [(ns, reason, keys, freed_bytes[ns]) for ns, keys in keys_by_namespace.items() if keys],
    )


def reclaim_expired(conn: sqlite3.Connection, namespace: str, rank: int, now: float) -> int:
    """Free the pages of pending entries on `rank` whose writer's deadline passed."""
    rows = conn.execute(
        "DELETE FROM entries WHERE namespace = ? AND rank = ? AND state = 0 AND deadline < ?"
        " RETURNING page",
        (namespace, rank, now),
    ).fetchall()
    free_pages_of_rows(conn, [(namespace, rank, page, now) for (page,) in rows])
    return len(rows)


# A key of `key_lru l` may go: no entry pending, none leased, no live pin. Checked per
# key while the age index is walked (the key's entries through `entries_by_key`).
_EVICTABLE = (
    "NOT EXISTS (SELECT 1 FROM entries e INDEXED BY entries_by_key"
    " WHERE e.namespace = l.namespace AND e.key = l.key"
    " AND (e.state = 0 OR e.lease_until > :now))"
    " AND NOT EXISTS (SELECT 1 FROM pins p WHERE p.namespace = l.namespace AND p.key = l.key"
    " AND (p.expires = 0 OR p.expires > :now))"
)
# The oldest evictable keys of one namespace: `key_lru_unpinned` walked in order, stopping
# after :limit (no sort, no scan of the rest).
VICTIMS_OF_NAMESPACE = (
    "SELECT l.last_access, -l.depth, l.namespace, l.key FROM key_lru l"
    f" INDEXED BY key_lru_unpinned WHERE l.namespace = :ns AND l.pinned = 0 AND {_EVICTABLE}"
    " ORDER BY l.last_access ASC, l.depth DESC LIMIT :limit"
)
# The expired evictable keys of one namespace (issue 22), soonest expired first:
# `key_lru_by_expiry` walked up to :now, stopping after :limit.
EXPIRED_OF_NAMESPACE = (
    "SELECT l.expires_at, -l.depth, l.namespace, l.key FROM key_lru l"
    " INDEXED BY key_lru_by_expiry WHERE l.namespace = :ns AND l.expires_at IS NOT NULL"
    f" AND l.expires_at <= :now AND l.pinned = 0 AND {_EVICTABLE}"
    " ORDER BY l.expires_at ASC LIMIT :limit"
)


class Victim(NamedTuple):
    """A key chosen for eviction, and whether it was chosen for having expired."""

    namespace: str
    key: str
    expired: bool = False


def _merged_walks(
    conn: sqlite3.Connection, query: str, names: Sequence[str], now: float, limit: int
) -> list[tuple[str, str]]:
    """`query`'s rows for each namespace of `names`, merged in order, the first `limit`."""
    walks = [conn.execute(query, {"ns": ns, "now": now, "limit": limit}) for ns in names]
    ordered = heapq.merge(*walks) if len(walks) != 1 else walks[0]
    found = [(ns, key) for _, _, ns, key in itertools.islice(ordered, limit)]
    for walk in walks:
        walk.close()  # the walks not read to their end
    return found


def drop_expired_pins(conn: sqlite3.Connection, now: float) -> None:
    """Drop pins past their TTL (`pins_by_expiry`): their keys rejoin `key_lru_unpinned`,
    the LRU order eviction walks."""
    conn.execute("DELETE FROM pins WHERE expires != 0 AND expires <= ?", (now,))


def choose_victims(
    conn: sqlite3.Connection, now: float, scope: Sequence[str] | None, limit: int
) -> list[Victim]:
    """THE eviction decision of the allocate path (the store's capacity and quotas):
    the `limit` evictable keys of `scope` (None: every namespace) to go first — the
    expired ones (soonest expired first), then the least recently used.

    Evictable: committed on every rank it has, none pending, no read lease, not pinned.
    LRU order: last access, then chain tails (greatest depth) first. Each namespace's
    keys come from its `key_lru_by_expiry` and `key_lru_unpinned` walks (O(limit log n));
    several namespaces are merged lazily, so each is read only as far as its keys are
    among the first. The Redis twin is `choose_victims` in `redis/lua/eviction.lua`
    (docs/design.md, "Eviction").
    """
    if scope is None:
        names = [ns for (ns,) in conn.execute("SELECT id FROM namespaces ORDER BY id")]
    else:
        names = sorted(set(scope))
    expired = _merged_walks(conn, EXPIRED_OF_NAMESPACE, names, now, limit)
    victims = [Victim(ns, key, True) for ns, key in expired]
    if len(victims) < limit:
        taken = set(expired)
        # the LRU walk may meet the expired keys again: ask for as many more
        for ns, key in _merged_walks(conn, VICTIMS_OF_NAMESPACE, names, now, limit + len(taken)):
            if (ns, key) not in taken and len(victims) < limit:
                victims.append(Victim(ns, key))
    return victims


def drop_expired(conn: sqlite3.Connection, namespace: str, keys: Sequence[str], now: float) -> int:
    """Drop expired `keys` on every rank (an allocation saving them anew), counted as
    evicted for "expired"; returns how many were dropped."""
    freed: dict[tuple[str, int], int] = defaultdict(int)
    for key in keys:
        for rank, _ in _drop_key(conn, namespace, key, now):
            freed[(namespace, rank)] += 1
    _finish(conn, freed, {namespace: len(keys)}, "expired")
    return len(keys)


def _committed_pages(
    conn: sqlite3.Connection, victims: Sequence[Victim]
) -> dict[tuple[str, str], list[tuple[int, int, float]]]:
    """The committed (rank, page, lease_until) of each victim, in rank order: what
    `_drop_key` would delete and return, read in one statement per namespace."""
    keys: dict[str, list[str]] = defaultdict(list)
    for ns, key, _ in victims:
        keys[ns].append(key)
    pages: dict[tuple[str, str], list[tuple[int, int, float]]] = defaultdict(list)
    for ns, names in keys.items():
        for start in range(0, len(names), _IN_CHUNK):
            chunk = names[start : start + _IN_CHUNK]
            for key, rank, page, lease in conn.execute(
                "SELECT key, rank, page, lease_until FROM entries INDEXED BY entries_by_key"
                f" WHERE namespace = ? AND key IN ({','.join('?' * len(chunk))}) AND state = 1"
                " ORDER BY key, rank",
                (ns, *chunk),
            ):
                pages[(ns, key)].append((rank, page, lease))
    return pages


def _drop_victims(
    conn: sqlite3.Connection,
    victims: Sequence[Victim],
    pages: dict[tuple[str, str], list[tuple[int, int, float]]],
    now: float,
) -> None:
    """`_drop_key` of each victim, in their order (the `changes` log's order), as one
    prepared DELETE and one free-list INSERT for all of them."""
    conn.executemany(
        "DELETE FROM entries INDEXED BY entries_by_key WHERE namespace = ? AND key = ?"
        " AND state = 1",
        [(ns, key) for ns, key, _ in victims],
    )
    conn.executemany(
        "INSERT INTO free_pages (namespace, rank, page, reusable_after) VALUES (?,?,?,?)",
        [
            (ns, rank, page, max(now, lease))
            for ns, key, _ in victims
            for rank, page, lease in pages.get((ns, key), ())
        ],
    )


def evict_lru(
    conn: sqlite3.Connection,
    now: float,
    *,
    scope: Sequence[str] | None,
    satisfied: Callable[[], bool],
    on_free: Callable[[str, int, int], None],
    reason: str,
    batch: int = _BATCH,
    limit: int | None = None,
) -> int:
    """Evict LRU keys of `scope` (every rank at once) until `satisfied()`, or `limit`
    keys went (None: no limit).

    `on_free(namespace, rank, page)` is told of every page a victim frees (all reusable
    now: the candidates hold no lease), victim by victim with `satisfied()` asked before
    each, as if each were dropped alone; the chosen victims of a batch are then dropped
    together. Returns how many keys were evicted; they are counted under `reason`, the
    expired ones under "expired".
    """
    freed: dict[str, dict[tuple[str, int], int]] = defaultdict(lambda: defaultdict(int))
    by_namespace: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    evicted = 0
    drop_expired_pins(conn, now)
    while evicted != limit and not satisfied():
        want = batch if limit is None else min(batch, limit - evicted)
        candidates = choose_victims(conn, now, scope, want)
        if not candidates:
            break
        pages = _committed_pages(conn, candidates)
        chosen: list[Victim] = []
        for victim in candidates:
            if evicted + len(chosen) == limit or satisfied():
                break
            ns, key, expired = victim
            why = "expired" if expired else reason
            for rank, page, _ in pages.get((ns, key), ()):
                freed[why][(ns, rank)] += 1
                on_free(ns, rank, page)
            chosen.append(victim)
            by_namespace[why][ns] += 1
        _drop_victims(conn, chosen, pages, now)
        evicted += len(chosen)
    for why, counts in by_namespace.items():
        _finish(conn, freed[why], counts, why)
    return evicted


# The oldest keys of a namespace committed on :rank and not leased there, not pinned.
FILE_VICTIMS = (
    "SELECT l.key FROM key_lru l INDEXED BY key_lru_unpinned WHERE l.namespace = :ns"
    " AND l.pinned = 0"
    " AND EXISTS (SELECT 1 FROM entries e INDEXED BY entries_by_key"
    " WHERE e.namespace = l.namespace AND e.key = l.key AND e.rank = :rank"
    " AND e.state = 1 AND e.lease_until <= :now)"
    " AND NOT EXISTS (SELECT 1 FROM pins p WHERE p.namespace = l.namespace"
    " AND p.key = l.key AND (p.expires = 0 OR p.expires > :now))"
    " ORDER BY l.last_access ASC, l.depth DESC LIMIT :limit OFFSET :offset"
)


# … and the expired ones first (issue 22): `key_lru_by_expiry` walked up to :now.
FILE_EXPIRED = (
    "SELECT l.key FROM key_lru l INDEXED BY key_lru_by_expiry WHERE l.namespace = :ns"
    " AND l.expires_at IS NOT NULL AND l.expires_at <= :now AND l.pinned = 0"
    " AND EXISTS (SELECT 1 FROM entries e INDEXED BY entries_by_key"
    " WHERE e.namespace = l.namespace AND e.key = l.key AND e.rank = :rank"
    " AND e.state = 1 AND e.lease_until <= :now)"
    " AND NOT EXISTS (SELECT 1 FROM pins p WHERE p.namespace = l.namespace"
    " AND p.key = l.key AND (p.expires = 0 OR p.expires > :now))"
    " ORDER BY l.expires_at ASC LIMIT :limit OFFSET :offset"
)


def choose_file_victims(
    conn: sqlite3.Connection,
    namespace: str,
    rank: int,
    now: float,
    limit: int,
    offset: int,
    expired: bool = False,
) -> list[tuple[str]]:
    """The eviction decision of a full fixed-size file: the least-recently-used keys of
    the namespace (chain tails first, `key_lru_unpinned` walked in order) committed on
    `rank`, not leased there, not pinned — or, with `expired`, its expired such keys,
    which go first (`key_lru_by_expiry`); the caller skips keys pending or leased on
    another rank. Redis: `evict_lru` with `need_rank` (`redis/lua/eviction.lua`)."""
    return conn.execute(
        FILE_EXPIRED if expired else FILE_VICTIMS,
        {"ns": namespace, "rank": rank, "now": now, "limit": limit, "offset": offset},
    ).fetchall()


def evict_for_allocation(
    conn: sqlite3.Connection,
    namespace: str,
    rank: int,
    now: float,
    target_used: int,
    limit: int | None = None,
) -> int:
    """Evict LRU keys until `rank` holds at most `target_used` pages, or `limit` keys
    went (None: no limit; expired keys first, counted too); returns keys evicted."""
    used = conn.execute(
        "SELECT used FROM rank_files WHERE namespace = ? AND rank = ?", (namespace, rank)
    ).fetchone()[0]
    num_ranks = conn.execute(
        "SELECT num_ranks FROM namespaces WHERE id = ?", (namespace,)
    ).fetchone()[0]
    evicted = 0
    drop_expired_pins(conn, now)
    for expired, reason in ((True, "expired"), (False, "file_full")):
        freed: dict[tuple[str, int], int] = defaultdict(int)
        dropped = 0
        skipped = 0
        while used > target_used and evicted + dropped != limit:
            batch = choose_file_victims(
                conn, namespace, rank, now, max(_BATCH, used - target_used), skipped, expired
            )
            if not batch:
                break
            for (key,) in batch:
                if used <= target_used or evicted + dropped == limit:
                    break
                if num_ranks > 1:
                    busy = conn.execute(
                        "SELECT 1 FROM entries INDEXED BY entries_by_key WHERE namespace = ?"
                        " AND key = ? AND (state = 0 OR lease_until > ?) LIMIT 1",
                        (namespace, key, now),
                    ).fetchone()
                    if busy is not None:
                        skipped += 1
                        continue
                for freed_rank, _ in _drop_key(conn, namespace, key, now):
                    freed[(namespace, freed_rank)] += 1
                    if freed_rank == rank:
                        used -= 1
                dropped += 1
        _finish(conn, freed, {namespace: dropped}, reason)
        evicted += dropped
    return evicted


def invalidate_pages(
    conn: sqlite3.Connection,
    namespace: str,
    rank: int,
    items: Sequence[tuple[str, int, str]],
    now: float,
) -> int:
    """Drop every key whose committed entry on `rank` is still the reported (page, checksum).

    The key goes on every rank at once (`_drop_key`); a key re-saved since under another
    page or checksum, or already gone, is left alone. Returns how many keys were dropped.
    """
    freed: dict[tuple[str, int], int] = defaultdict(int)
    dropped = 0
    for key, page, checksum in items:
        still = conn.execute(
            "SELECT 1 FROM entries WHERE namespace = ? AND rank = ? AND page = ? AND key = ?"
            " AND checksum = ? AND state = 1",
            (namespace, rank, page, key, checksum),
        ).fetchone()
        if still is None:
            continue
        for freed_rank, _ in _drop_key(conn, namespace, key, now):
            freed[(namespace, freed_rank)] += 1
        dropped += 1
    _finish(conn, freed, {namespace: dropped}, "corrupt")
    return dropped


# Admin candidates of one namespace: an LRU index (`key_lru_unpinned`, or `key_lru_pinned`
# for the pinned ones) walked from just after the last
# key a batch returned (:after_access, :after_depth, :after_key: keyset paging, so a
# batch never re-walks the keys before it), keys older than :before, none pending.
# Leased keys may go (their pages wait for the lease); pinned ones only when asked.
_ADMIN_BATCH = 1024
ADMIN_VICTIMS = (
    "SELECT l.last_access, -l.depth, l.namespace, l.key FROM key_lru l INDEXED BY {index}"
    " WHERE l.namespace = :ns AND l.last_access >= :after_access AND l.last_access < :before"
    " AND (l.last_access > :after_access OR l.depth < :after_depth"
    " OR (l.depth = :after_depth AND l.key > :after_key))"
    " AND NOT EXISTS (SELECT 1 FROM entries e INDEXED BY entries_by_key"
    " WHERE e.namespace = l.namespace AND e.key = l.key AND e.state = 0) {pins}"
    " ORDER BY l.last_access ASC, l.depth DESC, l.key ASC LIMIT :limit"
)
_ADMIN_NOT_PINNED = (
    " AND l.pinned = 0 AND NOT EXISTS (SELECT 1 FROM pins p WHERE p.namespace = l.namespace AND p.key = l.key"
    " AND (p.expires = 0 OR p.expires > :now))"
)
# `evict --include-pinned`: every key, from both LRU indexes (each key is in one).
_ADMIN_ALL = (
    ADMIN_VICTIMS.format(index="key_lru_unpinned", pins=" AND l.pinned = 0"),
    ADMIN_VICTIMS.format(index="key_lru_pinned", pins=" AND l.pinned = 1"),
)


def _admin_walk(
    conn: sqlite3.Connection, query: str, namespace: str, now: float, before: float
) -> Iterator[tuple[float, int, str, str]]:
    """One namespace's admin candidates in eviction order, read a batch at a time (each
    batch read whole before it is yielded: the caller deletes rows between batches)."""
    after: tuple[float, int, str] = (float("-inf"), 2**62, "")
    while True:
        rows = conn.execute(
            query,
            {
                "ns": namespace,
                "now": now,
                "before": before,
                "after_access": after[0],
                "after_depth": after[1],
                "after_key": after[2],
                "limit": _ADMIN_BATCH,
            },
        ).fetchall()
        yield from rows
        if len(rows) < _ADMIN_BATCH:
            return
        last_access, negative_depth, _, key = rows[-1]
        after = (last_access, -negative_depth, key)


def admin_cutoff(request: EvictRequest, now: float) -> float:
    """The last access before which `request` evicts keys (inf: any), as of `now`."""
    return float("inf") if request.older_than_s is None else now - request.older_than_s


def choose_admin_victims(
    conn: sqlite3.Connection, request: EvictRequest, now: float, before: float | None = None
) -> Iterator[tuple[str, str]]:
    """The eviction decision of `hf3fsctl evict`: committed keys of the request's scope
    (leased ones too; pinned ones only with `include_pinned`), LRU first, chain tails
    first among equally old keys, lazily: each namespace's LRU index walks in batches
    (`key_lru_unpinned`, and `key_lru_pinned` with `include_pinned`), merged, so
    `evict_entries` reads only as far as the request's target (O(k log n) for k keys
    evicted). `before`: the last-access cutoff (default: `older_than_s` before `now`).
    Redis: `redis/lua/evict.lua`."""
    drop_expired_pins(conn, now)
    queries = (
        _ADMIN_ALL
        if request.include_pinned
        else (ADMIN_VICTIMS.format(index="key_lru_unpinned", pins=_ADMIN_NOT_PINNED),)
    )
    if before is None:
        before = admin_cutoff(request, now)
    if request.namespace:
        names = [request.namespace]
    else:
        names = [ns for (ns,) in conn.execute("SELECT id FROM namespaces ORDER BY id")]
    walks = [_admin_walk(conn, query, ns, now, before) for ns in names for query in queries]
    for _, _, ns, key in heapq.merge(*walks) if len(walks) != 1 else walks[0]:
        yield ns, key


def evict_entries(
    conn: sqlite3.Connection,
    request: EvictRequest,
    now: float,
    capacity: int | None,
    before: float | None = None,
) -> EvictResult:
    """Evict committed keys by the request's criteria (the caller commits or rolls back).

    `target_usage` is a share of `capacity` (of the selected files' pages when the
    store is unbounded) that the live pages are brought down to; `before` is the
    last-access cutoff (`admin_cutoff`, fixed by a caller that evicts in batches).
    """
    scope, args = ("WHERE namespace = ?", [request.namespace]) if request.namespace else ("", [])
    slot_bytes: dict[tuple[str, int], int] = {}
    bytes_used = bytes_total = 0
    for ns, rank, slot, used, next_unused in conn.execute(
        f"SELECT namespace, rank, slot_bytes, used, next_unused FROM rank_files {scope}", args
    ):
        slot_bytes[(ns, rank)] = slot
        bytes_used += used * slot
        bytes_total += next_unused * slot
    if capacity is not None:
        bytes_total = capacity
    candidates = choose_admin_victims(conn, request, now, before)
    freed: dict[tuple[str, int], int] = defaultdict(int)
    by_namespace: dict[str, int] = defaultdict(int)
    keys = pages = freed_bytes = 0
    for ns, key in candidates:
        if request.max_entries is not None and keys >= request.max_entries:
            break
        if request.target_usage is not None and (bytes_used <= request.target_usage * bytes_total):
            break
        for rank, _ in _drop_key(conn, ns, key, now):
            freed[(ns, rank)] += 1
            pages += 1
            size = slot_bytes.get((ns, rank), 0)
            freed_bytes += size
            bytes_used -= size
        keys += 1
        by_namespace[ns] += 1
    _finish(conn, freed, by_namespace, "admin")
    return EvictResult(
        keys=keys,
        pages=pages,
        bytes=freed_bytes,
        dry_run=request.dry_run,
        by_namespace=dict(by_namespace),
    )
