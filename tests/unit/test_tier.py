"""The tier on its own (no vLLM): save and load through a real embedded `MetadataStore`,
a real growing `PageFile` and the `PosixEngine`, with staging rows as numpy arrays.

Covers what the connector relies on: round trips, keys already stored, a full store and
a full file system (nothing left pending), failed writes and commits (released), corrupt
pages (reported and dropped from the store), missing pages, the two load targets giving
the same bytes, and cancelled loads writing nothing the caller sees.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.meta_builders import PAGE_BYTES, keys, register_growable

from hf3fsctl.errors import MetadataUnavailable, StorageError
from hf3fsctl.meta.models import CommitItem, Location
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.staging import KVSegment, StagingPool, page_pieces
from hf3fsctl.storage.engine import ERROR_IO, PageResult
from hf3fsctl.storage.layout import PageFile
from hf3fsctl.storage.posix import PosixEngine
from hf3fsctl.tier import (
    CANCELLED,
    CHECKSUM,
    ERROR,
    EXISTING,
    IO,
    LOADED,
    METADATA_DOWN,
    NO_SPACE,
    NOT_FOUND,
    REUSED,
    SAVED,
    SIZE,
    LoadCancel,
    PagePieces,
    PageSources,
    SaveBatch,
    StagingRows,
    Tier,
)


def page(key: str) -> np.ndarray:
    """The bytes a page of `key` holds in these tests (distinct per key)."""
    seed = np.frombuffer(bytes.fromhex(key), dtype=np.uint8)
    return np.resize(seed, PAGE_BYTES) ^ np.arange(PAGE_BYTES, dtype=np.uint8)


def rows_of(chain: Sequence[str]) -> list[np.ndarray]:
    return [page(k) for k in chain]


def empty_rows(count: int) -> list[np.ndarray]:
    return [np.zeros(PAGE_BYTES, dtype=np.uint8) for _ in range(count)]


@dataclass
class Store:
    """An embedded store over one growing page file, and a tier over both."""

    root: Path
    store: MetadataStore
    ns: str
    file: PageFile
    engine: PosixEngine

    def call(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.store)

    def tier(self, engine: Any = None, call: Any = None, **kwargs: Any) -> Tier:
        return Tier(self.ns, 0, self.file, engine or self.engine, call or self.call, **kwargs)

    def pending(self) -> int:
        return sum(
            1 for e in self.store.list_entries(self.ns, limit=1000) if e.state != "committed"
        )

    def committed(self) -> int:
        return sum(
            1 for e in self.store.list_entries(self.ns, limit=1000) if e.state == "committed"
        )

    def sound(self) -> list[str]:
        return self.store.check_invariants()


@pytest.fixture
def st(tmp_path: Path) -> Iterator[Store]:
    root = tmp_path / "root"
    root.mkdir()
    policy = StorePolicy(storage_root=str(root), capacity="100%")
    store = MetadataStore(tmp_path / "meta.db", policy=policy, lease_s=60.0)
    store.set_capacity(64 * PAGE_BYTES)
    ns, files = register_growable(store, root)
    engine = PosixEngine(io_threads=4)
    yield Store(root, store, ns, files[0], engine)
    engine.close()
    files[0].close()
    store.close()


class FailingWrites(PosixEngine):
    """A POSIX engine whose writes of chosen pages fail with `detail` and `errno`."""

    def __init__(self, failing: set[int], detail: str, errno: int | None = None) -> None:
        super().__init__(io_threads=1)
        self.failing, self.detail, self.errno = failing, detail, errno

    def write_pages(self, file: Any, pages: Any, buffers: Any, **kw: Any) -> list[PageResult]:
        real = super().write_pages(file, pages, buffers, **kw)
        failed = [PageResult(r.page, False, ERROR_IO, None, self.detail, self.errno) for r in real]
        return [failed[i] if i in self.failing else r for i, r in enumerate(real)]


def _flip(st: Store, key: str) -> None:
    location = st.store.locate(st.ns, 0, [key])[0]
    assert location is not None
    offset = location.page * st.file.slot_bytes + location.size // 2
    with open(st.file.path, "r+b") as handle:
        handle.seek(offset)
        old = handle.read(8)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in old))


# --- save -------------------------------------------------------------------------


def test_saved_pages_load_back_byte_for_byte(st: Store) -> None:
    chain = keys(5)
    saved = st.tier().save(chain, rows_of(chain), 0)
    rows = empty_rows(5)
    loaded = st.tier().load(chain, StagingRows(rows))
    assert (saved.kinds, saved.committed, saved.storage_worked) == ([SAVED] * 5, 5, True)
    assert loaded.kinds == [LOADED] * 5
    assert all(np.array_equal(r, page(k)) for r, k in zip(rows, chain, strict=True))


class ModelsOnly:
    """The store through the data path's model calls only (as HTTP and Redis clients)."""

    def __init__(self, store: MetadataStore) -> None:
        self.allocate, self.commit, self.release = store.allocate, store.commit, store.release
        self.locate = store.locate


def test_a_store_without_the_tuple_calls_saves_the_same_entries(st: Store) -> None:
    chain = keys(4)
    st.tier().save(chain[:1], rows_of(chain[:1]), 0)  # through `SavesPages`
    proxy = ModelsOnly(st.store)
    saved = st.tier(call=lambda fn: fn(proxy)).save(chain, rows_of(chain), 0, retention_s=60.0)
    assert (saved.kinds, saved.committed) == ([EXISTING] + [SAVED] * 3, 3)
    rows = empty_rows(4)
    assert st.tier().load(chain, StagingRows(rows)).kinds == [LOADED] * 4
    assert all(np.array_equal(r, page(k)) for r, k in zip(rows, chain, strict=True))
    expiring = [e.key for e in st.store.list_entries(st.ns) if e.expires_at is not None]
    assert sorted(expiring) == sorted(chain[1:])
    assert st.sound() == []


def test_keys_already_stored_are_skipped(st: Store) -> None:
    chain = keys(3)
    st.tier().save(chain[:2], rows_of(chain[:2]), 0)
    again = st.tier().save(chain, rows_of(chain), 0)
    assert (again.kinds, again.committed) == ([EXISTING, EXISTING, SAVED], 1)
    assert (again.count(EXISTING), again.failures()) == (2, {})


def test_a_full_store_saves_what_fits_and_leaves_nothing_pending(st: Store) -> None:
    st.store.set_capacity(3 * st.file.slot_bytes)
    chain = keys(6)
    outcome = st.tier().save(chain, rows_of(chain), 0)
    assert (outcome.count(SAVED), outcome.count(NO_SPACE)) == (3, 3)
    assert outcome.failures() == {NO_SPACE: 3}
    assert (st.committed(), st.pending(), st.sound()) == (3, 0, [])


def test_enospc_claiming_disk_is_no_space_and_releases_every_page(
    st: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(pages: Any) -> None:
        raise StorageError("cannot claim pages: No space left on device", errno=errno.ENOSPC)

    monkeypatch.setattr(st.file, "reserve", full)
    chain = keys(4)
    outcome = st.tier().save(chain, rows_of(chain), 0)
    assert outcome.kinds == [NO_SPACE] * 4
    assert outcome.storage_failure is not None
    assert (outcome.storage_failure.kind, outcome.storage_failure.pages) == (NO_SPACE, 4)
    assert (outcome.storage_worked, st.committed(), st.pending(), st.sound()) == (False, 0, 0, [])


def test_another_errno_claiming_disk_is_an_io_failure(
    st: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(pages: Any) -> None:
        raise StorageError("cannot claim pages: Input/output error", errno=errno.EIO)

    monkeypatch.setattr(st.file, "reserve", broken)
    outcome = st.tier().save(keys(2), rows_of(keys(2)), 0)
    assert outcome.kinds == [IO, IO] and st.pending() == 0


@pytest.mark.parametrize(
    ("detail", "code", "kind"),
    [
        ("Input/output error", errno.EIO, IO),
        ("No space left on device", errno.ENOSPC, NO_SPACE),
        ("Disk quota exceeded", errno.EDQUOT, NO_SPACE),
        # the kind is the errno, never the words: a message about space with EIO is io
        ("no space for you", errno.EIO, IO),
    ],
    ids=["eio", "enospc", "edquot", "text-is-not-the-kind"],
)
def test_a_failed_write_releases_its_page_and_commits_the_rest(
    st: Store, detail: str, code: int, kind: str
) -> None:
    chain = keys(3)
    tier = st.tier(engine=FailingWrites({1}, detail, code))
    try:
        outcome = tier.save(chain, rows_of(chain), 0)
    finally:
        tier.engine.close()
    assert (outcome.kinds, outcome.committed, outcome.storage_worked) == (
        [SAVED, kind, SAVED],
        2,
        False,
    )
    assert outcome.storage_failure is not None
    assert (outcome.storage_failure.kind, outcome.storage_failure.reason) == (kind, detail)
    assert st.store.locate(st.ns, 0, [chain[1]]) == [None]
    assert (st.committed(), st.pending(), st.sound()) == (2, 0, [])


class CommitFails:
    """The store, but its `commit` finds the service gone."""

    def __init__(self, store: MetadataStore) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def commit(self, *args: Any) -> int:
        raise MetadataUnavailable("service went away")

    commit_pages = commit  # the same call as the embedded store's tuples (`SavesPages`)


def test_a_failed_commit_releases_every_page(st: Store) -> None:
    proxy = CommitFails(st.store)
    outcome = st.tier(call=lambda fn: fn(proxy)).save(keys(3), rows_of(keys(3)), 0)
    assert (outcome.kinds, outcome.committed) == ([METADATA_DOWN] * 3, 0)
    assert (st.committed(), st.pending(), st.sound()) == (0, 0, [])


def test_metadata_down_fails_saves_and_loads_of_every_key(st: Store) -> None:
    def down(fn: Callable[[Any], Any]) -> Any:
        raise MetadataUnavailable("down")

    tier = st.tier(call=down)
    assert tier.save(keys(2), rows_of(keys(2)), 0).kinds == [METADATA_DOWN] * 2
    assert tier.load(keys(2), StagingRows(empty_rows(2))).kinds == [METADATA_DOWN] * 2


# --- load -------------------------------------------------------------------------


def test_missing_and_resized_pages_fail_alone(st: Store) -> None:
    chain = keys(3)
    st.tier().save(chain[:1], rows_of(chain[:1]), 0)
    (other,) = st.store.allocate(st.ns, 0, [chain[2]]).allocated  # stored with another size
    st.store.commit(
        st.ns,
        0,
        [CommitItem(key=other.key, page=other.page, checksum="xxh3:" + "0" * 16, size=100)],
    )
    rows = empty_rows(3)
    outcome = st.tier().load(chain, StagingRows(rows))
    assert outcome.kinds == [LOADED, NOT_FOUND, SIZE]
    assert (outcome.failed, outcome.failure_kind) == ([1, 2], NOT_FOUND)
    assert np.array_equal(rows[0], page(chain[0])) and not rows[2].any()


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "handed-over"])
def test_a_corrupt_page_is_reported_and_dropped_from_the_store(st: Store, inline: bool) -> None:
    chain = keys(3)
    st.tier().save(chain, rows_of(chain), 0)
    _flip(st, chain[1])
    handed: list[list[Location]] = []
    delivered: list[list[int]] = []
    tier = st.tier()
    outcome = tier.load(
        chain,
        StagingRows(empty_rows(3), delivered.append),
        invalidate_with=None if inline else handed.append,
    )
    assert (outcome.kinds, outcome.failure_kind) == ([LOADED, CHECKSUM, LOADED], CHECKSUM)
    assert [loc.key for loc in outcome.corrupt] == [chain[1]]
    assert delivered == [[0, 2]]
    if inline:
        assert outcome.invalidated == 1
    else:
        assert outcome.invalidated == 0 and st.store.lookup(st.ns, chain) == 3
        assert tier.invalidate(handed[0]) == 1
    assert st.store.locate(st.ns, 0, chain)[1] is None  # the next load misses
    assert st.store.lookup(st.ns, chain) == 1


def _host_cache(blocks: int) -> tuple[torch.Tensor, list[KVSegment]]:
    """A host KV cache of two layers, layer-outermost: a page is two separate ranges."""
    layer_page = PAGE_BYTES // 2
    raw = torch.zeros(2 * blocks * layer_page, dtype=torch.uint8)
    segment = KVSegment(raw, 0, blocks * layer_page, layer_page, 2, blocks, layer_page)
    return raw, [segment]


def test_a_load_into_page_pieces_equals_a_load_into_rows(st: Store) -> None:
    chain = keys(4)
    st.tier().save(chain, rows_of(chain), 0)
    _flip(st, chain[3])
    rows = empty_rows(4)
    by_rows = st.tier().load(chain, StagingRows(rows), invalidate_with=lambda _: None)
    _, segments = _host_cache(8)
    blocks = [5, 1, 6, 2]
    by_pieces = st.tier().load(chain, PagePieces(page_pieces(segments, blocks)))
    assert by_pieces.kinds == by_rows.kinds == [LOADED, LOADED, LOADED, CHECKSUM]
    view = segments[0].blocks_view()
    for i in range(3):
        assert np.array_equal(view[blocks[i]].reshape(-1).numpy(), rows[i])


def _cache_holding(chain: list[str], blocks: list[int]) -> tuple[torch.Tensor, list[KVSegment]]:
    """A host KV cache whose `blocks[i]` hold the page of `chain[i]`."""
    raw, segments = _host_cache(8)
    for pieces, key in zip(page_pieces(segments, blocks), chain, strict=True):
        data, at = page(key).tobytes(), 0
        for piece in pieces:
            piece[:] = data[at : at + len(piece)]
            at += len(piece)
    return raw, segments


def test_a_save_from_block_ranges_stores_what_a_save_of_rows_stores(
    tmp_path: Path, st: Store
) -> None:
    chain, blocks = keys(4), [5, 1, 6, 2]
    _, segments = _cache_holding(chain, blocks)
    saved = st.tier().save(chain, PageSources(page_pieces(segments, blocks)), 0)
    assert (saved.kinds, saved.committed, saved.storage_worked) == ([SAVED] * 4, 4, True)
    rows = empty_rows(4)
    assert st.tier().load(chain, StagingRows(rows)).kinds == [LOADED] * 4
    assert all(np.array_equal(r, page(k)) for r, k in zip(rows, chain, strict=True))
    other = MetadataStore(tmp_path / "b.db")  # the same pages saved from rows
    (tmp_path / "b").mkdir()
    ns_b, files_b = register_growable(other, tmp_path / "b")
    alone = Store(tmp_path / "b", other, ns_b, files_b[0], st.engine)
    alone.tier().save(chain, rows_of(chain))
    assert _stored(st) == _stored(alone)  # the same checksums
    files_b[0].close()
    other.close()


def test_ranges_reused_before_their_write_ended_are_released_not_committed(st: Store) -> None:
    """The check is asked after the write: what was reused by then is never committed."""
    first, second = keys(3, salt="a"), keys(2, salt="b")
    _, segments = _cache_holding([*first, *second], [0, 1, 2, 3, 4])
    asked: list[str] = []

    def held(name: str, answer: bool) -> Callable[[], bool]:
        return lambda: asked.append(name) is None and answer

    kept, reused = held("kept", True), held("reused", False)
    outcomes = st.tier().save_many(
        [
            SaveBatch(first, PageSources(page_pieces(segments, [0, 1, 2]), [kept] * 3)),
            SaveBatch(second, PageSources(page_pieces(segments, [3, 4]), [reused] * 2), 3),
        ]
    )
    assert [o.kinds for o in outcomes] == [[SAVED] * 3, [REUSED] * 2]
    assert [o.committed for o in outcomes] == [3, 0]
    assert sorted(asked) == ["kept", "reused"]  # each check once, not once per key
    assert outcomes[1].storage_failure is None  # not the storage's fault: no back-off
    assert (st.committed(), st.pending(), st.sound()) == (3, 0, [])
    assert st.tier().save(second, rows_of(second), 3).kinds == [SAVED] * 2  # not held


def test_a_load_cancelled_before_it_starts_touches_nothing(st: Store) -> None:
    chain = keys(2)
    st.tier().save(chain, rows_of(chain), 0)
    cancel = LoadCancel()
    assert cancel.cancel()
    rows, delivered = empty_rows(2), []
    raw, segments = _host_cache(4)
    by_rows = st.tier().load(chain, StagingRows(rows, delivered.append), cancel=cancel)
    by_pieces = st.tier().load(chain, PagePieces(page_pieces(segments, [0, 1])), cancel=cancel)
    assert by_rows.kinds == by_pieces.kinds == [CANCELLED] * 2
    assert (delivered, any(r.any() for r in rows), bool(raw.any())) == ([], False, False)


def test_a_load_cancelled_while_reading_never_delivers(st: Store) -> None:
    chain = keys(2)
    st.tier().save(chain, rows_of(chain), 0)
    cancel = LoadCancel()

    class CancelledMidRead(PosixEngine):
        def read_pages(self, *args: Any, **kw: Any) -> list[PageResult]:
            results = super().read_pages(*args, **kw)
            assert cancel.cancel()  # the timeout fires while the pages are being read
            return results

    engine = CancelledMidRead(io_threads=1)
    cache = empty_rows(2)
    try:
        outcome = st.tier(engine=engine).load(
            chain,
            StagingRows(empty_rows(2), lambda good: [cache[i].fill(1) for i in good]),
            cancel=cancel,
        )
    finally:
        engine.close()
    assert outcome.kinds == [CANCELLED] * 2
    assert (any(r.any() for r in cache), cancel.delivered) == (False, False)


def test_a_cancel_after_delivery_is_too_late(st: Store) -> None:
    chain = keys(1)
    st.tier().save(chain, rows_of(chain), 0)
    cancel = LoadCancel()
    outcome = st.tier().load(chain, StagingRows(empty_rows(1)), cancel=cancel)
    assert (outcome.kinds, cancel.delivered, cancel.cancel()) == ([LOADED], True, False)


def test_a_closed_engine_fails_loads_as_errors_not_exceptions(st: Store) -> None:
    chain = keys(2)
    st.tier().save(chain, rows_of(chain), 0)
    engine = PosixEngine(io_threads=1)
    engine.close()
    outcome = st.tier(engine=engine).load(chain, StagingRows(empty_rows(2)))
    assert (outcome.kinds, outcome.failure_kind) == ([ERROR, ERROR], ERROR)


def test_a_lease_comes_from_the_tier_pool_in_page_rows(st: Store) -> None:
    pool = StagingPool(4 * PAGE_BYTES, pin=False)
    tier = st.tier(pool=pool)
    lease = tier.lease(3)
    assert lease is not None and tuple(lease.tensor.shape) == (3, PAGE_BYTES)
    assert tier.lease(4) is None  # the pool cannot hold a second lease of that size
    lease.release()


# --- several chains at once (a step's save jobs) ------------------------------------


def _batch(chain: list[str], first_depth: int = 0, **terms: Any) -> SaveBatch:
    return SaveBatch(chain, rows_of(chain), first_depth, **terms)


def _stored(st: Store) -> list[tuple[str, int, str | None]]:
    """(key, depth, checksum) of every entry: what a save leaves, less pages and times."""
    with st.store._read() as conn:
        return conn.execute(
            "SELECT key, depth, checksum FROM entries WHERE namespace = ? ORDER BY key",
            (st.ns,),
        ).fetchall()


def test_save_many_stores_what_saves_one_by_one_store(tmp_path: Path, st: Store) -> None:
    shared = keys(3)
    first, second = [*shared, *keys(2, salt="a")], [*shared, *keys(2, salt="b")]
    third = keys(2, salt="c")
    batches = [_batch(first), _batch(second[3:], 3), _batch(third, 5)]
    transactions: list[str] = []
    st.store._conn().set_trace_callback(
        lambda sql: transactions.append(sql) if sql == "BEGIN IMMEDIATE" else None
    )
    outcomes = st.tier().save_many(batches)
    st.store._conn().set_trace_callback(None)
    assert [o.kinds for o in outcomes] == [[SAVED] * 5, [SAVED] * 2, [SAVED] * 2]
    assert [o.committed for o in outcomes] == [5, 2, 2]
    assert all(o.storage_worked and o.storage_failure is None for o in outcomes)
    assert len(transactions) == 2  # one allocate, one commit
    other = MetadataStore(tmp_path / "b.db")  # the same batches saved one after the other
    (tmp_path / "b").mkdir()
    ns_b, files_b = register_growable(other, tmp_path / "b")
    alone = Store(tmp_path / "b", other, ns_b, files_b[0], st.engine)
    for batch in batches:
        alone.tier().save(batch.keys, batch.pages, batch.first_depth)
    assert _stored(st) == _stored(alone)
    rows = empty_rows(len(first))
    assert st.tier().load(first, StagingRows(rows)).kinds == [LOADED] * len(first)
    assert all(np.array_equal(r, page(k)) for r, k in zip(rows, first, strict=True))
    assert st.sound() == []
    files_b[0].close()
    other.close()


def test_save_many_tells_a_key_an_earlier_batch_names_existing(st: Store) -> None:
    chain = keys(3)
    outcomes = st.tier().save_many([_batch(chain), _batch(chain[1:], 1)])
    assert [o.kinds for o in outcomes] == [[SAVED] * 3, [EXISTING] * 2]
    assert [o.committed for o in outcomes] == [3, 0]
    assert (st.committed(), st.pending(), st.sound()) == (3, 0, [])


def test_save_many_of_different_retentions_saves_batch_by_batch(st: Store) -> None:
    a, b = keys(2, salt="a"), keys(2, salt="b")
    outcomes = st.tier().save_many([_batch(a, retention_s=60.0), _batch(b)])
    assert [o.kinds for o in outcomes] == [[SAVED] * 2, [SAVED] * 2]
    expiring = {e.key for e in st.store.list_entries(st.ns) if e.expires_at is not None}
    assert expiring == set(a)


def test_save_many_without_the_tuple_calls_saves_batch_by_batch(st: Store) -> None:
    proxy = ModelsOnly(st.store)
    a, b = keys(2, salt="a"), keys(2, salt="b")
    outcomes = st.tier(call=lambda fn: fn(proxy)).save_many([_batch(a), _batch(b, 2)])
    assert [o.kinds for o in outcomes] == [[SAVED] * 2, [SAVED] * 2]
    assert (st.committed(), st.pending(), st.sound()) == (4, 0, [])


def test_a_failed_write_in_save_many_fails_its_batch_and_releases_its_page(st: Store) -> None:
    a, b = keys(2, salt="a"), keys(2, salt="b")
    engine = FailingWrites({3}, "disk on fire", errno.EIO)
    outcomes = st.tier(engine=engine).save_many([_batch(a), _batch(b, 2)])
    engine.close()
    assert [o.kinds for o in outcomes] == [[SAVED] * 2, [SAVED, IO]]
    assert outcomes[0].storage_failure is None
    failure = outcomes[1].storage_failure
    assert failure is not None and (failure.kind, failure.pages) == (IO, 1)
    assert (st.committed(), st.pending(), st.sound()) == (3, 0, [])


def test_a_failed_commit_in_save_many_releases_every_batch(st: Store) -> None:
    proxy = CommitFails(st.store)
    outcomes = st.tier(call=lambda fn: fn(proxy)).save_many([_batch(keys(2)), _batch(keys(1, 5))])
    assert [o.kinds for o in outcomes] == [[METADATA_DOWN] * 2, [METADATA_DOWN]]
    assert (st.committed(), st.pending(), st.sound()) == (0, 0, [])
