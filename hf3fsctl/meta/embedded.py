"""`EmbeddedMetadataClient`: the `MetadataClient` for `sqlite:///PATH` URLs.

A thin wrapper over `MetadataStore` in this process: no server, and the scheduler and
workers of one node share the database file safely (WAL, `BEGIN IMMEDIATE`). A call
that cannot get the database within `timeout_s` (another process holds the write lock)
raises `MetadataUnavailable`, like a slow server would.

Lookup counters wait in the store's memory for a write, a lookup a second later, or
`close`. A process that only looks up (the connector's scheduler side) and exits
without `close` would lose them, where a server counts every lookup it answers; so the
client also flushes them when it is collected and when its process exits (a plain
interpreter exit, or the end of a multiprocessing child such as vLLM's EngineCore).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from multiprocessing import util as mp_util
from typing import Any

from hf3fsctl.config import MetadataUrl
from hf3fsctl.errors import ConfigError
from hf3fsctl.meta.models import (
    AllocateResult,
    Allocation,
    CapacityInfo,
    ChangeLog,
    CommitItem,
    DropNamespacesResult,
    EntryInfo,
    EvictRequest,
    EvictResult,
    InvalidateItem,
    Location,
    NamespaceInfo,
    PinInfo,
    PinResult,
    RankFile,
    StoreStats,
)
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite.store import MetadataStore

logger = logging.getLogger(__name__)


def _flush_counters(store: MetadataStore) -> None:
    """Write a store's pending lookup counters (at exit or collection; never raises)."""
    try:
        store.flush()
    except Exception as exc:  # exiting or collecting: report what is lost, never raise
        logger.warning("metadata store %s: lookup counters not flushed (%s)", store.path, exc)


class EmbeddedMetadataClient:
    """The metadata store in this process, behind the `MetadataClient` protocol.

    Args:
        url: `sqlite:///ABSOLUTE/PATH.db` (`sqlite:////ABSOLUTE/PATH.db` works too).
        timeout_s: how long a call waits for another writer before `MetadataUnavailable`.
        lease_s: read-lease length of `locate`.
        high_watermark: allocate evicts above this usage…
        low_watermark: … down to this one.
        policy: capacity, pins, quotas and the storage root (`StorePolicy`).
        read_only: read the store only (`MetadataStore`'s `read_only`).
    """

    def __init__(
        self,
        url: str | MetadataUrl,
        *,
        timeout_s: float = 2.0,
        lease_s: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        policy: StorePolicy | None = None,
        read_only: bool = False,
    ) -> None:
        target = url if isinstance(url, MetadataUrl) else MetadataUrl.parse(url)
        if not target.embedded or target.path is None:
            raise ConfigError(f"metadata.url: {target.url!r} is not sqlite:///PATH")
        self.url = target.url
        self.store = MetadataStore(
            target.path,
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            busy_timeout_s=timeout_s,
            policy=policy,
            read_only=read_only,
        )
        # Flushes when the client is collected or its process exits, unless `close` (which
        # flushes itself) cancelled it first. multiprocessing's Finalize rather than
        # atexit: a process started by multiprocessing (vLLM's EngineCore, forked by
        # default) ends with os._exit and runs only these; a forked copy of the client is
        # skipped (it runs in the process that made it).
        self._flush_at_exit = mp_util.Finalize(self, _flush_counters, (self.store,), exitpriority=0)

    def register_namespace(self, namespace: str, manifest: dict[str, Any]) -> NamespaceInfo:
        """Create a namespace, or return it if identical; `NamespaceConflict` if not."""
        return self.store.register_namespace(namespace, manifest)

    def register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        """Record one rank's page file; `NamespaceConflict` if it differs from before."""
        return self.store.register_rank(namespace, rank_file)

    def get_namespace(self, namespace: str) -> NamespaceInfo:
        """One namespace; `NotFound` if absent."""
        return self.store.get_namespace(namespace)

    def namespaces(self) -> list[NamespaceInfo]:
        """Every registered namespace."""
        return self.store.namespaces()

    def lookup(self, namespace: str, keys: Sequence[str]) -> int:
        """Number of leading `keys` committed on every rank of the namespace."""
        return self.store.lookup(namespace, keys)

    def locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        """Where each key's page is on `rank` (None if absent), with a read lease."""
        return self.store.locate(namespace, rank, keys)

    def allocate(
        self, namespace: str, rank: int, keys: Sequence[str], first_depth: int = 0
    ) -> AllocateResult:
        """Pages for keys not yet stored on `rank`."""
        return self.store.allocate(namespace, rank, keys, first_depth)

    def commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        """Commit written pages; returns how many were committed."""
        return self.store.commit(namespace, rank, items)

    def release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        """Give back pending allocations; returns how many were released."""
        return self.store.release(namespace, rank, allocations)

    def invalidate(
        self,
        namespace: str,
        rank: int,
        items: Sequence[Location | InvalidateItem | tuple[str, int, str]],
    ) -> int:
        """Drop keys whose page on `rank` was found corrupt; returns how many were dropped."""
        return self.store.invalidate(namespace, rank, items)

    def evict(self, request: EvictRequest) -> EvictResult:
        """Evict entries by the request's criteria."""
        return self.store.evict(request)

    def stats(self) -> StoreStats:
        """Usage and traffic of the store."""
        return self.store.stats()

    def list_entries(
        self, namespace: str | None = None, limit: int = 100, offset: int = 0
    ) -> list[EntryInfo]:
        """Entries, most recently used first."""
        return self.store.list_entries(namespace, limit, offset)

    def capacity(self) -> CapacityInfo:
        """The store's recorded capacity and what its page files hold."""
        return self.store.capacity()

    def set_capacity(self, capacity_bytes: int) -> CapacityInfo:
        """Record the store's capacity."""
        return self.store.set_capacity(capacity_bytes)

    def pin(self, namespace: str, keys: Sequence[str], ttl_s: float | None = None) -> PinResult:
        """Keep keys out of LRU eviction; `InvalidRequest` past `storage.max_pinned`."""
        return self.store.pin(namespace, keys, ttl_s)

    def unpin(self, namespace: str, keys: Sequence[str] | None = None) -> int:
        """Drop pins (all of the namespace's when `keys` is None); returns how many."""
        return self.store.unpin(namespace, keys)

    def list_pins(self, namespace: str | None = None, limit: int = 1000) -> list[PinInfo]:
        """Live pins, newest first."""
        return self.store.list_pins(namespace, limit)

    def drop_namespaces(
        self, namespace_ids: Sequence[str], *, dry_run: bool = False
    ) -> DropNamespacesResult:
        """Remove namespaces' metadata (the caller removes their page files)."""
        return self.store.drop_namespaces(namespace_ids, dry_run=dry_run)

    def changes(self, since: int, namespace: str | None = None, limit: int = 10_000) -> ChangeLog:
        """The change log after `since` (-1: its end)."""
        return self.store.changes(since, namespace, limit)

    def health(self) -> dict[str, Any]:
        """A cheap liveness check of the database."""
        return self.store.health()

    def close(self) -> None:
        """Flush counters and close the database connections."""
        self._flush_at_exit.cancel()
        self.store.close()
