"""A full store's eviction, batched (issue 21), decides and writes what the per-key loop did.

`eviction.evict_lru` reads a batch of victims' pages in one statement and drops the chosen
victims together, and `capacity._fit` asks for as many candidates as pages are short
instead of 256. The oracle is the per-key loop it replaced (`_drop_key` per victim, 256
candidates a scan), run on a copy of the same store: the same allocations must leave the
same entries, free pages, eviction counters and `changes` log (KV events follow it, in
its order).
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import PAGE_BYTES, checksum, keys, register_growable, store_written

from hf3fsctl.meta.models import CommitItem
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite import capacity, eviction
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.storage.layout import PageFile

EXPIRING = keys(1, salt="expiring")[0]


def per_key_evict_lru(
    conn: sqlite3.Connection,
    now: float,
    *,
    scope: Sequence[str] | None,
    satisfied: Callable[[], bool],
    on_free: Callable[[str, int, int], None],
    reason: str,
    batch: int = 256,
    limit: int | None = None,
) -> int:
    """The loop before issue 21's batching: one `_drop_key` per victim, 256 a scan (at
    most `limit` victims, as `evict_lru`)."""
    freed: dict[str, dict[tuple[str, int], int]] = defaultdict(lambda: defaultdict(int))
    by_namespace: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    evicted = 0
    eviction.drop_expired_pins(conn, now)
    while evicted != limit and not satisfied():
        candidates = eviction.choose_victims(conn, now, scope, 256)
        if not candidates:
            break
        for ns, key, expired in candidates:
            if evicted == limit or satisfied():
                break
            why = "expired" if expired else reason
            for rank, page in eviction._drop_key(conn, ns, key, now):
                freed[why][(ns, rank)] += 1
                on_free(ns, rank, page)
            evicted += 1
            by_namespace[why][ns] += 1
    for why, counts in by_namespace.items():
        eviction._finish(conn, freed[why], counts, why)
    return evicted


def open_store(directory: Path) -> MetadataStore:
    policy = StorePolicy(storage_root=str(directory / "root"), capacity="100%")
    return MetadataStore(
        directory / "meta.db", policy=policy, high_watermark=0.9, low_watermark=0.6, lease_s=60.0
    )


Files = dict[str, list[tuple[str, int]]]  # namespace: (relpath, num_pages) per rank


def build(directory: Path) -> tuple[str, str, Files]:
    """A store at its capacity: namespace `a` (one rank) and `b` (two ranks) with chains
    of several ages, a pinned key, a leased key and an expired key at the LRU head."""
    (directory / "root").mkdir(parents=True)
    store = open_store(directory)
    store.set_capacity(40 * PAGE_BYTES)
    a, files_a = register_growable(store, directory / "root", model="a")
    b, files_b = register_growable(store, directory / "root", model="b", tp_size=2)
    result = store.allocate(a, 0, [EXPIRING])
    store.commit(
        a,
        0,
        [
            CommitItem(
                key=EXPIRING,
                page=result.allocated[0].page,
                checksum=checksum(EXPIRING, result.allocated[0].page),
                size=PAGE_BYTES,
                retention_s=0.001,
            )
        ],
    )
    for round_ in range(3):
        store_written(store, a, files_a, keys(6, salt=f"a{round_}-"))
        time.sleep(0.002)
        store_written(store, b, files_b, keys(4, salt=f"b{round_}-"))
        time.sleep(0.002)
    store.pin(a, keys(1, salt="a0-"))
    store.locate(b, 1, keys(1, salt="b0-"))  # leased on rank 1
    paths = {
        ns: [(f.relpath, f.num_pages) for f in opened]
        for ns, opened in ((a, files_a), (b, files_b))
    }
    for file in (*files_a, *files_b):
        file.close()
    store.close()
    time.sleep(0.01)  # the expiring key is past its retention
    return a, b, paths


def save_while_full(directory: Path, a: str, b: str, paths: Files) -> dict[str, Any]:
    """Saves that each make room, then what the store holds."""
    store = open_store(directory)
    files = {
        ns: [
            PageFile.open(directory / "root", relpath, PAGE_BYTES, pages, growable=True)
            for relpath, pages in opened
        ]
        for ns, opened in paths.items()
    }
    for round_ in range(4):
        store_written(store, a, files[a], keys(5, salt=f"new-a{round_}-"), first_depth=round_)
        store_written(store, b, files[b], keys(3, salt=f"new-b{round_}-"))
    problems = store.check_invariants()
    store.close()
    for opened in files.values():
        for file in opened:
            file.close()
    conn = sqlite3.connect(directory / "meta.db")
    try:
        return {
            "changes": conn.execute(
                "SELECT namespace, key, delta FROM changes ORDER BY seq"
            ).fetchall(),
            "evictions": conn.execute("SELECT * FROM evictions ORDER BY 1, 2").fetchall(),
            "entries": conn.execute(
                "SELECT namespace, key, rank, page, state FROM entries ORDER BY 1, 2, 3"
            ).fetchall(),
            "free": conn.execute(
                "SELECT namespace, rank, page, punched FROM free_pages ORDER BY 1, 2, 3"
            ).fetchall(),
            "problems": problems,
        }
    finally:
        conn.close()


def test_batched_eviction_leaves_what_the_per_key_loop_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, paths = build(tmp_path / "built")
    shutil.copytree(tmp_path / "built", tmp_path / "batched")
    shutil.copytree(tmp_path / "built", tmp_path / "per_key")
    batched = save_while_full(tmp_path / "batched", a, b, paths)
    monkeypatch.setattr(capacity, "evict_lru", per_key_evict_lru)
    per_key = save_while_full(tmp_path / "per_key", a, b, paths)
    evicted = [row for row in per_key["changes"] if row[2] == -1]
    assert len(evicted) > 10  # the saves did evict, on both namespaces
    assert {ns for ns, _, _ in evicted} == {a, b}
    assert (EXPIRING in {key for _, key, _ in evicted}) is True
    assert batched == per_key
    assert batched["problems"] == []


def old_reusable_free(conn: sqlite3.Connection, namespace: str, rank: int, now: float) -> int:
    """The count `capacity.reusable_free` made before issue 21: every free page read."""
    return int(
        conn.execute(
            "SELECT COUNT(*) FROM free_pages WHERE namespace = ? AND rank = ?"
            " AND reusable_after <= ? AND punched = 0",
            (namespace, rank, now),
        ).fetchone()[0]
    )


def old_taken(conn: sqlite3.Connection, namespace: str, rank: int, now: float) -> list[Any]:
    """The free pages `capacity.take_pages` took first before issue 21 (a sort of all)."""
    return conn.execute(
        "SELECT page, reusable_after, punched FROM free_pages WHERE namespace = ? AND rank = ?"
        " AND reusable_after <= ? AND punched != 2 ORDER BY punched, reusable_after",
        (namespace, rank, now),
    ).fetchall()


def test_free_pages_are_counted_and_taken_as_the_full_count_and_sort_did(
    tmp_path: Path,
) -> None:
    """`reusable_free` from the rank file's row less the leased and marked pages, and
    `take_pages` by index order, agree with the scans they replaced on every rank file
    of a store whose free pages are reusable, leased, punched and being given back."""
    a, b, paths = build(tmp_path / "built")
    save_while_full(tmp_path / "built", a, b, paths)  # evictions: free and punched pages
    store = open_store(tmp_path / "built")
    for ns, salt in ((a, "released-a"), (b, "released-b")):  # free pages holding space
        store.release(ns, 0, store.allocate(ns, 0, keys(6, salt=salt)).allocated)
    conn = store._conn()
    conn.execute("BEGIN IMMEDIATE")
    try:
        # some pages marked to give back, some still leased
        plain = conn.execute(
            "SELECT namespace, rank, page FROM free_pages WHERE punched = 0 ORDER BY page"
        ).fetchall()
        conn.executemany(
            f"UPDATE free_pages SET punched = {capacity.GIVING_BACK}"
            " WHERE namespace = ? AND rank = ? AND page = ?",
            plain[0::4],
        )
        conn.executemany(
            "UPDATE free_pages SET reusable_after = reusable_after + 3600"
            " WHERE namespace = ? AND rank = ? AND page = ?",
            plain[1::4],
        )
        for ns, rank, page in plain[2::4]:  # and some punched, as holes of their file
            conn.execute(
                f"UPDATE free_pages SET punched = {capacity.PUNCHED}"
                " WHERE namespace = ? AND rank = ? AND page = ?",
                (ns, rank, page),
            )
            conn.execute(
                "UPDATE rank_files SET holes = holes + 1 WHERE namespace = ? AND rank = ?",
                (ns, rank),
            )
        states = conn.execute(
            "SELECT punched, reusable_after > ? FROM free_pages", (time.time(),)
        ).fetchall()
        assert {(0, 0), (0, 1), (capacity.PUNCHED, 0), (capacity.GIVING_BACK, 0)} <= set(states)
        for ns, rank in conn.execute("SELECT namespace, rank FROM rank_files").fetchall():
            for now in (0.0, time.time(), time.time() + 7200):
                assert capacity.reusable_free(conn, ns, rank, now) == old_reusable_free(
                    conn, ns, rank, now
                )
            row = capacity.rank_file_row(conn, ns, rank)
            assert row is not None
            expected = old_taken(conn, ns, rank, time.time())
            conn.execute("SAVEPOINT take")
            taken = capacity.take_pages(conn, row, len(expected), time.time(), None)
            conn.execute("ROLLBACK TO take")
            assert taken == [(page, after) for page, after, _ in expected]
    finally:
        conn.execute("ROLLBACK")
        store.close()
