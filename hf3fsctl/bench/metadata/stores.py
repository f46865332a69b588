"""The benchmark's stores: keys, the namespace and rank file, filling and copying.

Contract: every store a cell measures is made here — pre-filled with `entries`
committed keys through the store API in big batches (the full stores hold exactly their
capacity), copied from a pristine one so each cell starts from the same state — and
reached through `StoreSpec.client()` the way production reaches it.

Bulk fill (SQLite, `_fill_store`): the rows are the store's own — every key goes through
`allocate` and `commit` — but the keys go in globally sorted order, so each B-tree keyed
by the key (`entries_by_key`, `key_lru`) is appended to rather than inserted into at
random, and the fill's connection caches up to `FILL_CACHE_KIB` and skips fsync
(`synchronous = OFF`: a fill that dies is thrown away anyway). 10⁶ entries took 274 s
through 8,192-key batches in random order with the store's 2 MiB cache. Depths follow
the sorted order (`first_depth` of each batch). Redis (`fill_spec(workers=)`): the same
calls from several processes over disjoint key ranges, so the client side of the fill
is not one core's.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf3fsctl.bench.metadata.children import in_child, start_child
from hf3fsctl.errors import MetadataUnavailable

if TYPE_CHECKING:
    from hf3fsctl.meta.protocol import MetadataClient
from hf3fsctl.bench.metadata.settings import (
    FILL_CHUNK,
    FULL_NAMESPACES,
    FULL_OPS,
    PAGE_BYTES,
    UNBOUNDED_BYTES,
    URL_FILL_CHUNK,
)


def key(tag: str, index: int) -> str:
    """A block key (64 hex digits, like vLLM's sha256 block hashes)."""
    return hashlib.sha256(f"{tag}-{index}".encode()).hexdigest()


def bench_manifest(model: str) -> dict[str, Any]:
    from hf3fsctl.keys import NamespaceManifest

    return NamespaceManifest(
        model=model,
        revision="bench",
        kv_dtype="bfloat16",
        block_size=16,
        layout="LBNHC",
        backend="FLASH_ATTN",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        tp_size=1,
        pp_size=1,
        page_bytes=PAGE_BYTES,
        hash_algorithm="sha256",
        none_hash="00" * 32,
    ).to_dict()


def namespace_id(manifest: dict[str, Any]) -> str:
    from hf3fsctl.keys import NamespaceManifest

    return NamespaceManifest(**manifest).namespace_id


def bench_rank_file(namespace: str) -> Any:
    from hf3fsctl.meta.models import RankFile
    from hf3fsctl.storage.layout import GROWABLE_MAX_BYTES, rank_file_name, slot_bytes

    slot = slot_bytes(PAGE_BYTES)
    return RankFile(
        rank=0,
        path=rank_file_name(namespace, 0),
        page_bytes=PAGE_BYTES,
        slot_bytes=slot,
        num_pages=GROWABLE_MAX_BYTES // slot,
        preallocated=False,
    )


@dataclass(frozen=True)
class StoreSpec:
    """One store the cells run against, as every client process opens it."""

    name: str  # "main", "full_1ns", "full_8ns"
    url: str
    token: str | None
    namespaces: tuple[str, ...]
    stored_tag: str  # the prefilled keys are key(stored_tag, 0..entries-1)
    entries: int
    root: str | None = None  # storage root (embedded clients' policy: punching works)
    high: float = 0.95
    low: float = 0.85
    replicas: tuple[str, ...] = ()  # several servers of one store: client i uses i mod n

    def client(self, timeout_s: float = 120.0, worker: int = 0) -> MetadataClient:
        """A client of this store (embedded: its own `MetadataStore` in this process;
        `in-tree+http://`: vLLM's in-tree server through its own client)."""
        from hf3fsctl.bench.peers.in_tree import IN_TREE_SCHEME, InTreeClient
        from hf3fsctl.meta.client import open_metadata_client
        from hf3fsctl.meta.policy import StorePolicy

        url = self.replicas[worker % len(self.replicas)] if self.replicas else self.url
        if url.startswith(IN_TREE_SCHEME):
            return InTreeClient(url)  # type: ignore[return-value]  # the cells' calls only
        return open_metadata_client(
            url,
            timeout_s=timeout_s,
            token=self.token,
            high_watermark=self.high,
            low_watermark=self.low,
            policy=StorePolicy(storage_root=self.root) if self.root else None,
        )


def full_watermarks(pages: int) -> tuple[float, float]:
    """High 1.0 and low half a page below it: once full, each allocate evicts what it needs."""
    return 1.0, 1.0 - 0.5 / pages


def create_store(
    directory: Path, name: str, entries: int, tag: str, run: str, *, fork: bool = True
) -> tuple[StoreSpec, Path]:
    """Create and fill one store (in a child process unless `fork` is False: a caller
    that is one already); returns its spec and database."""
    full = name in FULL_OPS
    count = FULL_NAMESPACES if name == "full_8ns" else 1
    manifests = [bench_manifest(f"hf3fsctl-bench/{run}/{name}/{i}") for i in range(count)]
    namespaces = tuple(namespace_id(m) for m in manifests)
    db = directory / f"{name}.db"
    root = directory / f"storage-{name}"
    root.mkdir(parents=True, exist_ok=True)
    high, low = full_watermarks(entries) if full else (0.95, 0.85)
    capacity = entries * PAGE_BYTES if full else UNBOUNDED_BYTES
    spec = StoreSpec(
        name=name,
        url=f"sqlite:///{db}",
        token=None,
        namespaces=namespaces,
        stored_tag=tag,
        entries=entries,
        root=str(root) if full else None,
        high=high,
        low=low,
    )
    if fork:
        in_child(_fill_store, spec, db, root, capacity, manifests)
    else:
        _fill_store(spec, db, root, capacity, manifests)
    return spec, db


def _fill_store(
    spec: StoreSpec, db: Path, root: Path, capacity: int, manifests: list[dict[str, Any]]
) -> None:
    """Register the namespaces (growing files on disk) and commit `spec.entries` keys."""
    from hf3fsctl.meta.policy import StorePolicy
    from hf3fsctl.meta.sqlite.store import MetadataStore
    from hf3fsctl.storage.layout import PageFile

    store = MetadataStore(
        db,
        high_watermark=spec.high,
        low_watermark=spec.low,
        policy=StorePolicy(storage_root=spec.root) if spec.root else None,
    )
    try:
        store.set_capacity(capacity)
        for ns, manifest in zip(spec.namespaces, manifests, strict=True):
            store.register_namespace(ns, manifest)
            store.register_rank(ns, bench_rank_file(ns))
            PageFile.create_growable(root, ns, 0, PAGE_BYTES).close()
        bulk_connection(store)
        ordered = sorted(key(spec.stored_tag, i) for i in range(spec.entries))
        gc.disable()  # the fill makes no cycles; collections walking its heap cost ~10%
        for number, start in enumerate(range(0, spec.entries, FILL_CHUNK)):
            ns = spec.namespaces[number % len(spec.namespaces)]
            store_keys_now(store, spec, ns, ordered[start : start + FILL_CHUNK], start)
    finally:
        gc.enable()
        store.close()


FILL_CACHE_KIB = 512 * 1024  # the fill connection's page cache (the store's own: 2 MiB)


def bulk_connection(store: Any) -> None:
    """Tune the fill's own SQLite connection (this thread's) for a bulk fill: a large
    page cache and no fsync. The rows written do not change; only how fast."""
    conn = store._conn()  # the store's connection of this thread: the one its calls use
    conn.execute(f"PRAGMA cache_size = -{FILL_CACHE_KIB}")
    conn.execute("PRAGMA synchronous = OFF")


def store_chunk(api: Any, spec: StoreSpec, ns: str, start: int, stop: int) -> None:
    """Allocate and commit the prefilled keys `start..stop` in one call each.

    `api` is a `MetadataStore` or a `MetadataClient` (the same two calls). The keys go
    in sorted order: SQLite's B-tree inserts then walk each index once instead of at
    random (a 4·10⁵ fill: 58 s instead of 91 s); their depths follow that order.
    """
    keys = sorted(key(spec.stored_tag, i) for i in range(start, stop))
    store_keys_now(api, spec, ns, keys, start)


def store_keys_now(api: Any, spec: StoreSpec, ns: str, keys: list[str], first_depth: int) -> None:
    """Allocate and commit `keys` (depths from `first_depth`) in one call each."""
    from hf3fsctl.meta.models import CommitItem

    result = api.allocate(ns, 0, keys, first_depth=first_depth)
    if result.no_space:
        raise MetadataUnavailable(
            f"filling store {spec.name}: {len(result.no_space)} keys found no space",
            hint="use a store with room (a scratch server), or lower --entries",
        )
    api.commit(
        ns,
        0,
        [
            CommitItem.model_construct(
                key=a.key, page=a.page, checksum=f"xxh3:{a.page:016x}", size=PAGE_BYTES
            )
            for a in result.allocated
        ],
    )


def fill_url(client: MetadataClient, spec: StoreSpec) -> None:
    """Fill a running server's store through its client (for `--url`)."""
    for start in range(0, spec.entries, URL_FILL_CHUNK):
        store_chunk(
            client, spec, spec.namespaces[0], start, min(spec.entries, start + URL_FILL_CHUNK)
        )


def copy_store(spec: StoreSpec, db: Path, directory: Path) -> tuple[StoreSpec, Path]:
    """A private copy of a closed, filled store (each mode starts from the same state)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / db.name
    shutil.copy2(db, target)
    root = None
    if spec.root is not None:
        root = directory / Path(spec.root).name
        shutil.copytree(spec.root, root)
    else:
        (directory / f"storage-{spec.name}").mkdir(exist_ok=True)
    copy = dataclasses.replace(
        spec, url=f"sqlite:///{target}", root=None if root is None else str(root)
    )
    return copy, target


def fill_spec(spec: StoreSpec, chunk: int, workers: int = 1) -> float:
    """Fill `spec`'s first namespace with its entries through its client; seconds taken.

    With `workers > 1`, that many forked processes fill disjoint, interleaved ranges of
    `chunk` keys at once, each through its own client.
    """
    began = time.monotonic()
    if workers <= 1:
        _fill_range(spec, chunk, 0, 1)
    else:
        children = [start_child(_fill_range, spec, chunk, w, workers) for w in range(workers)]
        for child in children:
            child.result()
    return time.monotonic() - began


def _fill_range(spec: StoreSpec, chunk: int, worker: int, workers: int) -> None:
    """Every `workers`-th batch of `chunk` keys, from batch `worker` on."""
    client = spec.client()
    try:
        for start in range(worker * chunk, spec.entries, workers * chunk):
            stop = min(spec.entries, start + chunk)
            store_chunk(client, spec, spec.namespaces[0], start, stop)
    finally:
        client.close()


def register_main(spec: StoreSpec, manifest: dict[str, Any]) -> None:
    """Register the benchmark's namespace and rank file on an empty store, unbounded."""
    client = spec.client()
    try:
        client.set_capacity(UNBOUNDED_BYTES)
        client.register_namespace(spec.namespaces[0], manifest)
        client.register_rank(spec.namespaces[0], bench_rank_file(spec.namespaces[0]))
    finally:
        client.close()


def store_keys(spec: StoreSpec) -> int:
    """Keys committed in the store's namespaces now."""
    client = spec.client()
    try:
        stats = client.stats()
    finally:
        client.close()
    return sum(ns.keys for ns in stats.namespaces if ns.id in spec.namespaces)
