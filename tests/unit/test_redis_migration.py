"""The Redis store's formats: a store laid out by an older release (format 1 or 2, written
here key by key as that release wrote it) is migrated on open to format 3 and then
answers as if it had been written by this one; a newer format is refused.

Every test talks to a real `redis-server` (`helpers.redis_servers`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from helpers.redis_servers import redis_session_server, redis_url

from hf3fsctl.config import MetadataUrl
from hf3fsctl.errors import StoreFormatError
from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.models import EvictRequest, RankFile
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


def _open(url: str) -> RedisMetadataStore:
    return RedisMetadataStore(MetadataUrl.parse(url))


def _register(url: str, ranks: int = 1) -> str:
    """A namespace and its rank files, as every format lays them out (unchanged since 1)."""
    store = _open(url)
    try:
        manifest = {"model": "m", "tp_size": ranks, "pp_size": 1, "page_bytes": PAGE}
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
                    num_pages=1 << 20,
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
        assert raw.hget(f"{P}info", "format") == "3"
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
        assert raw.hget(f"{P}info", "format") == "3"
        assert raw.exists(f"{P}migrated_3") == 0
        assert store.lookup(ns, CHAIN) == 4
        assert [c.key for c in store.changes(0).changes] == ["01" * 32]
    finally:
        store.close()


def test_the_store_records_its_format_and_refuses_a_newer_one(redis_url: str, raw: Any) -> None:
    store = _open(redis_url)
    try:
        assert raw.hget(f"{P}info", "format") == "3"
        raw.hset(f"{P}info", "format", 4)  # as a newer hf3fsctl would leave it
        with pytest.raises(StoreFormatError, match="format 4") as refused:
            _open(redis_url)
        assert refused.value.hint is not None and "upgrade" in refused.value.hint
    finally:
        raw.hset(f"{P}info", "format", 3)
        store.close()


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks"])
def test_format_3_stores_each_key_as_its_bytes(redis_url: str, raw: Any, ranks: int) -> None:
    """32 bytes per 64-digit key in the entries and the LRU index; `c:NS` only with two
    or more ranks, where it carries the earliest expiry the lookup reads."""
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
            assert {len(m) for m in binary.zrange(f"{P}lru:{ns}", 0, -1)} == {34}
            counts = binary.hgetall(f"{P}c:{ns}")
        finally:
            binary.close()
        if ranks == 1:
            assert counts == {}
        else:  # the ranks committed, then the earliest expiry (rank 0's) in ms
            count, expiry = counts[bytes.fromhex(CHAIN[0])].split()
            assert int(count) == 2
            rows = [e for e in store.list_entries(ns) if e.key == CHAIN[0] and e.rank == 0]
            assert rows[0].expires_at == pytest.approx(float(expiry) / 1000, abs=1e-6)
        assert store.lookup(ns, CHAIN) == 4
        assert store.check_invariants() == []
    finally:
        store.close()
