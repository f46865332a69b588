"""`ShardedRedisStore`: one store split into N one-slot shards over a Redis Cluster.

`redis+cluster://HOST:PORT[,…]?shards=N`. A one-slot store (`RedisMetadataStore`) keeps
every key under one hash tag, so one master holds and serves all of it. Here the store
is N such stores — shard 0 under the tag `{hf3fsctl}` (the store-wide records live
there), shard `s` under `{hf3fsctl/s}` or `{hf3fsctl/s.j}`, the tag whose slot is
spaced evenly from shard 0's (`shard_prefix`) — each a complete `RedisMetadataStore` with its scripts,
format and migrations, and a cluster spreads the N slots over its masters. Every script
still touches one slot, so each call stays atomic *within* a shard.

Placement, fixed when the store is made (`info.shards` of shard 0; a different count is
refused at open, `migration.check_shards`):

- a block key lives in shard `crc32(key) % N` (keys are hashes: shards fill evenly);
- pages interleave in each page file: shard `s` owns the pages `p` with `p % N == s`
  and knows them as `p // N`, so the data path's pages, the files and their growth are
  exactly those of one store; a shard's rank file has `ceil((num_pages - s) / N)` pages;
- capacity, byte quotas and a byte `max_pinned` are split evenly (shares of capacity
  apply per shard as they are); each shard evicts its own least recently used keys.

What changes against one slot (docs/design.md, "Redis Cluster: sharding"):

- eviction is LRU per shard, not across the store: a shard evicts its oldest keys when
  *it* is past the watermark (`benchmarks/bench_shard_lru.py` measures the hit rate
  this costs against exact LRU);
- a call spanning shards is atomic per shard only: an `allocate` that fails midway
  leaves the pages it was granted pending, reclaimed as a dead writer's after
  `pending_timeout_s`; a `pin` refused by one shard's limit keeps the other shards'
  pins;
- the change log is one log per shard: `changes` reads each, and its `next_seq` is the
  id of a cursor recorded in shard 0 (every shard's position; the last
  `CURSORS_KEPT` kept), so a follower's cursor stays one integer. A change's `seq` is
  `shard seq * N + shard`: unique, increasing per key;
- admin calls (`stats`, `ls`, `evict`, pins, namespaces) ask every shard and merge.

`lookup` is one pipelined round trip per master: the shards' `HMGET`s, and shard 0's
counter script (the namespace's ranks, Redis's time and the traffic counters); its
answer is the first key any shard misses.
"""

from __future__ import annotations

import itertools
import logging
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis.exceptions as rex
from redis.crc import key_slot

from hf3fsctl.errors import InvalidRequest, MetadataUnavailable
from hf3fsctl.meta.base import Attempt, StoreCore
from hf3fsctl.meta.giveback import GiveBack, HolePuncher
from hf3fsctl.meta.models import (
    Allocation,
    Change,
    ChangeLog,
    CommitItem,
    DropNamespacesResult,
    DroppedNamespace,
    EntryInfo,
    EvictRequest,
    EvictResult,
    Location,
    NamespaceInfo,
    NamespaceStats,
    PinInfo,
    PinResult,
    RankFile,
    StoreStats,
    WriterInfo,
)
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.redis.codec import encode_key
from hf3fsctl.meta.redis.connection import StoreLua, call, redis_client
from hf3fsctl.meta.redis.lookup import RAW, Lookups, leading
from hf3fsctl.meta.redis.lookup_hits import LookupHits
from hf3fsctl.meta.redis.migration import StoreAccess, check_shards
from hf3fsctl.meta.redis.store import PREFIX, RedisMetadataStore

if TYPE_CHECKING:
    from hf3fsctl.config.urls import MetadataUrl

logger = logging.getLogger(__name__)

CLUSTER_SLOTS = 16_384
# Change-log cursors (every shard's position) kept: the newest, one per `changes` call
# that moved (~100 B each); a follower whose cursor is older starts at the ends, told it
# missed changes, as after the log's own trim.
CURSORS_KEPT = 100_000


def shard_prefix(prefix: str, shard: int, shards: int) -> str:
    """The key prefix of one shard: the store's own for shard 0; for shard `s` its hash
    tag with `/s` (and `.j`, the first j that places it) whose Cluster slot lies within
    an eighth of a step from `slot(shard 0) + s × 16384 / shards`. Slots evenly spaced
    land on distinct masters of a cluster whose slots are split evenly (what
    `redis-cli --cluster create` does), so N shards on N masters put one on each."""
    if shard == 0:
        return prefix
    if not (prefix.startswith("{") and prefix.endswith("}:")):
        raise InvalidRequest(f"a sharded store's prefix is {{TAG}}:, not {prefix!r}")
    tag = prefix[1:-2]
    step = CLUSTER_SLOTS / shards
    target = (key_slot(tag.encode()) + round(shard * step)) % CLUSTER_SLOTS
    near = max(1, int(step / 8))
    for j in itertools.count():
        name = f"{tag}/{shard}" if j == 0 else f"{tag}/{shard}.{j}"
        gap = abs(key_slot(name.encode()) - target)
        if min(gap, CLUSTER_SLOTS - gap) <= near:
            return f"{{{name}}}:"
    raise AssertionError("unreachable")


def shard_pages(num_pages: int, shard: int, shards: int) -> int:
    """How many of a file's `num_pages` pages are the shard's (those `p % shards == shard`)."""
    return (num_pages - shard + shards - 1) // shards


def split(total: int, shard: int, shards: int) -> int:
    """Shard `shard`'s part of `total` split evenly (the parts add up to `total`)."""
    return total // shards + (1 if shard < total % shards else 0)


def _shard_policy(policy: StorePolicy, shards: int) -> StorePolicy:
    """The policy each shard enforces: byte amounts split, shares as they are."""
    from dataclasses import replace

    from hf3fsctl.config.units import parse_amount

    def part(text: str, key: str) -> str:
        amount = parse_amount(text, key)
        return text if amount.share is not None else str((amount.bytes or 0) // shards)

    return replace(
        policy,
        max_pinned=part(policy.max_pinned, "storage.max_pinned"),
        quotas={name: part(text, f"quotas.{name}") for name, text in policy.quotas.items()},
    )


def by_master(
    client: Any, prefixes: Sequence[str], shards: Iterable[int]
) -> tuple[dict[str, tuple[Any, list[int]]], list[int]]:
    """`shards` grouped by the master the cached slot map names for each (that master's
    own connection, its shards in order), and the shards it names no master for."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    unplaced: list[int] = []
    for shard in shards:
        node = client.get_node_from_key(prefixes[shard])
        if node is None or node.redis_connection is None:
            unplaced.append(shard)
        else:
            groups.setdefault(node.name, (node.redis_connection, []))[1].append(shard)
    return groups, unplaced


class ShardPuncher(HolePuncher):
    """A shard's hole puncher: its marks name its own page numbers; the file holds them
    at `page * shards + shard`."""

    def __init__(self, storage_root: str | None, shard: int, shards: int) -> None:
        super().__init__(storage_root)
        self.shard, self.shards = shard, shards

    def punch(self, marked: Sequence[GiveBack]) -> tuple[list[GiveBack], list[GiveBack]]:
        placed = []
        for item in marked:
            ns, rank, path, slot, pages = item
            at = [p * self.shards + self.shard for p in pages]
            placed.append(((ns, rank, path, slot, at), item))
        done, refused = super().punch([at for at, _ in placed])
        back = {id(at): item for at, item in placed}
        return [back[id(at)] for at in done], [back[id(at)] for at in refused]


class ShardedLookups(Lookups):
    """`lookup` over the shards: per master one pipeline of its shards' `HMGET`s (and, on
    shard 0's master, the counter script); the answer is the first key any shard misses."""

    def __init__(
        self,
        client: Any,
        prefixes: list[str],
        where: str,
        lua: StoreLua,
        hits: LookupHits,
        shard_of: Callable[[str], int],
    ) -> None:
        super().__init__(client, prefixes[0], where, True, lua, hits)
        self.prefixes = prefixes
        self.shard_of = shard_of

    def _ask(
        self, namespace: str, keys: Sequence[str], ranks: int, counters: list[Any]
    ) -> tuple[int, int]:
        table = f"e:{namespace}:0" if ranks == 1 else f"c:{namespace}"
        positions: dict[int, list[int]] = {}
        fields: dict[int, list[bytes]] = {}
        for index, key in enumerate(keys):
            shard = self.shard_of(key)
            positions.setdefault(shard, []).append(index)
            fields.setdefault(shard, []).append(encode_key(key))
        values, script_reply = self._read_shards(table, fields, counters)
        answered, now_ms = int(script_reply[0]), float(script_reply[1])
        found = len(keys) if answered == ranks else 0
        for shard, replies in values.items() if found else ():
            counted = leading(replies, ranks, now_ms)  # the shard's first miss ends the chain
            if counted < len(replies):
                found = min(found, positions[shard][counted])
        return found, answered

    def _read_shards(
        self, table: str, fields: dict[int, list[bytes]], counters: list[Any]
    ) -> tuple[dict[int, list[Any]], list[Any]]:
        """Every shard's `HMGET` and the counter script, one pipeline per master; through
        the cluster client (which follows a moved slot) when a master's own fails."""
        by_node, unplaced = by_master(self.client, self.prefixes, sorted({0, *fields}))
        if unplaced:
            return self._through_cluster(table, fields, counters)
        values: dict[int, list[Any]] = {}
        script_reply: list[Any] = []
        # shard 0's master (the counter script) last: a master lost midway is retried
        # through the slot map before the counters were added, so never added twice
        pipelines = sorted(by_node.values(), key=lambda node: 0 in node[1])
        try:
            for connection, shards in pipelines:
                pipe = connection.pipeline(transaction=False)
                for shard in shards:
                    if shard in fields:
                        key = self.prefixes[shard] + table
                        pipe.execute_command("HMGET", key, *fields[shard], **RAW)
                    if shard == 0:
                        self.lua.queue(pipe, "count_lookup", self.prefix, counters)
                replies = list(pipe.execute(raise_on_error=False))
                for reply in replies:
                    if isinstance(reply, Exception):
                        raise reply
                for shard in shards:
                    if shard in fields:
                        values[shard] = replies.pop(0)
                    if shard == 0:
                        script_reply = replies.pop(0)
        except (rex.ConnectionError, rex.MovedError, rex.AskError,
                rex.ClusterDownError, rex.TryAgainError) as exc:  # fmt: skip
            logger.debug("Redis Cluster %s: %s; through the slot map", self.where, exc)
            return self._through_cluster(table, fields, counters)
        return values, script_reply

    def _through_cluster(
        self, table: str, fields: dict[int, list[bytes]], counters: list[Any]
    ) -> tuple[dict[int, list[Any]], list[Any]]:
        values = {
            shard: self.client.execute_command("HMGET", self.prefixes[shard] + table, *names, **RAW)
            for shard, names in fields.items()
        }
        return values, self.lua.run("count_lookup", self.prefix, counters)


class ShardedRedisStore(StoreCore):
    """The `Store` protocol over N one-slot `RedisMetadataStore` shards (module doc).

    Args: as `RedisMetadataStore`'s, and `shards`, the number of shards (the URL's
    `?shards=N`; fixed when the store is made).
    """

    lookup_does_io = True

    def __init__(
        self,
        target: MetadataUrl,
        *,
        shards: int,
        timeout_s: float = 2.0,
        token: str | None = None,
        ca_file: str | None = None,
        lease_s: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        pending_timeout_s: float = 120.0,
        policy: StorePolicy | None = None,
        prefix: str = PREFIX,
        read_only: bool = False,
    ) -> None:
        if shards < 2:
            raise InvalidRequest(f"a sharded store has at least 2 shards, got {shards}")
        self._init_core(
            target.url,
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            pending_timeout_s=pending_timeout_s,
            policy=policy,
        )
        self.shards = shards
        self.prefix = prefix
        self._redis = redis_client(target, timeout_s=timeout_s, token=token, ca_file=ca_file)
        made = check_shards(  # before a shard's open migrates anything
            StoreAccess(
                self.url,
                self._redis,
                lambda *parts: prefix + ":".join(str(p) for p in parts),
                lambda fn: call(fn, self.url, idempotent=True),
                lambda name, args: None,
            ),
            shards,
        )
        each = _shard_policy(self.policy, shards)
        lua = StoreLua(self._redis, self.url)  # one for every shard: one client
        self._parts = [
            RedisMetadataStore(
                target,
                lease_s=lease_s,
                high_watermark=high_watermark,
                low_watermark=low_watermark,
                pending_timeout_s=self.pending_timeout_s,
                policy=each,
                prefix=shard_prefix(prefix, s, shards),
                shard=(s, shards),
                client=self._redis,
                lua=lua,
                puncher=ShardPuncher(self.policy.storage_root, s, shards),
                read_only=read_only,
            )
            for s in range(shards)
        ]
        first = self._parts[0]
        self._lookups = ShardedLookups(
            self._redis,
            [part.prefix for part in self._parts],
            self.url,
            first._lua,
            first._hits,
            self.shard_of,
        )
        try:
            if read_only:  # an admin view: the next writable open records a capacity
                return
            if made:  # a store made sharded just now: a capacity recorded before is the whole
                whole = self._parts[0]._capacity_held()[0]
                if whole is not None:
                    self._set_capacity(whole)
            recorded, held = self._capacity_held()
            if recorded is None:
                self._default_capacity(held)
        except MetadataUnavailable as exc:  # connecting is lazy: a call will say so again
            logger.debug("Redis store %s: not reachable at open: %s", self.url, exc)

    # --- placement -----------------------------------------------------------------------

    def shard_of(self, key: str) -> int:
        """The shard that holds a block key."""
        return zlib.crc32(key.encode()) % self.shards

    def _by_shard(self, keys: Sequence[str]) -> dict[int, list[int]]:
        """Positions of `keys` per shard, in order."""
        out: dict[int, list[int]] = {}
        for index, key in enumerate(keys):
            out.setdefault(self.shard_of(key), []).append(index)
        return out

    def _global(self, page: int, shard: int) -> int:
        return page * self.shards + shard

    def _local(self, key: str, page: int) -> tuple[int, int] | None:
        """(shard, the shard's page) of a key's page; None when that page cannot be the
        key's (another shard's page: no entry of that key holds it)."""
        shard = self.shard_of(key)
        if page % self.shards != shard:
            return None
        return shard, page // self.shards

    # --- namespaces ----------------------------------------------------------------------

    def _register_namespace(
        self, namespace: str, manifest: dict[str, Any], num_ranks: int
    ) -> NamespaceInfo:
        for part in self._parts:
            part._register_namespace(namespace, manifest, num_ranks)
        return self._get_namespace(namespace)

    def _register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        if rank_file.num_pages < self.shards:
            raise InvalidRequest(
                f"rank {rank_file.rank}: a file of {rank_file.num_pages} pages cannot be "
                f"split over {self.shards} shards"
            )
        for s, part in enumerate(self._parts):
            pages = shard_pages(rank_file.num_pages, s, self.shards)
            part._register_rank(namespace, rank_file.model_copy(update={"num_pages": pages}))
        return self._get_namespace(namespace)

    def _merged_info(self, infos: list[NamespaceInfo]) -> NamespaceInfo:
        """One namespace as the store has it: shard 0's record, each rank file's pages
        summed over the shards."""
        pages: dict[int, int] = {}
        for info in infos:
            for rf in info.rank_files:
                pages[rf.rank] = pages.get(rf.rank, 0) + rf.num_pages
        files = [rf.model_copy(update={"num_pages": pages[rf.rank]}) for rf in infos[0].rank_files]
        return infos[0].model_copy(update={"rank_files": files})

    def _get_namespace(self, namespace: str) -> NamespaceInfo:
        return self._merged_info([part._get_namespace(namespace) for part in self._parts])

    def namespaces(self) -> list[NamespaceInfo]:
        """Every registered namespace, oldest first."""
        per_shard = [{info.id: info for info in part.namespaces()} for part in self._parts]
        return [
            self._merged_info([found[ns.id] for found in per_shard if ns.id in found])
            for ns in per_shard[0].values()
        ]

    # --- data path -----------------------------------------------------------------------

    def _lookup(self, namespace: str, keys: Sequence[str]) -> int:
        return self._lookups.lookup(namespace, keys)

    def _scripts(
        self, name: str, calls: dict[int, list[Any]], *, idempotent: bool
    ) -> dict[int, Any]:
        """Script `name` on each shard of `calls` (shard → its arguments): one pipeline
        per master, on that master's own connection (redis-py's cluster pipelines refuse
        scripts); a shard whose slot moved, or whose master lacks the script, did not run
        it and is asked again through the cluster client (which follows the slot map and
        loads scripts). Shards are atomic each, not together."""
        if len(calls) == 1:
            ((shard, args),) = calls.items()
            return {shard: self._parts[shard]._run(name, args, idempotent=idempotent)}
        lua = self._parts[0]._lua
        redirected = (rex.MovedError, rex.AskError, rex.TryAgainError)

        def run() -> dict[int, Any]:
            groups, again = by_master(self._redis, [part.prefix for part in self._parts], calls)
            replies: dict[int, Any] = {}
            for connection, shards in groups.values():
                pipe = connection.pipeline(transaction=False)
                for shard in shards:
                    lua.queue(pipe, name, self._parts[shard].prefix, calls[shard])
                try:
                    answers = pipe.execute(raise_on_error=False)
                except (rex.ConnectionError, rex.TimeoutError):
                    self._refresh_slot_map()  # a master lost: the next call finds its successor
                    raise
                for shard, reply in zip(shards, answers, strict=True):
                    if isinstance(reply, redirected) or lua.missing(reply):
                        again.append(shard)
                    elif isinstance(reply, Exception):
                        raise reply
                    else:
                        replies[shard] = reply
            for shard in again:
                replies[shard] = lua.run(name, self._parts[shard].prefix, calls[shard])
            return replies

        return call(run, self.url, idempotent=idempotent)

    def _refresh_slot_map(self) -> None:
        """Ask the cluster for its slot map again (the pipelines above go to the masters
        the cached map names; the cluster client refreshes only its own calls' map)."""
        try:
            self._redis.nodes_manager.initialize()
        except (rex.RedisError, OSError) as exc:  # still failing over: the next call asks
            logger.debug("Redis Cluster %s: slot map not refreshed: %s", self.url, exc)

    def _locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        if not keys:
            return self._parts[0]._locate(namespace, rank, keys)
        out: list[Location | None] = [None] * len(keys)
        positions = self._by_shard(keys)
        mine = {shard: [keys[i] for i in where] for shard, where in positions.items()}
        calls = {
            shard: self._parts[shard]._locate_args(namespace, rank, asked)
            for shard, asked in mine.items()
        }
        for shard, flat in self._scripts("locate", calls, idempotent=True).items():
            found = self._parts[shard]._locate_answer(mine[shard], flat)
            for index, location in zip(positions[shard], found, strict=True):
                if location is not None:
                    page = self._global(location.page, shard)
                    out[index] = location.model_copy(update={"page": page})
        return out

    def _allocate_once(
        self, namespace: str, rank: int, keys: list[str], depth_of: dict[str, int]
    ) -> Attempt:
        calls = {
            shard: self._parts[shard]._allocate_args(
                namespace, rank, [keys[i] for i in where], depth_of
            )
            for shard, where in self._by_shard(keys).items()
        }
        granted: list[tuple[str, int]] = []
        existing: list[str] = []
        no_space: list[str] = []
        marks: list[GiveBack] = []
        for shard, reply in self._scripts("allocate", calls, idempotent=False).items():
            got, known, full, marked = self._parts[shard]._allocate_answer(reply)
            granted += [(key, self._global(page, shard)) for key, page in got]
            existing += known
            no_space += full
            marks += [
                (ns, r, path, slot, [self._global(p, shard) for p in pages])
                for ns, r, path, slot, pages in marked
            ]
        order = {key: index for index, key in enumerate(keys)}  # the call's order, as one slot's
        granted.sort(key=lambda grant: order[grant[0]])
        existing.sort(key=order.__getitem__)
        no_space.sort(key=order.__getitem__)
        return granted, existing, no_space, marks

    def _give_back(self, marked: Sequence[GiveBack]) -> None:
        """Hand each shard the marks of its pages (they name the files' pages here)."""
        per_shard: dict[int, list[GiveBack]] = {}
        for ns, r, path, slot, pages in marked:
            mine: dict[int, list[int]] = {}
            for page in pages:
                mine.setdefault(page % self.shards, []).append(page // self.shards)
            for shard, local in mine.items():
                per_shard.setdefault(shard, []).append((ns, r, path, slot, local))
        for shard, items in per_shard.items():
            self._parts[shard]._give_back(items)

    def _giving_back_elsewhere(self) -> bool:
        return any(part._giving_back_elsewhere() for part in self._parts)

    def _pairs(self, pairs: Sequence[Any]) -> dict[int, list[Any]]:
        """Items with a key and a page of this store, per shard, with the shard's page;
        an item whose page is not its key's shard's is left out (it matches no entry)."""
        out: dict[int, list[Any]] = {}
        for item in pairs:
            placed = self._local(item.key, item.page)
            if placed is not None:
                shard, page = placed
                out.setdefault(shard, []).append(item.model_copy(update={"page": page}))
        return out

    def _commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        calls = {
            shard: self._parts[shard]._commit_args(namespace, rank, mine)
            for shard, mine in self._pairs(items).items()
        }
        return sum(int(n) for n in self._scripts("commit", calls, idempotent=False).values())

    def _release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        return sum(
            self._parts[shard]._release(namespace, rank, mine)
            for shard, mine in self._pairs(allocations).items()
        )

    def _invalidate(self, namespace: str, rank: int, triples: list[tuple[str, int, str]]) -> int:
        per_shard: dict[int, list[tuple[str, int, str]]] = {}
        for key, page, checksum in triples:
            placed = self._local(key, page)
            if placed is not None:
                per_shard.setdefault(placed[0], []).append((key, placed[1], checksum))
        return sum(
            self._parts[shard]._invalidate(namespace, rank, mine)
            for shard, mine in per_shard.items()
        )

    def _admit(self, namespace: str, keys: list[str], after_hits: int) -> list[bool]:
        out = [False] * len(keys)
        for shard, where in self._by_shard(keys).items():
            answers = self._parts[shard]._admit(namespace, [keys[i] for i in where], after_hits)
            for index, answer in zip(where, answers, strict=True):
                out[index] = answer
        return out

    # --- admin ---------------------------------------------------------------------------

    def _evict(self, request: EvictRequest) -> EvictResult:
        """Each shard evicts by the same criteria, its own least recently used first;
        `max_entries` is split evenly, and what a shard could not take is asked of the
        others in turn (a dry run asks a shard again for its share and the rest, and
        counts that answer instead of the first: nothing was taken)."""
        results: dict[int, list[EvictResult]] = {}
        if request.max_entries is None:
            for s, part in enumerate(self._parts):
                results[s] = [part._evict(request)]
        else:
            short = 0
            for s, part in enumerate(self._parts):
                share = split(request.max_entries, s, self.shards)
                if share:
                    mine = request.model_copy(update={"max_entries": share})
                    results[s] = [part._evict(mine)]
                    short += share - results[s][0].keys
            for s, part in enumerate(self._parts):
                if short <= 0:
                    break
                before = sum(r.keys for r in results.get(s, []))
                asked = short + (before if request.dry_run else 0)
                result = part._evict(request.model_copy(update={"max_entries": asked}))
                if request.dry_run:
                    results[s] = [result]
                    short -= result.keys - before
                else:
                    results.setdefault(s, []).append(result)
                    short -= result.keys
        done = [r for rs in results.values() for r in rs]
        by_namespace: dict[str, int] = {}
        for result in done:
            for ns, count in result.by_namespace.items():
                by_namespace[ns] = by_namespace.get(ns, 0) + count
        return EvictResult(
            keys=sum(r.keys for r in done),
            pages=sum(r.pages for r in done),
            bytes=sum(r.bytes for r in done),
            dry_run=request.dry_run,
            by_namespace=by_namespace,
        )

    def stats(self) -> StoreStats:
        """Usage and traffic of every namespace and of the whole store, summed over the
        shards."""
        per_shard = [part.stats() for part in self._parts]
        merged: dict[str, NamespaceStats] = {}
        for stats in per_shard:
            for ns in stats.namespaces:
                merged[ns.id] = ns if ns.id not in merged else _add(merged[ns.id], ns)
        capacity = _sum_or_none(s.capacity_bytes for s in per_shard)
        max_pinned = _sum_or_none(s.max_pinned_bytes for s in per_shard)
        return StoreStats.summed(list(merged.values()), capacity, max_pinned)

    def _list_entries(self, namespace: str | None, limit: int, offset: int) -> list[EntryInfo]:
        """Most recently used first across the shards (each shard's first
        `offset + limit`, merged)."""
        rows: list[EntryInfo] = []
        for s, part in enumerate(self._parts):
            for entry in part._list_entries(namespace, offset + limit, 0):
                rows.append(entry.model_copy(update={"page": self._global(entry.page, s)}))
        rows.sort(key=lambda e: (-e.last_access, e.depth, e.key, e.rank))  # each shard's order
        return rows[offset : offset + limit]

    def _capacity_held(self) -> tuple[int | None, int]:
        each = [part._capacity_held() for part in self._parts]
        return _sum_or_none(cap for cap, _ in each), sum(held for _, held in each)

    def _set_capacity(self, capacity_bytes: int) -> None:
        for s, part in enumerate(self._parts):
            part._set_capacity(split(capacity_bytes, s, self.shards))

    def _record_capacity_if_none(self, capacity_bytes: int) -> int | None:
        recorded = [
            part._record_capacity_if_none(split(capacity_bytes, s, self.shards))
            for s, part in enumerate(self._parts)
        ]
        return _sum_or_none(recorded)

    def _pin(self, namespace: str, keys: Sequence[str], ttl_s: float | None) -> PinResult:
        per_shard = self._by_shard(keys)
        pinned = stored = total = 0
        limit: int | None = 0
        for s, part in enumerate(self._parts):
            # every shard answers its pinned bytes (a shard without keys pins nothing)
            result = part._pin(namespace, [keys[i] for i in per_shard.get(s, [])], ttl_s)
            pinned, stored, total = (
                pinned + result.pinned,
                stored + result.stored,
                total + result.pinned_bytes,
            )
            limit = (
                None
                if limit is None or result.max_pinned_bytes is None
                else (limit + result.max_pinned_bytes)
            )
        return PinResult(pinned=pinned, stored=stored, pinned_bytes=total, max_pinned_bytes=limit)

    def _unpin(self, namespace: str, keys: Sequence[str] | None) -> int:
        if keys is None:
            return sum(part._unpin(namespace, None) for part in self._parts)
        return sum(
            self._parts[shard]._unpin(namespace, [keys[i] for i in where])
            for shard, where in self._by_shard(keys).items()
        )

    def _list_pins(self, namespace: str | None, limit: int) -> list[PinInfo]:
        pins = [pin for part in self._parts for pin in part._list_pins(namespace, limit)]
        pins.sort(key=lambda p: (-p.created, p.namespace, p.key))
        return pins[:limit]

    def _drop_namespaces(self, namespace_ids: list[str], dry_run: bool) -> DropNamespacesResult:
        """Drop in every shard, or in none: a namespace that some shard is writing is
        skipped everywhere (asked first with a dry run; a save that starts between the
        two passes is dropped with the namespace, as on one slot after the check)."""
        for ns in namespace_ids:  # all or none: an unknown one drops nothing
            self._get_namespace(ns)
        merged: dict[str, DroppedNamespace] = {}
        for part in self._parts:
            for item in part._drop_namespaces(namespace_ids, True).namespaces:
                merged[item.id] = _add_dropped(merged.get(item.id), item)
        if not dry_run:
            free = [ns for ns in namespace_ids if merged[ns].skipped is None]
            done: dict[str, DroppedNamespace] = {}
            for part in self._parts:
                for item in part._drop_namespaces(free, False).namespaces if free else []:
                    done[item.id] = _add_dropped(done.get(item.id), item)
            merged.update(done)
        return DropNamespacesResult(
            namespaces=[merged[ns] for ns in namespace_ids], dry_run=dry_run
        )

    def _record_writer(self, namespace: str, writer: WriterInfo) -> None:
        self._parts[0]._record_writer(namespace, writer)

    def _writers(self, namespace: str | None) -> dict[str, list[WriterInfo]]:
        return self._parts[0]._writers(namespace)

    def _changes(self, since: int, namespace: str | None, limit: int) -> ChangeLog:
        """Every shard's log after its position in cursor `since` (-1: their ends); the
        answer's `next_seq` is a new cursor id (or `since` when nothing moved)."""
        first = self._parts[0]
        missed = False
        if since <= 0:  # -1: every shard's end; 0: every shard's start
            positions = [since] * self.shards
        else:
            raw = first._read(lambda: self._redis.hget(first._key("cursors"), since))
            missed = raw is None  # an unknown or expired cursor: start at the ends
            positions = (
                [int(p) for p in str(raw).split(",")] if raw is not None else [-1] * self.shards
            )
        changes: list[Change] = []
        ends: list[int] = []
        for s, part in enumerate(self._parts):
            left = limit - len(changes)
            if left <= 0:  # the limit is reached: this shard's position stays
                ends.append(positions[s])
                continue
            log = part._changes(positions[s], namespace, left)
            missed = missed or log.missed
            changes += [
                change.model_copy(update={"seq": change.seq * self.shards + s})
                for change in log.changes
            ]
            ends.append(log.next_seq)
        if since > 0 and ends == positions:
            return ChangeLog(changes=changes, next_seq=since, missed=missed)
        cursor = int(first._read(lambda: self._redis.incr(first._key("cursor_id"))))
        text = ",".join(map(str, ends))

        def record() -> None:
            pipe = self._redis.pipeline(transaction=False)  # one slot: shard 0's
            pipe.hset(first._key("cursors"), cursor, text)
            pipe.hdel(first._key("cursors"), cursor - CURSORS_KEPT)
            pipe.execute()

        first._read(record)
        return ChangeLog(changes=changes, next_seq=cursor, missed=missed)

    def health(self) -> dict[str, Any]:
        """Every shard answers; raises `MetadataUnavailable` when one does not."""
        answers = [part.health() for part in self._parts]
        return {**answers[0], "shards": self.shards}

    def replication(self) -> dict[str, Any]:
        """Shard 0's master as `RedisMetadataStore.replication` says, the shard count, how
        many masters hold the shards and how many the cluster has (`doctor` warns when
        the shards use fewer masters than they could)."""
        holding = {self._redis.get_node_from_key(part.prefix).name for part in self._parts}
        return {
            **self._parts[0].replication(),
            "shards": self.shards,
            "masters": len(holding),
            "cluster_masters": len(self._redis.get_primaries()),
        }

    def maxmemory_policy(self) -> str | None:
        """Shard 0's master's `maxmemory-policy`."""
        return self._parts[0].maxmemory_policy()

    def check_invariants(self) -> list[str]:
        """Every shard's violated invariants, each line naming its shard."""
        return [
            f"shard {s}: {line}"
            for s, part in enumerate(self._parts)
            for line in part.check_invariants()
        ]

    def flush(self) -> None:
        """Count the hits of this process's last lookups now."""
        for part in self._parts:
            part.flush()

    def close(self) -> None:
        """Count pending lookup hits, then release the connections."""
        for part in self._parts:
            part.close()
        self._redis.close()


def _sum_or_none(values: Any) -> int | None:
    """The sum, or None when any part is None (unbounded)."""
    total = 0
    for value in values:
        if value is None:
            return None
        total += value
    return total


_SUMMED = (
    "keys", "pages_used", "bytes_live", "bytes_used", "pinned_keys", "pinned_bytes", "hits",
    "lookups", "lookup_keys", "hit_keys", "admission_skipped", "expiring_keys", "expired_keys",
)  # fmt: skip


def _add_dropped(before: DroppedNamespace | None, item: DroppedNamespace) -> DroppedNamespace:
    """Two shards' parts of one dropped namespace, added."""
    if before is None:
        return item
    return before.model_copy(
        update={
            "keys": before.keys + item.keys,
            "bytes": before.bytes + item.bytes,
            "skipped": before.skipped or item.skipped,
        }
    )


def _add(a: NamespaceStats, b: NamespaceStats) -> NamespaceStats:
    """Two shards' figures of one namespace, added."""
    update: dict[str, Any] = {name: getattr(a, name) + getattr(b, name) for name in _SUMMED}
    update["quota_bytes"] = (
        None if a.quota_bytes is None or b.quota_bytes is None else a.quota_bytes + b.quota_bytes
    )
    newest = [t for t in (a.last_access, b.last_access) if t is not None]
    update["last_access"] = max(newest) if newest else None
    update["last_used"] = max(a.last_used, b.last_used)
    evicted = {reason: list(v) for reason, v in a.evicted.items()}
    for reason, (count, size) in b.evicted.items():
        old = evicted.get(reason, [0, 0])
        evicted[reason] = [old[0] + count, old[1] + size]
    update["evicted"] = evicted
    return a.model_copy(update=update)


__all__ = ["ShardedRedisStore", "shard_prefix"]
