"""The metadata vocabulary: pydantic models shared by the store, the server and the clients.

Results (`Location`, `AllocateResult`, `StoreStats`, …) are what every `MetadataClient`
returns, whether it talks to SQLite in-process or to `hf3fsctl serve` over HTTP; request
bodies (`*Request`) are what the HTTP routes accept. Keys are lower-case hex block keys
(`hf3fsctl.keys.check_key`), namespaces 16-hex-digit ids.

The key lists of request bodies (`BlockKeys`) are checked all at once (`check_keys`, one
C-speed pass: ~0.04 ms for 1,000 keys, a third of what a pattern per key costs)
and arrive as `CheckedKeys`, which the store does not check again. Integers of requests
are bounded by `INT_MAX` (2**53: exact in every JSON reader, far inside SQLite's INTEGER),
so an oversized number is a 422, not a 500; a whole-number float (`2.0`) is the integer
it is, as JSON Schema says. What a request model declares is what `/openapi.json` says
(the server adds the one app-level bound, `maxItems: max_batch`); rules a schema cannot
state (a namespace id is its manifest's hash) are in the models' docstrings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    TypeAdapter,
    WithJsonSchema,
    model_validator,
)
from pydantic.config import JsonDict

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.keys import check_keys

KEY_PATTERN = r"^[0-9a-f]{16,128}$"
NAMESPACE_PATTERN = r"^[0-9a-f]{16}$"
# a rank's page file, relative to the storage root (`storage.layout.rank_file_name`): the
# pattern alone keeps a registered path under the root (no "/", "..", NUL or backslash)
RANK_FILE_PATTERN = r"^[0-9a-f]{16}/rank-[0-9]{4}\.pages$"
# the largest integer a request may carry: 2**53, the interoperable JSON range (I-JSON,
# RFC 7493: beyond it a JSON number may be read as a float and rounded, so a bound near
# SQLite's 2**63 - 1 is not the same bound on both sides), far inside SQLite's INTEGER
INT_MAX = 2**53
SQL_INT_MAX = INT_MAX  # the earlier name
MAX_RANKS = 4096  # tp_size * pp_size of one namespace


def _whole_number(value: Any) -> Any:
    """A float with no fractional part as the int it is (JSON Schema's "integer": 2.0 is one)."""
    return int(value) if type(value) is float and value.is_integer() else value


WholeNumber = BeforeValidator(_whole_number)
"""Integers of request bodies are parsed strictly (no `"1"`, no `true`) but take `2.0`."""

Key = Annotated[str, Field(pattern=KEY_PATTERN)]
NamespaceId = Annotated[str, Field(pattern=NAMESPACE_PATTERN)]
Rank = Annotated[int, Field(ge=0, le=MAX_RANKS - 1), WholeNumber]
Page = Annotated[int, Field(ge=0, le=INT_MAX), WholeNumber]
Positive = Annotated[int, Field(gt=0, le=INT_MAX), WholeNumber]
Size = Annotated[int, Field(ge=0, le=INT_MAX), WholeNumber]


class CheckedKeys(list[str]):
    """Block keys a request model has checked (`BlockKeys`): the store trusts them."""

    __slots__ = ()


_KEY_LIST: TypeAdapter[list[str]] = TypeAdapter(list[Key])


def _checked_keys(keys: list[str]) -> CheckedKeys:
    """`keys` checked in one pass; on failure pydantic's own error names the first bad key."""

    try:
        check_keys(keys)  # a trailing newline too is refused (`fullmatch`), as the schema says
    except InvalidRequest:
        _KEY_LIST.validate_python(keys)  # raises, located at the bad key
        raise
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


class PageLocation(NamedTuple):
    """A `Location` as an embedded store hands it to `Tier` (`LocatesPages`): the same
    fields in a tuple, built from the store's own row without validation (a synchronous
    load locates tens of pages on the engine thread; a pydantic model is ~1 µs each).
    Never a request or response body: the HTTP shape stays `Location`."""

    key: str
    page: int
    checksum: str
    size: int

    def to_location(self) -> Location:
        """The validated model (for `invalidate` and anything else that wants one)."""
        return Location(key=self.key, page=self.page, checksum=self.checksum, size=self.size)


class PageGrant(NamedTuple):
    """An `AllocateResult` as an embedded store hands it to `Tier` (`SavesPages`): the
    same lists, the allocations as `(key, page)` tuples, without validation (a save
    allocates tens of pages beside the forward; a pydantic model is ~1 µs each). Never
    a request or response body: the HTTP shape stays `AllocateResult`."""

    allocated: list[tuple[str, int]]
    existing: list[str]
    no_space: list[str]


class Allocation(_Model):
    """A page handed to a writer for a key; pending until committed or released."""

    key: Key
    page: Page


class AllocateResult(_Model):
    """Outcome of `allocate`: new pages, keys already stored or being written, no space."""

    allocated: list[Allocation]
    existing: list[Key]
    no_space: list[Key]


# A retention is a positive, finite number of seconds, at most ~285 years (INT_MAX ms).
Retention = Annotated[float, Field(gt=0, le=INT_MAX / 1000, allow_inf_nan=False)]


class CommitItem(_Model):
    """A written page: the allocation plus the checksum of what was written.

    `retention_s` gives the entry an expiry (commit time + retention): once it passes, the
    entry is absent for `lookup` and `locate` and the first to go in every eviction (a pin
    still keeps it from eviction, not from expiring). `renew_on_read`: each `locate` of
    the entry moves its expiry to then + `retention_s`; other reads never extend it.
    """

    key: Key
    page: Page
    checksum: str = Field(min_length=1, max_length=64)
    size: Size
    retention_s: Retention | None = None  # None: the entry never expires
    renew_on_read: bool = False  # a locate renews the expiry (ignored without retention_s)


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


_EVICT_CRITERIA: JsonDict = {
    "anyOf": [
        {"required": ["all"], "properties": {"all": {"const": True}}},
        {"required": ["older_than_s"], "properties": {"older_than_s": {"type": "number"}}},
        {"required": ["target_usage"], "properties": {"target_usage": {"type": "number"}}},
        {"required": ["max_entries"], "properties": {"max_entries": {"type": "integer"}}},
    ]
}


class EvictRequest(_Model):
    """What to evict. Criteria combine (AND); `all` evicts everything selected.

    At least one criterion must be given (`all`, `older_than_s`, `target_usage` or
    `max_entries`); the schema says so (`anyOf`), the store refuses others (400).
    """

    model_config = ConfigDict(json_schema_extra=_EVICT_CRITERIA)

    namespace: NamespaceId | None = None
    older_than_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # last access
    target_usage: float | None = Field(default=None, ge=0, le=1)  # evict LRU down to this
    max_entries: Size | None = None  # at most this many
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
    admission_skipped: int = 0  # keys `admit` answered False (seen fewer than after_hits)
    expiring_keys: int = 0  # keys held whose entries have an expiry (retention_s)
    expired_keys: int = 0  # … of those, expired now (absent for lookups; evicted first)


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

    @classmethod
    def summed(
        cls,
        namespaces: list[NamespaceStats],
        capacity_bytes: int | None,
        max_pinned_bytes: int | None,
    ) -> StoreStats:
        """The store's figures: its namespaces' totals under its capacity."""
        held = sum(n.bytes_used for n in namespaces)
        return cls(
            namespaces=namespaces,
            capacity_bytes=capacity_bytes,
            bytes_used=held,
            bytes_free=None if capacity_bytes is None else max(0, capacity_bytes - held),
            bytes_live=sum(n.bytes_live for n in namespaces),
            pages_used=sum(n.pages_used for n in namespaces),
            pinned_keys=sum(n.pinned_keys for n in namespaces),
            pinned_bytes=sum(n.pinned_bytes for n in namespaces),
            max_pinned_bytes=max_pinned_bytes,
        )

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


WriterId = Annotated[str, Field(pattern=r"^[0-9a-f]{12}$")]
MAX_WRITER_SETTINGS = 32  # settings one writer records, each at most 200 characters


class WriterInfo(_Model):
    """An engine that wrote pages to a namespace: its numerics (the settings that decide
    the KV's bits, `hf3fsctl.vllm_tools.numerics`) and their short hash."""

    id: WriterId  # `numerics_hash(numerics)`
    numerics: dict[str, Annotated[str, Field(max_length=200)]]
    first_seen: float = 0.0  # when the store first recorded it (the store's clock)


class RecordWriterRequest(_Model):
    """Record a writer of a namespace (idempotent: the first record of an id is kept)."""

    namespace: NamespaceId
    writer: WriterInfo


class WritersResponse(_Model):
    """Recorded writers by namespace id, oldest first."""

    writers: dict[str, list[WriterInfo]]


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
    expires_at: float | None = None  # when the entry expires (None: never)


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


def _manifest_ranks(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with `tp_size` / `pp_size` checked, whole-number floats made ints.

    Their product (at most `MAX_RANKS`) is the store's to check (400): a schema cannot say it.
    """
    sizes = {name: _whole_number(manifest.get(name)) for name in ("tp_size", "pp_size")}
    for name, value in sizes.items():
        if type(value) is not int or not 1 <= value <= MAX_RANKS:
            raise ValueError(f"manifest.{name} must be an integer in 1..{MAX_RANKS}")
    return {**manifest, **sizes}


_RANK_COUNT = {"type": "integer", "minimum": 1, "maximum": MAX_RANKS}
Manifest = Annotated[
    dict[str, Any],
    AfterValidator(_manifest_ranks),
    WithJsonSchema(
        {
            "type": "object",
            "description": "A namespace manifest (`hf3fsctl.keys.NamespaceManifest`); the "
            f"store needs `tp_size` and `pp_size`, whose product is at most {MAX_RANKS}.",
            "required": ["tp_size", "pp_size"],
            "properties": {"tp_size": _RANK_COUNT, "pp_size": _RANK_COUNT},
            "additionalProperties": True,
        }
    ),
]
"""A manifest in a request: any JSON object whose `tp_size` and `pp_size` the store can use."""


class RankFileBody(RankFile):
    """A rank file in a request: its `path` is the rank's file under the storage root."""

    path: Annotated[str, Field(pattern=RANK_FILE_PATTERN)]  # "<namespace>/rank-NNNN.pages"

    def as_rank_file(self) -> RankFile:
        """The plain `RankFile` (what the store records and compares)."""
        return RankFile.model_construct(**self.__dict__)


class RegisterNamespaceRequest(_Model):
    """Register a namespace. Its id must be `hf3fsctl.keys.namespace_id(manifest)` (400)."""

    namespace: NamespaceId
    manifest: Manifest


class RegisterRankRequest(_Model):
    """Register a rank's page file: `<namespace>/rank-NNNN.pages` of this very namespace and
    rank (422), so that no namespace can point at another's file. The rank must be below
    the namespace's `num_ranks`, `page_bytes` the manifest's, and `slot_bytes` at least
    `page_bytes` (else 400)."""

    namespace: NamespaceId
    rank_file: RankFileBody

    @model_validator(mode="after")
    def _own_file(self) -> RegisterRankRequest:
        expected = f"{self.namespace}/rank-{self.rank_file.rank:04d}.pages"
        if self.rank_file.path != expected:
            raise ValueError(f"rank_file.path must be {expected!r}, the file of this rank")
        return self


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
    first_depth: Annotated[int, Field(ge=0, le=INT_MAX), WholeNumber] = 0  # position of keys[0]


class AdmitRequest(_Model):
    """Record one sighting of each key; a key is admitted once seen `after_hits` times."""

    namespace: NamespaceId
    keys: BlockKeys
    after_hits: Annotated[int, Field(ge=0, le=INT_MAX), WholeNumber]


class AdmitResponse(_Model):
    admitted: list[bool]  # per key: seen at least after_hits times now


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

    since: Annotated[int, Field(ge=-1, le=SQL_INT_MAX), WholeNumber]
    namespace: NamespaceId | None = None  # only this namespace's changes
    limit: Annotated[int, Field(ge=1, le=100_000), WholeNumber] = 10_000


class CountResponse(_Model):
    count: int


class ErrorResponse(_Model):
    error: str  # the error class, e.g. "NamespaceConflict"
    detail: str  # one line saying what was wrong
