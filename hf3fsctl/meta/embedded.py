"""`EmbeddedMetadataClient`: the `MetadataClient` for `sqlite:///PATH` URLs.

A thin wrapper over `MetadataStore` in this process: no server, and the scheduler and
workers of one node share the database file safely (WAL, `BEGIN IMMEDIATE`). A call
that cannot get the database within `timeout_s` (another process holds the write lock)
raises `MetadataUnavailable`, like a slow server would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf3fsctl.errors import ConfigError
from hf3fsctl.meta.models import (
    AllocateResult,
    Allocation,
    CommitItem,
    EntryInfo,
    EvictRequest,
    EvictResult,
    InvalidateItem,
    Location,
    NamespaceInfo,
    RankFile,
    StoreStats,
)
from hf3fsctl.meta.store import MetadataStore, sqlite_path

SCHEME = "sqlite:///"


class EmbeddedMetadataClient:
    """The metadata store in this process, behind the `MetadataClient` protocol.

    Args:
        url: `sqlite:///ABSOLUTE/PATH.db` (`sqlite:////ABSOLUTE/PATH.db` works too).
        timeout_s: how long a call waits for another writer before `MetadataUnavailable`.
        lease_s: read-lease length of `locate`.
        high_watermark: allocate evicts above this usage…
        low_watermark: … down to this one.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 2.0,
        lease_s: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
    ) -> None:
        if not url.startswith(SCHEME) or len(url) == len(SCHEME):
            raise ConfigError(f"metadata.url: {url!r} is not sqlite:///PATH")
        self.url = url
        self.store = MetadataStore(
            sqlite_path(url),
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            busy_timeout_s=timeout_s,
        )

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

    def health(self) -> dict[str, Any]:
        """A cheap liveness check of the database."""
        return self.store.health()

    def close(self) -> None:
        """Flush counters and close the database connections."""
        self.store.close()
