"""`StoreCore`: what the SQLite and the Redis store share, written once.

A store subclasses `StoreCore` and implements only its primitives (the `_`-prefixed
methods left abstract below: one transaction or one Lua script each). The core owns,
for both alike:

- validation: key batches (`require_keys`, skipped for `CheckedKeys` a request model
  already checked), namespace ids, ranks' page numbers, watermarks, capacity values,
  eviction criteria, pin TTLs and the pin limit's error (`pin_limit_error`), commit
  retentions (`check_retention`), `admit`'s threshold (`after_hits <= 1` answers every
  key True without a primitive call) and its duplicate keys;
- the allocate loop: duplicate keys collapsed to their first depth, then up to
  `ALLOCATE_ATTEMPTS` primitive allocations — an allocation refused for space that is
  being given back (this call's marks, or another writer's) punches its marks
  (`_give_back`) and asks again once that space is settled, instead of refusing a save
  for space that is about to exist;
- capacity bookkeeping around the primitives: the default capacity recorded from the
  policy when a store has none (`_record_default_capacity`), `CapacityInfo` from
  (recorded, held), the hole puncher that gives freed space back;
- the log lines of evictions and invalidations.

Where eviction is *decided* is each backend's own: `sqlite/eviction.py: choose_victims`
and `redis/lua/evict.lua` (docs/design.md, "Eviction", lists the pairs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from hf3fsctl.errors import InvalidRequest, NotFound
from hf3fsctl.keys import check_keys, check_namespace_id, namespace_id
from hf3fsctl.meta.giveback import GiveBack, HolePuncher
from hf3fsctl.meta.models import (
    INT_MAX,
    MAX_WRITER_SETTINGS,
    AllocateResult,
    Allocation,
    CapacityInfo,
    ChangeLog,
    CheckedKeys,
    CommitItem,
    DropNamespacesResult,
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
    page_triples,
)
from hf3fsctl.meta.policy import StorePolicy, resolve_capacity
from hf3fsctl.meta.protocol import InvalidateItems

logger = logging.getLogger(__name__)

ALLOCATE_ATTEMPTS = 3  # an allocation that met space being given back asks again
SETTLE_WAIT_S = 0.002  # … after this long, when another writer is giving space back
_ALLOCATE_RESULT = TypeAdapter(AllocateResult)

# One attempt's answer: ([(key, page)] granted, existing keys, keys without room,
# pages marked to give back).
Attempt = tuple[list[tuple[str, int]], list[str], list[str], list[GiveBack]]


def require_keys(keys: Sequence[str]) -> None:
    """`check_keys`, unless a request model already did (`CheckedKeys`)."""
    if not isinstance(keys, CheckedKeys):
        check_keys(keys)


def check_retention(retention_s: float) -> None:
    """A retention is a positive, finite number of seconds (what `CommitItem` declares;
    checked again for items built with `model_construct`)."""
    if not (isinstance(retention_s, int | float) and 0 < retention_s <= INT_MAX / 1000):
        raise InvalidRequest(
            f"retention_s must be a positive number of seconds, got {retention_s!r}"
        )


def check_watermarks(low: float, high: float) -> None:
    if not 0 <= low <= high <= 1:
        raise InvalidRequest(f"watermarks must satisfy 0 <= low ({low}) <= high ({high}) <= 1")


def pin_limit_error(new: int, size: int, total: int, max_pinned: int | None) -> InvalidRequest:
    """The refusal of pins that would hold more than `storage.max_pinned`."""
    return InvalidRequest(
        f"pinning {new} more keys ({size} bytes) would pin {total} bytes,"
        f" more than storage.max_pinned ({max_pinned} bytes)",
        hint="unpin something (`hf3fsctl unpin`), pin fewer prompts, or raise storage.max_pinned",
    )


def capacity_info(capacity: int | None, held: int) -> CapacityInfo:
    return CapacityInfo(
        capacity_bytes=capacity,
        bytes_used=held,
        bytes_free=None if capacity is None else max(0, capacity - held),
    )


def manifest_ranks(manifest: dict[str, Any]) -> int:
    """`tp_size * pp_size` of a manifest, validated."""
    sizes = []
    for name in ("tp_size", "pp_size"):
        value = manifest.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
            raise InvalidRequest(f"manifest {name} must be an integer in 1..4096, got {value!r}")
        sizes.append(value)
    if sizes[0] * sizes[1] > 4096:
        raise InvalidRequest(f"manifest has {sizes[0] * sizes[1]} ranks (TP x PP); at most 4096")
    return sizes[0] * sizes[1]


def check_rank_file(info: NamespaceInfo, rank_file: RankFile) -> None:
    """Refuse a rank file its namespace cannot have (every store checks the same).

    Raises:
        InvalidRequest: the rank is out of range, `page_bytes` differs from the
            manifest's, or `slot_bytes` is smaller than `page_bytes`.
    """
    if rank_file.rank >= info.num_ranks:
        raise InvalidRequest(
            f"rank {rank_file.rank} is out of range: namespace {info.id} has {info.num_ranks} ranks"
        )
    page_bytes = info.manifest.get("page_bytes")
    if isinstance(page_bytes, int) and page_bytes != rank_file.page_bytes:
        raise InvalidRequest(
            f"rank file page_bytes {rank_file.page_bytes} differs from the manifest's {page_bytes}"
        )
    if rank_file.slot_bytes < rank_file.page_bytes:
        raise InvalidRequest("rank file slot_bytes is smaller than page_bytes")


class StoreCore:
    """The validation, allocate loop and capacity bookkeeping of every store.

    Args (of `_init_core`, which a store's `__init__` calls first):
        url: what the store prints as its location (a redacted URL, or a path).
        lease_s: how long a located page stays unreusable, even if evicted.
        high_watermark: an allocation past this share of the capacity makes room…
        low_watermark: … down to this share.
        pending_timeout_s: a pending allocation older than this belongs to a dead writer
            (`policy.pending_timeout_s`, the configured value, wins when set).
        policy: capacity, pins, quotas and the storage root (`StorePolicy`). Without one
            the store is unbounded, as are pins, and freed space stays in its files.
    """

    lookup_does_io: bool = False  # the server runs lookups on its loop unless True
    url: str
    policy: StorePolicy

    def _init_core(
        self,
        url: str,
        *,
        lease_s: float,
        high_watermark: float,
        low_watermark: float,
        pending_timeout_s: float,
        policy: StorePolicy | None,
    ) -> None:
        check_watermarks(low_watermark, high_watermark)
        self.url = url
        self.lease_s = float(lease_s)
        self.high_watermark = float(high_watermark)
        self.low_watermark = float(low_watermark)
        self.policy = policy or StorePolicy(storage_root=None, capacity="100%")
        if self.policy.pending_timeout_s is not None:  # the configured deadline wins
            pending_timeout_s = self.policy.pending_timeout_s
        self.pending_timeout_s = float(pending_timeout_s)
        self._puncher = HolePuncher(self.policy.storage_root)

    # --- primitives: each store's own -------------------------------------------------

    def _register_namespace(
        self, namespace: str, manifest: dict[str, Any], num_ranks: int
    ) -> NamespaceInfo:
        raise NotImplementedError

    def _register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        raise NotImplementedError

    def _get_namespace(self, namespace: str) -> NamespaceInfo:
        raise NotImplementedError

    def _lookup(self, namespace: str, keys: Sequence[str]) -> int:
        raise NotImplementedError

    def _locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        raise NotImplementedError

    def _allocate_once(
        self, namespace: str, rank: int, keys: list[str], depth_of: dict[str, int]
    ) -> Attempt:
        """One atomic allocation of `keys` (new to the call): reclaim, make room (the
        backend's eviction decision), grant pages."""
        raise NotImplementedError

    def _give_back(self, marked: Sequence[GiveBack]) -> None:
        """Punch pages an attempt marked, then settle the marks."""
        raise NotImplementedError

    def _giving_back_elsewhere(self) -> bool:
        """Whether some writer's freed pages are marked and not yet punched."""
        raise NotImplementedError

    def _commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        raise NotImplementedError

    def _release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        raise NotImplementedError

    def _invalidate(self, namespace: str, rank: int, triples: list[tuple[str, int, str]]) -> int:
        raise NotImplementedError

    def _admit(self, namespace: str, keys: list[str], after_hits: int) -> list[bool]:
        """One sighting of each of `keys` (distinct); whether each is now admitted."""
        raise NotImplementedError

    def _evict(self, request: EvictRequest) -> EvictResult:
        raise NotImplementedError

    def _capacity_held(self) -> tuple[int | None, int]:
        """(recorded capacity, held bytes)."""
        raise NotImplementedError

    def _set_capacity(self, capacity_bytes: int) -> None:
        raise NotImplementedError

    def _record_capacity_if_none(self, capacity_bytes: int) -> int | None:
        """Record `capacity_bytes` unless a capacity is recorded; returns the recorded one."""
        raise NotImplementedError

    def _pin(self, namespace: str, keys: Sequence[str], ttl_s: float | None) -> PinResult:
        raise NotImplementedError

    def _unpin(self, namespace: str, keys: Sequence[str] | None) -> int:
        raise NotImplementedError

    def _list_pins(self, namespace: str | None, limit: int) -> list[PinInfo]:
        raise NotImplementedError

    def _list_entries(self, namespace: str | None, limit: int, offset: int) -> list[EntryInfo]:
        raise NotImplementedError

    def _drop_namespaces(self, namespace_ids: list[str], dry_run: bool) -> DropNamespacesResult:
        raise NotImplementedError

    def _changes(self, since: int, namespace: str | None, limit: int) -> ChangeLog:
        raise NotImplementedError

    def _record_writer(self, namespace: str, writer: WriterInfo) -> None:
        raise NotImplementedError

    def _writers(self, namespace: str | None) -> dict[str, list[WriterInfo]]:
        raise NotImplementedError

    def stats(self) -> StoreStats:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        """`close` at the end of a server's life."""
        self.close()

    # --- capacity bookkeeping ---------------------------------------------------------

    def _default_capacity(self, held: int) -> int | None:
        """Record the policy's default capacity when the store has none and the storage
        root is here to size it from; returns the recorded capacity (None: unbounded)."""
        root = self.policy.storage_root
        if root is None or not Path(root).is_dir():
            logger.log(
                logging.WARNING if root is not None else logging.DEBUG,
                "metadata store %s has no recorded capacity and no storage root here to "
                "size one from: unbounded until `hf3fsctl init --capacity` records one",
                self.url,
            )
            return None
        value = resolve_capacity(self.policy.capacity, root, held)
        recorded = self._record_capacity_if_none(value)
        if recorded == value:
            logger.info("metadata store %s: capacity %d bytes recorded", self.url, value)
        return recorded

    def capacity(self) -> CapacityInfo:
        """The recorded capacity and the bytes the page files hold."""
        return capacity_info(*self._capacity_held())

    def set_capacity(self, capacity_bytes: int) -> CapacityInfo:
        """Record the store's capacity (every process enforces the recorded value)."""
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidRequest(f"capacity must be a number of bytes, got {capacity_bytes!r}")
        if capacity_bytes <= 0:
            raise InvalidRequest(f"capacity must be positive, got {capacity_bytes}")
        self._set_capacity(capacity_bytes)
        return self.capacity()

    # --- namespaces -------------------------------------------------------------------

    def register_namespace(self, namespace: str, manifest: dict[str, Any]) -> NamespaceInfo:
        """Create a namespace, or return it if identical; `NamespaceConflict` if not."""
        check_namespace_id(namespace)
        expected = namespace_id(manifest)
        if expected != namespace:
            raise InvalidRequest(
                f"namespace id {namespace} does not match its manifest (hash {expected})"
            )
        return self._register_namespace(namespace, manifest, manifest_ranks(manifest))

    def register_rank(self, namespace: str, rank_file: RankFile) -> NamespaceInfo:
        """Record one rank's page file; `NamespaceConflict` if it differs from before."""
        check_namespace_id(namespace)
        return self._register_rank(namespace, rank_file)

    def get_namespace(self, namespace: str) -> NamespaceInfo:
        """One namespace; `NotFound` if absent."""
        check_namespace_id(namespace)
        return self._get_namespace(namespace)

    def drop_namespaces(
        self, namespace_ids: Sequence[str], *, dry_run: bool = False
    ) -> DropNamespacesResult:
        """Remove namespaces' metadata (entries, rank files, pins, the namespace).

        A namespace whose pages are being written is skipped (its `skipped` says why).
        The page files are the caller's to remove (`storage.layout.remove_namespace_files`):
        the server may not have the mount.
        """
        for ns in namespace_ids:
            check_namespace_id(ns)
        return self._drop_namespaces(list(dict.fromkeys(namespace_ids)), dry_run)

    def record_writer(self, namespace: str, writer: WriterInfo) -> None:
        """Record an engine that wrote to `namespace`; the first record of an id is kept.

        Raises:
            NotFound: the namespace is not registered.
            InvalidRequest: more than `MAX_WRITER_SETTINGS` settings.
        """
        check_namespace_id(namespace)
        writer = WriterInfo.model_validate(writer)
        if len(writer.numerics) > MAX_WRITER_SETTINGS:
            raise InvalidRequest(
                f"a writer records at most {MAX_WRITER_SETTINGS} settings, "
                f"got {len(writer.numerics)}"
            )
        self._get_namespace(namespace)  # NotFound
        self._record_writer(namespace, writer.model_copy(update={"first_seen": time.time()}))

    def writers(self, namespace: str | None = None) -> dict[str, list[WriterInfo]]:
        """Recorded writers by namespace id (one namespace's, or all), oldest first."""
        if namespace is not None:
            check_namespace_id(namespace)
        found = self._writers(namespace)
        return {ns: sorted(ws, key=lambda w: (w.first_seen, w.id)) for ns, ws in found.items()}

    def namespace_stats(self, namespace: str) -> NamespaceStats:
        """Usage and traffic of one namespace; `NotFound` if absent."""
        check_namespace_id(namespace)
        for stats in self.stats().namespaces:
            if stats.id == namespace:
                return stats
        raise NotFound(f"namespace {namespace} is not registered")

    # --- data path --------------------------------------------------------------------

    def lookup(self, namespace: str, keys: Sequence[str]) -> int:
        """Number of leading `keys` committed on every rank of the namespace.

        Keys are checked (`check_keys`) on this and the other data-path calls, except
        `CheckedKeys`, which a request model already checked (the server's bodies).
        """
        require_keys(keys)
        check_namespace_id(namespace)
        return self._lookup(namespace, keys)

    def locate(self, namespace: str, rank: int, keys: Sequence[str]) -> list[Location | None]:
        """Committed locations of `keys` on `rank` (None if absent), with a read lease."""
        require_keys(keys)
        check_namespace_id(namespace)
        return self._locate(namespace, rank, keys)

    def allocate(
        self, namespace: str, rank: int, keys: Sequence[str], first_depth: int = 0
    ) -> AllocateResult:
        """Pages for keys not yet stored on `rank`; may evict LRU keys above the watermark.

        Up to `ALLOCATE_ATTEMPTS` atomic steps: an allocation refused for space that is
        being given back (this call's marks, or another writer's) asks again once that
        space is settled.
        """
        allocated, existing, no_space = self._allocate_keys(namespace, rank, keys, first_depth)
        return _ALLOCATE_RESULT.validate_python(
            {
                "allocated": [{"key": key, "page": page} for key, page in allocated],
                "existing": existing,
                "no_space": no_space,
            }
        )

    def _allocate_keys(
        self,
        namespace: str,
        rank: int,
        keys: Sequence[str],
        first_depth: int,
        depths: Sequence[int] | None = None,
    ) -> tuple[list[tuple[str, int]], list[str], list[str]]:
        """`allocate`'s checks and loop: ([(key, page)] granted, existing, no space).

        `depths`: each key's chain position (several chains at once), instead of
        `first_depth` + its index.
        """
        require_keys(keys)
        check_namespace_id(namespace)
        if first_depth < 0:
            raise InvalidRequest(f"first_depth must be >= 0, got {first_depth}")
        depth_of: dict[str, int] = {}
        if depths is None:
            for index, key in enumerate(keys):
                depth_of.setdefault(key, first_depth + index)
        else:
            if len(depths) != len(keys) or any(
                type(depth) is not int or depth < 0 for depth in depths
            ):
                raise InvalidRequest("depths must be one integer >= 0 per key")
            for key, depth in zip(keys, depths, strict=True):
                depth_of.setdefault(key, depth)
        allocated: list[tuple[str, int]] = []
        existing: list[str] = []
        wanted = list(depth_of)
        no_space: list[str] = []
        for attempt in range(ALLOCATE_ATTEMPTS):
            granted, known, no_space, marked = self._allocate_once(
                namespace, rank, wanted, depth_of
            )
            allocated += granted
            existing += known
            self._give_back(marked)
            if not no_space or attempt == ALLOCATE_ATTEMPTS - 1:
                break
            # Space counts as free only once punched: ask again once the room this call
            # made is settled, or — when another writer's freed pages are still being
            # given back — a moment later.
            if not marked:
                if not self._giving_back_elsewhere():
                    break
                time.sleep(SETTLE_WAIT_S)
            wanted = no_space
        return allocated, existing, no_space

    def commit(self, namespace: str, rank: int, items: Sequence[CommitItem]) -> int:
        """Pending → committed for the exact (key, page) pairs; returns how many.

        `items` are validated models (their keys were checked when they were built).
        """
        if not items:
            return 0
        check_namespace_id(namespace)
        for item in items:
            if item.retention_s is not None:
                check_retention(item.retention_s)
        if any(item.renew_on_read and item.retention_s is None for item in items):
            # Nothing to renew without an expiry: the flag is dropped, not refused (the
            # request is valid by the API's schema, and a never-expiring entry is what
            # it asks for). Backends then see renew_on_read only beside a retention.
            items = [
                item.model_copy(update={"renew_on_read": False})
                if item.renew_on_read and item.retention_s is None
                else item
                for item in items
            ]
        return self._commit(namespace, rank, items)

    def release(self, namespace: str, rank: int, allocations: Sequence[Allocation]) -> int:
        """Give back pending allocations (exact (key, page) pairs); returns how many.

        `allocations` are validated models (their keys were checked when they were built).
        """
        if not allocations:
            return 0
        check_namespace_id(namespace)
        return self._release(namespace, rank, allocations)

    def invalidate(self, namespace: str, rank: int, items: InvalidateItems) -> int:
        """Drop keys whose committed page on `rank` a reader found corrupt.

        A key is dropped on every rank, and only while `rank` still holds exactly the
        reported (page, checksum); pages are freed honouring read leases. Idempotent.
        Returns how many keys were dropped.
        """
        triples = page_triples(items)
        check_keys([key for key, _, _ in triples])
        if any(page < 0 for _, page, _ in triples):
            raise InvalidRequest("pages must be >= 0")
        if not triples:
            return 0
        check_namespace_id(namespace)
        dropped = self._invalidate(namespace, rank, triples)
        if dropped:
            logger.warning(
                "dropped %d keys of namespace %s: corrupt pages on rank %d",
                dropped,
                namespace,
                rank,
            )
        return dropped

    def admit(self, namespace: str, keys: Sequence[str], after_hits: int) -> list[bool]:
        """Record one sighting of each key; per key, whether it has now been seen at least
        `after_hits` times (`after_hits <= 1`: every key, nothing recorded).

        A key repeated in `keys` is one sighting, and answered alike at each position.

        Raises:
            NotFound: the namespace is not registered.
        """
        require_keys(keys)
        check_namespace_id(namespace)
        if isinstance(after_hits, bool) or not isinstance(after_hits, int):
            raise InvalidRequest(f"after_hits must be an integer, got {after_hits!r}")
        if after_hits <= 1:
            return [True] * len(keys)
        unique = list(dict.fromkeys(keys))
        admitted = dict(zip(unique, self._admit(namespace, unique, after_hits), strict=True))
        return [admitted[key] for key in keys]

    # --- admin ------------------------------------------------------------------------

    def evict(self, request: EvictRequest) -> EvictResult:
        """Evict committed keys (all ranks at once) by the request's criteria."""
        if not (
            request.all
            or request.older_than_s is not None
            or request.target_usage is not None
            or request.max_entries is not None
        ):
            raise InvalidRequest(
                "say what to evict: all, older_than_s, target_usage or max_entries"
            )
        if request.namespace is not None:
            check_namespace_id(request.namespace)
        result = self._evict(request)
        if result.keys and not request.dry_run:
            logger.info("evicted %d keys (%d pages)", result.keys, result.pages)
        return result

    def list_entries(
        self, namespace: str | None = None, limit: int = 100, offset: int = 0
    ) -> list[EntryInfo]:
        """Entries (one per key and rank), most recently used first."""
        if namespace is not None:
            check_namespace_id(namespace)
        if limit < 0 or offset < 0:
            raise InvalidRequest("limit and offset must be >= 0")
        return self._list_entries(namespace, limit, offset)

    def pin(self, namespace: str, keys: Sequence[str], ttl_s: float | None = None) -> PinResult:
        """Keep `keys` out of LRU eviction (for `ttl_s`, or until unpinned).

        Raises:
            InvalidRequest: the pins would hold more than `storage.max_pinned`.
            NotFound: the namespace is not registered.
        """
        check_keys(keys)
        check_namespace_id(namespace)
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequest(f"ttl must be positive, got {ttl_s}")
        return self._pin(namespace, keys, ttl_s)

    def unpin(self, namespace: str, keys: Sequence[str] | None = None) -> int:
        """Drop pins of `keys` (all of the namespace's when None); returns how many."""
        check_namespace_id(namespace)
        if keys is not None:
            check_keys(keys)
        return self._unpin(namespace, keys)

    def list_pins(self, namespace: str | None = None, limit: int = 1000) -> list[PinInfo]:
        """Live pins, newest first."""
        if namespace is not None:
            check_namespace_id(namespace)
        return self._list_pins(namespace, limit)

    def changes(self, since: int, namespace: str | None = None, limit: int = 10_000) -> ChangeLog:
        """The change log after `since` (-1: its end): keys that gained or lost a rank."""
        if namespace is not None:
            check_namespace_id(namespace)
        return self._changes(since, namespace, limit)
