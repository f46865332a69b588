"""The factories: the metadata client (or store) a URL names, chosen by its scheme.

- `sqlite:///PATH` → `MetadataStore` (`meta/sqlite/`): the SQLite store itself, in this
  process (no server; processes of one node share the database file; lookup counters
  are written even by a process that exits without `close`).
- `http(s)://HOST:PORT` → `HttpMetadataClient`: `hf3fsctl serve` over HTTP (stdlib
  `http.client` keep-alive connections for the hot calls, httpx for the rest; a deadline
  per call, TLS verified against `metadata.ca_file`, retries only for idempotent calls).
- `redis://HOST:PORT/DB`, `rediss://…`, `redis+sentinel://HOST:PORT[,…]/SERVICE[/DB]`,
  `redis+cluster://HOST:PORT[,…]` →
  `RedisMetadataStore` (`meta/redis/`): the store itself, shared by every process that
  names the same Redis (one Lua script per call; no server of ours in between);
  `redis+cluster://…?shards=N` → `ShardedRedisStore` (`meta/redis/sharded.py`): that
  store split into N one-slot shards over the cluster's masters.

The protocols these return are declared once, in `meta/protocol.py` (`MetadataClient`,
and the narrow `DataPath`, `Registry`, `Admin`, `ChangeFeed` a caller may depend on
instead).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf3fsctl.config.schema import Config
    from hf3fsctl.config.urls import MetadataUrl
    from hf3fsctl.meta.policy import StorePolicy
    from hf3fsctl.meta.protocol import MetadataClient, Store

__all__ = ["connect", "metadata_token", "open_metadata_client", "open_store"]


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
    `rediss://…`, `redis+sentinel://…` or `redis+cluster://…`).

    The store-side settings (lease, watermarks, capacity policy) apply to the stores this
    process runs (embedded SQLite, Redis); a server uses its own. `read_only` opens an
    embedded SQLite store for reading only (no writer lock), and a Redis store without
    the writes of its open (default capacity, marks left by a crash); a service ignores it.
    """
    from hf3fsctl.config.urls import MetadataUrl

    target = url if isinstance(url, MetadataUrl) else MetadataUrl.parse(url)
    if target.scheme == "sqlite":
        if target.path is None:
            from hf3fsctl.errors import ConfigError

            raise ConfigError(f"metadata.url: {target.url!r} is not sqlite:///PATH")
        from hf3fsctl.meta.sqlite import MetadataStore

        # The store itself, in this process: `timeout_s` is how long a call waits for
        # another process's writer before `MetadataUnavailable`, as a slow server would.
        return MetadataStore(
            target.path,
            busy_timeout_s=timeout_s,
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            policy=policy,
            read_only=read_only,
        )
    if target.redis:
        return _redis_store(
            target,
            timeout_s=timeout_s,
            token=token,
            ca_file=ca_file,
            lease_s=lease_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            policy=policy,
            read_only=read_only,
        )
    from hf3fsctl.meta.http.client import HttpMetadataClient

    assert target.base is not None
    return HttpMetadataClient(target.base, timeout_s=timeout_s, token=token, ca_file=ca_file)


def _redis_store(target: MetadataUrl, **settings: Any) -> Store:
    """The Redis store a URL names: one slot, or `?shards=N` of a cluster's slots."""
    if target.shards > 1:
        from hf3fsctl.meta.redis.sharded import ShardedRedisStore

        return ShardedRedisStore(target, shards=target.shards, **settings)
    from hf3fsctl.meta.redis import RedisMetadataStore

    return RedisMetadataStore(target, **settings)


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
    a `redis://`, `rediss://`, `redis+sentinel://` or `redis+cluster://` URL (`token`, `ca_file`, `timeout_s`
    reach Redis; a Redis-backed server keeps nothing in its process, so replicas can share
    one Redis).

    Raises:
        ConfigError: an `http(s)://` URL (a server cannot front another server).
    """
    from hf3fsctl.config.urls import MetadataUrl

    if isinstance(url, str) and "://" not in url:
        url = f"sqlite:///{Path(url).expanduser().absolute()}"
    target = url if isinstance(url, MetadataUrl) else MetadataUrl.parse(url)
    if target.redis:
        return _redis_store(
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
    from hf3fsctl.meta.sqlite.store import MetadataStore

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

    `read_only`: an embedded SQLite store is opened for reading only; a Redis store
    writes nothing when it opens (no default capacity recorded, no marks finished).
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
