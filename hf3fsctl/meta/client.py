"""One metadata client protocol, three implementations chosen by URL scheme.

- `sqlite:///PATH` → `EmbeddedMetadataClient`: the SQLite store in this process (no
  server; processes of one node share the database file).
- `http(s)://HOST:PORT` → `HttpMetadataClient`: `hf3fsctl serve` over HTTP (stdlib
  `http.client` keep-alive connections for the hot calls, httpx for the rest; a deadline
  per call, TLS verified against `metadata.ca_file`, retries only for idempotent calls).
- `redis://HOST:PORT/DB`, `rediss://…`, `redis+sentinel://HOST:PORT[,…]/SERVICE[/DB]` →
  `RedisMetadataStore` (`meta/redis/`): the store itself, shared by every process that
  names the same Redis (one Lua script per call; no server of ours in between).

Both raise the same typed errors (`hf3fsctl.errors`): `MetadataUnavailable` when the
service cannot answer in time, `AuthError`, `InvalidRequest`, `NotFound`,
`NamespaceConflict` as the store decides.

Contract of the data-path calls (the store enforces it; both clients pass it through):

- `lookup(ns, keys)` → how many leading keys are committed on every rank. Read-only
  apart from traffic counters.
- `locate(ns, rank, keys)` → a `Location` (page, checksum, size) or None per key, and
  a read lease: the located pages are not reused for `lease_s`, even if evicted.
- `allocate(ns, rank, keys, first_depth)` → pages for keys not yet stored on that
  rank; keys already committed or pending are `existing`; `no_space` when nothing
  could be freed. May evict LRU entries (chain tails first) above the high watermark.
- `commit(ns, rank, items)` → pending → committed with checksums; only for the
  exact (key, page) the writer was allocated. Returns how many committed.
- `release(ns, rank, allocations)` → a writer gives up pending allocations (only the
  exact (key, page) pairs it holds); returns how many released.
- Admin calls: `capacity()` / `set_capacity(bytes)` (the store's one budget, recorded
  in the store), `pin` / `unpin` / `list_pins`, `drop_namespaces` (metadata only: the
  caller removes the page files), `evict`, `stats`, `list_entries`.
- `invalidate(ns, rank, items)` → a reader found these committed pages corrupt
  (`Location`s or `(key, page, checksum)`): each key whose entry on `rank` still has
  that exact page and checksum is dropped on every rank (pages freed honouring read
  leases); a key re-saved since is left alone. Returns how many keys were dropped;
  idempotent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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

if TYPE_CHECKING:
    from hf3fsctl.config import Config, MetadataUrl
    from hf3fsctl.meta.policy import StorePolicy
    from hf3fsctl.meta.redis import RedisMetadataStore
    from hf3fsctl.meta.store import MetadataStore

    Store = MetadataStore | RedisMetadataStore
    """A store `hf3fsctl serve` can front (`create_app(store)`)."""


@runtime_checkable
class MetadataClient(Protocol):
    """What the CLI and the connector need from the metadata store."""

    url: str

    def register_namespace(self, namespace: str, manifest: dict[str, Any]) -> NamespaceInfo:
        """Create a namespace, or return it if identical; `NamespaceConflict` if not."""
        ...

    def register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        """Record one rank's page file; `NamespaceConflict` if it differs from before."""
        ...

    def get_namespace(self, namespace: str) -> NamespaceInfo:
        """One namespace; `NotFound` if absent."""
        ...

    def namespaces(self) -> list[NamespaceInfo]:
        """Every registered namespace."""
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
        """Pages for keys not yet stored on `rank`."""
        ...

    def commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        """Commit written pages; returns how many were committed."""
        ...

    def release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        """Give back pending allocations; returns how many were released."""
        ...

    def invalidate(
        self,
        namespace: str,
        rank: int,
        items: Sequence[Location | InvalidateItem | tuple[str, int, str]],
    ) -> int:
        """Drop keys whose page on `rank` was found corrupt; returns how many were dropped."""
        ...

    def evict(self, request: EvictRequest) -> EvictResult:
        """Evict entries by the request's criteria."""
        ...

    def stats(self) -> StoreStats:
        """Usage and traffic of the store."""
        ...

    def list_entries(
        self, namespace: str | None = None, limit: int = 100, offset: int = 0
    ) -> list[EntryInfo]:
        """Entries, most recently used first."""
        ...

    def capacity(self) -> CapacityInfo:
        """The store's recorded capacity and what its page files hold."""
        ...

    def set_capacity(self, capacity_bytes: int) -> CapacityInfo:
        """Record the store's capacity."""
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

    def drop_namespaces(
        self, namespace_ids: Sequence[str], *, dry_run: bool = False
    ) -> DropNamespacesResult:
        """Remove namespaces' metadata (the caller removes their page files)."""
        ...

    def changes(self, since: int, namespace: str | None = None, limit: int = 10_000) -> ChangeLog:
        """The change log after `since` (-1: its end): keys that gained or lost a rank."""
        ...

    def health(self) -> dict[str, Any]:
        """A cheap liveness check; raises `MetadataUnavailable` when down."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


def open_metadata_client(
    url: str | MetadataUrl,
    *,
    timeout_s: float = 2.0,
    token: str | None = None,
    lease_s: float = 30.0,
    high_watermark: float = 0.95,
    low_watermark: float = 0.85,
    policy: StorePolicy | None = None,
    ca_file: str | None = None,
    read_only: bool = False,
) -> MetadataClient:
    """Open the client for a metadata URL (`sqlite:///…`, `http(s)://…`, `redis://…`,
    `rediss://…` or `redis+sentinel://…`).

    The store-side settings (lease, watermarks, capacity policy) apply to the stores this
    process runs (embedded SQLite, Redis); a server uses its own. `read_only` opens an
    embedded SQLite store for reading only (no writer lock; other backends ignore it).
    """
    from hf3fsctl.config import MetadataUrl

    target = url if isinstance(url, MetadataUrl) else MetadataUrl.parse(url)
    if target.scheme == "sqlite":
        from hf3fsctl.meta.embedded import EmbeddedMetadataClient

        return EmbeddedMetadataClient(
            target.url,
            timeout_s=timeout_s,
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            policy=policy,
            read_only=read_only,
        )
    if target.redis:
        from hf3fsctl.meta.redis import RedisMetadataStore

        return RedisMetadataStore(
            target,
            timeout_s=timeout_s,
            token=token,
            ca_file=ca_file,
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            policy=policy,
        )
    from hf3fsctl.meta.http import HttpMetadataClient

    assert target.base is not None
    return HttpMetadataClient(target.base, timeout_s=timeout_s, token=token, ca_file=ca_file)


def metadata_token(config: Config) -> str | None:
    """The secret in `metadata.token_file`: the bearer token of an `http(s)://` service, or
    the password of a Redis URL that has none; None when unset.

    Raises:
        ConfigError: the file cannot be read.
    """
    if not config.metadata.token_file:
        return None
    from hf3fsctl.errors import ConfigError

    try:
        return Path(config.metadata.token_file).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"metadata.token_file: cannot read {config.metadata.token_file!r}: {exc.strerror}"
        ) from None


def open_store(
    url: str | MetadataUrl,
    *,
    timeout_s: float = 2.0,
    token: str | None = None,
    ca_file: str | None = None,
    lease_s: float = 30.0,
    high_watermark: float = 0.95,
    low_watermark: float = 0.85,
    policy: StorePolicy | None = None,
    background_checkpoint: bool = False,
) -> Store:
    """The store a metadata URL names, for `hf3fsctl serve` to front: the SQLite
    `MetadataStore` of `sqlite:///PATH` (or a plain path), or the `RedisMetadataStore` of
    a `redis://`, `rediss://` or `redis+sentinel://` URL (`token`, `ca_file`, `timeout_s`
    reach Redis; a Redis-backed server keeps nothing in its process, so replicas can share
    one Redis).

    Raises:
        ConfigError: an `http(s)://` URL (a server cannot front another server).
    """
    from hf3fsctl.config import MetadataUrl

    if isinstance(url, str) and "://" not in url:
        url = f"sqlite:///{Path(url).expanduser().absolute()}"
    target = url if isinstance(url, MetadataUrl) else MetadataUrl.parse(url)
    if target.redis:
        from hf3fsctl.meta.redis import RedisMetadataStore

        return RedisMetadataStore(
            target,
            timeout_s=timeout_s,
            token=token,
            ca_file=ca_file,
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            policy=policy,
        )
    if target.scheme != "sqlite" or target.path is None:
        from hf3fsctl.errors import ConfigError

        raise ConfigError(f"a server's store is sqlite:///PATH or redis://…, not {target.url!r}")
    from hf3fsctl.meta.store import MetadataStore

    return MetadataStore(
        target.path,
        lease_s=lease_s,
        high_watermark=high_watermark,
        low_watermark=low_watermark,
        background_checkpoint=background_checkpoint,
        policy=policy,
    )


def connect(config: Config, *, read_only: bool = False) -> MetadataClient:
    """Open the metadata client a configuration points at (reads the token file).

    `read_only`: an embedded SQLite store is opened for reading only.
    """
    token = metadata_token(config)
    from hf3fsctl.meta.policy import StorePolicy

    md = config.metadata
    return open_metadata_client(
        config.metadata_target,
        timeout_s=md.timeout_s,
        token=token,
        lease_s=md.lease_s,
        high_watermark=md.high_watermark,
        low_watermark=md.low_watermark,
        policy=StorePolicy.from_config(config),
        ca_file=md.ca_file,
        read_only=read_only,
    )
