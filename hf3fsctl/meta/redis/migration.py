"""The Redis store's format (`info.format`): recorded by the first process that opens an
empty store, older formats migrated on open, newer ones refused.

- Format 1 → 2 (`lua/migrate_lru.lua`): LRU members gain the depth, so equally old keys
  go deepest first.
- Format 2 → 3 (`lua/migrate_format3.lua`): keys as bytes, 58-byte entries, LRU members
  with a 2-byte depth, no `c:NS` for one-rank namespaces, the change log's runs
  length-prefixed (`codec.py`).
- Format 3 → 4 (`lua/migrate_format4.lua`): the LRU in generations (`lua/common.lua`,
  `lru_touch`): entries rewritten with their key's generation (page and size in 4 bytes,
  depth and hits in 3), `c:NS` values with it, `lru:NS` replaced by generations filled in
  its order.
- Format 4 → 5 (`lua/migrate_format5.lua`): the pending and free sets scored in whole µs
  since 2025-01-01 instead of seconds with six decimals (integer scores are what a small
  sorted set's listpack inserts cheaply), the same times.

Each step is one atomic script per namespace (and one for the change log) that records
what it finished in a set, so a process that dies midway leaves the old format recorded
and the next open migrates only the rest; the new format is recorded once all are done.
A process of the older release must not write the store meanwhile (as for any upgrade:
stop the old ones first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hf3fsctl.errors import MetadataUnavailable, StoreFormatError

logger = logging.getLogger(__name__)

# The Redis store's key layout (hf3fsctl/meta/redis/__init__.py), as `info.format`.
FORMAT = 5
MIGRATABLE = (1, 2, 3, 4)


@dataclass(frozen=True)
class StoreAccess:
    """What a migration needs of the store: its URL (redacted), client, key names, and
    its read and script calls (errors typed, as the store's own)."""

    url: str
    redis: Any
    key: Callable[..., str]
    read: Callable[[Callable[[], Any]], Any]
    run: Callable[[str, Sequence[Any]], Any]


def check_format(store: StoreAccess) -> None:
    """Record `FORMAT` in an empty store; migrate an older one; refuse a newer one.

    A Redis that cannot be reached now is left to the calls (opening stays lazy, as for
    the other clients); the next process that opens it checks.

    Raises:
        StoreFormatError: the store records a format this release neither reads nor
            migrates (newer: upgrade hf3fsctl).
    """
    redis = store.redis
    info = store.key("info")
    try:
        store.read(lambda: redis.hsetnx(info, "format", FORMAT))
        raw = store.read(lambda: redis.hget(info, "format"))
    except MetadataUnavailable as exc:
        logger.debug("Redis store %s: format not checked: %s", store.url, exc)
        return
    stored = int(raw) if raw is not None else FORMAT
    if stored == FORMAT:
        return
    if stored in MIGRATABLE:
        if stored == 1:
            _migrate(store, "migrate_lru", "migrated_lru", "LRU index rebuilt", 2)
        if stored <= 2:
            _migrate(store, "migrate_format3", "migrated_3", "keys and entries packed", 3)
        if stored <= 3:
            _migrate(store, "migrate_format4", "migrated_4", "LRU moved to generations", 4)
        _migrate(store, "migrate_format5", "migrated_5", "pending and free sets in µs", 5)
        return
    newer = stored > FORMAT
    raise StoreFormatError(
        f"Redis metadata store {store.url} is in format {stored}; this hf3fsctl reads "
        f"format {FORMAT}",
        hint="upgrade hf3fsctl on this node to the release that wrote the store"
        if newer
        else "no migration exists for this Redis format: evict the store's keys "
        "(`hf3fsctl evict --all`) with the hf3fsctl that wrote it, or use a new "
        "Redis database",
        stored=stored,
        supported=FORMAT,
    )


def check_shards(store: StoreAccess, shards: int) -> bool:
    """Record `shards` (`info.shards` of shard 0, the store's first prefix) in a new store;
    refuse a store split into another number of shards (its keys and pages are placed
    by that number: `sharded.py`). A store without the field is one shard. Returns
    whether this call recorded it (the store was made sharded now).

    Raises:
        ConfigError: naming `metadata.url`, with the number the store was made with.
    """
    redis = store.redis
    info = store.key("info")
    made = False
    try:
        if shards > 1:
            fresh = store.read(lambda: redis.zcard(store.key("namespaces"))) == 0
            if fresh:
                made = bool(store.read(lambda: redis.hsetnx(info, "shards", shards)))
        raw = store.read(lambda: redis.hget(info, "shards"))
    except MetadataUnavailable as exc:
        logger.debug("Redis store %s: shards not checked: %s", store.url, exc)
        return False
    recorded = int(raw) if raw is not None else 1
    if recorded != shards:
        from hf3fsctl.errors import ConfigError

        raise ConfigError(
            f"metadata.url: the Redis store at {store.url} was made with {recorded} "
            f"shard{'s' if recorded != 1 else ''}, the URL asks for {shards}",
            hint=(
                f"use ?shards={recorded} in the URL (a store's shard count is fixed when it "
                "is made; a new count needs a new store: another prefix or database)"
                if recorded > 1
                else "drop ?shards= from the URL (a store's shard count is fixed when it is "
                "made; a sharded store needs a new, empty one)"
            ),
        )
    return made


def _migrate(store: StoreAccess, script: str, done: str, what: str, to: int) -> None:
    """Run `script` on every namespace (then, for format 3, on the change log: `''`),
    record format `to`, drop the done-set."""
    redis = store.redis
    namespaces = store.read(lambda: list(redis.zrange(store.key("namespaces"), 0, -1)))
    targets = [*namespaces, ""] if to == 3 else namespaces
    for ns in targets:
        moved = store.run(script, [ns])
        logger.info("Redis store %s: %s: %s (%s)", store.url, ns or "change log", what, moved)
    store.read(lambda: redis.hset(store.key("info"), "format", to))
    store.read(lambda: redis.delete(store.key(done)))
