"""The store behind the offloading tier: settings, namespace, page file, metadata client.

`connector.offload_tier` (the vLLM `SecondaryTierManager`) asks this module for a
`TierStore`; nothing here imports vLLM at module level, so it is tested without an engine.

Contract:
    * `tier_settings(kwargs)` turns the tier's entry of `secondary_tiers` (what vLLM's
      `SecondaryTierFactory` passes as keyword arguments) into an hf3fsctl `Config`:
      `config` (the hf3fsctl YAML), then `storage_path` / `metadata_url` overrides, then
      any dotted key (`"storage.io_threads": 8`). An unknown key or a bad value is one
      `ConfigError` line naming the key, raised at construction (start-up), never later.
    * `offload_manifest(spec, page_bytes)` is the namespace of vLLM's primary CPU tier
      chunks: one page is one chunk of the primary tier (every worker's bytes of
      `blocks_per_chunk` blocks, in the primary tier's layout, padded to its alignment),
      so it can never be the connector's page (one block of one rank, in the GPU
      layout). The manifest says which door wrote it: `extra["door"] = "offload-tier"`
      (the connector's manifests carry no door), which `stats` / `ls` show with the
      namespace's `extra`.
    * Keys are vLLM's `OffloadKey` in hex: the block hash (the same chain the connector
      keys by, `hf3fsctl.keys`) followed by the 4-byte KV cache group index.
    * `TierStore.ensure_registered()` registers namespace and rank 0 (the scheduler holds
      every worker's bytes of a chunk, so the namespace has one rank) and is retried by
      every job until it works: a metadata service down at start-up fails jobs, it does
      not stop vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hf3fsctl.config import Config, load_config
from hf3fsctl.errors import ConfigError, Hf3fsctlError
from hf3fsctl.keys import NamespaceManifest, model_revision
from hf3fsctl.meta.client import connect
from hf3fsctl.meta.models import RankFile
from hf3fsctl.storage.factory import open_engine
from hf3fsctl.storage.layout import PageFile, write_manifest
from hf3fsctl.tier import Tier

if TYPE_CHECKING:
    from hf3fsctl.meta.protocol import DataPath, MetadataClient
    from hf3fsctl.storage.engine import IOEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")

DOOR = "offload-tier"
RANK = 0
# Keyword arguments of the tier itself (the rest of its secondary_tiers entry).
TIER_KEYS = ("config", "storage_path", "metadata_url", "threads", "enable_kv_events", "locality")
_OVERRIDE_OF = {"storage_path": "storage.path", "metadata_url": "metadata.url"}


def tier_settings(kwargs: Mapping[str, Any]) -> Config:
    """The hf3fsctl configuration of a `secondary_tiers` entry.

    Raises:
        ConfigError: an unknown key or a bad value, naming the key.
    """
    overrides: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in _OVERRIDE_OF:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"secondary_tiers[hf3fsctl].{key}: expected a non-empty string")
            overrides[_OVERRIDE_OF[key]] = value
        elif "." in key:
            overrides[key] = value
        elif key not in TIER_KEYS:
            raise ConfigError(
                f"secondary_tiers[hf3fsctl].{key}: unknown key (known: "
                f"{', '.join(TIER_KEYS)}, or a dotted hf3fsctl config key)"
            )
    path = kwargs.get("config")
    if path is not None and (not isinstance(path, str) or not Path(path).is_file()):
        raise ConfigError(f"secondary_tiers[hf3fsctl].config: {path!r} is not a readable file")
    threads = kwargs.get("threads", 4)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
        raise ConfigError(f"secondary_tiers[hf3fsctl].threads: expected 1..64, got {threads!r}")
    return load_config(path, overrides=overrides)


def _none_hash_fingerprint() -> str:
    """vLLM's NONE_HASH in this process (set by the engine before the scheduler starts)."""
    try:
        from vllm.v1.core import kv_cache_utils

        value = getattr(kv_cache_utils, "NONE_HASH", None)
    except ImportError:
        value = None
    return bytes(value).hex()[:16] if value else "unset"


def offload_manifest(spec: Any, page_bytes: int) -> NamespaceManifest:
    """The namespace of one vLLM offloading spec's primary chunks (see the module doc)."""
    config = spec.config
    parallel = config.parallel
    groups = [
        {"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)}
        for g in config.groups
    ]
    extra = {
        "door": DOOR,
        "blocks_per_chunk": str(config.cache.blocks_per_chunk),
        "groups": hashlib.sha256(json.dumps(groups).encode()).hexdigest()[:16],
        "worker_kv_bytes_per_block": str(config.worker_kv_bytes_per_block),
        "world_size": str(parallel.world_size),
        "dcp_pcp": f"{parallel.dcp_size}x{parallel.pcp_size}",
        "replicated_layout": str(bool(config.replicated_layout)),
        "canonical_layout": str(bool(config.canonical_layout)),
    }
    return NamespaceManifest(
        model=str(config.model.name),
        revision=model_revision(config.model.name),
        kv_dtype=str(config.model.dtype).removeprefix("torch."),
        block_size=int(config.cache.tokens_per_hash) * int(config.cache.blocks_per_chunk),
        layout=f"offload-chunk:{config.kv_cache_layout or 'direct'}",
        backend="vllm-offloading",
        num_layers=sum(len(g.layer_names) for g in config.groups),
        num_kv_heads=0,
        head_dim=0,
        tp_size=int(parallel.tp_size),
        pp_size=1,  # one page holds every worker's bytes: the namespace has one rank
        page_bytes=page_bytes,
        hash_algorithm="vllm-offload-key",
        none_hash=_none_hash_fingerprint(),
        extra=extra,
    )


def offload_key(key: bytes) -> str:
    """The storage key of a vLLM `OffloadKey` (block hash + group index)."""
    return bytes(key).hex()


class TierStore:
    """One namespace of the store, opened for the offloading tier (rank 0)."""

    def __init__(self, config: Config, manifest: NamespaceManifest) -> None:
        self.config = config
        self.manifest = manifest
        self.namespace = manifest.namespace_id
        self.client: MetadataClient = connect(config)
        self.engine: IOEngine | None = None
        self.page_file: PageFile | None = None
        self.tier: Tier | None = None
        self._registered = False
        self._lock = threading.Lock()

    def call(self, fn: Callable[[DataPath], T], /) -> T:
        """One metadata call (the tier's `client_call`)."""
        return fn(self.client)

    def ensure_registered(self) -> Tier:
        """Open storage and register namespace and rank once; the open `Tier`.

        Raises:
            Hf3fsctlError: storage or the metadata service is unusable now (the job
                fails; the next one tries again).
        """
        if self._registered and self.tier is not None:
            return self.tier
        with self._lock:
            if self._registered and self.tier is not None:
                return self.tier
            storage = self.config.storage
            root = Path(storage.path)
            if not root.is_dir():
                raise ConfigError(
                    f"storage.path: {root} does not exist (mount it, or hf3fsctl init)"
                )
            if self.engine is None:
                self.engine = open_engine(
                    storage.engine,
                    io_threads=storage.io_threads,
                    o_direct=storage.o_direct,
                    root=storage.path,
                )
            if self.page_file is None:
                self.page_file = PageFile.create_growable(
                    root, self.namespace, RANK, self.manifest.page_bytes
                )
            write_manifest(root, self.manifest)
            self.client.register_namespace(self.namespace, self.manifest.to_dict())
            file = self.page_file
            self.client.register_rank(
                self.namespace,
                RankFile(
                    rank=RANK,
                    path=file.relpath,
                    page_bytes=file.page_bytes,
                    slot_bytes=file.slot_bytes,
                    num_pages=file.num_pages,
                    preallocated=not file.growable,
                ),
            )
            self.tier = Tier(self.namespace, RANK, file, self.engine, self.call)
            self._registered = True
            logger.info(
                "hf3fsctl offload tier: namespace %s (%s, %d B/chunk), page file %s, metadata %s",
                self.namespace,
                self.manifest.model,
                self.manifest.page_bytes,
                file.path,
                self.client.url,
            )
            return self.tier

    def forget_registration(self) -> None:
        """The store no longer knows the namespace (its metadata was reset, or the
        namespace removed): the next job registers it again, with a new page file if the
        old one went with it."""
        with self._lock:
            if not self._registered:
                return
            self._registered = False
            if self.page_file is not None and self.page_file.removed:
                self.page_file = None  # re-created; loads still reading it keep their handle
        logger.warning(
            "hf3fsctl offload tier: namespace %s is no longer registered in the store: "
            "registering it again",
            self.namespace,
        )

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is committed (prefix lookups, restarted after each miss).

        Raises:
            Hf3fsctlError: the metadata service failed (the caller reports misses).
        """
        found = [False] * len(keys)
        start = 0
        while start < len(keys):
            hits = self.client.lookup(self.namespace, list(keys[start:]))
            for i in range(start, start + hits):
                found[i] = True
            start += hits + 1
        return found

    def close(self) -> None:
        """Close the client, engine and page file (best effort)."""
        for part in (self.client, self.engine, self.page_file):
            if part is None:
                continue
            try:
                part.close()
            except (Hf3fsctlError, OSError) as exc:
                logger.warning("closing %s: %s", type(part).__name__, exc)
