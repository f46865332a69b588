"""Save, load, verify and invalidate the pages of one (namespace, rank), without vLLM.

The connector's worker side, `hf3fsctl warm` and a page scrub all move pages the same
way; this is that way, written once.

Contract:
    * `Tier.save(keys, pages, first_depth)`: allocate pages for the keys (keys already
      committed or being written are `existing`; `no_space` when the store could not make
      room) → claim their disk space (`PageFile.reserve`, growing files) → write the
      pages → commit with the checksums the engine computed (and the entries' expiry:
      `retention_s`, `renew_on_read`: meta/protocol.py, "Expiry"). Whatever fails gives back
      what this writer still holds, so nothing stays pending: the pages that failed to
      write at once, and every allocation when the claim, the commit or anything before
      it fails. ENOSPC/EDQUOT on the claim or on a page write (the errno, never the text) is
      `no_space`; another storage error is `io` (either is also the outcome's
      `storage_failure`, for the caller's back-off and health); a metadata outage is
      `metadata_down`; another typed error is `error`. A save that reached the store
      with no storage failure sets `storage_worked`. `Tier.save_many(batches)`: the same
      for several chains (a step's save jobs) in one allocate and one commit transaction
      where the store offers `SavesPages`, an outcome per batch. The pages are one buffer
      per key, or `PageSources`: each key's byte ranges (a host KV cache's block), written
      in place; a key whose ranges its owner reused before the write ended (asked after
      it) is `reused` and released, never committed.
    * `Tier.load(keys, into)`: locate (a read lease) → read each found page of the
      expected size into its target, verifying its checksum → deliver the intact pages.
      One path for both targets: `StagingRows` (one buffer per key; its `deliver`
      callback, a scatter into a KV cache, gets the intact rows) and `PagePieces` (the
      byte ranges of each key's page, such as a block of a host KV cache: the read itself
      delivers). Per key: `loaded`, `not_found`, `size` (the stored page has another
      size), `checksum`, `io`, `metadata_down`, `cancelled` or `error`.
    * A load given a `LoadCancel` checks it before it starts and, atomically with the
      delivery, before delivering: once cancelled, nothing is delivered (every key is
      `cancelled`), and a `cancel` after the delivery reports that it came too late. A
      `PagePieces` read delivers as it goes, so only a load the caller waits for should
      use it.
    * Pages that fail their checksum, or end before their size (a file truncated
      through them: torn), are returned (`LoadOutcome.corrupt`) and the store
      is told to drop them (`invalidate`: that exact page of the key, on every rank),
      so they fail one load and not every later one: inline (`LoadOutcome.invalidated`
      counts the keys dropped), or handed to the caller's `invalidate_with` (the
      connector runs a synchronous load's invalidation on a background thread, off the
      engine step; it calls `Tier.invalidate` there).
    * Neither call raises for a page, storage or metadata failure: typed errors
      (`Hf3fsctlError`) become outcomes. Anything else (a bug) propagates, after the
      save has released its allocations.
    * Metadata calls go through `client_call(fn)`, which runs `fn(client)` with the
      caller's guard (the connector's `MetadataGuard.call`: timeout, back-off); releases
      through `release_call`, default the same.

Imports neither vLLM, nor the CLI, nor the connector, nor torch (a staging pool is
passed in by a caller that has one).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar, cast

from hf3fsctl.errors import (
    Hf3fsctlError,
    InvalidRequest,
    MetadataUnavailable,
    NotFound,
    StorageError,
)
from hf3fsctl.meta.models import Allocation, CommitItem, Location, PageGrant, PageLocation
from hf3fsctl.meta.protocol import LocatesPages, SavesPages
from hf3fsctl.storage.engine import (
    ERROR_CHECKSUM,
    ERROR_SHORT,
    Buffer,
    IOEngine,
    PageResult,
    engine_host_memory,
)
from hf3fsctl.storage.layout import PageFile

if TYPE_CHECKING:
    from hf3fsctl.meta.protocol import DataPath
    from hf3fsctl.staging import StagingBuffer, StagingPool

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Per-key outcomes of a save.
SAVED = "saved"  # written and committed
EXISTING = "existing"  # already committed or being written by another writer
NO_SPACE = "no_space"  # the store or the file system had no room
REUSED = "reused"  # its source bytes were given to other data before the write ended
# Per-key outcomes of a load.
LOADED = "loaded"  # read, verified and delivered
NOT_FOUND = "not_found"  # not committed on this rank (a save: the namespace is unknown)
SIZE = "size"  # stored with another page size: never read
CHECKSUM = "checksum"  # the bytes read do not match the recorded checksum, or end early
CANCELLED = "cancelled"  # the load was cancelled before it delivered
# Of either.
IO = "io"  # the file system failed the read, write or claim
METADATA_DOWN = "metadata_down"  # the metadata service did not answer
ERROR = "error"  # any other typed error

_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class ClientCall(Protocol):
    """Runs one metadata call: `call(lambda client: client.locate(...))`. A tier needs
    only the data path of the store (`meta/protocol.py: DataPath`)."""

    def __call__(self, fn: Callable[[DataPath], T], /) -> T: ...


def _counts(kinds: Sequence[str], ok: tuple[str, ...]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind in kinds:
        if kind not in ok:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


@dataclass(frozen=True)
class StorageFailure:
    """The file system failed a save: what kind, how many pages, and why."""

    kind: str  # NO_SPACE or IO
    pages: int
    reason: str


@dataclass
class SaveOutcome:
    """What `Tier.save` did with each key."""

    kinds: list[str]  # per key, in the order given: SAVED, EXISTING or a failure kind
    committed: int = 0  # pages the store committed (fewer than SAVED if it reclaimed some)
    storage_failure: StorageFailure | None = None  # the file system failed (back off)
    storage_worked: bool = False  # pages reached the store with no storage failure
    # The store does not know this namespace or rank (its metadata was reset, or the
    # namespace removed): every key is `not_found`; the owner registers again.
    unregistered: bool = False

    def count(self, kind: str) -> int:
        """Keys with outcome `kind`."""
        return self.kinds.count(kind)

    def failures(self) -> dict[str, int]:
        """Keys not stored (neither saved nor existing), by kind, in first-seen order."""
        return _counts(self.kinds, (SAVED, EXISTING))


@dataclass
class LoadOutcome:
    """What `Tier.load` did with each key."""

    kinds: list[str]  # per key, in the order given: LOADED or a failure kind
    corrupt: list[Location] = field(default_factory=list)  # pages that failed their checksum
    invalidated: int = 0  # keys the store dropped (inline invalidation only)

    @property
    def loaded(self) -> list[int]:
        """Indices (into the keys) of the pages delivered intact."""
        return [i for i, kind in enumerate(self.kinds) if kind == LOADED]

    @property
    def failed(self) -> list[int]:
        """Indices of the keys whose page was not delivered intact."""
        return [i for i, kind in enumerate(self.kinds) if kind != LOADED]

    @property
    def failure_kind(self) -> str | None:
        """The kind a caller reports the load's failures under (None: nothing failed).

        `not_found` when a key was missing, else the first failed read (`checksum`,
        `io`), else the first failure of any kind.
        """
        failed = [kind for kind in self.kinds if kind != LOADED]
        if not failed:
            return None
        if NOT_FOUND in failed:
            return NOT_FOUND
        return next((kind for kind in failed if kind in (CHECKSUM, IO)), failed[0])

    def failures(self) -> dict[str, int]:
        """Keys not loaded, by kind, in first-seen order."""
        return _counts(self.kinds, (LOADED,))


class LoadCancel:
    """Cancels a load that may be running on another thread (a timeout, say)."""

    def __init__(self, whole: LoadCancel | None = None) -> None:
        self._lock: threading.Lock = threading.Lock() if whole is None else whole._lock
        self._whole = whole
        self._cancelled = False
        self._delivered = False

    def part(self) -> LoadCancel:
        """The cancel of one part of this load (a load in pieces): cancelled when this
        one is; a part delivering leaves this load undelivered, so a cancel between
        parts still stops the rest."""
        return LoadCancel(self)

    @property
    def cancelled(self) -> bool:
        """Whether `cancel` took effect (on this load, or on the whole it is part of)."""
        return self._cancelled or (self._whole is not None and self._whole.cancelled)

    @property
    def delivered(self) -> bool:
        """Whether the load delivered its pages (a cancel now is too late)."""
        return self._delivered

    def cancel(self) -> bool:
        """Stop the load from delivering; False when it already has."""
        with self._lock:
            if self._delivered:
                return False
            self._cancelled = True
            return True

    def deliver(self, fn: Callable[[], None]) -> bool:
        """Run `fn` (the delivery) unless cancelled; True when it ran."""
        with self._lock:
            if self.cancelled:
                return False
            fn()
            self._delivered = True
            return True


class LoadTarget(Protocol):
    """Where a load puts each key's page."""

    def __len__(self) -> int:
        """How many keys it has room for."""
        ...

    def read(
        self,
        engine: IOEngine,
        file: PageFile,
        indices: Sequence[int],
        pages: Sequence[int],
        expected: Sequence[str],
    ) -> list[PageResult]:
        """Read `pages[j]` into key `indices[j]`'s place, verifying `expected[j]`."""
        ...

    def deliver(self, indices: list[int]) -> None:
        """Hand on the intact pages of keys `indices` (not called for a cancelled load)."""
        ...


@dataclass(frozen=True)
class StagingRows:
    """Load into one buffer per key (staging rows); `deliver` gets the intact rows.

    Attributes:
        rows: writable buffers of at least `page_bytes`, one per key.
        deliver_to: called with the indices of the intact rows, unless the load was
            cancelled (the connector scatters them into the KV cache there).
    """

    rows: Sequence[Buffer]
    deliver_to: Callable[[list[int]], None] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def read(
        self,
        engine: IOEngine,
        file: PageFile,
        indices: Sequence[int],
        pages: Sequence[int],
        expected: Sequence[str],
    ) -> list[PageResult]:
        """One `read_pages` call into the keys' rows."""
        return engine.read_pages(
            file, pages, [self.rows[i] for i in indices], expected=list(expected)
        )

    def deliver(self, indices: list[int]) -> None:
        """Pass the intact rows to `deliver_to`."""
        if self.deliver_to is not None and indices:
            self.deliver_to(indices)


@dataclass(frozen=True)
class PagePieces:
    """Load straight into byte ranges: `pieces[i]` together are key i's page, in order.

    `hf3fsctl.staging.page_pieces` names a host KV cache's blocks this way. The read is
    the delivery (a failed page may leave any bytes in its pieces).
    """

    pieces: Sequence[Sequence[Buffer]]

    def __len__(self) -> int:
        return len(self.pieces)

    def read(
        self,
        engine: IOEngine,
        file: PageFile,
        indices: Sequence[int],
        pages: Sequence[int],
        expected: Sequence[str],
    ) -> list[PageResult]:
        """One `read_pages_scattered` call into the keys' pieces."""
        # `indices` are distinct and ascending (`Tier.load`): as many as keys means all
        pieces = (
            self.pieces if len(indices) == len(self.pieces) else [self.pieces[i] for i in indices]
        )
        return engine.read_pages_scattered(file, pages, pieces, expected=expected)

    def deliver(self, indices: list[int]) -> None:
        """Nothing to do: the pages are already in place."""


@dataclass(frozen=True)
class PageSources:
    """Save straight from byte ranges: `pieces[i]` together are key i's page, in order
    (`hf3fsctl.staging.page_pieces` names a host KV cache's blocks this way), written
    without staging.

    The ranges belong to someone else, who may give them to other data: `intact[i]()`
    says whether key i's ranges still hold its page. It is asked after the write; a page
    whose ranges were reused by then may hold the new bytes and is not committed
    (`REUSED`). Empty: the ranges never change while the save runs.
    """

    pieces: Sequence[Sequence[Buffer]]
    intact: Sequence[Callable[[], bool]] = ()

    def __len__(self) -> int:
        return len(self.pieces)

    def take(self, rows: Sequence[int]) -> PageSources:
        """The sources of keys `rows`, in that order."""
        return PageSources(
            [self.pieces[r] for r in rows], [self.intact[r] for r in rows] if self.intact else ()
        )

    def reused(self) -> set[int]:
        """The keys whose ranges no longer hold their page (each check asked once)."""
        answers: dict[int, bool] = {}
        out: set[int] = set()
        for index, check in enumerate(self.intact):
            held = answers.get(id(check))
            if held is None:
                held = answers[id(check)] = check()
            if not held:
                out.add(index)
        return out


def _joined(sources: Sequence[PageSources]) -> PageSources:
    """Several chains' sources as one (`save_many`)."""
    always: Callable[[], bool] = lambda: True  # noqa: E731
    checks = any(source.intact for source in sources)
    return PageSources(
        [piece for source in sources for piece in source.pieces],
        [check for source in sources for check in (source.intact or [always] * len(source))]
        if checks
        else (),
    )


Pages = Sequence[Buffer] | PageSources  # what a save writes: one buffer per key, or ranges


@dataclass(frozen=True)
class SaveBatch:
    """One chain of pages for `Tier.save_many` (a request's save job): `save`'s arguments."""

    keys: Sequence[str]  # block keys, in prefix order
    pages: Pages  # one buffer of `page_bytes` per key, or their ranges
    first_depth: int = 0  # chain position of keys[0]
    retention_s: float | None = None  # the committed entries expire this long after commit
    renew_on_read: bool = False  # a locate renews the expiry (with retention_s)


class Tier:
    """The pages of one (namespace, rank): a page file, an I/O engine, the metadata store.

    Attributes:
        namespace: the namespace id.
        rank: the rank whose page file this is.
        page_file: the open page file.
        engine: the I/O engine.
        pool: staging memory for `lease` (None: callers bring their own buffers).
    """

    def __init__(
        self,
        namespace: str,
        rank: int,
        page_file: PageFile,
        engine: IOEngine,
        client_call: ClientCall,
        pool: StagingPool | None = None,
        *,
        release_call: ClientCall | None = None,
    ) -> None:
        """Bind the tier's parts.

        Args:
            namespace: the namespace id.
            rank: the rank.
            page_file: this rank's page file.
            engine: the I/O engine for it.
            client_call: runs one metadata call, `client_call(lambda c: c.commit(...))`,
                with the caller's guard; raises the client's typed errors.
            pool: staging memory handed out by `lease`. When the engine has memory of
                its own that it moves without a copy (USRBIO's iov), the pool allocates
                there from now on (`StagingPool.use_host_memory`).
            release_call: runs `release` (best effort; default `client_call`). The
                connector passes one that tries even while its guard has the service
                marked down.
        """
        self.namespace = namespace
        self.rank = rank
        self.page_file = page_file
        self.engine = engine
        self.pool = pool
        if pool is not None:
            memory = engine_host_memory(engine)
            if memory is not None:
                pool.use_host_memory(memory)
        self._call = client_call
        self._release_call = release_call or client_call

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""
        return self.page_file.page_bytes

    def lease(self, count: int, timeout_s: float = 0.0) -> StagingBuffer | None:
        """Staging rows for `count` pages from `pool`; None when it cannot hold them in time."""
        if self.pool is None:
            raise InvalidRequest("this tier has no staging pool")
        return self.pool.acquire(count, self.page_bytes, timeout_s)

    # --- save ----------------------------------------------------------------------

    def save(
        self,
        keys: Sequence[str],
        pages: Pages,
        first_depth: int = 0,
        *,
        retention_s: float | None = None,
        renew_on_read: bool = False,
    ) -> SaveOutcome:
        """Store `pages[i]` as key `keys[i]`'s page (keys in chain order).

        Args:
            keys: block keys, in prefix order.
            pages: one buffer of `page_bytes` per key, or each key's byte ranges
                (`PageSources`).
            first_depth: chain position of `keys[0]` (eviction takes tails first).
            retention_s: the committed entries expire this long after commit (None: never).
            renew_on_read: a `locate` of an entry renews its expiry (with `retention_s`).

        Raises:
            InvalidRequest: `keys` and `pages` differ in length.
        """
        if len(keys) != len(pages):
            raise InvalidRequest(f"{len(keys)} keys, {len(pages)} pages: the lengths must match")
        return self._save(keys, pages, first_depth, None, (retention_s, renew_on_read))

    def save_many(self, batches: Sequence[SaveBatch]) -> list[SaveOutcome]:
        """`save` of several chains (a step's save jobs), one outcome per batch as `save`
        would give it: one allocate, one claim, one write and one commit for all of them
        where the store offers `SavesPages` and the batches share their retention, else
        one `save` each. A key that an earlier batch also names is `existing` in the
        later one (as when saved one after the other); the failure of a shared step
        (allocate, claim, commit) is every batch's.

        Raises:
            InvalidRequest: a batch's keys and pages differ in length.
        """
        for batch in batches:
            if len(batch.keys) != len(batch.pages):
                raise InvalidRequest(
                    f"{len(batch.keys)} keys, {len(batch.pages)} pages: the lengths must match"
                )
        terms = {(batch.retention_s, batch.renew_on_read) for batch in batches}
        ranges = {isinstance(batch.pages, PageSources) for batch in batches}
        if len(batches) < 2 or len(terms) > 1 or len(ranges) > 1 or not self._offers_batches():
            return [
                self._save(b.keys, b.pages, b.first_depth, None, (b.retention_s, b.renew_on_read))
                for b in batches
            ]
        keys = [key for batch in batches for key in batch.keys]
        sources = [b.pages for b in batches if isinstance(b.pages, PageSources)]
        pages: Pages = (
            _joined(sources)
            if sources
            else [page for b in batches for page in cast("Sequence[Buffer]", b.pages)]
        )
        depths = [b.first_depth + i for b in batches for i in range(len(b.keys))]
        return _split(self._save(keys, pages, 0, depths, terms.pop()), batches)

    def _offers_batches(self) -> bool:
        """Whether the store takes several chains in one allocate (`SavesPages`)."""
        try:
            return self._call(_saves_pages)
        except Hf3fsctlError:  # `save` reports the store's state per batch
            return False

    def _save(
        self,
        keys: Sequence[str],
        pages: Pages,
        first_depth: int,
        depths: list[int] | None,
        terms: tuple[float | None, bool],
    ) -> SaveOutcome:
        """Allocate, then `_store`; `depths` (one per key) instead of `first_depth`."""
        if not keys:
            return SaveOutcome([])
        try:
            result = self._call(
                lambda c: _allocate(c, self.namespace, self.rank, keys, first_depth, depths)
            )
        except MetadataUnavailable:
            return SaveOutcome([METADATA_DOWN] * len(keys))
        except NotFound:  # the caller says so once, and registers again
            return SaveOutcome([NOT_FOUND] * len(keys), unregistered=True)
        except Hf3fsctlError as exc:
            logger.warning("allocating %d pages of %s failed: %s", len(keys), self._where(), exc)
            return SaveOutcome([ERROR] * len(keys))
        kind_of = dict.fromkeys(result.existing, EXISTING)
        kind_of.update(dict.fromkeys(result.no_space, NO_SPACE))
        outcome = SaveOutcome([])
        if result.allocated:
            row_of: dict[str, int] = {}
            for row, key in enumerate(keys):
                row_of.setdefault(key, row)
            rows = [row_of[key] for key, _ in result.allocated]
            buffers = (
                pages.take(rows) if isinstance(pages, PageSources) else [pages[r] for r in rows]
            )
            self._store(result.allocated, buffers, kind_of, outcome, terms)
        outcome.kinds = [kind_of.get(key, ERROR) for key in keys]
        return outcome

    def _store(
        self,
        allocated: list[tuple[str, int]],
        buffers: list[Buffer] | PageSources,
        kind_of: dict[str, str],
        outcome: SaveOutcome,
        terms: tuple[float | None, bool],
    ) -> None:
        """Claim, write and commit `allocated` ((key, page) pairs) with `terms` (retention,
        renew on read); release what this writer still holds on failure."""
        held = allocated  # allocations not yet released
        done = False
        try:
            pages = [page for _, page in allocated]
            try:
                self.page_file.reserve(pages)
            except StorageError as exc:
                kind = NO_SPACE if exc.errno in _NO_SPACE_ERRNOS else IO
                kind_of.update(dict.fromkeys((key for key, _ in allocated), kind))
                outcome.storage_failure = StorageFailure(kind, len(allocated), exc.message)
                return
            reused: set[int] = set()
            if isinstance(buffers, PageSources):
                results = self.engine.write_pages_gathered(
                    self.page_file, pages, buffers.pieces, checksums=True
                )
                reused = buffers.reused()  # after the write: its bytes may be the new data
            else:
                results = self.engine.write_pages(self.page_file, pages, buffers, checksums=True)
            written: list[tuple[str, int, str]] = []  # (key, page, checksum)
            failed: list[tuple[str, int]] = []
            stale: list[tuple[str, int]] = []
            for index, ((key, page), result) in enumerate(zip(allocated, results, strict=True)):
                if index in reused:
                    stale.append((key, page))
                elif result.ok and result.checksum:
                    written.append((key, page, result.checksum))
                else:
                    failed.append((key, page))
            if failed:
                detail = next((r.detail for r in results if not r.ok), None) or "write failed"
                kind = NO_SPACE if any(r.no_space for r in results) else IO
                kind_of.update(dict.fromkeys((key for key, _ in failed), kind))
                outcome.storage_failure = StorageFailure(kind, len(failed), detail)
            if stale:
                kind_of.update(dict.fromkeys((key for key, _ in stale), REUSED))
            if failed or stale:
                self._release(failed + stale)
                dropped = {key for key, _ in failed + stale}
                held = [a for a in allocated if a[0] not in dropped]
            if written:
                size = self.page_bytes
                outcome.committed = self._call(
                    lambda c: _commit(c, self.namespace, self.rank, written, size, *terms)
                )
                kind_of.update(dict.fromkeys((key for key, _, _ in written), SAVED))
                outcome.storage_worked = not failed
            done = True
        except Hf3fsctlError as exc:
            logger.warning("saving %d pages of %s failed: %s", len(held), self._where(), exc)
            kind = METADATA_DOWN if isinstance(exc, MetadataUnavailable) else ERROR
            kind_of.update(dict.fromkeys((key for key, _ in held), kind))
        finally:
            if not done:
                self._release(held)

    def _release(self, allocations: list[tuple[str, int]]) -> None:
        if not allocations:
            return
        try:
            models = [Allocation(key=key, page=page) for key, page in allocations]
            self._release_call(lambda c: c.release(self.namespace, self.rank, models))
        except Exception as exc:  # best effort: the store reclaims abandoned pending pages
            logger.warning("could not release %d allocations: %s", len(allocations), exc)

    # --- load ----------------------------------------------------------------------

    def load(
        self,
        keys: Sequence[str],
        into: LoadTarget,
        *,
        cancel: LoadCancel | None = None,
        invalidate_with: Callable[[list[Location]], None] | None = None,
    ) -> LoadOutcome:
        """Read, verify and deliver the stored pages of `keys` into `into`.

        Args:
            keys: block keys; `into` has one place per key, in the same order.
            into: where the pages go (`StagingRows` or `PagePieces`).
            cancel: checked before the load starts and before it delivers.
            invalidate_with: gets the pages that failed their checksum, to invalidate
                them elsewhere (with `Tier.invalidate`); default: invalidated here.

        Raises:
            InvalidRequest: `into` does not have one place per key.
        """
        count = len(keys)
        if len(into) != count:
            raise InvalidRequest(f"{count} keys, a target for {len(into)}: the lengths must match")
        if cancel is not None and cancel.cancelled:
            return LoadOutcome([CANCELLED] * count)
        if not keys:
            return LoadOutcome([])
        try:
            locations = self._call(lambda c: _locate(c, self.namespace, self.rank, keys))
        except MetadataUnavailable:
            return LoadOutcome([METADATA_DOWN] * count)
        except Hf3fsctlError as exc:
            logger.warning("locating %d pages of %s failed: %s", count, self._where(), exc)
            return LoadOutcome([ERROR] * count)
        page_bytes = self.page_bytes
        kinds: list[str] = []
        found: list[int] = []  # indices of the keys to read
        read: list[Location | PageLocation] = []  # … and where their pages are
        for i, loc in enumerate(locations):
            if loc is None:
                kinds.append(NOT_FOUND)
            elif loc.size != page_bytes:
                kinds.append(SIZE)
            else:
                kinds.append(LOADED)
                found.append(i)
                read.append(loc)
        outcome = LoadOutcome(kinds)
        try:
            results: list[PageResult] | None = into.read(
                self.engine,
                self.page_file,
                found,
                [loc.page for loc in read],
                [loc.checksum for loc in read],
            )
        except Hf3fsctlError as exc:  # the engine or file is closed, a page out of range
            logger.warning("reading %d pages of %s failed: %s", len(found), self._where(), exc)
            results = None
        if results is None:
            for i in found:
                kinds[i] = ERROR
        else:
            for i, loc, result in zip(found, read, results, strict=True):
                if result.ok:
                    continue
                # A page that ends early (its file was truncated through it) is torn:
                # corrupt like a checksum mismatch, not a passing I/O error, so it is
                # dropped and saved again instead of failing every later load.
                corrupt = result.error in (ERROR_CHECKSUM, ERROR_SHORT)
                kinds[i] = CHECKSUM if corrupt else IO
                if corrupt:
                    outcome.corrupt.append(
                        loc.to_location() if isinstance(loc, PageLocation) else loc
                    )
        if outcome.corrupt:
            if invalidate_with is None:
                outcome.invalidated = self.invalidate(outcome.corrupt)
            else:
                invalidate_with(list(outcome.corrupt))
        good = outcome.loaded
        if cancel is None:
            into.deliver(good)
        elif not cancel.deliver(lambda: into.deliver(good)):
            outcome.kinds = [CANCELLED] * count
        return outcome

    def warm_up(self) -> None:
        """Pay the first `load`'s one-time costs of the store now, off the request path
        (issue 23): where it offers `locate_pages`, its statements are compiled on the
        calling thread's connection (the thread that will load) and the client's class
        is checked against the protocols (`LocatesPages`, and `SavesPages` for the first
        save). Nothing a reader sees changes. Best effort.
        """
        try:
            self._call(_saves_pages)
            self._call(lambda c: _prepare_locate(c, self.namespace, self.rank))
        except Exception as exc:  # the first load pays instead
            logger.debug("warming the loads of %s up failed: %s", self._where(), exc)

    def invalidate(self, pages: Sequence[Location]) -> int:
        """Have the store drop the keys of `pages` (they failed their checksum).

        Best effort: a page that could not be dropped fails its next load and is
        reported again. Returns how many keys the store dropped.
        """
        if not pages:
            return 0
        try:
            return self._call(lambda c: c.invalidate(self.namespace, self.rank, list(pages)))
        except Exception as exc:
            logger.warning("could not invalidate %d corrupt pages: %s", len(pages), exc)
            return 0

    def _where(self) -> str:
        return f"namespace {self.namespace} rank {self.rank}"


def _split(flat: SaveOutcome, batches: Sequence[SaveBatch]) -> list[SaveOutcome]:
    """The outcome of one `_save` of the batches' keys, told per batch."""
    outcomes: list[SaveOutcome] = []
    seen: set[str] = set()
    start, committed = 0, flat.committed
    failure = flat.storage_failure
    for batch in batches:
        kinds = flat.kinds[start : start + len(batch.keys)]
        start += len(batch.keys)
        saved: set[str] = set()
        for i, key in enumerate(batch.keys):
            if key in seen:
                kinds[i] = EXISTING if kinds[i] == SAVED else kinds[i]
            elif kinds[i] == SAVED:
                saved.add(key)
        seen.update(batch.keys)
        outcome = SaveOutcome(
            kinds, min(len(saved), committed), None, flat.storage_worked, flat.unregistered
        )
        committed -= outcome.committed
        if failure is not None and (failed := kinds.count(failure.kind)):
            outcome.storage_failure = StorageFailure(failure.kind, failed, failure.reason)
        outcomes.append(outcome)
    return outcomes


def _offers(client: DataPath, protocol: type) -> bool:
    """Whether `client` is a `protocol` (`LocatesPages`, `SavesPages`): a runtime protocol
    check costs microseconds, the first one of a process ~0.3 ms, so it is made once per
    client class (a class's methods are its instances')."""
    kind = (type(client), protocol)
    offers = _OFFERS.get(kind)
    if offers is None:
        offers = _OFFERS[kind] = isinstance(client, protocol)
    return offers


def _saves_pages(client: DataPath) -> bool:
    """Whether `client` offers `allocate_pages` / `commit_pages`."""
    return _offers(client, SavesPages)


def _allocate(
    client: DataPath,
    namespace: str,
    rank: int,
    keys: Sequence[str],
    first_depth: int,
    depths: list[int] | None = None,
) -> PageGrant:
    """`allocate`, as tuples where the store offers them (`SavesPages`: no model per page;
    `depths` only there)."""
    if _saves_pages(client):
        return cast(SavesPages, client).allocate_pages(namespace, rank, keys, first_depth, depths)
    if depths is not None:
        raise InvalidRequest("allocating several chains at once needs a `SavesPages` store")
    result = client.allocate(namespace, rank, list(keys), first_depth)
    return PageGrant([(a.key, a.page) for a in result.allocated], result.existing, result.no_space)


def _commit(
    client: DataPath,
    namespace: str,
    rank: int,
    pages: list[tuple[str, int, str]],
    size: int,
    retention_s: float | None,
    renew_on_read: bool,
) -> int:
    """`commit` of `(key, page, checksum)` pages, as tuples where the store offers it."""
    if _saves_pages(client):
        return cast(SavesPages, client).commit_pages(
            namespace, rank, pages, size, retention_s, renew_on_read
        )
    items = [
        CommitItem(
            key=key,
            page=page,
            checksum=checksum,
            size=size,
            retention_s=retention_s,
            renew_on_read=renew_on_read,
        )
        for key, page, checksum in pages
    ]
    return client.commit(namespace, rank, items)


def _offers_pages(client: DataPath) -> bool:
    """Whether `client` offers `locate_pages`."""
    return _offers(client, LocatesPages)


def _locate(
    client: DataPath, namespace: str, rank: int, keys: Sequence[str]
) -> Sequence[Location | PageLocation | None]:
    """`locate`, as tuples where the store offers them (`LocatesPages`: no model per key)."""
    if _offers_pages(client):
        return cast(LocatesPages, client).locate_pages(namespace, rank, keys)
    return client.locate(namespace, rank, list(keys))


def _prepare_locate(client: DataPath, namespace: str, rank: int) -> None:
    if _offers_pages(client):
        cast(LocatesPages, client).prepare_locate_pages(namespace, rank)


# Whether each (client class, protocol) is an instance of it.
_OFFERS: dict[tuple[type, type], bool] = {}
