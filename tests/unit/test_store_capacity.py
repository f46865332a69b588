"""One capacity for the whole store: cross-namespace LRU over growing page files on a
real disk, hole punching, quotas, pins, namespace drop, dead writers, leases, and a schema-1
store after `hf3fsctl migrate`.

Every store here has a storage root under `tmp_path` holding real sparse page files
(`PageFile.create_growable`); the tests write real bytes into the pages they are granted,
so `disk_bytes` (st_blocks) shows what the store punched back to the file system.
Capacities are counted in 4 KiB pages; watermarks are high 0.8, low 0.5 unless a test
says otherwise.

What every store must do here (cross-namespace LRU, space given back, quotas, pins,
drops, leases) runs on each implementation in `tests/contract/test_contract_capacity.py`;
this file keeps what needs the SQLite store itself: refused or crashed punches
(monkeypatched), writer deadlines and leases shorter than any config allows, schema 1.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import (
    PAGE_BYTES,
    checksum,
    commit_items,
    keys,
    make_manifest,
    register_growable,
    store_written,
    write_pages,
)
from helpers.old_stores import SCHEMA_1_PAGES, schema_1_store

from hf3fsctl.errors import MetadataUnavailable
from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.models import CommitItem
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite.migration import migrate
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.storage.extents import disk_bytes

SLOT = PAGE_BYTES  # the slot of a 4 KiB page


def ns_id(model: str = "tiny", **changes: Any) -> str:
    """The id `register_growable(model=…, **changes)` will register (for quotas)."""
    return namespace_id(make_manifest(model=model, **changes).to_dict())


class Tier:
    """A store with one capacity over growing page files under `tmp_path/root`."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        capacity_pages: int = 20,
        with_root: bool = True,
        quotas: dict[str, str] | None = None,
        max_pinned: str = "25%",
        **store_args: Any,
    ) -> None:
        self.root = tmp_path / "root"
        self.root.mkdir(exist_ok=True)
        policy = StorePolicy(
            storage_root=str(self.root) if with_root else None,
            capacity="100%",
            max_pinned=max_pinned,
            quotas=quotas or {},
        )
        settings = {"high_watermark": 0.8, "low_watermark": 0.5, "lease_s": 60.0, **store_args}
        self.store = MetadataStore(tmp_path / "meta.db", policy=policy, **settings)
        self.capacity = capacity_pages * SLOT
        self.store.set_capacity(self.capacity)
        self.files: dict[str, list[Any]] = {}

    def add(self, model: str = "tiny", **changes: Any) -> str:
        """Register a namespace with growing files; returns its id."""
        ns, files = register_growable(self.store, self.root, model=model, **changes)
        self.files[ns] = files
        return ns

    def put(self, ns: str, chain: list[str], first_depth: int = 0) -> int:
        """Store `chain` (allocate, write, commit on every rank); returns keys granted."""
        return store_written(self.store, ns, self.files[ns], chain, first_depth)

    def disk(self, ns: str) -> int:
        """Disk the namespace's page files hold now (st_blocks)."""
        return sum(disk_bytes(f.path) for f in self.files[ns])

    def held(self, ns: str) -> int:
        """Disk the store accounts to the namespace's files."""
        return self.store.namespace_stats(ns).bytes_used

    def stored(self, ns: str) -> int:
        """Entries (keys × ranks) the namespace holds."""
        return len(self.store.list_entries(ns, limit=100_000))

    def sound(self) -> list[str]:
        return self.store.check_invariants()

    def close(self) -> None:
        for files in self.files.values():
            for file in files:
                file.close()
        self.store.close()


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[Callable[..., Tier]]:
    made: list[Tier] = []

    def make(**settings: Any) -> Tier:
        tier = Tier(tmp_path, **settings)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def tier(make_tier: Callable[..., Tier]) -> Tier:
    """20 pages of capacity, watermarks 0.8 / 0.5, long leases."""
    return make_tier()


def older_then_newer(
    tier: Tier, first: tuple[str, list[str]], *rest: tuple[str, list[str]]
) -> None:
    """Store chains in order, each strictly more recently used than the one before."""
    for ns, chain in (first, *rest):
        tier.put(ns, chain)
        time.sleep(0.002)


# --- 1. eviction across namespaces by LRU ---------------------------------------------


def test_capacity_eviction_spares_other_namespaces_where_holes_cannot_be_punched(
    tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hf3fsctl.storage.layout as layout

    monkeypatch.setattr(layout, "punch_pages", lambda *args: False)  # e.g. a FUSE mount
    a, b = tier.add("a"), tier.add("b")
    older_then_newer(tier, (a, keys(8, salt="a")), (b, keys(6, salt="b")))
    granted = tier.put(b, keys(4, salt="b2"))  # 14 + 4 > 16; 6 pages are still free
    assert (granted, tier.store.lookup(a, keys(8, salt="a"))) == (4, 8)
    assert tier.sound() == []


# --- 2. held bytes never pass the capacity --------------------------------------------


def test_held_and_disk_bytes_never_exceed_capacity_through_random_traffic(
    make_tier: Callable[..., Tier],
) -> None:
    # short leases and writer deadlines: leased keys and dead writers' pages come and go
    tier = make_tier(capacity_pages=48, lease_s=0.005, pending_timeout_s=0.01)
    spaces = [
        tier.add("p4k", page_bytes=4096),
        tier.add("p8k", page_bytes=8192),
        tier.add("p12k", page_bytes=12288, tp_size=2),
        tier.add("p5000", page_bytes=5000),  # slot 8192
    ]
    slack = sum(f.slot_bytes for files in tier.files.values() for f in files)
    rng = random.Random(1234)
    stored: dict[str, list[list[str]]] = {ns: [] for ns in spaces}
    pending: list[tuple[str, int, list[Any], list[str]]] = []  # (ns, rank, allocations, chain)
    violations: list[str] = []
    fullest = 0
    for step in range(400):
        ns = rng.choice(spaces)
        op = rng.random()
        if op < 0.4:
            chain = keys(rng.randint(1, 6), salt=f"{step}-")
            for rank, file in enumerate(tier.files[ns]):
                result = tier.store.allocate(ns, rank, chain)
                write_pages(file, [a.page for a in result.allocated])
                pending.append((ns, rank, list(result.allocated), chain))
        elif op < 0.8 and pending:
            p_ns, rank, allocations, chain = pending.pop(rng.randrange(len(pending)))
            size = tier.files[p_ns][rank].page_bytes
            tier.store.commit(
                p_ns,
                rank,
                [
                    CommitItem(key=a.key, page=a.page, checksum=checksum(a.key, a.page), size=size)
                    for a in allocations
                ],
            )
            if rank == 0:
                stored[p_ns].append(chain)
        elif op < 0.88 and pending:
            p_ns, rank, allocations, _ = pending.pop(rng.randrange(len(pending)))
            tier.store.release(p_ns, rank, allocations)
        elif stored[ns]:
            tier.store.locate(ns, 0, rng.choice(stored[ns]))
        info = tier.store.capacity()
        on_disk = sum(tier.disk(n) for n in spaces)
        fullest = max(fullest, info.bytes_used)
        if info.bytes_used > tier.capacity or on_disk > tier.capacity + slack:
            violations.append(f"step {step}: held {info.bytes_used}, disk {on_disk}")
    assert (violations, fullest > 0.8 * tier.capacity) == ([], True)  # and it was full
    assert tier.sound() == []


# --- 3. space freed in another file goes back to the file system --------------------


def test_failed_allocation_leaves_the_evicted_keys_data_on_disk(
    tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hf3fsctl.meta.sqlite.capacity as capacity_module

    def disk_full(*args: Any) -> None:
        error = sqlite3.OperationalError("database or disk is full")
        error.sqlite_errorcode = sqlite3.SQLITE_FULL  # what SQLite's own error carries
        raise error

    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(12, salt="a"))
    time.sleep(0.002)
    monkeypatch.setattr(capacity_module, "take_pages", disk_full)  # fails after the eviction
    with pytest.raises(MetadataUnavailable):
        tier.store.allocate(b, 0, keys(6, salt="b"))
    assert (tier.store.lookup(a, keys(12, salt="a")), tier.disk(a)) == (12, 12 * SLOT)
    assert tier.sound() == []


def test_held_bytes_stay_within_capacity_when_a_punch_is_refused(
    tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hf3fsctl.storage.layout as layout

    real = layout.punch_pages

    def page_files_refuse(root: Any, relpath: str, slot: int, pages: Any) -> bool:
        if relpath.startswith(".hf3fsctl-punch-probe"):
            return real(root, relpath, slot, pages)
        return False  # e.g. EACCES/EIO on that page file (punch_pages logs and says False)

    monkeypatch.setattr(layout, "punch_pages", page_files_refuse)
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(16, salt="a"))
    time.sleep(0.002)
    tier.put(b, keys(8, salt="b"))  # 24 > 16: 14 of A's pages marked, B grows by 8
    held = tier.store.capacity().bytes_used
    assert max(held, tier.disk(a) + tier.disk(b)) <= tier.capacity
    assert tier.sound() == []


def test_pages_marked_before_a_crash_are_given_back_when_a_store_opens(
    tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(12, salt="a"))
    time.sleep(0.002)
    monkeypatch.setattr(MetadataStore, "_give_back", lambda self, marked: None)  # the crash
    tier.put(b, keys(6, salt="b"))  # committed: 8 of A's pages marked, none punched
    monkeypatch.undo()
    before = tier.disk(a)
    MetadataStore(tier.store.path, policy=tier.store.policy).close()
    assert (before, tier.disk(a)) == (12 * SLOT, 4 * SLOT)
    assert tier.sound() == []


def test_an_opening_store_finishes_left_marks_under_the_writer_lock(
    tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store between its two phases (marked, not yet punched) is a crashed one here;
    # the store that opens next punches and settles its marks while holding the writer
    # lock, so no other store can settle those pages and hand them out meanwhile.
    import fcntl

    import hf3fsctl.storage.layout as layout

    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(12, salt="a"))
    time.sleep(0.002)
    monkeypatch.setattr(MetadataStore, "_give_back", lambda self, marked: None)  # "crash"
    tier.put(b, keys(6, salt="b"))  # A's pages marked, never punched
    monkeypatch.undo()
    real = layout.punch_pages
    locked_while_punching: list[bool] = []

    def observed(root: Any, relpath: str, slot: int, pages: Any) -> bool:
        if not relpath.startswith(".hf3fsctl-punch-probe"):
            fd = os.open(tier.store.path + ".lock", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked_while_punching.append(False)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                locked_while_punching.append(True)
            finally:
                os.close(fd)
        return real(root, relpath, slot, pages)

    monkeypatch.setattr(layout, "punch_pages", observed)
    MetadataStore(tier.store.path, policy=tier.store.policy).close()
    assert locked_while_punching and all(locked_while_punching)
    assert tier.disk(a) == 4 * SLOT  # the marked pages were given back
    assert tier.sound() == []


# --- 5. quotas ----------------------------------------------------------------------


def test_dead_writers_pending_pages_are_reclaimed_for_a_quota(
    make_tier: Callable[..., Tier],
) -> None:
    tier = make_tier(capacity_pages=100, quotas={ns_id("a"): str(8 * SLOT)}, pending_timeout_s=0.05)
    a = tier.add("a")
    tier.store.allocate(a, 0, keys(8, salt="dead"))  # the whole quota, never committed
    time.sleep(0.06)
    assert tier.put(a, keys(4, salt="new")) == 4
    assert tier.sound() == []


def test_model_quota_holds_through_random_traffic(make_tier: Callable[..., Tier]) -> None:
    quota = 12 * SLOT
    tier = make_tier(capacity_pages=200, quotas={"m": str(quota)}, lease_s=0.005)
    spaces = [tier.add("m"), tier.add("m", tp_size=2), tier.add("m", page_bytes=8192)]
    slack = sum(f.slot_bytes for files in tier.files.values() for f in files)
    rng = random.Random(99)
    stored: dict[str, list[list[str]]] = {ns: [] for ns in spaces}
    over = []
    for step in range(150):
        ns = rng.choice(spaces)
        if rng.random() < 0.8 or not stored[ns]:
            chain = keys(rng.randint(1, 5), salt=f"{step}-")
            tier.put(ns, chain)
            stored[ns].append(chain)
        else:
            tier.store.locate(ns, 0, rng.choice(stored[ns]))  # touched, briefly leased
        held = sum(tier.held(n) for n in spaces)
        disk = sum(tier.disk(n) for n in spaces)
        if held > quota or disk > quota + slack:
            over.append(f"step {step}: held {held}, disk {disk}")
    assert over == []
    assert tier.sound() == []


# --- 8. dead writers' pending pages ---------------------------------------------------


def test_dead_writers_pending_pages_are_reclaimed_when_capacity_is_needed(
    make_tier: Callable[..., Tier],
) -> None:
    tier = make_tier(capacity_pages=10, pending_timeout_s=0.05)
    a, b = tier.add("a"), tier.add("b")
    dead = tier.store.allocate(a, 0, keys(8, salt="a")).allocated
    write_pages(tier.files[a][0], [d.page for d in dead])
    time.sleep(0.06)  # the writer's deadline passes
    granted = len(tier.store.allocate(b, 0, keys(8, salt="b")).allocated)
    late = tier.store.commit(a, 0, commit_items(dead))
    assert (granted, late, tier.disk(a)) == (8, 0, 0)
    assert tier.sound() == []


# --- 9. schema-1 stores, migrated ----------------------------------------------------


@pytest.fixture
def migrated(tmp_path: Path) -> Iterator[tuple[MetadataStore, str, list[str]]]:
    chain = keys(3, salt="old")
    ns = schema_1_store(tmp_path / "meta.db", chain)
    migrate(tmp_path / "meta.db")  # `hf3fsctl migrate`: never done on open
    store = MetadataStore(tmp_path / "meta.db", policy=StorePolicy(storage_root=None))
    yield store, ns, chain
    store.close()


def test_schema_1_rank_files_count_as_preallocated(migrated: Any) -> None:
    store, ns, _ = migrated
    files = store.get_namespace(ns).rank_files
    assert ([f.preallocated for f in files], store.capacity().bytes_used) == (
        [True],
        SCHEMA_1_PAGES * SLOT,
    )
    assert store.check_invariants() == []


def test_schema_1_entries_are_still_found(migrated: Any) -> None:
    store, ns, chain = migrated
    locations = store.locate(ns, 0, chain)
    assert (store.lookup(ns, chain), [loc.page for loc in locations]) == (3, [0, 1, 2])
    assert store.check_invariants() == []


def test_schema_1_store_records_schema_2(migrated: Any, tmp_path: Path) -> None:
    store, _, _ = migrated
    conn = sqlite3.connect(tmp_path / "meta.db")
    version = conn.execute("SELECT value FROM store_info WHERE name = 'schema_version'")
    assert version.fetchone()[0] == "2"
    conn.close()
    assert store.check_invariants() == []


def test_schema_1_store_keeps_allocating_from_its_free_list(migrated: Any) -> None:
    store, ns, _ = migrated
    store.set_capacity(2 * SLOT)  # a preallocated file is not bounded by the capacity
    result = store.allocate(ns, 0, keys(2, salt="new"))
    assert [a.page for a in result.allocated] == [3, 4]
    assert store.check_invariants() == []


def test_schema_1_store_opens_again_unchanged(migrated: Any, tmp_path: Path) -> None:
    store, ns, chain = migrated
    again = MetadataStore(tmp_path / "meta.db", policy=StorePolicy(storage_root=None))
    try:
        assert (again.lookup(ns, chain), again.check_invariants()) == (3, [])
    finally:
        again.close()
    assert store.check_invariants() == []
