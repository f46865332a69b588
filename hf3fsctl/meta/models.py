"""The metadata vocabulary: pydantic models shared by the store, the server and the clients.

Results (`Location`, `AllocateResult`, `StoreStats`, …) are what every `MetadataClient`
returns, whether it talks to SQLite in-process or to `hf3fsctl serve` over HTTP; request
bodies (`*Request`) are what the HTTP routes accept. Keys are lower-case hex block keys
(`hf3fsctl.keys.check_key`), namespaces 16-hex-digit ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

Key = Annotated[str, Field(pattern=r"^[0-9a-f]{16,128}$")]
NamespaceId = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
Rank = Annotated[int, Field(ge=0, le=4095)]
Page = Annotated[int, Field(ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- namespaces -------------------------------------------------------------------


class RankFile(_Model):
    """One rank's page file of a namespace."""

    rank: Rank
    path: str  # relative to the storage root, e.g. "<namespace>/rank-0000.pages"
    page_bytes: int = Field(gt=0)  # bytes of one page (a block, all layers, K and V)
    slot_bytes: int = Field(gt=0)  # bytes between page starts (page_bytes, aligned)
    num_pages: int = Field(gt=0)  # pages the file holds


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
    size: int = Field(ge=0)


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
    older_than_s: float | None = Field(default=None, ge=0)  # last access older than this
    target_usage: float | None = Field(default=None, ge=0, le=1)  # evict LRU down to this
    max_entries: int | None = Field(default=None, ge=0)  # evict at most this many keys
    all: bool = False
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
    pages_total: int  # pages in all registered rank files
    bytes_used: int
    bytes_total: int
    hits: int  # pages located for loading
    lookups: int  # lookup calls
    lookup_keys: int  # keys asked about in lookups
    hit_keys: int  # keys found by lookups
    last_access: float | None


class StoreStats(_Model):
    """Usage and traffic of the whole store."""

    namespaces: list[NamespaceStats]
    pages_used: int
    pages_total: int
    bytes_used: int
    bytes_total: int

    @property
    def usage(self) -> float:
        return self.bytes_used / self.bytes_total if self.bytes_total else 0.0


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


# --- request bodies (HTTP) ---------------------------------------------------------


class RegisterNamespaceRequest(_Model):
    namespace: NamespaceId
    manifest: dict[str, Any]


class RegisterRankRequest(_Model):
    namespace: NamespaceId
    rank_file: RankFile


class LookupRequest(_Model):
    namespace: NamespaceId
    keys: list[Key]


class LookupResponse(_Model):
    hits: int  # leading keys committed on every rank


class LocateRequest(_Model):
    namespace: NamespaceId
    rank: Rank
    keys: list[Key]


class LocateResponse(_Model):
    locations: list[Location | None]


class AllocateRequest(_Model):
    namespace: NamespaceId
    rank: Rank
    keys: list[Key]
    first_depth: int = Field(default=0, ge=0)  # chain position of keys[0]


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


class CountResponse(_Model):
    count: int


class ErrorResponse(_Model):
    error: str  # the error class, e.g. "NamespaceConflict"
    detail: str  # one line saying what was wrong
