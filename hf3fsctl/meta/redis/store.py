"""`RedisMetadataStore`: the `MetadataClient` contract on Redis (docs/design.md decision 13).

Same semantics, models and typed errors as the SQLite `MetadataStore`; the key layout
and the scripts are described in `hf3fsctl/meta/redis/__init__.py`. Every data-path call
is one round trip: one call of a Lua script (`FCALL` of the store's function library on
Redis 7, else `EVALSHA`: `connection.StoreLua`), which Redis runs atomically (no other
command runs while it does), so allocate — capacity, quotas, eviction and all — commit,
release, invalidate and admin eviction are each one atomic step, whichever process or
node calls them. Time is the Redis server's (`TIME` inside the scripts), so leases,
writer deadlines and entries' expiries mean the same on every node of a fleet; `lookup`
(`lookup.py`) reads the expiries against the time its counter script answers. `admit`'s
sightings live in Redis too (`admit.lua`), so every engine's add up, at most
`ADMISSION_TRACKED_KEYS` per store. Keys, checksums and entries cross the boundary
once, as bytes (`codec.py`); the store's format is checked, and older ones migrated, on
open (`migration.py`).

Freed disk space is given back in two phases, as the SQLite store does: a script *marks*
free pages (they leave the free list, still counted as held), this process punches them
(`storage.layout.punch_pages`) and a second script *settles* them (holes, no longer
held) — or returns them to the free list if the file system refused. Marks a crashed
process left are finished by the next store that opens (only marks older than
`STALE_MARK_S`, so a live process's in-flight marks are never punched twice).

Nothing lives in this process but the connection pool, the Lua's names, each looked-up
namespace's rank count (fixed by its manifest) and the hits of its last lookups (counted
with its next lookup, or at stats, close or exit): several
`hf3fsctl serve` replicas, connectors and CLI commands on one Redis see one store.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from multiprocessing import util as mp_util
from typing import TYPE_CHECKING, Any, TypeVar

import redis.exceptions as rex
from pydantic import TypeAdapter

from hf3fsctl.config.units import parse_amount
from hf3fsctl.errors import InvalidRequest, MetadataUnavailable, NotFound
from hf3fsctl.meta.base import Attempt, StoreCore, check_rank_file, pin_limit_error
from hf3fsctl.meta.giveback import GiveBack, HolePuncher
from hf3fsctl.meta.models import (
    Allocation,
    ChangeLog,
    CommitItem,
    DropNamespacesResult,
    DroppedNamespace,
    EntryInfo,
    EvictRequest,
    EvictResult,
    Location,
    NamespaceInfo,
    PinInfo,
    PinResult,
    RankFile,
    StoreStats,
    WriterInfo,
)
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.redis import reports
from hf3fsctl.meta.redis.codec import decode_checksum, decode_key, encode_checksum, encode_key
from hf3fsctl.meta.redis.connection import StoreLua, call, redis_client
from hf3fsctl.meta.redis.lookup import Lookups
from hf3fsctl.meta.redis.lookup_hits import LookupHits
from hf3fsctl.meta.redis.migration import StoreAccess, check_format, check_shards

if TYPE_CHECKING:
    from hf3fsctl.config.urls import MetadataUrl

logger = logging.getLogger(__name__)

T = TypeVar("T")

PREFIX = "{hf3fsctl}:"  # one hash tag: every key of a store in one Cluster slot
STALE_MARK_S = 60.0  # a mark this old belongs to a process that died before punching
EVICT_BATCH = 1000  # keys an admin eviction takes per script call (tens of ms of Redis)
ADMISSION_TRACKED_KEYS = 1_000_000  # seen-counts `admit` keeps per store (LRU beyond)
SIZE_MAX = (1 << 32) - 1  # an entry holds a page's size in 4 bytes (format 4)
_LOCATIONS = TypeAdapter(list[Location | None])


def _marks(reply: Sequence[Any]) -> list[GiveBack]:
    return [
        (str(ns), int(r), str(path), int(slot), [int(p) for p in pages])
        for ns, r, path, slot, pages in reply
    ]


def walked_no_further(walked: dict[str, int], args: Sequence[Any]) -> bool:
    """Whether a batch of an admin eviction left every namespace's walk where it was
    (nothing evicted, nothing passed): no further batch can do more."""
    before = {str(args[i]): int(args[i + 1]) for i in range(12, len(args), 2)}
    return all(before.get(ns, 0) == offset for ns, offset in walked.items())


class RedisMetadataStore(StoreCore):
    """The metadata store on Redis: the `Store` protocol (`meta/protocol.py`), on the
    store core (`meta/base.py`: validation, the allocate loop), with Lua primitives.

    Args:
        target: a parsed `redis://`, `rediss://` or `redis+sentinel://` URL.
        timeout_s: connect and per-call deadline (`metadata.timeout_s`).
        token: the password when the URL has none (`metadata.token_file`).
        ca_file: the CA of a `rediss://` server's certificate (`metadata.ca_file`).
        lease_s: how long a located page stays unreusable, even if evicted.
        high_watermark: an allocation past this share of the capacity makes room…
        low_watermark: … down to this share.
        pending_timeout_s: a pending allocation older than this belongs to a dead writer
            (`policy.pending_timeout_s` wins when set).
        policy: capacity, pins, quotas and the storage root (`StorePolicy`).
        prefix: the prefix of every key (several stores can share one Redis database).
        shard: `(index, shards)` when this is one shard of a `ShardedRedisStore`
            (`sharded.py`): it then uses that store's `client`, `lua` and `puncher`
            (which punches its pages at their place in the page files) and leaves recording
            the default capacity to it. None: a whole store, which refuses to open a
            sharded one.
    """

    lookup_does_io = True  # `hf3fsctl serve` runs its lookups off the event loop

    def __init__(
        self,
        target: MetadataUrl,
        *,
        timeout_s: float = 2.0,
        token: str | None = None,
        ca_file: str | None = None,
        lease_s: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        pending_timeout_s: float = 120.0,
        policy: StorePolicy | None = None,
        prefix: str = PREFIX,
        shard: tuple[int, int] | None = None,
        client: Any | None = None,
        puncher: HolePuncher | None = None,
        lua: StoreLua | None = None,
        read_only: bool = False,
    ) -> None:
        self.read_only = read_only  # an admin view (`stats`, `ls`): opening writes nothing
        self._init_core(
            target.url,  # redacted: safe to log and print
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            pending_timeout_s=pending_timeout_s,
            policy=policy,
        )
        self.prefix = prefix
        self.shard = shard
        if puncher is not None:
            self._puncher = puncher
        self._owns_client = client is None
        self._redis = (
            client
            if client is not None
            else redis_client(target, timeout_s=timeout_s, token=token, ca_file=ca_file)
        )
        self._cluster = target.scheme == "redis+cluster"
        self._lua = lua if lua is not None else StoreLua(self._redis, self.url)
        self._hits = LookupHits(self._lua, prefix, self.url)
        self._lookups = Lookups(self._redis, prefix, self.url, self._cluster, self._lua, self._hits)
        # A process that only looks up (the connector's scheduler) may exit without
        # `close`: count its last hits then too, as the embedded client flushes its
        # counters (multiprocessing's Finalize also runs in vLLM's EngineCore children).
        self._count_at_exit = mp_util.Finalize(self, self._hits.count, exitpriority=0)
        access = StoreAccess(self.url, self._redis, self._key, self._read, self._run)
        check_format(access)
        if shard is None:
            check_shards(access, 1)
        self._record_default_capacity()

    # --- plumbing ------------------------------------------------------------------------

    def _run(self, name: str, args: Sequence[Any], *, idempotent: bool = False) -> Any:
        return call(lambda: self._lua.run(name, self.prefix, args), self.url, idempotent=idempotent)

    def _read(self, fn: Callable[[], T]) -> T:
        return call(fn, self.url, idempotent=True)

    def _owner(self) -> dict[str, Any]:
        """On a cluster, where a server command (`INFO`, `CONFIG GET`) must go: the master
        of the store's slot (redis-py sends one to a random node otherwise)."""
        if not self._cluster:
            return {}
        return {"target_nodes": self._redis.get_node_from_key(self.prefix)}

    def _key(self, *parts: object) -> str:
        return self.prefix + ":".join(str(p) for p in parts)

    def _give_back(self, marked: Sequence[GiveBack]) -> None:
        """Punch pages a script marked, then settle the marks."""
        if not marked:
            return
        done, refused = self._puncher.punch(marked)
        args: list[Any] = []
        for items, ok in ((done, 1), (refused, 0)):
            for ns, rank, _, _, pages in items:
                args += [ns, rank, ok, len(pages), *pages]
        try:
            self._run("settle", args)
        except MetadataUnavailable as exc:  # the next store that opens settles them
            logger.warning("pages given back but not yet settled: %s", exc)

    def _record_default_capacity(self) -> None:
        """Finish marks a crashed process left; record the policy's default capacity
        when the store has none and the storage root is here to size it from."""
        try:
            self._warn_if_redis_evicts()
            if self.read_only:  # the next writable open finishes marks, records a capacity
                return
            if self._puncher.available():
                self._give_back(_marks(self._run("marks", [STALE_MARK_S])))
            if self.shard is not None:  # the sharded store records each shard's share
                return
            recorded, held = self._capacity_held()
            if recorded is None:
                self._default_capacity(held)
        except MetadataUnavailable as exc:  # connecting is lazy: a call will say so again
            logger.debug("Redis store %s: not reachable at open: %s", self.url, exc)

    def _warn_if_redis_evicts(self) -> None:
        """Warn when Redis may evict keys by itself (`maxmemory-policy` other than
        `noeviction`): it would drop parts of the store and break its invariants. A Redis
        that refuses `CONFIG GET` (managed services often do) is not asked again."""

        policy = self.maxmemory_policy()  # refused credentials or no Redis: the typed error
        if policy and policy != "noeviction":
            logger.warning(
                "Redis at %s has maxmemory-policy %s: when full it evicts keys of the "
                "metadata store itself; set maxmemory-policy noeviction (the store evicts "
                "by itself, and a full Redis only makes saves miss)",
                self.url,
                policy,
            )

    def maxmemory_policy(self) -> str | None:
        """Redis's `maxmemory-policy` (the store needs `noeviction`); None when Redis
        refuses `CONFIG GET` (managed services often do)."""

        def read() -> Any:
            try:
                return self._redis.config_get("maxmemory-policy", **self._owner()).get(
                    "maxmemory-policy"
                )
            except rex.ResponseError:  # CONFIG refused or renamed (NOPERM, unknown command)
                return None

        policy = self._read(read)
        return str(policy) if policy else None

    # --- namespaces ----------------------------------------------------------------------

    def _register_namespace(
        self, namespace: str, manifest: dict[str, Any], num_ranks: int
    ) -> NamespaceInfo:
        text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), default=str)
        page_bytes = manifest.get("page_bytes")
        key_bytes = 0
        if isinstance(page_bytes, int) and not isinstance(page_bytes, bool) and page_bytes > 0:
            from hf3fsctl.storage.layout import slot_bytes

            key_bytes = slot_bytes(page_bytes) * num_ranks
        model = str(manifest.get("model"))
        created = self._run(
            "register_namespace", [namespace, text, num_ranks, model, key_bytes], idempotent=True
        )
        if created:
            logger.info("registered namespace %s (%d ranks)", namespace, num_ranks)
        return self.get_namespace(namespace)

    def _register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        check_rank_file(self.get_namespace(namespace), rank_file)
        if rank_file.slot_bytes > SIZE_MAX:
            raise InvalidRequest(
                f"rank {rank_file.rank}: pages of {rank_file.slot_bytes} bytes; an entry of the "
                f"Redis store holds sizes up to {SIZE_MAX}"
            )
        self._run(
            "register_rank",
            [
                namespace,
                rank_file.rank,
                rank_file.path,
                rank_file.page_bytes,
                rank_file.slot_bytes,
                rank_file.num_pages,
                int(rank_file.preallocated),
            ],
            idempotent=True,
        )
        return self.get_namespace(namespace)

    def _get_namespace(self, namespace: str) -> NamespaceInfo:
        found = self._read(lambda: reports.namespace_infos(self._redis, self.prefix, [namespace]))
        if not found:
            raise NotFound(f"namespace {namespace} is not registered")
        return found[0]

    def namespaces(self) -> list[NamespaceInfo]:
        """Every registered namespace, oldest first."""
        return self._read(lambda: reports.namespace_infos(self._redis, self.prefix, None))

    # --- data path -----------------------------------------------------------------------

    def _lookup(self, namespace: str, keys: Sequence[str]) -> int:
        return self._lookups.lookup(namespace, keys)

    def _locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        if not keys:
            self._run("locate", [namespace, rank, self.lease_s], idempotent=True)
            return []
        flat = self._run("locate", self._locate_args(namespace, rank, keys), idempotent=True)
        return self._locate_answer(keys, flat)

    # A call's arguments and the reading of its script's reply, apart, so a sharded store
    # can pipeline several shards' scripts on one master (`sharded.py`).

    def _locate_args(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Any]:
        return [namespace, rank, self.lease_s, *(encode_key(key) for key in keys)]

    def _locate_answer(self, keys: Sequence[str], flat: Sequence[Any]) -> list[Location | None]:
        return _LOCATIONS.validate_python(
            [
                None
                if flat[3 * i] == -1
                else {
                    "key": key,
                    "page": flat[3 * i],
                    "checksum": decode_checksum(flat[3 * i + 1]),
                    "size": flat[3 * i + 2],
                }
                for i, key in enumerate(keys)
            ]
        )

    def _allocate_once(
        self, namespace: str, rank: int, keys: list[str], depth_of: dict[str, int]
    ) -> Attempt:
        """One `allocate.lua` run: reclaim, make room (`evict_for_room` in the script),
        grant pages."""
        args = self._allocate_args(namespace, rank, keys, depth_of)
        return self._allocate_answer(self._run("allocate", args))

    def _allocate_args(
        self, namespace: str, rank: int, keys: list[str], depth_of: dict[str, int]
    ) -> list[Any]:
        quotas: list[Any] = []
        for name, text in self.policy.quotas.items():
            amount = parse_amount(text, f"quotas.{name}")
            if amount.share is not None:
                quotas += [name, "s", amount.share]
            else:
                quotas += [name, "b", amount.bytes or 0]
        args: list[Any] = [
            namespace,
            rank,
            self.pending_timeout_s,
            self.high_watermark,
            self.low_watermark,
            int(self._puncher.available()),
            len(quotas) // 3,
            *quotas,
        ]
        for key in keys:
            args += [encode_key(key), depth_of[key]]
        return args

    def _allocate_answer(self, reply: Sequence[Any]) -> Attempt:
        flat, existing, no_space, marks = reply
        allocated = [(decode_key(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]
        return (
            allocated,
            [decode_key(k) for k in existing],
            [decode_key(k) for k in no_space],
            _marks(marks),
        )

    def _giving_back_elsewhere(self) -> bool:
        values = self._read(lambda: self._redis.hvals(self._key("giving")))
        return any(int(v) > 0 for v in values)

    def _commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        return int(self._run("commit", self._commit_args(namespace, rank, items)))

    def _commit_args(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> list[Any]:
        args: list[Any] = [namespace, rank]
        for item in items:
            if item.size > SIZE_MAX:
                raise InvalidRequest(
                    f"key {item.key}: size {item.size} is more than an entry of the Redis "
                    f"store holds ({SIZE_MAX})"
                )
            args += [
                encode_key(item.key),
                item.page,
                encode_checksum(item.checksum),
                item.size,
                "" if item.retention_s is None else repr(float(item.retention_s)),
                int(item.renew_on_read),
            ]
        return args

    def _release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        args: list[Any] = [namespace, rank]
        for allocation in allocations:
            args += [encode_key(allocation.key), allocation.page]
        return int(self._run("release", args))

    def _invalidate(self, namespace: str, rank: int, triples: list[tuple[str, int, str]]) -> int:
        args: list[Any] = [namespace, rank]
        for key, page, checksum in triples:
            args += [encode_key(key), page, encode_checksum(checksum)]
        return int(self._run("invalidate", args, idempotent=True))

    def _admit(self, namespace: str, keys: list[str], after_hits: int) -> list[bool]:
        """One `admit.lua` run: a sighting of each key, the counts bounded store-wide."""
        args: list[Any] = [namespace, after_hits, ADMISSION_TRACKED_KEYS]
        reply = self._run("admit", args + [encode_key(key) for key in keys])
        return [bool(v) for v in reply]

    # --- admin ---------------------------------------------------------------------------

    def _evict(self, request: EvictRequest) -> EvictResult:
        """In batches of `EVICT_BATCH` keys, each one atomic script (LRU order across the
        batches; a key another writer touches meanwhile may move in it), so evicting a
        large store never holds Redis for more than a few milliseconds at a time.
        """

        def text(value: object) -> object:
            return "" if value is None else value

        can_punch = self._puncher.available()
        keys = pages = freed = 0
        by_namespace: dict[str, int] = {}
        walked: dict[str, int] = {}
        cutoff: object = ""
        phase, expired_by = "x", ""  # expired keys first, then the LRU
        while True:  # one atomic batch per script call: Redis is never held for long
            left = None if request.max_entries is None else request.max_entries - keys
            args: list[Any] = [
                text(request.namespace),
                text(request.older_than_s),
                text(request.target_usage),
                text(left),
                int(request.include_pinned),
                int(request.dry_run),
                int(can_punch),
                EVICT_BATCH,
                cutoff,
                freed if request.dry_run else 0,
                phase,
                expired_by,
            ]
            for ns, offset in walked.items():
                args += [ns, offset]
            reply = self._run("evict", args)
            got, got_pages, got_bytes, flat, marks, offsets, done, cut, now_phase, by = reply
            self._give_back(_marks(marks))
            keys, pages, freed = keys + int(got), pages + int(got_pages), freed + int(got_bytes)
            for i in range(0, len(flat), 2):
                by_namespace[flat[i]] = by_namespace.get(flat[i], 0) + int(flat[i + 1])
            walked = {offsets[i]: int(offsets[i + 1]) for i in range(0, len(offsets), 2)}
            cutoff, expired_by = cut, by
            if done or (not got and now_phase == phase and walked_no_further(walked, args)):
                break
            phase = now_phase
        return EvictResult(
            keys=keys,
            pages=pages,
            bytes=freed,
            dry_run=request.dry_run,
            by_namespace=by_namespace,
        )

    def stats(self) -> StoreStats:
        """Usage and traffic of every namespace and of the whole store."""
        self.flush()
        capacity = self.capacity().capacity_bytes
        return self._read(
            lambda: reports.store_stats(
                self._redis,
                self.prefix,
                capacity=capacity,
                quotas=self.policy.quota_bytes(capacity),
                max_pinned=self.policy.max_pinned_bytes(capacity),
            )
        )

    def _list_entries(self, namespace: str | None, limit: int, offset: int) -> list[EntryInfo]:
        return self._read(
            lambda: reports.list_entries(self._redis, self.prefix, namespace, limit, offset)
        )

    def _capacity_held(self) -> tuple[int | None, int]:
        def read() -> tuple[Any, list[Any]]:
            pipe = self._redis.pipeline(transaction=True)
            pipe.hget(self._key("info"), "capacity_bytes")
            pipe.hvals(self._key("held"))
            cap, held = pipe.execute()
            return cap, held

        cap_text, held_values = self._read(read)
        cap = int(cap_text) if cap_text is not None else None
        return cap, sum(int(v) for v in held_values)

    def _set_capacity(self, capacity_bytes: int) -> None:
        self._read(lambda: self._redis.hset(self._key("info"), "capacity_bytes", capacity_bytes))

    def _record_capacity_if_none(self, capacity_bytes: int) -> int | None:
        key = self._key("info")
        self._read(lambda: self._redis.hsetnx(key, "capacity_bytes", capacity_bytes))
        return self._capacity_held()[0]

    # --- pins and namespace clean-up -------------------------------------------------------

    def _pin(self, namespace: str, keys: Sequence[str], ttl_s: float | None) -> PinResult:
        max_pinned = self.policy.max_pinned_bytes(self.capacity().capacity_bytes)
        reply = self._run(
            "pin",
            [
                namespace,
                "" if ttl_s is None else ttl_s,
                "" if max_pinned is None else max_pinned,
                *(encode_key(key) for key in keys),
            ],
            idempotent=True,
        )
        if reply[0] == -1:
            _, new, size, total = reply
            raise pin_limit_error(new, size, total, max_pinned)
        pinned, stored, total = reply
        return PinResult(
            pinned=int(pinned),
            stored=int(stored),
            pinned_bytes=int(total),
            max_pinned_bytes=max_pinned,
        )

    def _unpin(self, namespace: str, keys: Sequence[str] | None) -> int:
        args: list[Any] = [namespace, int(keys is None), *(encode_key(k) for k in keys or [])]
        return int(self._run("unpin", args, idempotent=True))

    def _list_pins(self, namespace: str | None, limit: int) -> list[PinInfo]:
        return self._read(lambda: reports.list_pins(self._redis, self.prefix, namespace, limit))

    def _drop_namespaces(self, namespace_ids: list[str], dry_run: bool) -> DropNamespacesResult:
        for ns in namespace_ids:  # all or none: an unknown one drops nothing
            self._get_namespace(ns)
        dropped = []
        for ns in namespace_ids:
            keys, held, paths, writing = self._run("drop_namespace", [ns, int(dry_run)])
            item = DroppedNamespace(
                id=ns,
                keys=int(keys),
                bytes=int(held),
                rank_files=list(paths),
                skipped=f"{writing} pages are being written" if writing else None,
            )
            if item.skipped is None and not dry_run:
                logger.info("dropped namespace %s (%d keys, %d bytes)", ns, item.keys, item.bytes)
                self._drop_writers(ns)
            dropped.append(item)
        return DropNamespacesResult(namespaces=dropped, dry_run=dry_run)

    # --- writers: one hash, field "<namespace>:<writer id>" → {numerics, first_seen} --------

    def _record_writer(self, namespace: str, writer: WriterInfo) -> None:
        value = json.dumps({"numerics": writer.numerics, "first_seen": writer.first_seen})
        field = f"{namespace}:{writer.id}"
        self._read(lambda: self._redis.hsetnx(self._key("writers"), field, value))

    def _writers(self, namespace: str | None) -> dict[str, list[WriterInfo]]:
        rows = self._read(lambda: self._redis.hgetall(self._key("writers")))
        out: dict[str, list[WriterInfo]] = {}
        for field, value in rows.items():
            ns, _, writer_id = str(field).partition(":")
            if namespace is not None and ns != namespace:
                continue
            data = json.loads(value)
            out.setdefault(ns, []).append(
                WriterInfo(id=writer_id, numerics=data["numerics"], first_seen=data["first_seen"])
            )
        return out

    def _drop_writers(self, namespace: str) -> None:
        key = self._key("writers")
        fields = [
            f for f in self._read(lambda: self._redis.hkeys(key)) if f.startswith(namespace + ":")
        ]
        if fields:
            self._read(lambda: self._redis.hdel(key, *fields))

    def _changes(self, since: int, namespace: str | None, limit: int) -> ChangeLog:
        return self._read(
            lambda: reports.read_changes(self._redis, self.prefix, since, namespace, limit)
        )

    def health(self) -> dict[str, Any]:
        """A cheap liveness check: Redis answers; raises `MetadataUnavailable` when down."""
        count = self._read(lambda: self._redis.zcard(self._key("namespaces")))
        return {"status": "ok", "store": "redis", "namespaces": int(count)}

    def replication(self) -> dict[str, Any]:
        """What `doctor` reports of the Redis this store talks to: its role (`master` or
        `slave`), how many replicas are connected, the link to its master (a replica),
        the Redis version, the store's format, `maxmemory-policy` and how its Lua runs."""
        info = self._read(lambda: self._redis.info("replication", **self._owner()))
        server = self._read(lambda: self._redis.info("server", **self._owner()))
        stored = self._read(lambda: self._redis.hget(self._key("info"), "format"))
        return {
            "role": str(info.get("role", "?")),
            "connected_replicas": int(info.get("connected_slaves", 0)),
            "master_link_status": info.get("master_link_status"),
            "redis_version": str(server.get("redis_version", "?")),
            "format": int(stored) if stored is not None else None,
            "maxmemory_policy": self.maxmemory_policy(),
            "lua": self._read(lambda: self._lua.describe(self.prefix)),
        }

    def check_invariants(self) -> list[str]:
        """Every violated invariant of the store, one line each; empty when sound."""
        return self._read(lambda: reports.invariants(self._redis, self.prefix))

    def flush(self) -> None:
        """Count the hits of this process's last lookups now (every other counter is
        written by its call's own script)."""
        self._hits.count()

    def close(self) -> None:
        """Count pending lookup hits, then release the connections."""
        self._count_at_exit.cancel()
        self.flush()
        if not self._owns_client:  # a shard: its sharded store closes the connections
            return
        self._redis.close()
        pool = getattr(self._redis, "connection_pool", None)
        if pool is not None:
            pool.disconnect()
