"""The contract's one capacity: cross-namespace LRU over growing page files on a real disk,
space given back to the file system, no storage root, quotas, pins, dropping namespaces,
pending pages and leases — on every store.

Every store here has a storage root under `tmp_path` holding real sparse page files
(`PageFile.create_growable`); the tests write real bytes into the pages they are granted,
so `disk_bytes` (st_blocks) shows what the store gave back to the file system.
Capacities are counted in 4 KiB pages; watermarks are high 0.8, low 0.5 unless a test
says otherwise. What only the SQLite store can be made to do (refused or crashed punches,
writer deadlines, leases shorter than a config allows) is in
`tests/unit/test_store_capacity.py`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from contract_backends import ONE_SLOT_BACKENDS, Backend
from helpers.lease_window import leasing
from helpers.meta_builders import (
    PAGE_BYTES,
    commit_items,
    keys,
    make_manifest,
    register_growable,
    store_written,
    write_pages,
)

from hf3fsctl.errors import InvalidRequest, NotFound
from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.models import EvictRequest, NamespaceStats, RankFile
from hf3fsctl.storage.extents import disk_bytes
from hf3fsctl.storage.layout import PageFile, remove_namespace_files

SLOT = PAGE_BYTES  # the slot of a 4 KiB page
LEASE_S = 0.25  # the lease tests': long enough to allocate within, short to sleep past

# Capacity and eviction order of one slot, with files and capacities of a few pages: the
# sharded store evicts per shard (tests/unit/test_redis_sharded.py covers it).
BACKENDS = ONE_SLOT_BACKENDS


def ns_id(model: str = "tiny", **changes: Any) -> str:
    """The id `register_growable(model=…, **changes)` will register (for quotas)."""
    return namespace_id(make_manifest(model=model, **changes).to_dict())


class Tier:
    """A store with one capacity over growing page files under the backend's root."""

    def __init__(
        self,
        backend: Backend,
        *,
        capacity_pages: int = 20,
        with_root: bool = True,
        quotas: dict[str, str] | None = None,
        max_pinned: str = "25%",
        lease_s: float = 60.0,
    ) -> None:
        self.backend = backend
        self.root = backend.root
        self.root.mkdir(exist_ok=True)  # the files' directory, whether the store has it
        self.store = backend.open(
            high_watermark=0.8,
            low_watermark=0.5,
            lease_s=lease_s,
            with_root=with_root,
            max_pinned=max_pinned,
            quotas=quotas,
        )
        self.capacity = capacity_pages * SLOT
        self.store.set_capacity(self.capacity)
        self.files: dict[str, list[Any]] = {}

    def add(self, model: str = "tiny", **changes: Any) -> str:
        """Register a namespace with growing files; returns its id."""
        ns, files = register_growable(self.store, self.root, model=model, **changes)
        self.files[ns] = files
        return ns

    def add_preallocated(self, model: str, num_pages: int) -> str:
        """Register a one-rank namespace whose file is preallocated at `num_pages` pages."""
        data = make_manifest(model=model).to_dict()
        ns = namespace_id(data)
        self.store.register_namespace(ns, data)
        file = PageFile.create(self.root, ns, 0, PAGE_BYTES, num_pages * SLOT)
        self.store.register_rank(
            ns,
            RankFile(
                rank=0,
                path=file.relpath,
                page_bytes=PAGE_BYTES,
                slot_bytes=SLOT,
                num_pages=num_pages,
                preallocated=True,
            ),
        )
        self.files[ns] = [file]
        return ns

    def put(self, ns: str, chain: list[str], first_depth: int = 0) -> int:
        """Store `chain` (allocate, write, commit on every rank); returns keys granted."""
        return store_written(self.store, ns, self.files[ns], chain, first_depth)

    def disk(self, ns: str) -> int:
        """Disk the namespace's page files hold now (st_blocks)."""
        return sum(disk_bytes(f.path) for f in self.files[ns])

    def namespace_stats(self, ns: str) -> NamespaceStats:
        (stats,) = [s for s in self.store.stats().namespaces if s.id == ns]
        return stats

    def held(self, ns: str) -> int:
        """Disk the store accounts to the namespace's files."""
        return self.namespace_stats(ns).bytes_used

    def stored(self, ns: str) -> int:
        """Entries (keys × ranks) the namespace holds."""
        return len(self.store.list_entries(ns, limit=100_000))

    def sound(self) -> list[str]:
        return self.backend.invariants()

    def close(self) -> None:
        for files in self.files.values():
            for file in files:
                file.close()


@pytest.fixture
def make_tier(backend: Backend) -> Iterator[Callable[..., Tier]]:
    made: list[Tier] = []

    def make(**settings: Any) -> Tier:
        tier = Tier(backend, **settings)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def tier(make_tier: Callable[..., Tier]) -> Tier:
    """20 pages of capacity, watermarks 0.8 / 0.5, long leases."""
    return make_tier()


def flood(tier: Tier, ns: str, rounds: int = 12, size: int = 4) -> None:
    """Store `rounds` fresh chains of `size` keys, each newer than everything before."""
    for round_ in range(rounds):
        time.sleep(0.002)
        tier.put(ns, keys(size, salt=f"flood{round_}-"))


def older_then_newer(
    tier: Tier, first: tuple[str, list[str]], *rest: tuple[str, list[str]]
) -> None:
    """Store chains in order, each strictly more recently used than the one before."""
    for ns, chain in (first, *rest):
        tier.put(ns, chain)
        time.sleep(0.002)


# --- 1. eviction across namespaces by LRU -----------------------------------------


def test_capacity_eviction_takes_the_least_recently_used_namespace_first(tier: Tier) -> None:
    a, b, c = tier.add("a"), tier.add("b"), tier.add("c")
    older_then_newer(tier, (a, keys(8, salt="a")), (b, keys(4, salt="b")))
    # 12 held + 5 > 16 (high) → evict LRU until 5 + 5 <= 10 (low): 7 of A's keys
    granted = tier.put(c, keys(5, salt="c"))
    lookups = tuple(
        tier.store.lookup(ns, keys(n, salt=s)) for ns, n, s in [(a, 8, "a"), (b, 4, "b")]
    )
    assert (granted, lookups) == (5, (1, 4))
    assert tier.sound() == []


def test_capacity_eviction_takes_chain_tails_before_heads(tier: Tier) -> None:
    a, b, c = tier.add("a"), tier.add("b"), tier.add("c")
    older_then_newer(tier, (a, keys(10, salt="a")), (b, keys(2, salt="b")))
    tier.put(c, keys(5, salt="c"))  # evicts 7 of A's 10 equally old keys
    depths = sorted(e.depth for e in tier.store.list_entries(a))
    assert (tier.store.lookup(a, keys(10, salt="a")), depths) == (3, [0, 1, 2])
    assert tier.sound() == []


def test_capacity_eviction_takes_a_key_on_every_rank_at_once(tier: Tier) -> None:
    a, c = tier.add("a", tp_size=2), tier.add("c")
    tier.put(a, keys(6, salt="a"))  # 12 pages
    time.sleep(0.002)
    tier.put(c, keys(5, salt="c"))  # 17 > 16 → held down to 5: 4 keys, 2 pages each
    ranks = [e.rank for e in tier.store.list_entries(a, limit=100)]
    assert ranks.count(0) == ranks.count(1) == tier.store.lookup(a, keys(6, salt="a")) == 2
    assert tier.sound() == []


def test_capacity_eviction_brings_the_store_down_to_the_low_watermark(tier: Tier) -> None:
    a, b, c = tier.add("a"), tier.add("b"), tier.add("c")
    older_then_newer(tier, (a, keys(8, salt="a")), (b, keys(4, salt="b")))
    tier.put(c, keys(5, salt="c"))
    assert tier.store.stats().bytes_used == 10 * SLOT  # low 0.5 of 20 pages, with C's 5
    assert tier.sound() == []


def test_located_namespace_counts_as_recently_used(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(lease_s=0.1)
    a, b, c = tier.add("a"), tier.add("b"), tier.add("c")
    older_then_newer(tier, (a, keys(6, salt="a")), (b, keys(6, salt="b")))
    tier.store.locate(a, 0, keys(6, salt="a"))  # A is now the most recently used
    time.sleep(0.15)  # … and its lease is over
    tier.put(c, keys(5, salt="c"))  # 17 > 16 → held down to 5: B's 6 first, then A's tails
    assert (tier.stored(a), tier.stored(b)) == (5, 0)
    assert tier.sound() == []


def test_capacity_eviction_skips_leased_keys_of_other_namespaces(tier: Tier) -> None:
    a, b, c = tier.add("a"), tier.add("b"), tier.add("c")
    tier.put(a, keys(6, salt="a"))
    tier.store.locate(a, 0, keys(6, salt="a"))  # a reader holds A's pages
    time.sleep(0.002)
    tier.put(b, keys(6, salt="b"))  # B is newer than A's last access
    tier.put(c, keys(5, salt="c"))  # 17 > 16: A is the LRU, but leased
    assert (tier.stored(a), tier.stored(b) < 6) == (6, True)
    assert tier.sound() == []


def test_capacity_eviction_spares_keys_of_preallocated_files(
    make_tier: Callable[..., Tier],
) -> None:
    tier = make_tier(capacity_pages=40)
    p = tier.add_preallocated("pre", num_pages=16)  # holds its 16 pages whatever it stores
    tier.put(p, keys(8, salt="p"))
    time.sleep(0.002)
    g = tier.add("g")
    tier.put(g, keys(10, salt="g"))  # 26 held
    tier.put(g, keys(8, salt="g2"))  # 34 > 32: only G's own pages can make room
    assert (tier.store.lookup(p, keys(8, salt="p")), tier.store.capacity().bytes_used) == (
        8,
        26 * SLOT,
    )
    assert tier.sound() == []


def test_a_full_single_namespace_store_evicts_one_swing_not_everything(tier: Tier) -> None:
    # 20-page capacity, watermarks 0.8 / 0.5: one swing is 6 pages. The namespace's own
    # freed pages are room too (kept for reuse), so eviction stops once this allocation
    # and one swing fit — it must not empty the store trying to reach the low watermark.
    a = tier.add("a")
    old = keys(16, salt="old")
    tier.put(a, old)
    time.sleep(0.002)
    assert tier.put(a, keys(2, salt="new")) == 2
    kept = sum(1 for key in old if tier.store.lookup(a, [key]) == 1)
    assert 6 <= kept <= 10
    assert tier.store.capacity().bytes_used <= 20 * SLOT
    assert tier.sound() == []


# --- 2. held bytes never pass the capacity ----------------------------------------


def test_pages_beyond_capacity_are_never_granted(tier: Tier) -> None:
    a = tier.add("a")
    result = tier.store.allocate(a, 0, keys(25))
    assert (len(result.allocated), len(result.no_space)) == (20, 5)
    assert tier.sound() == []


# --- 3. space freed in another file goes back to the file system ------------------


def test_evicted_pages_of_another_file_are_punched_back_to_the_file_system(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(12, salt="a"))
    before = tier.disk(a)
    time.sleep(0.002)
    tier.put(b, keys(6, salt="b"))  # 18 > 16 → A loses 8 keys, punched
    assert (before, tier.disk(a)) == (12 * SLOT, 4 * SLOT)
    assert tier.sound() == []


def test_allocating_file_grows_into_space_punched_elsewhere(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(12, salt="a"))
    time.sleep(0.002)
    tier.put(b, keys(6, salt="b"))
    tier.put(b, keys(6, salt="b2"))  # 4 + 6 + 6 = 16: no eviction, B grows on
    assert (tier.disk(a), tier.disk(b)) == (4 * SLOT, 12 * SLOT)  # 12 > 20 - A's 12
    assert tier.sound() == []


def test_released_pages_of_another_file_are_punched_before_any_eviction(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(4, salt="a"))
    spare = tier.store.allocate(a, 0, keys(6, salt="spare")).allocated
    write_pages(tier.files[a][0], [s.page for s in spare])
    tier.store.release(a, 0, spare)  # 10 pages on disk, 4 of them live
    tier.put(b, keys(8, salt="b"))  # 10 + 8 > 16: the 6 free pages go back first
    assert (tier.store.lookup(a, keys(4, salt="a")), tier.disk(a)) == (4, 4 * SLOT)
    assert tier.sound() == []


def test_admin_eviction_gives_the_space_back(tier: Tier) -> None:
    a = tier.add("a")
    tier.put(a, keys(8, salt="a"))
    tier.store.evict(EvictRequest(all=True))
    assert (tier.disk(a), tier.store.capacity().bytes_used) == (0, 0)
    assert tier.sound() == []


# --- 4. without a storage root ----------------------------------------------------


def test_without_storage_root_capacity_evicts_only_the_allocating_namespace(
    make_tier: Callable[..., Tier],
) -> None:
    tier = make_tier(with_root=False)
    a, b = tier.add("a"), tier.add("b")
    older_then_newer(tier, (a, keys(8, salt="a")), (b, keys(6, salt="b")))
    tier.put(b, keys(4, salt="b2"))  # 14 + 4 > 16: A is older, but its space can't be punched
    assert (tier.store.lookup(a, keys(8, salt="a")), tier.stored(b) < 10) == (8, True)
    assert tier.sound() == []


def test_without_storage_root_no_file_is_punched(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(with_root=False)
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(8, salt="a"))
    tier.store.evict(EvictRequest(all=True))
    tier.put(b, keys(10, salt="b"))  # A's 8 free pages stay held: B gets 20 - 8 = 12 ≥ 10
    assert (tier.disk(a), tier.store.capacity().bytes_used) == (8 * SLOT, 18 * SLOT)
    assert tier.sound() == []


def test_without_storage_root_pages_beyond_capacity_are_refused(
    make_tier: Callable[..., Tier],
) -> None:
    tier = make_tier(with_root=False)
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(14, salt="a"))
    result = tier.store.allocate(b, 0, keys(8, salt="b"))  # B has nothing to evict
    assert (len(result.allocated), tier.stored(a)) == (6, 14)
    assert tier.sound() == []


# --- 5. quotas --------------------------------------------------------------------


def test_namespace_quota_evicts_only_its_own_keys(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(capacity_pages=100, quotas={ns_id("a"): str(8 * SLOT)})
    b, a = tier.add("b"), tier.add("a")
    older_then_newer(tier, (b, keys(10, salt="b")), (a, keys(6, salt="a")))
    tier.put(a, keys(4, salt="a2"))  # 6 + 4 > 6.4 pages: A evicts its own, B is older
    assert (tier.stored(b), tier.store.lookup(a, keys(4, salt="a2"))) == (10, 4)
    assert tier.sound() == []


def test_namespace_never_holds_more_than_its_quota(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(capacity_pages=100, quotas={ns_id("a"): str(8 * SLOT)})
    a = tier.add("a")
    rng = random.Random(7)
    seen = []
    for round_ in range(30):
        tier.put(a, keys(rng.randint(1, 12), salt=f"{round_}-"))
        stats = tier.namespace_stats(a)
        seen.append((stats.bytes_live, stats.bytes_used))
    assert [s for s in seen if max(s) > 8 * SLOT] == []
    assert tier.sound() == []


def test_model_quota_is_shared_by_the_models_namespaces(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(capacity_pages=100, quotas={"m": str(8 * SLOT)})
    other = tier.add("other")
    x, y = tier.add("m"), tier.add("m", kv_dtype="bfloat16")
    older_then_newer(tier, (other, keys(10, salt="o")), (x, keys(5, salt="x")))
    tier.put(y, keys(5, salt="y"))  # 5 + 5 > 6.4: the model evicts its own LRU (X's)
    live = [tier.namespace_stats(ns).bytes_live for ns in (x, y)]
    assert (tier.stored(other), tier.stored(x) < 5, sum(live) <= 8 * SLOT) == (10, True, True)
    assert tier.sound() == []


def test_model_quota_is_reported_on_each_namespace(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(capacity_pages=100, quotas={"m": "10%", ns_id("m"): str(4 * SLOT)})
    x, y, other = tier.add("m"), tier.add("m", kv_dtype="bfloat16"), tier.add("other")
    quotas = {s.id: s.quota_bytes for s in tier.store.stats().namespaces}
    assert quotas == {x: 4 * SLOT, y: 10 * SLOT, other: None}
    assert tier.sound() == []


def test_model_never_holds_more_disk_than_its_quota(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(capacity_pages=100, quotas={"m": str(8 * SLOT)})
    x, y = tier.add("m"), tier.add("m", kv_dtype="bfloat16")
    older_then_newer(tier, (x, keys(6, salt="x")))
    tier.put(y, keys(6, salt="y"))  # evicts X's keys for Y and punches their pages
    held = sum(tier.held(ns) for ns in (x, y))
    disk = tier.disk(x) + tier.disk(y)
    assert max(held, disk) <= 8 * SLOT
    assert tier.sound() == []


# --- 6. pins ----------------------------------------------------------------------


def test_pinned_prefix_survives_a_flood(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    chain = keys(8, salt="a")
    tier.put(a, chain)
    tier.store.pin(a, chain[:3])
    flood(tier, b)
    assert (tier.store.lookup(a, chain), tier.stored(a)) == (3, 3)
    assert tier.sound() == []


def test_unpinned_prefix_is_evictable_again(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    chain = keys(4, salt="a")
    tier.put(a, chain)
    tier.store.pin(a, chain)
    tier.store.unpin(a, None)
    flood(tier, b)
    assert (tier.store.lookup(a, chain), tier.store.list_pins()) == (0, [])
    assert tier.sound() == []


def test_expired_pin_is_evictable(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    chain = keys(4, salt="a")
    tier.put(a, chain)
    tier.store.pin(a, chain, ttl_s=0.05)
    time.sleep(0.06)
    flood(tier, b)
    assert (tier.store.lookup(a, chain), tier.store.list_pins()) == (0, [])
    assert tier.sound() == []


def test_admin_evict_all_leaves_pinned_keys(tier: Tier) -> None:
    a = tier.add("a")
    chain = keys(6, salt="a")
    tier.put(a, chain)
    tier.store.pin(a, chain[:2])
    result = tier.store.evict(EvictRequest(all=True))
    assert (result.keys, tier.store.lookup(a, chain)) == (4, 2)
    assert tier.sound() == []


def test_admin_evict_include_pinned_takes_pinned_keys(tier: Tier) -> None:
    a = tier.add("a")
    chain = keys(6, salt="a")
    tier.put(a, chain)
    tier.store.pin(a, chain[:2])
    result = tier.store.evict(EvictRequest(all=True, include_pinned=True))
    assert (result.keys, tier.store.lookup(a, chain)) == (6, 0)
    assert tier.sound() == []


def test_pinning_past_max_pinned_is_refused(tier: Tier) -> None:
    # max_pinned 25% of 20 pages = 5 pages; a key of a 2-rank namespace counts 2 pages
    a, b = tier.add("a", tp_size=2), tier.add("b")
    tier.store.pin(a, keys(2, salt="a"))  # 4 pages
    tier.store.pin(b, keys(1, salt="b"))  # 5 pages
    with pytest.raises(InvalidRequest, match="max_pinned"):
        tier.store.pin(a, keys(1, start=2, salt="a"))
    assert len(tier.store.list_pins()) == 3
    assert tier.sound() == []


def test_pinning_under_a_malformed_namespace_id_is_refused(tier: Tier) -> None:
    # validation lives in the store core: every backend refuses it before touching data
    with pytest.raises(InvalidRequest, match="namespace id"):
        tier.store.pin("not-a-namespace", keys(1, salt="a"))
    assert tier.store.list_pins() == []


def test_refreshing_a_pin_does_not_count_it_twice(tier: Tier) -> None:
    a = tier.add("a")
    tier.store.pin(a, keys(5, salt="a"))
    result = tier.store.pin(a, keys(5, salt="a"), ttl_s=60)
    assert (result.pinned, result.pinned_bytes) == (5, 5 * SLOT)
    assert tier.sound() == []


# --- 7. dropping namespaces -------------------------------------------------------


def test_drop_namespace_removes_exactly_that_namespace(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(4, salt="a"))
    tier.put(b, keys(4, salt="b"))
    tier.store.pin(a, keys(1, salt="a"))
    tier.store.drop_namespaces([a])
    remove_namespace_files(tier.root, a)
    with pytest.raises(NotFound):
        tier.store.get_namespace(a)
    remaining = ([ns.id for ns in tier.store.namespaces()], tier.store.list_pins())
    assert (remaining, tier.store.lookup(b, keys(4, salt="b"))) == (([b], []), 4)
    assert (tier.root / a).exists() is False
    assert tier.sound() == []


def test_drop_namespace_lowers_bytes_used_by_its_bytes(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b", page_bytes=8192)
    tier.put(a, keys(4, salt="a"))
    tier.put(b, keys(3, salt="b"))
    before = tier.store.stats().bytes_used
    dropped = tier.store.drop_namespaces([b]).namespaces[0]
    freed = remove_namespace_files(tier.root, b)
    after = tier.store.stats().bytes_used
    assert (before - after, dropped.bytes, freed) == (3 * 8192, 3 * 8192, 3 * 8192)
    assert tier.sound() == []


def test_drop_skips_a_namespace_with_a_live_pending_allocation(tier: Tier) -> None:
    a = tier.add("a")
    tier.put(a, keys(2, salt="a"))
    pending = tier.store.allocate(a, 0, keys(2, salt="p")).allocated
    dropped = tier.store.drop_namespaces([a]).namespaces[0]
    committed = tier.store.commit(a, 0, commit_items(pending))
    assert (dropped.skipped is not None, committed, tier.store.lookup(a, keys(2, salt="a"))) == (
        True,
        2,
        2,
    )
    assert tier.sound() == []


def test_drop_dry_run_changes_nothing(tier: Tier) -> None:
    a = tier.add("a")
    tier.put(a, keys(3, salt="a"))
    result = tier.store.drop_namespaces([a], dry_run=True)
    assert (result.namespaces[0].keys, tier.store.lookup(a, keys(3, salt="a"))) == (3, 3)
    assert tier.sound() == []


def test_dropped_namespace_space_is_reusable_by_others(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(15, salt="a"))
    tier.store.drop_namespaces([a])
    remove_namespace_files(tier.root, a)
    assert tier.put(b, keys(15, salt="b")) == 15
    assert tier.sound() == []


# --- 8. pending pages -------------------------------------------------------------


def test_live_pending_pages_are_never_taken_for_capacity(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(capacity_pages=10)  # writers' deadline: the default 120 s
    a, b = tier.add("a"), tier.add("b")
    pending = tier.store.allocate(a, 0, keys(8, salt="a")).allocated
    granted = len(tier.store.allocate(b, 0, keys(8, salt="b")).allocated)
    assert (granted, tier.store.commit(a, 0, commit_items(pending))) == (2, 8)
    assert tier.sound() == []


# --- 9. leases --------------------------------------------------------------------


def test_leased_pages_of_another_file_are_not_punched_until_the_lease_ends(
    make_tier: Callable[..., Tier],
) -> None:
    tier = make_tier(capacity_pages=10, lease_s=LEASE_S)
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(8, salt="a"))
    _, lease = leasing(lambda: tier.store.locate(a, 0, keys(8, salt="a")), LEASE_S)
    tier.store.evict(EvictRequest(all=True))  # admin eviction takes leased keys
    first = len(tier.store.allocate(b, 0, keys(8, salt="b")).allocated)
    held_disk = tier.disk(a)
    if lease.still_held():  # asked well within the lease (a slow machine skips this)
        assert (first, held_disk) == (2, 8 * SLOT)
    lease.sleep_past()
    second = len(tier.store.allocate(b, 0, keys(6, salt="b2")).allocated)
    assert (second, tier.disk(a)) == (6, 0)
    assert tier.sound() == []


def test_leased_page_of_the_allocating_file_is_not_reused_until_the_lease_ends(
    make_tier: Callable[..., Tier],
) -> None:
    tier = make_tier(capacity_pages=10, lease_s=LEASE_S)
    a = tier.add("a")
    tier.put(a, keys(2, salt="a"))
    _, lease = leasing(lambda: tier.store.locate(a, 0, keys(2, salt="a")), LEASE_S)
    tier.store.evict(EvictRequest(all=True))
    during = [x.page for x in tier.store.allocate(a, 0, keys(2, salt="during")).allocated]
    if lease.still_held():  # asked well within the lease (a slow machine skips this)
        assert during == [2, 3]
    lease.sleep_past()
    after = [x.page for x in tier.store.allocate(a, 0, keys(2, salt="after")).allocated]
    assert sorted(after) == [0, 1]
    assert tier.sound() == []


def test_leased_keys_are_not_evicted_for_capacity(make_tier: Callable[..., Tier]) -> None:
    tier = make_tier(capacity_pages=10, lease_s=60)
    a, b = tier.add("a"), tier.add("b")
    tier.put(a, keys(8, salt="a"))
    tier.store.locate(a, 0, keys(8, salt="a"))
    granted = len(tier.store.allocate(b, 0, keys(8, salt="b")).allocated)
    assert (granted, tier.store.lookup(a, keys(8, salt="a")), tier.disk(a)) == (2, 8, 8 * SLOT)
    assert tier.sound() == []


# --- 10. pins listed and dropped by key ----------------------------------------------


def test_pins_are_listed_by_namespace_and_dropped_by_key(tier: Tier) -> None:
    a, b = tier.add("a"), tier.add("b")
    tier.store.pin(a, keys(3, salt="a"))
    tier.store.pin(b, keys(1, salt="b"))
    dropped = tier.store.unpin(a, keys(2, salt="a"))
    listed = {(p.namespace, p.key) for p in tier.store.list_pins(a)}
    assert (dropped, listed) == (2, {(a, keys(1, start=2, salt="a")[0])})
    assert len(tier.store.list_pins()) == 2
    assert tier.sound() == []


# --- 11. the recorded capacity ------------------------------------------------------


def test_capacity_is_recorded_in_the_store_for_every_client(tier: Tier) -> None:
    a = tier.add("a")
    tier.put(a, keys(3, salt="a"))
    seen = tier.backend.connect().capacity()
    assert (seen.capacity_bytes, seen.bytes_used, seen.bytes_free) == (
        20 * SLOT,
        3 * SLOT,
        17 * SLOT,
    )
    assert tier.sound() == []


def test_one_allocation_evicts_at_most_its_need_beyond_the_limit(
    make_tier: Callable[..., Tier],
) -> None:
    """A watermark swing larger than `EVICT_BEYOND_NEED` (2,048) keys is not evicted by
    one allocation (one transaction or script holding the store): the allocation evicts
    its own need and 2,048 more, the next ones take the rest when they need it."""
    tier = make_tier(capacity_pages=8000)  # a swing of 0.3 x 8,000 = 2,400 pages
    ns = tier.add()
    held = int(0.8 * 8000)  # at the high watermark: the fill evicts nothing
    for start in range(0, held, 500):
        chunk = keys(min(500, held - start), start=start)
        assert tier.put(ns, chunk, first_depth=start) == len(chunk)
    assert tier.put(ns, keys(3, salt="new")) == 3
    assert tier.namespace_stats(ns).evicted["capacity"][0] == 3 + 2048
    assert tier.stored(ns) == held + 3 - (3 + 2048)
    assert tier.sound() == []
