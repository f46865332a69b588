"""The metadata vocabulary: pydantic models shared by the store, the server and the clients.

Results (`Location`, `AllocateResult`, `StoreStats`, …) are what every `MetadataClient`
returns, whether it talks to SQLite in-process or to `hf3fsctl serve` over HTTP; request
bodies (`*Request`) are what the HTTP routes accept. Keys are lower-case hex block keys
(`hf3fsctl.keys.check_key`), namespaces 16-hex-digit ids.

The key lists of request bodies (`BlockKeys`) are checked all at once (`check_keys`, one
C-speed pass: ~0.04 ms for 1,000 keys, a third of what a pattern per key costs)
and arrive as `CheckedKeys`, which the store does not check again. Integers that reach
SQLite are bounded by its INTEGER range, so an oversized number is a 422, not a 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    TypeAdapter,
    WithJsonSchema,
)

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.keys import check_keys

KEY_PATTERN = r"^[0-9a-f]{16,128}$"
NAMESPACE_PATTERN = r"^[0-9a-f]{16}$"
SQL_INT_MAX = 2**63 - 1  # SQLite's largest INTEGER

Key = Annotated[str, Field(pattern=KEY_PATTERN)]
NamespaceId = Annotated[str, Field(pattern=NAMESPACE_PATTERN)]
Rank = Annotated[int, Field(ge=0, le=4095)]
Page = Annotated[int, Field(ge=0, le=SQL_INT_MAX)]
Positive = Annotated[int, Field(gt=0, le=SQL_INT_MAX)]


class CheckedKeys(list[str]):
    """Block keys a request model has checked (`BlockKeys`): the store trusts them."""

    __slots__ = ()


_KEY_LIST: TypeAdapter[list[str]] = TypeAdapter(list[Key])


def _checked_keys(keys: list[str]) -> CheckedKeys:
    """`keys` checked in one pass; on failure pydantic's own error names the first bad key."""

    try:
        check_keys(keys)
    except InvalidRequest:
        _KEY_LIST.validate_python(keys)  # raises, located at the bad key
        raise
    # `check_key`'s pattern lets a trailing newline through; the declared schema does not
    if keys and "\n" in "".join(keys):
        _KEY_LIST.validate_python(keys)
    return CheckedKeys(keys)


BlockKeys = Annotated[
    list[Annotated[StrictStr, WithJsonSchema({"type": "string", "pattern": KEY_PATTERN})]],
    AfterValidator(_checked_keys),
]
"""A request's list of block keys, validated in one pass into `CheckedKeys`."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- namespaces -------------------------------------------------------------------


class RankFile(_Model):
    """One rank's page file of a namespace."""

    rank: Rank
    path: str  # relative to the storage root, e.g. "<namespace>/rank-0000.pages"
    page_bytes: Positive  # bytes of one page (a block, all layers, K and V)
    slot_bytes: Positive  # bytes between page starts (page_bytes, aligned)
    num_pages: Positive  # pages the file can address (a growing file: its limit)
    preallocated: bool = False  # fallocated at full size (else grows on demand)


class NamespaceInfo(_Model):
    """A registered namespace and the rank files registered so far."""

    id: NamespaceId
    manifest: dict[str, Any]
    num_ranks: int = Field(gt=0)
    created: float
    rank_files: list[RankFile]


# --- data path --------------------------------------------------------------------


class Location(_Model):
    """Where a committed page lives, and how to verify it."""

    key: Key
    page: Page
    checksum: str
    size: int


class Allocation(_Model):
    """A page handed to a writer for a key; pending until committed or released."""

    key: Key
    page: Page


class AllocateResult(_Model):
    """Outcome of `allocate`: new pages, keys already stored or being written, no space."""

    allocated: list[Allocation]
    existing: list[Key]
    no_space: list[Key]


class CommitItem(_Model):
    """A written page: the allocation plus the checksum of what was written."""

    key: Key
    page: Page
    checksum: str = Field(min_length=1, max_length=64)
    size: int = Field(ge=0, le=SQL_INT_MAX)


class InvalidateItem(_Model):
    """A committed page a reader found corrupt: drop its key if the page is still this one."""

    key: Key
    page: Page
    checksum: str = Field(min_length=1, max_length=64)


def page_triples(
    items: Sequence[Location | InvalidateItem | tuple[str, int, str]],
) -> list[tuple[str, int, str]]:
    """`(key, page, checksum)` of each item of an `invalidate` call."""
    return [
        item if isinstance(item, tuple) else (item.key, item.page, item.checksum) for item in items
    ]


# --- admin ------------------------------------------------------------------------


class EvictRequest(_Model):
    """What to evict. Criteria combine (AND); `all` evicts everything selected."""

    namespace: NamespaceId | None = None
    older_than_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # last access
    target_usage: float | None = Field(default=None, ge=0, le=1)  # evict LRU down to this
    max_entries: int | None = Field(default=None, ge=0, le=SQL_INT_MAX)  # at most this many
    all: bool = False
    include_pinned: bool = False  # pinned keys are left alone unless this is set
    dry_run: bool = False


class EvictResult(_Model):
    """What was (or, for a dry run, would be) evicted."""

    keys: int  # block keys removed (all ranks of each)
    pages: int  # pages freed
    bytes: int  # bytes freed
    dry_run: bool
    by_namespace: dict[str, int]  # keys removed per namespace


class NamespaceStats(_Model):
    """Usage and traffic of one namespace."""

    id: NamespaceId
    manifest: dict[str, Any]
    num_ranks: int
    keys: int  # block keys committed on every rank (loadable)
    pages_used: int  # pages held by committed or pending entries, all ranks
    bytes_live: int  # bytes of those pages
    bytes_used: int  # disk held by its page files (live pages, free pages not given back)
    quota_bytes: int | None  # its quota (or its model's), if any
    pinned_keys: int
    pinned_bytes: int  # pinned keys × page slots × ranks
    hits: int  # pages located for loading
    lookups: int  # lookup calls
    lookup_keys: int  # keys asked about in lookups
    hit_keys: int  # keys found by lookups
    last_access: float | None  # newest entry access
    last_used: float  # registration, lookups or loads, whichever is newest
    evicted: dict[str, list[int]] = Field(default_factory=dict)  # reason → [keys, bytes]


class StoreStats(_Model):
    """Usage and traffic of the whole store."""

    namespaces: list[NamespaceStats]
    capacity_bytes: int | None  # the store's one budget (None: unbounded)
    bytes_used: int  # disk held by every page file
    bytes_free: int | None  # capacity - used (None: unbounded)
    bytes_live: int  # bytes of pages held by entries
    pages_used: int  # pages held by entries
    pinned_keys: int
    pinned_bytes: int
    max_pinned_bytes: int | None

    @property
    def usage(self) -> float:
        """Held bytes as a share of the capacity (0 when unbounded)."""
        return self.bytes_used / self.capacity_bytes if self.capacity_bytes else 0.0


class CapacityInfo(_Model):
    """The store's recorded capacity and what holds it."""

    capacity_bytes: int | None
    bytes_used: int
    bytes_free: int | None


class SetCapacityRequest(_Model):
    capacity_bytes: Positive


class PinRequest(_Model):
    """Keep keys of a namespace out of LRU eviction (for `ttl_s` seconds, or until unpinned)."""

    namespace: NamespaceId
    keys: BlockKeys
    ttl_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class UnpinRequest(_Model):
    """Drop pins: the given keys, or every pin of the namespace when `keys` is None."""

    namespace: NamespaceId
    keys: BlockKeys | None = None


class PinResult(_Model):
    """Outcome of `pin`."""

    pinned: int  # keys pinned (new or refreshed)
    stored: int  # of those, keys committed now
    pinned_bytes: int  # bytes all pins of the store hold after this call
    max_pinned_bytes: int | None


class PinInfo(_Model):
    """One pin, for `ls --pins`."""

    namespace: NamespaceId
    key: Key
    created: float
    expires: float | None  # None: until unpinned
    stored: bool  # committed on every rank now


class DropNamespacesRequest(_Model):
    """Remove namespaces' metadata: entries, rank files, pins, the namespace itself."""

    namespaces: list[NamespaceId]
    dry_run: bool = False


class DroppedNamespace(_Model):
    id: NamespaceId
    keys: int  # committed keys removed
    bytes: int  # disk its page files held
    rank_files: list[str]  # their paths, relative to the storage root
    skipped: str | None = None  # why it was left alone (a writer is active)


class DropNamespacesResult(_Model):
    namespaces: list[DroppedNamespace]
    dry_run: bool


class EntryInfo(_Model):
    """One (key, rank) entry, for `ls`."""

    namespace: NamespaceId
    key: Key
    rank: Rank
    page: Page
    size: int
    checksum: str | None
    state: str  # "committed" or "pending"
    depth: int  # position of the block in its prefix chain
    created: float
    last_access: float
    hits: int
    pinned: bool = False


class Change(_Model):
    """One row of the store's change log: a (namespace, key) gained or lost a committed rank."""

    seq: int  # position in the log, increasing
    namespace: NamespaceId
    key: Key
    delta: Literal[1, -1]  # +1: one more rank committed; -1: a committed rank removed


class ChangeLog(_Model):
    """A slice of the change log, for KV events and other followers of the store.

    `next_seq` is where the next read starts. `missed` is True when rows after the
    requested `since` were already pruned (the follower lost some changes and should
    treat what it knew as stale).
    """

    changes: list[Change]
    next_seq: int
    missed: bool = False


# --- request bodies (HTTP) ---------------------------------------------------------


class RegisterNamespaceRequest(_Model):
    namespace: NamespaceId
    manifest: dict[str, Any]


class RegisterRankRequest(_Model):
    namespace: NamespaceId
    rank_file: RankFile


class LookupRequest(_Model):
    namespace: NamespaceId
    keys: BlockKeys


class LookupResponse(_Model):
    hits: int  # leading keys committed on every rank


class LocateRequest(_Model):
    namespace: NamespaceId
    rank: Rank
    keys: BlockKeys


class LocateResponse(_Model):
    locations: list[Location | None]


class AllocateRequest(_Model):
    namespace: NamespaceId
    rank: Rank
    keys: BlockKeys
    first_depth: int = Field(default=0, ge=0, le=2**62)  # chain position of keys[0]


class CommitRequest(_Model):
    namespace: NamespaceId
    rank: Rank
    items: list[CommitItem]


class ReleaseRequest(_Model):
    namespace: NamespaceId
    rank: Rank
    allocations: list[Allocation]


class InvalidateRequest(_Model):
    namespace: NamespaceId
    rank: Rank
    items: list[InvalidateItem]


class ChangesRequest(_Model):
    """Read the change log after `since` (-1: start at its end, returning no rows)."""

    since: int = Field(ge=-1, le=SQL_INT_MAX)
    namespace: NamespaceId | None = None  # only this namespace's changes
    limit: int = Field(default=10_000, ge=1, le=100_000)


class CountResponse(_Model):
    count: int


class ErrorResponse(_Model):
    error: str  # the error class, e.g. "NamespaceConflict"
    detail: str  # one line saying what was wrong
