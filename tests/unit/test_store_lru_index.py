"""Eviction by index on SQLite (issue 21): the victims come from `key_lru_unpinned` walked
in order with a LIMIT — no sort of every entry — and they are the same keys the old
full `GROUP BY … ORDER BY MAX(last_access), MAX(depth) DESC` query chose.

`key_lru` is kept by triggers; these tests write `entries` the way every store version
does (real SQL on a real store) and check the table against the entries it summarises.
"""

from __future__ import annotations

import random
import sqlite3
import time
from pathlib import Path

import pytest
from helpers.meta_builders import keys, register, store_keys

from hf3fsctl.meta.models import EvictRequest
from hf3fsctl.meta.sqlite import eviction, schema
from hf3fsctl.meta.sqlite.store import MetadataStore

# The choice before issue 21 (every entry grouped and sorted): the reference.
_FULL_SORT = (
    "SELECT e.namespace, e.key FROM entries e WHERE NOT EXISTS (SELECT 1 FROM pins p"
    " WHERE p.namespace = e.namespace AND p.key = e.key AND (p.expires = 0 OR p.expires > :now))"
    " GROUP BY e.namespace, e.key"
    " HAVING SUM(e.state = 0) = 0 AND MAX(e.lease_until) <= :now"
    " ORDER BY MAX(e.last_access) ASC, MAX(e.depth) DESC LIMIT :limit"
)


def _pairs(victims: list[eviction.Victim]) -> list[tuple[str, str]]:
    return [(v.namespace, v.key) for v in victims]


def _plan(conn: sqlite3.Connection, sql: str, args: dict[str, object]) -> str:
    return "\n".join(str(row[-1]) for row in conn.execute("EXPLAIN QUERY PLAN " + sql, args))


def test_victim_queries_walk_the_age_index_without_a_sort(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db")
    register(store)
    store.close()
    conn = sqlite3.connect(tmp_path / "m.db")
    args = {"ns": "n", "now": 0.0, "limit": 4, "rank": 0, "offset": 0}
    for sql in (eviction.VICTIMS_OF_NAMESPACE, eviction.FILE_VICTIMS):
        plan = _plan(conn, sql, args)  # the unpinned keys' order: pinned ones never walked
        assert "INDEX key_lru_unpinned (namespace=?)" in plan, plan
        assert "TEMP B-TREE" not in plan, plan
        assert "SCAN e" not in plan and "SCAN entries" not in plan, plan
    for sql in (eviction.EXPIRED_OF_NAMESPACE, eviction.FILE_EXPIRED):  # issue 22
        plan = _plan(conn, sql, args)
        assert "key_lru_by_expiry (namespace=? AND expires_at>? AND expires_at<?)" in plan, plan
        assert "TEMP B-TREE" not in plan, plan
        assert "SCAN e" not in plan and "SCAN entries" not in plan, plan
    conn.close()


def test_admin_victims_walk_the_age_index_from_the_last_batch_without_a_sort(
    tmp_path: Path,
) -> None:
    store = MetadataStore(tmp_path / "m.db")
    register(store)
    store.close()
    conn = sqlite3.connect(tmp_path / "m.db")
    args = {
        "ns": "n",
        "now": 0.0,
        "before": 1.0,
        "after_access": 0.0,
        "after_depth": 3,
        "after_key": "",
        "limit": 4,
    }
    for index, pins in (
        ("key_lru_unpinned", " AND l.pinned = 0"),  # --include-pinned: both LRU indexes
        ("key_lru_pinned", " AND l.pinned = 1"),
        ("key_lru_unpinned", eviction._ADMIN_NOT_PINNED),
    ):
        plan = _plan(conn, eviction.ADMIN_VICTIMS.format(index=index, pins=pins), args)
        assert f"INDEX {index} (namespace=? AND last_access>? AND last_access<?)" in plan, plan
        assert "TEMP B-TREE" not in plan, plan
        assert "SCAN" not in plan, plan
    conn.close()


def _random_store(tmp_path: Path, seed: int) -> tuple[Path, list[str], float]:
    """Two namespaces (1 and 2 ranks) of committed, pending, leased, pinned, touched,
    partly dropped keys, written through the store and then by plain SQL."""
    rng = random.Random(seed)
    store = MetadataStore(tmp_path / "m.db", lease_s=60.0)
    names = [register(store, num_pages=400), register(store, num_pages=400, tp_size=2, model="b")]
    for ranks, ns in zip((1, 2), names, strict=True):
        store_keys(store, ns, keys(120, salt=ns), ranks=ranks)
        store.allocate(ns, 0, keys(5, salt=ns + "-pending"))  # pending: never a victim
        store.locate(ns, 0, keys(120, salt=ns)[40:45])  # leased now: skipped
    store.pin(names[0], keys(120, salt=names[0])[:3])
    store.close()
    conn = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    now = time.time()
    conn.execute("BEGIN")
    pages = conn.execute("SELECT namespace, rank, page FROM entries WHERE state = 1").fetchall()
    for ns, rank, page in pages:  # later distinct times (locate), other depths (regrant)
        conn.execute(
            "UPDATE entries SET last_access = ?, depth = ? WHERE namespace = ? AND rank = ?"
            " AND page = ?",
            (now + rng.randrange(10_000) + rng.random(), rng.randrange(50), ns, rank, page),
        )
    for ns, rank, page in rng.sample(pages, 20):  # ranks dropped while the key stays
        conn.execute(
            "DELETE FROM entries WHERE namespace = ? AND rank = ? AND page = ?", (ns, rank, page)
        )
    conn.execute("COMMIT")
    conn.close()
    return tmp_path / "m.db", names, now


def _lru_problems(conn: sqlite3.Connection) -> list[tuple[object, ...]]:
    """Violations of the store's invariants about `key_lru` (the raw deletes above
    leave rank files' counts behind on purpose; those are not what is checked)."""
    return [
        row
        for _, query in schema.INVARIANT_QUERIES
        if schema.KEY_LRU_TABLE in query
        for row in conn.execute(query)
    ]


def test_index_walk_chooses_the_full_sorts_victims(tmp_path: Path) -> None:
    db, names, now = _random_store(tmp_path, seed=21)
    conn = sqlite3.connect(db)
    assert _lru_problems(conn) == []
    for limit in (1, 7, 60, 500):
        expected = conn.execute(_FULL_SORT, {"now": now, "limit": limit}).fetchall()
        assert _pairs(eviction.choose_victims(conn, now, None, limit)) == expected
        scoped = [v for v in expected if v[0] == names[1]]
        assert _pairs(eviction.choose_victims(conn, now, [names[1]], len(scoped))) == scoped
    conn.close()


# The admin choice before issue 21's follow-up (every entry grouped and sorted).
_ADMIN_FULL_SORT = (
    "SELECT e.namespace, e.key FROM entries e {where} GROUP BY e.namespace, e.key"
    " HAVING SUM(e.state = 0) = 0 {older} ORDER BY MAX(e.last_access) ASC, MAX(e.depth) DESC,"
    " e.key ASC"
)


def test_admin_index_walk_chooses_the_full_sorts_victims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, names, now = _random_store(tmp_path, seed=22)
    monkeypatch.setattr(eviction, "_ADMIN_BATCH", 7)  # many batches: the paging is exercised
    now += 5_000  # half the keys' (random, later) last accesses are before this
    conn = sqlite3.connect(db)
    not_pinned = eviction.NOT_PINNED
    for request, where, older, named in (
        (EvictRequest(all=True), f"WHERE {not_pinned}", "", {}),
        (EvictRequest(all=True, include_pinned=True), "", "", {}),
        (
            EvictRequest(namespace=names[1], older_than_s=0.0),
            f"WHERE e.namespace = :ns AND {not_pinned}",
            "AND MAX(e.last_access) < :before",
            {"ns": names[1], "before": now},
        ),
        (
            EvictRequest(older_than_s=1_000.0, include_pinned=True),
            "",
            "AND MAX(e.last_access) < :before",
            {"before": now - 1_000},
        ),
    ):
        expected = conn.execute(
            _ADMIN_FULL_SORT.format(where=where, older=older), {"now": now, **named}
        ).fetchall()
        chosen = list(eviction.choose_admin_victims(conn, request, now))
        # equally old keys of different namespaces may come in either order: compare
        # the order of (last access, depth) and the set of keys
        assert sorted(chosen) == sorted(expected)
        assert _ages(conn, chosen) == _ages(conn, expected)
    conn.close()


def _ages(conn: sqlite3.Connection, victims: list[tuple[str, str]]) -> list[tuple[float, int]]:
    return [
        conn.execute(
            "SELECT last_access, -depth FROM key_lru WHERE namespace = ? AND key = ?", victim
        ).fetchone()
        for victim in victims
    ]


def test_a_store_written_before_key_lru_gets_it_filled_on_open(tmp_path: Path) -> None:
    db, _, now = _random_store(tmp_path, seed=5)
    conn = sqlite3.connect(db, isolation_level=None)
    expected = conn.execute(_FULL_SORT, {"now": now, "limit": 1000}).fetchall()
    conn.executescript(
        "BEGIN; DROP TABLE key_lru; DROP TRIGGER key_lru_on_insert; DROP TRIGGER key_lru_on_touch;"
        " DROP TRIGGER key_lru_on_shallower; DROP TRIGGER key_lru_on_state;"
        " DROP TRIGGER key_lru_on_delete; COMMIT;"
    )
    conn.close()
    MetadataStore(db).close()  # a writable open of the older store
    conn = sqlite3.connect(db)
    assert _lru_problems(conn) == []
    assert _pairs(eviction.choose_victims(conn, now, None, 1000)) == expected
    conn.close()


def test_lookup_reads_committed_ranks_from_disk_on_new_and_older_stores(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store, tp_size=2)
    chain = keys(10)
    store_keys(store, ns, chain, ranks=2)
    store.allocate(ns, 0, keys(3, salt="half"))  # pending on one rank: no hit
    assert store.lookup(ns, chain) == 10
    assert store.lookup(ns, [*chain[:4], *keys(3, salt="half"), *chain[4:]]) == 4
    store.evict(EvictRequest(namespace=ns, max_entries=1))  # the oldest: a chain tail
    held = store.lookup(ns, chain)
    assert held < 10
    store.close()
    conn = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    conn.executescript("BEGIN; DROP TABLE key_lru; COMMIT;")  # as written before key_lru
    conn.close()
    reader = MetadataStore(tmp_path / "m.db", read_only=True)
    assert reader.lookup(ns, chain) == held
    reader.close()


def _lru_indexes(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'key_lru'"
        " AND sql IS NOT NULL"
    )
    return {name for (name,) in rows}


def test_each_key_is_in_one_lru_index(tmp_path: Path) -> None:
    """A touch (every `locate`) moves a key in one LRU index, not two (issue 23)."""
    db, _, _ = _random_store(tmp_path, seed=7)
    conn = sqlite3.connect(db)
    assert _lru_indexes(conn) == {"key_lru_unpinned", "key_lru_pinned", "key_lru_by_expiry"}
    total, unpinned, pinned = conn.execute(
        "SELECT COUNT(*), SUM(pinned = 0), SUM(pinned = 1) FROM key_lru"
    ).fetchone()
    assert pinned > 0 and unpinned + pinned == total
    conn.close()


def test_a_store_with_the_age_index_of_every_key_loses_it_on_a_writable_open(
    tmp_path: Path,
) -> None:
    """Stores written before kept `key_lru_by_age` beside `key_lru_unpinned`; a writable
    open drops it and builds `key_lru_pinned`, and admin eviction still takes pinned keys
    in LRU order with `include_pinned`."""
    db = tmp_path / "m.db"
    store = MetadataStore(db)
    ns = register(store)
    chain = keys(6)
    store_keys(store, ns, chain)
    store.pin(ns, chain[:2])
    store.locate(ns, 0, chain[:1])  # the newest access: evicted last
    store.close()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.executescript(
        "BEGIN; DROP INDEX key_lru_pinned;"
        " CREATE INDEX key_lru_by_age ON key_lru (namespace, last_access, depth DESC); COMMIT;"
    )
    conn.close()
    reader = MetadataStore(db, read_only=True)  # a reader changes nothing
    reader.close()
    conn = sqlite3.connect(db)
    assert "key_lru_by_age" in _lru_indexes(conn)
    conn.close()
    store = MetadataStore(db)
    conn = sqlite3.connect(db)
    assert _lru_indexes(conn) == {"key_lru_unpinned", "key_lru_pinned", "key_lru_by_expiry"}
    conn.close()
    assert store.check_invariants() == []
    first = store.evict(EvictRequest(max_entries=5, include_pinned=True))
    assert first.keys == 5
    assert store.lookup(ns, chain[:1]) == 1  # the key touched last is the one left
    store.close()
