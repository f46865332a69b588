"""The Redis store's `lookup`: one pipelined round trip, the hot read native (no Lua).

The pipeline is a native `HMGET` of the keys and the `count_lookup` script, which counts
the lookup and answers the namespace's ranks (`NotFound` if none) and Redis's time in
ms. Passing 1,000 keys through a script would cost Redis ~4x more. What the `HMGET`
reads depends on the namespace's ranks (fixed by its manifest, so remembered per
namespace; the first lookup of a namespace in a process reads them first):

- one rank: `e:NS:0`, the entries themselves (no `c:NS` then): a key
  counts when its entry is committed and unexpired (`codec.entry_counts`: the flags and
  the expiry, at fixed offsets);
- more: `c:NS`, "RANKS GEN" or "RANKS GEN EXPIRY_MS" per key (`codec.committed_counts`).

Keys count up to the first that does not. A lookup's hits are counted with this
process's next lookup, or at `flush` / `close` / exit (`lookup_hits.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis.exceptions as rex
from redis.client import NEVER_DECODE

from hf3fsctl.errors import NotFound
from hf3fsctl.meta.redis.codec import FOREVER, committed_counts, encode_key, entry_counts
from hf3fsctl.meta.redis.connection import call

if TYPE_CHECKING:
    from hf3fsctl.meta.redis.connection import StoreLua
    from hf3fsctl.meta.redis.lookup_hits import LookupHits

logger = logging.getLogger(__name__)

# The `HMGET`'s values as bytes (redis-py's option): decoding 1,000 binary entries to text
# would cost the client more than the rest of the lookup.
RAW = {NEVER_DECODE: True}


def leading(values: Sequence[Any], ranks: int, now_ms: float) -> int:
    """How many leading `HMGET` values count: one rank's entries (committed and
    unexpired), or more ranks' `c:NS` values (committed on every rank, unexpired)."""
    found = 0
    if ranks == 1:
        for value in values:
            # a committed entry without expiry, else the entry's flags and expiry
            if value is None or (value[:8] != FOREVER and not entry_counts(value, now_ms)):
                break
            found += 1
    else:
        for value in values:
            if not committed_counts(value, ranks, now_ms):
                break
            found += 1
    return found


class Lookups:
    """The store's lookups: its client, the `count_lookup` script, the hits not yet
    counted, and each namespace's ranks once read."""

    def __init__(
        self, client: Any, prefix: str, where: str, cluster: bool, lua: StoreLua, hits: LookupHits
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.where = where
        self.cluster = cluster
        self.lua = lua
        self.hits = hits
        self.ranks: dict[str, int] = {}  # namespace → its ranks (fixed by its manifest)

    def lookup(self, namespace: str, keys: Sequence[str]) -> int:
        """How many leading `keys` are committed on every rank and unexpired."""
        ranks = self.ranks.get(namespace)
        if ranks is None:
            ranks = self._num_ranks(namespace)
        found, answered = self._lookup(namespace, keys, ranks)
        if answered != ranks:  # dropped and registered again with other ranks: ask again
            self.ranks[namespace] = answered
            found, answered = self._lookup(namespace, keys, answered)
        return found

    def _num_ranks(self, namespace: str) -> int:
        key = f"{self.prefix}ns:{namespace}"
        value = call(lambda: self.client.hget(key, "num_ranks"), self.where, idempotent=True)
        if value is None:
            raise NotFound(f"namespace {namespace} is not registered")
        self.ranks[namespace] = int(value)
        return int(value)

    def _lookup(self, namespace: str, keys: Sequence[str], ranks: int) -> tuple[int, int]:
        """(leading keys that count, the namespace's ranks as the counter script answered):
        one `_ask`, this process's pending hits counted with it."""
        pending = self.hits.take()
        counters: list[Any] = [namespace, len(keys)]
        for ns, hits in pending.items():
            counters += [ns, hits]

        def run() -> tuple[int, int]:
            try:
                return self._ask(namespace, keys, ranks, counters)
            except rex.ResponseError as exc:
                if not self.lua.missing(exc):
                    raise
            # a server without the counter (new, or after a failover): once through `run`,
            # which loads it (or finds the server runs no functions), then ask again
            self.lua.run("count_lookup", self.prefix, ["", 0])
            return self._ask(namespace, keys, ranks, counters)

        try:
            found, answered = call(run, self.where, idempotent=True)
        except BaseException:
            self.hits.add(pending)  # not counted: keep them for the next lookup
            raise
        if found:
            self.hits.add({namespace: found})
        return found, answered

    def _ask(
        self, namespace: str, keys: Sequence[str], ranks: int, counters: list[Any]
    ) -> tuple[int, int]:
        """The round trip: the `HMGET` and the counter script, read."""
        read = f"{self.prefix}e:{namespace}:0" if ranks == 1 else f"{self.prefix}c:{namespace}"
        fromhex = bytes.fromhex  # `encode_key`, inlined for even keys: per key, per lookup
        fields = [fromhex(key) if not len(key) & 1 else encode_key(key) for key in keys]
        replies = self._pipeline(read, fields, counters)
        answered, now_ms = int(replies[-1][0]), float(replies[-1][1])
        found = leading(replies[0], ranks, now_ms) if keys and answered == ranks else 0
        return found, answered

    def _pipeline(self, read: str, fields: list[bytes], counters: list[Any]) -> list[Any]:
        if self.cluster:
            # redis-py's cluster pipelines refuse scripts: pipeline on the slot's master
            # itself; once the slot moved or that master is gone, two round trips through
            # the cluster client, which follows the slot map
            node = self.client.get_node_from_key(self.prefix)
            if node is not None and node.redis_connection is not None:
                try:
                    return self._pipelined(node.redis_connection, read, fields, counters)
                except (rex.ConnectionError, rex.MovedError, rex.AskError,
                        rex.ClusterDownError, rex.TryAgainError) as exc:  # fmt: skip
                    # (a timeout is not repeated: `call` says why)
                    logger.debug("Redis Cluster %s: %s; through the slot map", self.where, exc)
            head = [self.client.execute_command("HMGET", read, *fields, **RAW)] if fields else []
            return [*head, self.lua.run("count_lookup", self.prefix, counters)]
        return self._pipelined(self.client, read, fields, counters)

    def _pipelined(
        self, client: Any, read: str, fields: list[bytes], counters: list[Any]
    ) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        if fields:
            pipe.execute_command("HMGET", read, *fields, **RAW)
        self.lua.queue(pipe, "count_lookup", self.prefix, counters)
        # Errors come back as the exceptions themselves, not re-worded by the pipeline:
        # `translate` reads their kind as any other call's.
        replies = list(pipe.execute(raise_on_error=False))
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies
