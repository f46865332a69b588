"""The metadata protocols, each declared once: a caller depends on the smallest it uses.

| protocol | calls | who uses it |
| --- | --- | --- |
| `DataPath` | `register_namespace`, `register_rank`, `lookup`, `locate`, `allocate`, `commit`, `release`, `invalidate`, `admit`, `health`, `close` | the connector and `Tier` (every request) |
| `ChangeFeed` | `changes` | the connector's KV events |
| `Registry` | `get_namespace`, `namespaces`, `drop_namespaces`, `record_writer`, `writers` | `ls`, `evict --stale`, `warm`, the connector's writer record |
| `Admin` | `evict`, `stats`, `list_entries`, `capacity`, `set_capacity`, `pin`, `unpin`, `list_pins` | the CLI, the bench |
| `MetadataClient` | all of the above | admin tools, the server |

Implementations (chosen by URL in `meta/client.py`): the SQLite `MetadataStore`
(`meta/sqlite/`), the `RedisMetadataStore` (`meta/redis/`), both on one core
(`meta/base.py`), and `HttpMetadataClient` (`meta/http/`) in front of `hf3fsctl serve`.
None restates these signatures' contract; it is here:

- `lookup(ns, keys)` → how many leading keys are committed on every rank. Read-only
  apart from traffic counters.
- `locate(ns, rank, keys)` → a `Location` (page, checksum, size) or None per key, and
  a read lease: the located pages are not reused for `lease_s`, even if evicted.
- `allocate(ns, rank, keys, first_depth)` → pages for keys not yet stored on that
  rank; keys already committed or pending are `existing`; `no_space` when nothing
  could be freed. May evict LRU entries (chain tails first) above the high watermark
  (where: docs/design.md, "Eviction").
- `commit(ns, rank, items)` → pending → committed with checksums; only for the
  exact (key, page) the writer was allocated. Returns how many committed. An item's
  `retention_s` gives its entry an expiry (`expires_at` = commit time + retention_s;
  None: never), `renew_on_read` lets `locate` renew it.
- Expiry: an expired entry (`expires_at <= now`) is absent for `lookup` and `locate`
  (a key counts only if committed and unexpired on every rank) and for `allocate` (an
  expired key is dropped on every rank and saved anew); every eviction (capacity,
  quota, full file) takes expired keys before any LRU victim (reason "expired"), except
  pinned ones (a pin keeps an expired entry from eviction, not from expiring). Reads
  never extend an expiry, but a `locate` of an entry committed with `renew_on_read`
  moves it to now + its retention. Admin `evict` purges expired keys like any other,
  and first. `list_entries` shows `expires_at`.
- `admit(ns, keys, after_hits)` → per key, whether it has now been seen at least
  `after_hits` times (one sighting of each distinct key recorded per call, counts kept
  in the store: every engine's sightings add up). `after_hits <= 1`: all True, nothing
  recorded (a client need not call). Keys answered False count in the namespace's
  `admission_skipped`. Counts are bounded (`ADMISSION_TRACKED_KEYS`, 1,000,000 per
  store, next to each backend's implementation): the least recently seen go first; a
  key's count may be dropped once it is committed. Unknown namespace: `NotFound`.
- `release(ns, rank, allocations)` → a writer gives up pending allocations (only the
  exact (key, page) pairs it holds); returns how many released.
- `invalidate(ns, rank, items)` → a reader found these committed pages corrupt
  (`Location`s or `(key, page, checksum)`): each key whose entry on `rank` still has
  that exact page and checksum is dropped on every rank (pages freed honouring read
  leases); a key re-saved since is left alone. Returns how many keys were dropped;
  idempotent.
- `record_writer(ns, writer)` records an engine that wrote pages to a namespace (its
  numerics and their hash, `WriterInfo`); the first record of an id is kept, so it is
  idempotent. `writers(ns=None)` → recorded writers by namespace, oldest first; a
  namespace with two is one whose pages were computed with other numerics
  (docs/design.md decision 15). Dropping a namespace drops its writers.
- Admin: `capacity()` / `set_capacity(bytes)` (the store's one budget, recorded in the
  store), `pin` / `unpin` / `list_pins`, `drop_namespaces` (metadata only: the caller
  removes the page files), `evict`, `stats`, `list_entries`.

Every implementation raises the same typed errors (`hf3fsctl.errors`):
`MetadataUnavailable` when the service cannot answer in time, `AuthError`,
`InvalidRequest`, `NotFound`, `NamespaceConflict` as the store decides.

Capabilities only some implementations have are optional protocols, checked with
`isinstance`, never probed with `getattr`: `SelfChecking` (`check_invariants`),
`Replicated` (`replication`, Redis), `LocatesPages` (`locate_pages`, SQLite: `locate`
as tuples, for the engine thread), `SavesPages` (`allocate_pages`, `commit_pages`,
SQLite: `allocate` and `commit` as tuples, for the save threads). A store that
`hf3fsctl serve` can front is a `Store`: it also says whether its `lookup` does I/O
(`lookup_does_io`: the server then runs lookups off its event loop) and flushes its
counters (`flush`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

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
    PageGrant,
    PageLocation,
    PinInfo,
    PinResult,
    RankFile,
    StoreStats,
    WriterInfo,
)

InvalidateItems = Sequence[Location | InvalidateItem | tuple[str, int, str]]


@runtime_checkable
class DataPath(Protocol):
    """The calls of the data path: what the connector and `Tier` need on every request."""

    url: str

    def register_namespace(self, namespace: str, manifest: dict[str, Any]) -> NamespaceInfo:
        """Create a namespace, or return it if identical; `NamespaceConflict` if not."""
        ...

    def register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        """Record one rank's page file; `NamespaceConflict` if it differs from before."""
        ...

    def lookup(self, namespace: str, keys: Sequence[str]) -> int:
        """Number of leading `keys` committed on every rank of the namespace."""
        ...

    def locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        """Where each key's page is on `rank` (None if absent), with a read lease."""
        ...

    def allocate(
        self, namespace: str, rank: int, keys: Sequence[str], first_depth: int = 0
    ) -> AllocateResult:
        """Pages for keys not yet stored on `rank`; may evict LRU keys above the watermark."""
        ...

    def commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        """Pending → committed for the exact (key, page) pairs; returns how many."""
        ...

    def release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        """Give back pending allocations (exact (key, page) pairs); returns how many."""
        ...

    def invalidate(self, namespace: str, rank: int, items: InvalidateItems) -> int:
        """Drop keys whose page on `rank` was found corrupt; returns how many were dropped."""
        ...

    def admit(self, namespace: str, keys: Sequence[str], after_hits: int) -> list[bool]:
        """Record a sighting of each key; per key, whether it was seen >= `after_hits` times."""
        ...

    def health(self) -> dict[str, Any]:
        """A cheap liveness check; raises `MetadataUnavailable` when down."""
        ...

    def close(self) -> None:
        """Flush what is pending and release connections."""
        ...


@runtime_checkable
class ChangeFeed(Protocol):
    """The change log (KV events)."""

    def changes(self, since: int, namespace: str | None = None, limit: int = 10_000) -> ChangeLog:
        """The change log after `since` (-1: its end): keys that gained or lost a rank."""
        ...


@runtime_checkable
class Registry(Protocol):
    """Reading and dropping registered namespaces."""

    def get_namespace(self, namespace: str) -> NamespaceInfo:
        """One namespace; `NotFound` if absent."""
        ...

    def namespaces(self) -> list[NamespaceInfo]:
        """Every registered namespace, oldest first."""
        ...

    def drop_namespaces(
        self, namespace_ids: Sequence[str], *, dry_run: bool = False
    ) -> DropNamespacesResult:
        """Remove namespaces' metadata (the caller removes their page files); a namespace
        whose pages are being written is skipped (its `skipped` says why)."""
        ...

    def record_writer(self, namespace: str, writer: WriterInfo) -> None:
        """Record an engine that wrote to `namespace`; the first record of an id is kept."""
        ...

    def writers(self, namespace: str | None = None) -> dict[str, list[WriterInfo]]:
        """Recorded writers by namespace id (one namespace's, or all), oldest first."""
        ...


@runtime_checkable
class Admin(Protocol):
    """Capacity, eviction, pins and listings."""

    def evict(self, request: EvictRequest) -> EvictResult:
        """Evict committed keys (all ranks at once) by the request's criteria."""
        ...

    def stats(self) -> StoreStats:
        """Usage and traffic of every namespace and of the whole store."""
        ...

    def list_entries(
        self, namespace: str | None = None, limit: int = 100, offset: int = 0
    ) -> list[EntryInfo]:
        """Entries (one per key and rank), most recently used first."""
        ...

    def capacity(self) -> CapacityInfo:
        """The store's recorded capacity and what its page files hold."""
        ...

    def set_capacity(self, capacity_bytes: int) -> CapacityInfo:
        """Record the store's capacity (every process enforces the recorded value)."""
        ...

    def pin(self, namespace: str, keys: Sequence[str], ttl_s: float | None = None) -> PinResult:
        """Keep keys out of LRU eviction; `InvalidRequest` past `storage.max_pinned`."""
        ...

    def unpin(self, namespace: str, keys: Sequence[str] | None = None) -> int:
        """Drop pins (all of the namespace's when `keys` is None); returns how many."""
        ...

    def list_pins(self, namespace: str | None = None, limit: int = 1000) -> list[PinInfo]:
        """Live pins, newest first."""
        ...


@runtime_checkable
class MetadataClient(DataPath, ChangeFeed, Registry, Admin, Protocol):
    """Every call: what admin tools and the server need."""


@runtime_checkable
class SelfChecking(Protocol):
    """A store that can list its violated invariants (`doctor`, the contract suite)."""

    def check_invariants(self) -> list[str]:
        """Every violated invariant, one line each; empty when sound."""
        ...


@runtime_checkable
class LocatesPages(Protocol):
    """A store that can answer `locate` with plain tuples (`PageLocation`): the SQLite
    store, in process, where `Tier.load` runs on the engine thread. Same contract as
    `locate` (the read lease included); only the result's type differs."""

    def locate_pages(
        self, namespace: str, rank: int, keys: Sequence[str]
    ) -> list[PageLocation | None]:
        """`locate`, as `PageLocation`s."""
        ...

    def prepare_locate_pages(self, namespace: str, rank: int) -> None:
        """Pay the first `locate_pages`' one-time costs now (statements compiled),
        changing nothing a reader sees."""
        ...


@runtime_checkable
class PreparesLookups(Protocol):
    """A store whose first `lookup` in a thread has one-time costs it can pay ahead (the
    SQLite store compiles its statements): the connector's scheduler side, which answers
    an embedded store's lookups on the engine thread, asks it when it opens the store."""

    def prepare_lookup(self) -> None:
        """Pay this thread's first `lookup`'s one-time costs now, changing nothing."""
        ...


@runtime_checkable
class SavesPages(Protocol):
    """A store that can allocate and commit with plain tuples: the SQLite store, in
    process, where `Tier.save` runs on save threads that share the cores with the
    forward. Same contract as `allocate` and `commit` (checks, transactions, what is
    stored); only the argument and result types differ."""

    def allocate_pages(
        self,
        namespace: str,
        rank: int,
        keys: Sequence[str],
        first_depth: int = 0,
        depths: Sequence[int] | None = None,
    ) -> PageGrant:
        """`allocate`, as a `PageGrant`; `depths` (one per key) instead of `first_depth`
        allocates the chains of several requests in one transaction."""
        ...

    def commit_pages(
        self,
        namespace: str,
        rank: int,
        pages: Sequence[tuple[str, int, str]],
        size: int,
        retention_s: float | None = None,
        renew_on_read: bool = False,
    ) -> int:
        """`commit` of `(key, page, checksum)` pages of `size` bytes with one retention."""
        ...


@runtime_checkable
class Replicated(Protocol):
    """A store on a replicated server (Redis): what `doctor` reports of it."""

    def replication(self) -> dict[str, Any]:
        """`role`, `connected_replicas`, `master_link_status`, `redis_version`, `format`."""
        ...


@runtime_checkable
class Store(MetadataClient, SelfChecking, Protocol):
    """A store `hf3fsctl serve` can front (`create_app(store)`)."""

    lookup_does_io: bool  # True: lookups are network round trips, run off the event loop

    def flush(self) -> None:
        """Write counters held in this process now."""
        ...

    def shutdown(self) -> None:
        """`close` at the end of a server's life (SQLite: the WAL checkpointed into the
        database and truncated, so the file alone is complete)."""
        ...
