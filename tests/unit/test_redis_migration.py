"""The Redis store's formats: a store laid out by an older release (format 1, 2, 3 or 4,
written here as that release wrote it) is migrated on open to format 5 and then answers
as if it had been written by this one; a newer format is refused.

Every test talks to a real `redis-server` (`helpers.redis_servers`).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from helpers.redis_servers import redis_session_server, redis_url

from hf3fsctl.config import MetadataUrl
from hf3fsctl.errors import StoreFormatError
from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.models import CommitItem, EvictRequest, RankFile
from hf3fsctl.meta.redis import RedisMetadataStore

__all__ = ["redis_session_server", "redis_url"]  # fixtures used here

P = "{hf3fsctl}:"
PAGE = 4096
OLD_ENTRY = struct.Struct("<Bddddddddd")  # format 2's entry: state, then 9 doubles
CHAIN = [f"{i:064x}" for i in range(1, 5)]  # one chain, depths 0..3, committed at once
ODD = "abcdef0123456789f"  # 17 hex digits: no byte form
PENDING = "77" * 32  # allocated, not yet committed
CHECKSUM = "xxh3:0123456789abcdef"


@pytest.fixture
def raw(redis_url: str) -> Iterator[Any]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def binary(redis_url: str) -> Iterator[Any]:
    """A client that leaves replies as bytes (keys are stored as bytes)."""
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _open(url: str) -> RedisMetadataStore:
    return RedisMetadataStore(MetadataUrl.parse(url))


def _register(url: str, ranks: int = 1, num_pages: int = 1 << 20, model: str = "m") -> str:
    """A namespace and its rank files, as every format lays them out (unchanged since 1)."""
    store = _open(url)
    try:
        manifest = {"model": model, "tp_size": ranks, "pp_size": 1, "page_bytes": PAGE}
        ns = namespace_id(manifest)
        store.register_namespace(ns, manifest)
        for rank in range(ranks):
            store.register_rank(
                ns,
                RankFile(
                    rank=rank,
                    path=f"{ns}/rank-{rank}.pages",
                    page_bytes=PAGE,
                    slot_bytes=PAGE,
                    num_pages=num_pages,
                ),
            )
        return ns
    finally:
        store.close()


def _write_old_store(raw: Any, ns: str, ranks: int, fmt: int, now: float) -> None:
    """What format `fmt` (1 or 2) wrote for CHAIN and ODD committed on every rank and
    PENDING allocated on rank 0: hex keys, 73-byte entries, `c:NS`, hex LRU members
    (format 1: the bare key), the change log's space-separated runs."""
    committed = [*CHAIN, ODD]
    depth = {key: i for i, key in enumerate(CHAIN)} | {ODD: 0}
    for rank in range(ranks):
        entries = {
            key: OLD_ENTRY.pack(1, page, depth[key], now - 5, now - 5, 2, 0, 0, 0, PAGE)
            + (CHECKSUM if key != ODD else "plain").encode()
            for page, key in enumerate(committed)
        }
        used = len(committed)
        if rank == 0:
            entries[PENDING] = OLD_ENTRY.pack(0, used, 0, now, now, 0, now + 60, 0, 0, 0)
            raw.zadd(f"{P}pend:{ns}:0", {PENDING: now + 60})
            used += 1
        raw.hset(f"{P}e:{ns}:{rank}", mapping=entries)
        raw.hset(f"{P}rf:{ns}:{rank}", mapping={"used": used, "next_unused": used})
        raw.hincrby(f"{P}held", ns, used * PAGE)
    raw.hset(f"{P}c:{ns}", mapping=dict.fromkeys(committed, ranks))
    raw.hset(f"{P}ns:{ns}", "keys", len(committed))

    def member(key: str) -> str:
        return key if fmt == 1 else f"{0xFFFF - depth[key]:04x}{key}"

    raw.zadd(f"{P}lru:{ns}", {member(key): now - 5 for key in committed})
    raw.xadd(
        f"{P}changes",
        {"ns": ns, "delta": "1", "keys": " ".join(committed)},
        id=f"0-{len(committed) * ranks}",
    )
    raw.set(f"{P}seq", len(committed) * ranks)
    raw.hset(f"{P}pins:{ns}", CHAIN[0], "0.000000 1.000000")
    raw.hset(f"{P}info", "format", fmt)


@pytest.mark.parametrize(("fmt", "ranks"), [(2, 1), (2, 2), (1, 1)], ids=["2", "2-ranks", "1"])
def test_an_older_store_is_migrated_on_open_and_answers_as_before(
    redis_url: str, raw: Any, fmt: int, ranks: int
) -> None:
    ns = _register(redis_url, ranks)
    seconds, micros = raw.time()
    now = seconds + micros / 1e6
    _write_old_store(raw, ns, ranks, fmt, now)
    store = _open(redis_url)
    try:
        assert raw.hget(f"{P}info", "format") == "5"
        assert store.check_invariants() == []
        assert store.lookup(ns, CHAIN) == 4
        assert store.lookup(ns, [ODD]) == 1
        assert raw.exists(f"{P}c:{ns}") == (ranks > 1)  # one rank: the entries answer
        located = store.locate(ns, 0, [*CHAIN, ODD, PENDING])
        assert [loc and (loc.page, loc.checksum) for loc in located] == [
            (0, CHECKSUM),
            (1, CHECKSUM),
            (2, CHECKSUM),
            (3, CHECKSUM),
            (4, "plain"),
            None,  # pending: not located, still its writer's
        ]
        rows = {(e.key, e.rank): e for e in store.list_entries(ns)}
        assert rows[(PENDING, 0)].state == "pending"
        assert rows[(CHAIN[3], 0)].depth == 3 and rows[(CHAIN[3], 0)].created == pytest.approx(
            now - 5, abs=0.002
        )
        assert [p.key for p in store.list_pins(ns)] == [CHAIN[0]]
        log = store.changes(0)
        assert [c.key for c in log.changes] == [*CHAIN, ODD]
        # the LRU order survived: equally old keys go deepest first (ODD, depth 0, was
        # read since; the pinned head stays)
        assert store.evict(EvictRequest(namespace=ns, max_entries=1)).keys == 1
        assert store.lookup(ns, CHAIN) == 3
        assert store.check_invariants() == []
    finally:
        store.close()


def test_a_migration_cut_short_is_finished_by_the_next_open(redis_url: str, raw: Any) -> None:
    """A process that died after migrating some namespaces left format 2 recorded; the
    next open migrates only the rest (each namespace's script records itself as done)."""
    ns = _register(redis_url)
    _write_old_store(raw, ns, 1, 2, 1.79e9)
    raw.sadd(f"{P}migrated_3", "#changes")  # as if the change log were done…
    raw.delete(f"{P}changes")
    raw.xadd(f"{P}changes", {"ns": ns, "delta": "1", "keys": "\x20" + "\x01" * 32}, id="0-5")
    store = _open(redis_url)  # … so its runs, already format 3, are left alone
    try:
        assert raw.hget(f"{P}info", "format") == "5"
        assert raw.exists(f"{P}migrated_3") == 0
        assert store.lookup(ns, CHAIN) == 4
        assert [c.key for c in store.changes(0).changes] == ["01" * 32]
    finally:
        store.close()


def test_the_store_records_its_format_and_refuses_a_newer_one(redis_url: str, raw: Any) -> None:
    store = _open(redis_url)
    try:
        assert raw.hget(f"{P}info", "format") == "5"
        raw.hset(f"{P}info", "format", 6)  # as a newer hf3fsctl would leave it
        with pytest.raises(StoreFormatError, match="format 6") as refused:
            _open(redis_url)
        assert refused.value.hint is not None and "upgrade" in refused.value.hint
    finally:
        raw.hset(f"{P}info", "format", 5)
        store.close()


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks"])
def test_format_4_stores_each_key_as_its_bytes(redis_url: str, raw: Any, ranks: int) -> None:
    """32 bytes per 64-digit key in the entries and the LRU generations; `c:NS` only with
    two or more ranks, where it carries the key's generation and the earliest expiry the
    lookup reads."""
    from hf3fsctl.meta.models import CommitItem

    ns = _register(redis_url, ranks)
    store = _open(redis_url)
    try:
        for rank in range(ranks):
            granted = store.allocate(ns, rank, CHAIN).allocated
            store.commit(
                ns,
                rank,
                [
                    CommitItem(
                        key=a.key,
                        page=a.page,
                        checksum=CHECKSUM,
                        size=PAGE,
                        retention_s=3600.0 + rank,
                    )
                    for a in granted
                ],
            )
        binary = redis.Redis.from_url(redis_url)
        try:
            fields = binary.hkeys(f"{P}e:{ns}:0")
            assert sorted(fields) == sorted(bytes.fromhex(k) for k in CHAIN)
            assert {len(v) for v in binary.hvals(f"{P}e:{ns}:0")} == {60}
            gens = [int(g) for g in binary.zrange(f"{P}gi:{ns}", 0, -1)]
            members = [m for g in gens for m in binary.zrange(f"{P}g:{ns}:{g}", 0, -1)]
            assert sorted(m[2:] for m in members) == sorted(bytes.fromhex(k) for k in CHAIN)
            assert {len(m) for m in members} == {34}
            assert binary.object("encoding", f"{P}g:{ns}:{gens[0]}") == b"listpack"
            counts = binary.hgetall(f"{P}c:{ns}")
        finally:
            binary.close()
        if ranks == 1:
            assert counts == {}
        else:  # the ranks committed, the generation, the earliest expiry (rank 0's) in ms
            count, gen, expiry = counts[bytes.fromhex(CHAIN[0])].split()
            assert int(count) == 2 and int(gen) in gens
            rows = [e for e in store.list_entries(ns) if e.key == CHAIN[0] and e.rank == 0]
            assert rows[0].expires_at == pytest.approx(float(expiry) / 1000, abs=1e-6)
        assert store.lookup(ns, CHAIN) == 4
        assert store.check_invariants() == []
    finally:
        store.close()


FORMAT3_ENTRY = "<B7s6sI5s5sI5s5s5sf"  # format 3's entry (then the checksum)
SPREAD = [f"{i:064x}" for i in range(100, 400)]  # 300 keys: more than two generations


def _le(value: int, size: int) -> bytes:
    return value.to_bytes(size, "little")


def _format3_entry(
    flags: int, until_us: int, page: int, depth: int, at_ms: int, hits: int, checksum: bytes
) -> bytes:
    """An entry as format 3's `common.lua` packed it (times in ms after `EPOCH_MS`)."""
    return (
        struct.pack(
            FORMAT3_ENTRY,
            flags,
            _le(until_us, 7),
            _le(page, 6),
            depth,
            _le(at_ms, 5),
            _le(at_ms + 1, 5),
            hits,
            _le(0, 5),
            _le(0, 5),
            _le(PAGE, 5),
            3600.0 if until_us else 0.0,
        )
        + checksum
    )


def _write_format3_store(url: str, ns: str, ranks: int, now: float) -> dict[str, Any]:
    """What format 3 wrote for SPREAD (committed on every rank, last accessed at 300
    different times, scrambled, and ties of four keys at several depths), CHAIN (one tie,
    depths 0..3), one key expiring in an hour, one pinned, PENDING allocated on rank 0:
    keys as bytes, 60-byte entries, `lru:NS` by last access, `c:NS` "RANKS[ EXPIRY_MS]".
    Returns what each committed key holds: its page, depth, last access (s), hits."""
    from hf3fsctl.meta.redis.codec import EPOCH_MS

    binary = redis.Redis.from_url(url)
    try:
        committed = [*SPREAD, *CHAIN]
        epoch_ms = int(now * 1000) - EPOCH_MS
        held: dict[str, Any] = {}
        for i, key in enumerate(SPREAD):
            age = (i * 7919) % 75  # 75 access times, four keys each
            held[key] = {"page": i, "depth": i % 4, "last": now - 100 + age, "hits": i}
        for i, key in enumerate(CHAIN):
            held[key] = {"page": len(SPREAD) + i, "depth": i, "last": now - 50, "hits": 0}
        expiring = SPREAD[5]
        expiry_us = (epoch_ms + 3_600_000) * 1000
        for rank in range(ranks):
            entries = {}
            for key in committed:
                h = held[key]
                until = expiry_us if key == expiring else 0
                entries[bytes.fromhex(key)] = _format3_entry(
                    1,
                    until,
                    h["page"],
                    h["depth"],
                    epoch_ms - 200_000,
                    h["hits"],
                    b"\x01" + bytes.fromhex("0123456789abcdef"),
                )
            used = len(committed)
            if rank == 0:
                entries[bytes.fromhex(PENDING)] = _format3_entry(
                    0, (epoch_ms + 60_000) * 1000, used, 0, epoch_ms, 0, b""
                )
                binary.zadd(f"{P}pend:{ns}:0", {bytes.fromhex(PENDING): now + 60})
                used += 1
            binary.hset(f"{P}e:{ns}:{rank}", mapping=entries)
            binary.hset(f"{P}rf:{ns}:{rank}", mapping={"used": used, "next_unused": used})
            binary.hincrby(f"{P}held", ns, used * PAGE)
        if ranks > 1:
            values = {bytes.fromhex(k): str(ranks) for k in committed}
            values[bytes.fromhex(expiring)] = f"{ranks} {EPOCH_MS + expiry_us / 1000:.3f}"
            binary.hset(f"{P}c:{ns}", mapping=values)
        binary.hset(f"{P}ns:{ns}", "keys", len(committed))

        def member(key: str) -> bytes:
            return struct.pack(">H", 0xFFFF - held[key]["depth"]) + bytes.fromhex(key)

        binary.zadd(f"{P}lru:{ns}", {member(k): f"{held[k]['last']:.6f}" for k in committed})
        binary.zadd(f"{P}x:{ns}", {member(expiring): EPOCH_MS + expiry_us / 1000})
        binary.hset(f"{P}pins:{ns}", bytes.fromhex(SPREAD[0]), "0.000000 1.000000")
        binary.hset(f"{P}info", "format", 3)
        return held
    finally:
        binary.close()


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks"])
def test_a_format_3_store_keeps_every_entry_pin_expiry_and_its_lru_order(
    redis_url: str, raw: Any, ranks: int
) -> None:
    """Format 3 → 4 moves `lru:NS` into generations in its own order: every entry reads
    back as written, the pin and the expiry hold, and an eviction of every key takes them
    oldest first, deepest first among equally old ones, the pinned one left."""
    ns = _register(redis_url, ranks)
    seconds, micros = raw.time()
    now = seconds + micros / 1e6
    held = _write_format3_store(redis_url, ns, ranks, now)
    store = _open(redis_url)
    try:
        assert raw.hget(f"{P}info", "format") == "5"
        assert raw.exists(f"{P}lru:{ns}", f"{P}migrated_4") == 0
        assert int(raw.zcard(f"{P}gi:{ns}")) >= 3  # 304 keys, at most 128 a generation
        assert store.check_invariants() == []
        rows = {(e.key, e.rank): e for e in store.list_entries(ns, limit=10_000)}
        assert len(rows) == len(held) * ranks + 1
        assert rows[(PENDING, 0)].state == "pending"
        for key, h in held.items():
            for rank in range(ranks):
                e = rows[(key, rank)]
                assert (e.state, e.page, e.depth, e.hits, e.size, e.checksum) == (
                    "committed",
                    h["page"],
                    h["depth"],
                    h["hits"],
                    PAGE,
                    CHECKSUM,
                ), key
        assert rows[(SPREAD[5], 0)].expires_at == pytest.approx(now + 3600, abs=0.002)
        assert rows[(SPREAD[6], 0)].expires_at is None
        assert [p.key for p in store.list_pins(ns)] == [SPREAD[0]]
        assert store.lookup(ns, [*CHAIN, *SPREAD]) == len(held)
        since = store.changes(0).next_seq
        evicted = store.evict(EvictRequest(namespace=ns, max_entries=len(held)))
        assert evicted.keys == len(held) - 1  # all but the pinned key
        gone = [c.key for c in store.changes(since).changes if c.delta == -1]
        order = sorted(
            (k for k in held if k != SPREAD[0]),
            key=lambda k: (held[k]["last"], -held[k]["depth"], k),
        )
        assert list(dict.fromkeys(gone)) == order
        assert store.check_invariants() == []
    finally:
        store.close()


def test_a_format_4_migration_cut_short_is_finished_by_the_next_open(
    redis_url: str, raw: Any
) -> None:
    """A process that died after moving one namespace's LRU left format 3 recorded and
    that namespace in `migrated_4`: the next open leaves it as it is and moves the rest."""
    done = _register(redis_url)
    store = _open(redis_url)
    try:  # `done` written by this release, as if migrated before the process died
        granted = store.allocate(done, 0, CHAIN).allocated
        store.commit(
            done,
            0,
            [CommitItem(key=a.key, page=a.page, checksum=CHECKSUM, size=PAGE) for a in granted],
        )
    finally:
        store.close()
    left = _register(redis_url, 2)
    seconds, micros = raw.time()
    held = _write_format3_store(redis_url, left, 2, seconds + micros / 1e6)
    raw.sadd(f"{P}migrated_4", done)
    store = _open(redis_url)
    try:
        assert raw.hget(f"{P}info", "format") == "5"
        assert raw.exists(f"{P}migrated_4", f"{P}lru:{left}") == 0
        assert store.lookup(done, CHAIN) == 4
        assert store.lookup(left, list(held)) == len(held)
        assert store.check_invariants() == []
    finally:
        store.close()


def _as_format4(url: str, ns: str) -> None:
    """The store as format 4 left it: format 4 differs from 5 only in how it scored the
    pending and free sets (`pend:NS:RANK`, `free:NS:RANK`): in seconds, six decimals
    (`f6` in its `common.lua`). Those sets rescored so, and format 4 recorded."""
    from hf3fsctl.meta.redis.codec import EPOCH_MS

    binary: Any = redis.Redis.from_url(url)
    try:
        ranks = int(binary.hget(f"{P}ns:{ns}", "num_ranks"))
        for rank in range(ranks):
            for kind in ("pend", "free"):
                key = f"{P}{kind}:{ns}:{rank}"
                scored = binary.zrange(key, 0, -1, withscores=True)
                if scored:
                    binary.delete(key)
                    seconds = {m: f"{EPOCH_MS / 1000 + s / 1e6:.6f}" for m, s in scored}
                    binary.zadd(key, seconds)
        binary.hset(f"{P}info", "format", 4)
    finally:
        binary.close()


TIMEOUT_S = 4.0  # the writers' pending timeout in the format-4 tests
WRITERS = [f"{i:064x}" for i in range(500, 507)]  # 7 pending keys: with the leased page, 8
LATE = "99" * 32  # a key allocated on the full file after the migration


def _fill_with_writers(store: RedisMetadataStore, ns: str) -> tuple[int, list[int]]:
    """CHAIN committed, its head located (an hour's lease), every key evicted, then
    WRITERS allocated: the 8-page file is full of pending pages and a freed page whose
    lease has not ended. Returns the leased page and the writers' pages."""
    granted = store.allocate(ns, 0, CHAIN).allocated
    store.commit(
        ns, 0, [CommitItem(key=a.key, page=a.page, checksum=CHECKSUM, size=PAGE) for a in granted]
    )
    head = store.locate(ns, 0, [CHAIN[0]])[0]
    assert head is not None
    assert store.evict(EvictRequest(namespace=ns, all=True)).keys == len(CHAIN)
    pending = store.allocate(ns, 0, WRITERS)
    pages = [a.page for a in pending.allocated]
    assert len(pages) == len(WRITERS) and head.page not in pages
    return head.page, pages


def _writers_store(url: str) -> RedisMetadataStore:
    return RedisMetadataStore(MetadataUrl.parse(url), lease_s=3600.0, pending_timeout_s=TIMEOUT_S)


def test_a_format_4_store_keeps_its_writers_deadlines_and_leased_free_pages(
    redis_url: str, raw: Any, binary: Any
) -> None:
    """Format 4 → 5 rescores the pending and free sets to whole µs, the same times: on
    the full file a writer's page is reclaimed only once its deadline passed, and a freed
    page is not reused before its lease ends (a set left in seconds would give both at
    once: every score in seconds is far below NOW in µs)."""
    ns = _register(redis_url, num_pages=8)
    writer = _writers_store(redis_url)
    try:
        leased, pages = _fill_with_writers(writer, ns)
    finally:
        writer.close()
    pend, free = f"{P}pend:{ns}:0", f"{P}free:{ns}:0"
    written = dict(binary.zrange(pend, 0, -1, withscores=True))  # µs, as format 5 writes them
    lease_end = raw.zscore(free, leased)
    _as_format4(redis_url, ns)
    assert max(binary.zrange(pend, 0, -1, withscores=True), key=lambda m: m[1])[1] < 1e10
    store = _writers_store(redis_url)
    try:
        assert raw.hget(f"{P}info", "format") == "5"
        assert raw.exists(f"{P}migrated_5") == 0
        assert store.check_invariants() == []
        rescored = dict(binary.zrange(pend, 0, -1, withscores=True))
        assert rescored.keys() == written.keys()
        for key, score in rescored.items():
            assert score == int(score) and abs(score - written[key]) <= 1, key
        assert raw.zscore(free, leased) == pytest.approx(lease_end, abs=1)
        # before the writers' deadline: nothing to reclaim, the leased page not reusable
        assert store.allocate(ns, 0, [LATE]).no_space == [LATE]
        pending = {e.key for e in store.list_entries(ns) if e.state == "pending"}
        assert pending == set(WRITERS)
        seconds, micros = raw.time()
        from hf3fsctl.meta.redis.codec import EPOCH_MS

        now_us = (seconds - EPOCH_MS // 1000) * 1_000_000 + micros
        time.sleep((max(written.values()) - now_us) / 1e6 + 0.3)
        late = store.allocate(ns, 0, [LATE]).allocated  # the dead writers' pages reclaimed
        assert [a.key for a in late] == [LATE] and late[0].page in pages
        pending = {e.key for e in store.list_entries(ns) if e.state == "pending"}
        assert pending == {LATE}
        assert raw.zscore(free, leased) == pytest.approx(lease_end, abs=1)  # still leased
        assert store.check_invariants() == []
    finally:
        store.close()


def test_a_format_5_migration_cut_short_is_finished_by_the_next_open(
    redis_url: str, raw: Any, binary: Any
) -> None:
    """A process that died after rescoring one namespace left format 4 recorded and that
    namespace in `migrated_5`: the next open leaves its sets as they are and rescores
    the other's; the doctor finds a set still in seconds."""
    done = _register(redis_url, num_pages=8)
    writer = _writers_store(redis_url)
    try:
        _fill_with_writers(writer, done)
    finally:
        writer.close()
    left = _register(redis_url, num_pages=8, model="m2")
    writer = _writers_store(redis_url)
    try:
        _fill_with_writers(writer, left)
        assert writer.check_invariants() == []
    finally:
        writer.close()
    kept = {k: binary.zrange(f"{P}{k}:{done}:0", 0, -1, withscores=True) for k in ("pend", "free")}
    _as_format4(redis_url, left)
    raw.sadd(f"{P}migrated_5", done)
    raw.hset(f"{P}info", "format", 5)  # format 4's sets, as if format 5's: the doctor sees
    doctor = _writers_store(redis_url)
    try:
        problems = " ".join(doctor.check_invariants())
        assert "free pages scored other than in whole µs" in problems
        assert "pending index's deadline" in problems
    finally:
        doctor.close()
    raw.hset(f"{P}info", "format", 4)
    store = _open(redis_url)
    try:
        assert raw.hget(f"{P}info", "format") == "5"
        assert raw.exists(f"{P}migrated_5") == 0
        for k, scored in kept.items():
            assert binary.zrange(f"{P}{k}:{done}:0", 0, -1, withscores=True) == scored
        for k in ("pend", "free"):
            scores = [s for _, s in binary.zrange(f"{P}{k}:{left}:0", 0, -1, withscores=True)]
            assert scores and all(s == int(s) and s > 1e11 for s in scores)
        assert store.check_invariants() == []
    finally:
        store.close()
