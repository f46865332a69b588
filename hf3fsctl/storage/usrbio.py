"""The USRBIO I/O engine: 3FS's user-space ring I/O, through its Python binding.

Contract (beyond `hf3fsctl.storage.engine.IOEngine`):
    * Written against 3FS's binding ``hf3fs_fuse.io`` (its ``hf3fs_fuse/io.py`` over
      ``src/lib/py/usrbio_binding.cc``): `make_iovec(shm, mount)` links a /dev/shm file
      under ``<mount>/3fs-virt/iovs/`` for the FUSE daemon to map; `make_ioring(mount,
      entries, for_read, io_depth)`; `register_fd` / `deregister_fd`; ``ring.prepare(iov
      slice, read, fd, offset, userdata=)``, ``ring.submit()``, ``ring.wait(min_results=,
      max_results=, timeout=timedelta)`` returning completions whose ``result`` is the
      bytes moved or ``-errno``. On machines without 3FS it is tested against
      ``tests/helpers/fake_hf3fs_fuse.py``, a FAKE of that binding (named as one).
    * One copy. USRBIO moves data only through iovs, so `host_memory` hands out staging
      memory that IS an iov (one iov per allocation, kept open for its lifetime). A page
      whose buffer lies inside one goes to or from 3FS in place. Any other buffer (bytes,
      a host KV cache's page pieces) goes through the engine's own bounce iov: one more
      memcpy, counted in `counters()` (`copied_pages`, against `direct_pages`).
    * Per page: a ``-errno`` result, a short transfer (a read past EOF), or a prepare the
      ring refuses (an unregistered fd: ``EBADF``) is that page's `PageResult`; nothing
      is raised for a page.
    * Back-pressure: at most `ring_entries` I/Os are in flight; a prepare refused with
      ``EAGAIN`` (ring full) waits for completions first. Waits may return fewer
      completions than asked; the engine waits again until every page has its result.
    * Never a hang: a call waits at most `timeout_s` in all. Pages without a result by
      then fail (``io``, "timed out"). The ring and the bounce iov that timed out are
      retired, never used again, so a late completion cannot land in a later batch. (A
      limit: a late read could still land in a caller's iov-backed buffer after the
      caller reused it; it takes an I/O that outlives the timeout.)
    * io_depth 0: the daemon issues whatever is queued when told (a positive io_depth
      waits until that many I/Os are queued, which would hang a smaller batch).
    * One read ring and one write ring, each used by one thread at a time (USRBIO rings
      are single-producer, single-consumer), so a load and a save run side by side.
    * Page files' descriptors are registered on first use (again if the descriptor now
      names another file) and deregistered by `close()`; close the engine before the page
      files it served. Staging memory already handed out stays valid after `close()`.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import numpy as np

from hf3fsctl.errors import InvalidRequest, StorageError
from hf3fsctl.storage.checksum import checksum, checksum_views, page_checksum
from hf3fsctl.storage.engine import (
    ERROR_BOUNDS,
    ERROR_CHECKSUM,
    ERROR_IO,
    ERROR_SHORT,
    USRBIO_BINDING,
    Buffer,
    PageResult,
    find_mount,
)
from hf3fsctl.storage.layout import PageFile

logger = logging.getLogger(__name__)

DEFAULT_BOUNCE_BYTES = 64 * 1024 * 1024
RING_ENTRIES = 1024
DEFAULT_TIMEOUT_S = 30.0
SHM_DIR = "/dev/shm"  # where SharedMemory (and so every iov) lives on Linux


def _address(view: memoryview) -> int:
    """The address of a C-contiguous byte view's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@dataclass
class _Region:
    """One iov: shared memory the FUSE daemon maps, and the binding's handle on it."""

    shm: SharedMemory
    iov: Any
    address: int
    size: int

    def release(self) -> bool:
        """Drop the iov (its link goes) and unmap our side; False while something views it."""
        self.iov = None
        try:
            self.shm.close()
        except BufferError:  # a tensor still views it: try again later
            return False
        return True


@dataclass
class _Item:
    """One page of a batch: where it goes in the file and which memory it uses."""

    index: int  # position in the caller's batch
    page: int
    file_offset: int
    size: int  # bytes to move
    targets: list[memoryview]  # the caller's buffer, or a page's pieces in order
    region: _Region | None = None  # the iov the I/O uses (None until assigned)
    offset: int = 0  # in region
    direct: bool = False  # region is the caller's own memory: no copy
    checksum: str | None = None  # writes: of the bytes sent


class _Ring:
    """One direction's ring and bounce iov, used by one thread at a time."""

    def __init__(self, reading: bool) -> None:
        self.reading = reading
        self.lock = threading.Lock()
        self.ring: Any = None
        self.bounce: _Region | None = None


class _IovMemory:
    """`SharedHostMemory` of a `UsrbioEngine`: each allocation is an iov of its own."""

    name = "usrbio iov"

    def __init__(self, engine: UsrbioEngine) -> None:
        self._engine = engine
        self._warned = False

    def allocate(self, nbytes: int) -> memoryview | None:
        """A new iov of `nbytes`, or None (logged once) when 3FS refuses one."""
        try:
            region = self._engine._new_region(nbytes)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "USRBIO iov of %d bytes refused (%s): staging falls back to plain "
                    "memory, copied once more through the engine's bounce iov",
                    nbytes,
                    exc,
                )
            return None
        self._engine._adopt(region)
        buf = region.shm.buf
        assert buf is not None  # just created
        return buf

    def free(self, address: int) -> None:
        """Drop the iov that `allocate` returned at `address`."""
        self._engine._disown(address)


class UsrbioEngine:
    """Page I/O through 3FS USRBIO rings (one read ring, one write ring)."""

    name = "usrbio"

    def __init__(
        self,
        *,
        root: Path,
        io_threads: int = 16,
        bounce_bytes: int = DEFAULT_BOUNCE_BYTES,
        ring_entries: int = RING_ENTRIES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        binding: str = USRBIO_BINDING,
    ) -> None:
        """Find the 3FS mount holding `root` and open a ring on it.

        Args:
            root: the storage root (on a 3FS mount).
            io_threads: accepted for the engines' common signature; the FUSE daemon
                decides USRBIO's parallelism (io_depth 0).
            bounce_bytes: size of each direction's bounce iov, for buffers outside the
                engine's staging memory (made on first use).
            ring_entries: I/Os in flight per ring.
            timeout_s: longest a call waits for its I/Os.
            binding: the module providing the USRBIO API.

        Raises:
            StorageError: the binding is missing, or the mount refuses a ring.
        """
        del io_threads
        if ring_entries < 1 or timeout_s <= 0:
            raise InvalidRequest("ring_entries and timeout_s must be positive")
        try:
            self._io: Any = importlib.import_module(binding)
        except ImportError as exc:
            raise StorageError(f"USRBIO binding {binding} does not import: {exc}") from None
        self.mount_point = self._find_mount_point(root)
        self.bounce_bytes = bounce_bytes
        self.ring_entries = ring_entries
        self.timeout_s = timeout_s
        self.host_memory = _IovMemory(self)
        self._regions: dict[int, _Region] = {}  # staging iovs by address
        self._regions_lock = threading.Lock()
        self._unmapping: list[_Region] = []  # freed staging iovs something still views
        self._registered: dict[int, tuple[int, int]] = {}  # fd -> (st_dev, st_ino)
        self._fd_lock = threading.Lock()
        self._rings = {True: _Ring(True), False: _Ring(False)}
        self._retired: list[Any] = []  # timed-out rings and bounce iovs: never reused
        self._counts = dict.fromkeys(
            ("direct_pages", "copied_pages", "copied_bytes", "ring_full", "timeouts"), 0
        )
        self._closed = False
        try:
            for state in self._rings.values():
                state.ring = self._make_ring(state.reading)
        except Exception as exc:
            raise StorageError(f"USRBIO refused {self.mount_point}: {exc}") from None
        logger.info(
            "USRBIO engine on %s: %d ring entries, %.0f s timeout",
            self.mount_point,
            ring_entries,
            timeout_s,
        )

    def _find_mount_point(self, root: Path) -> str:
        extract = getattr(self._io, "extract_mount_point", None)
        if extract is not None:
            try:
                found = extract(str(root))
            except OSError as exc:
                raise StorageError(f"USRBIO cannot place {root}: {exc}") from None
            if not found:
                raise StorageError(f"{root} is not on a 3FS mount (USRBIO found none)")
            return str(found)
        return find_mount(root)[0]

    def _make_ring(self, reading: bool) -> Any:
        return self._io.make_ioring(self.mount_point, self.ring_entries, reading, 0)

    def _new_region(self, nbytes: int) -> _Region:
        """Shared memory of `nbytes` made an iov (the daemon maps it as the link appears).

        Raises:
            StorageError: /dev/shm has no room for it. (A tmpfs past its size does not
                fail the allocation: it kills the process with SIGBUS on first touch.)
        """
        stat = os.statvfs(SHM_DIR)
        free = stat.f_bavail * stat.f_frsize
        if free < nbytes:
            raise StorageError(
                f"{SHM_DIR} has {free >> 20} MiB free, a USRBIO iov needs {nbytes >> 20} MiB",
                hint="give the container more shared memory (docker --shm-size) or lower "
                "connector.staging_bytes",
            )
        shm = SharedMemory(size=nbytes, create=True)
        try:
            iov = self._io.make_iovec(shm, self.mount_point, 0, -1)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        shm.unlink()  # mapped by both sides now; the name is no longer needed
        buf = shm.buf
        assert buf is not None
        return _Region(shm, iov, _address(buf), nbytes)

    def _adopt(self, region: _Region) -> None:
        with self._regions_lock:
            self._regions[region.address] = region

    def _disown(self, address: int) -> None:
        with self._regions_lock:
            region = self._regions.pop(address, None)
            if region is not None:
                self._unmapping.append(region)
            # Unmap what nothing views any more; keep the rest (closing a SharedMemory
            # that is still viewed fails, and so would its __del__).
            self._unmapping = [r for r in self._unmapping if not r.release()]

    def _locate(self, view: memoryview) -> tuple[_Region, int] | None:
        """The staging iov holding all of `view`, and where in it, or None."""
        if not self._regions:
            return None
        start = _address(view)
        with self._regions_lock:
            for region in self._regions.values():
                if region.address <= start and start + len(view) <= region.address + region.size:
                    return region, start - region.address
        return None

    def counters(self) -> dict[str, int]:
        """Pages moved in place vs through the bounce iov, ring-full waits, timeouts."""
        with self._regions_lock:
            return dict(self._counts, staging_iovs=len(self._regions))

    def _count(self, key: str, n: int = 1) -> None:
        with self._regions_lock:
            self._counts[key] += n

    # --- the IOEngine calls --------------------------------------------------------

    def write_pages(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        *,
        checksums: bool = True,
    ) -> list[PageResult]:
        """Write `buffers[i]` into page `pages[i]`; see `IOEngine.write_pages`."""
        if len(pages) != len(buffers):
            raise InvalidRequest("pages and buffers must have the same length")
        return self._write(file, pages, [[b] for b in buffers], checksums)

    def write_pages_gathered(
        self,
        file: PageFile,
        pages: Sequence[int],
        pieces: Sequence[Sequence[Buffer]],
        *,
        checksums: bool = True,
    ) -> list[PageResult]:
        """Write the buffers `pieces[i]`, in order, as page `pages[i]`; see `IOEngine`.

        Pieces are not iov memory: each page is copied into the bounce iov piece by piece
        (counted as copied)."""
        if len(pages) != len(pieces):
            raise InvalidRequest("pages and piece lists must have the same length")
        return self._write(file, pages, pieces, checksums)

    def _write(
        self,
        file: PageFile,
        pages: Sequence[int],
        sources: Sequence[Sequence[Buffer]],
        checksums: bool,
    ) -> list[PageResult]:
        """Each page's buffers, in order: one (moved in place when it is iov memory) or
        several (through the bounce iov)."""
        results: list[PageResult | None] = [None] * len(pages)
        items: list[_Item] = []
        for i, (page, parts) in enumerate(zip(pages, sources, strict=True)):
            try:
                offset = file.offset(page)
                views = [memoryview(part).cast("B") for part in parts]
            except (InvalidRequest, TypeError, ValueError) as exc:
                results[i] = PageResult(page, False, ERROR_BOUNDS, None, str(exc))
                continue
            nbytes = sum(len(v) for v in views)
            if not 0 < nbytes <= file.page_bytes:
                results[i] = PageResult(page, False, ERROR_BOUNDS, None, "bad buffer size")
                continue
            item = _Item(i, page, offset, nbytes, views)
            if checksums:
                item.checksum = (
                    page_checksum(views[0]) if len(views) == 1 else checksum_views(views)
                )
            items.append(item)
        return self._batch(file, items, results, None, reading=False)

    def read_pages(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PageResult]:
        """Read page `pages[i]` into `buffers[i]`; see `IOEngine.read_pages`."""
        if len(pages) != len(buffers):
            raise InvalidRequest("pages and buffers must have the same length")
        return self._read(file, pages, [[b] for b in buffers], expected, whole=True)

    def read_pages_scattered(
        self,
        file: PageFile,
        pages: Sequence[int],
        pieces: Sequence[Sequence[Buffer]],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PageResult]:
        """Read page `pages[i]` into the buffers `pieces[i]`; see `IOEngine`.

        Pieces are not iov memory: each page goes through the bounce iov and is copied
        piece by piece once verified (counted as copied).
        """
        if len(pages) != len(pieces):
            raise InvalidRequest("pages and piece lists must have the same length")
        return self._read(file, pages, pieces, expected, whole=False)

    def _read(
        self,
        file: PageFile,
        pages: Sequence[int],
        targets: Sequence[Sequence[Buffer]],
        expected: Sequence[str | None] | None,
        *,
        whole: bool,
    ) -> list[PageResult]:
        if expected is not None and len(expected) != len(pages):
            raise InvalidRequest("pages and checksums must have the same length")
        results: list[PageResult | None] = [None] * len(pages)
        items: list[_Item] = []
        for i, (page, parts) in enumerate(zip(pages, targets, strict=True)):
            try:
                offset = file.offset(page)
                views = [memoryview(part).cast("B") for part in parts]
            except (InvalidRequest, TypeError, ValueError) as exc:
                results[i] = PageResult(page, False, ERROR_BOUNDS, None, str(exc))
                continue
            if whole:
                ok = len(views[0]) >= file.page_bytes
                views = [views[0][: file.page_bytes]]
            else:
                ok = sum(len(v) for v in views) == file.page_bytes
            if not ok or any(v.readonly for v in views):
                detail = "bad buffer size" if whole else "bad piece sizes"
                results[i] = PageResult(page, False, ERROR_BOUNDS, None, detail)
                continue
            items.append(_Item(i, page, offset, file.page_bytes, views))
        return self._batch(file, items, results, expected, reading=True)

    def close(self) -> None:
        """Deregister the page files' descriptors and drop the rings and bounce iovs."""
        for state in self._rings.values():
            with state.lock:
                state.ring = None
                if state.bounce is not None:
                    state.bounce.release()
                    state.bounce = None
        with self._fd_lock:
            self._closed = True
            for fd in self._registered:
                try:
                    self._io.deregister_fd(fd)
                except Exception as exc:  # a closed fd must not stop the others
                    logger.warning("USRBIO deregister of fd %s failed: %s", fd, exc)
            self._registered.clear()
        self._retired.clear()

    # --- batches -------------------------------------------------------------------

    def _register(self, file: PageFile) -> None:
        """Register `file.fd` (again if the number now names another file)."""
        stat = os.fstat(file.fd)
        identity = (stat.st_dev, stat.st_ino)
        with self._fd_lock:
            if self._closed:
                raise StorageError("the USRBIO engine is closed")
            known = self._registered.get(file.fd)
            if known == identity:
                return
            if known is not None:
                self._io.deregister_fd(file.fd)
                del self._registered[file.fd]
            self._io.register_fd(file.fd)
            self._registered[file.fd] = identity

    def _batch(
        self,
        file: PageFile,
        items: list[_Item],
        results: list[PageResult | None],
        expected: Sequence[str | None] | None,
        *,
        reading: bool,
    ) -> list[PageResult]:
        """Run `items` through this direction's ring and fill in `results`."""
        if items:
            state = self._rings[reading]
            deadline = time.monotonic() + self.timeout_s
            with state.lock:
                try:
                    self._register(file)
                    rounds = self._rounds(state, file, items)
                except (OSError, StorageError) as exc:
                    what = exc.message if isinstance(exc, StorageError) else f"register_fd: {exc}"
                    for item in items:
                        results[item.index] = PageResult(
                            item.page, False, ERROR_IO, None, f"USRBIO {what}"
                        )
                    rounds = []
                failure: str | None = None  # once a ring is retired, the batch stops
                for round_items in rounds:
                    done: dict[int, int] = {}
                    if failure is None:
                        done, failure = self._run(state, file.fd, round_items, deadline)
                    for item in round_items:
                        moved = done.get(item.index)
                        results[item.index] = (
                            PageResult(item.page, False, ERROR_IO, None, f"USRBIO {failure}")
                            if moved is None
                            else self._complete(item, moved, expected, reading)
                        )
        return [
            r if r is not None else PageResult(-1, False, ERROR_IO, None, "lost") for r in results
        ]

    def _rounds(self, state: _Ring, file: PageFile, items: list[_Item]) -> list[list[_Item]]:
        """Give each item its iov: in place when its buffer is one, else a bounce slot.

        Items needing bounce slots are split into rounds the bounce iov holds.
        """
        rounds: list[list[_Item]] = [[]]
        used = 0
        for item in items:
            found = self._locate(item.targets[0]) if len(item.targets) == 1 else None
            if found is not None:
                item.region, item.offset = found
                item.direct = True
                rounds[-1].append(item)
                continue
            bounce = self._bounce(state, file.slot_bytes)
            if used + file.slot_bytes > bounce.size:
                rounds.append([])
                used = 0
            item.region, item.offset = bounce, used
            used += file.slot_bytes
            rounds[-1].append(item)
        return [r for r in rounds if r]

    def _bounce(self, state: _Ring, slot_bytes: int) -> _Region:
        if state.bounce is None or state.bounce.size < slot_bytes:
            if state.bounce is not None:
                state.bounce.release()
            state.bounce = self._new_region(max(self.bounce_bytes, slot_bytes))
        return state.bounce

    def _run(
        self, state: _Ring, fd: int, items: list[_Item], deadline: float
    ) -> tuple[dict[int, int], str | None]:
        """Prepare, submit and reap `items`.

        Returns:
            Each item's result (bytes moved or -errno) by index, and None, or why the
            items missing from it have none (a timeout, a failed ring: retired).
        """
        done: dict[int, int] = {}
        try:
            if state.ring is None:
                state.ring = self._make_ring(state.reading)
        except OSError as exc:
            return done, f"could not open a ring: {exc}"
        ring = state.ring
        for item in items:
            if not state.reading and not item.direct:
                assert item.region is not None and item.region.shm.buf is not None
                position = item.offset
                for source in item.targets:  # one buffer, or a gathered page's pieces
                    item.region.shm.buf[position : position + len(source)] = source
                    position += len(source)
        queue = deque(items)
        in_flight = 0
        try:
            while queue or in_flight:
                while queue and in_flight < self.ring_entries:
                    item = queue[0]
                    assert item.region is not None
                    piece = item.region.iov[item.offset : item.offset + item.size]
                    try:
                        ring.prepare(
                            piece, state.reading, fd, item.file_offset, userdata=item.index
                        )
                    except OSError as exc:
                        if exc.errno == errno.EAGAIN and in_flight:
                            self._count("ring_full")
                            break  # ring full: reap completions first
                        done[item.index] = -(exc.errno or errno.EIO)
                    else:
                        in_flight += 1
                    queue.popleft()
                if queue and in_flight >= self.ring_entries:
                    self._count("ring_full")  # as many in flight as the ring holds
                if not in_flight:
                    continue
                ring.submit()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                completions = ring.wait(
                    min_results=1, max_results=in_flight, timeout=timedelta(seconds=remaining)
                )
                for completion in completions:
                    done[int(completion.userdata)] = int(completion.result)
                in_flight -= len(completions)
                if not completions and time.monotonic() >= deadline:
                    break
        except OSError as exc:
            return done, self._retire(state, f"ring failed: {exc}")
        if in_flight or queue:
            self._count("timeouts")
            return done, self._retire(state, f"timed out after {self.timeout_s:g} s")
        return done, None

    def _retire(self, state: _Ring, why: str) -> str:
        """Never reuse a ring (or its bounce iov) that may still have I/O in flight."""
        logger.warning(
            "USRBIO %s ring %s; the next batch opens a fresh one",
            "read" if state.reading else "write",
            why,
        )
        self._retired.append((state.ring, state.bounce))
        state.ring = None
        state.bounce = None
        return why

    def _complete(
        self,
        item: _Item,
        moved: int,
        expected: Sequence[str | None] | None,
        reading: bool,
    ) -> PageResult:
        page = item.page
        if moved < 0:
            return PageResult(
                page, False, ERROR_IO, None, f"USRBIO: {os.strerror(-moved)}", errno=-moved
            )
        if moved < item.size:
            kind = ERROR_SHORT if reading else ERROR_IO
            return PageResult(page, False, kind, None, f"moved {moved} of {item.size} bytes")
        self._count("direct_pages" if item.direct else "copied_pages")
        if not item.direct:
            self._count("copied_bytes", item.size)
        if not reading:
            return PageResult(page, True, None, item.checksum)
        assert item.region is not None and item.region.shm.buf is not None
        data = item.region.shm.buf[item.offset : item.offset + item.size]
        want = None if expected is None else expected[item.index]
        actual = None
        if want is not None:
            try:
                actual = checksum(data, want.split(":", 1)[0])
            except InvalidRequest as exc:
                return PageResult(page, False, ERROR_CHECKSUM, None, exc.message)
            if actual != want:
                return PageResult(page, False, ERROR_CHECKSUM, actual, f"expected {want}")
        if not item.direct:
            position = 0
            for view in item.targets:
                view[:] = data[position : position + len(view)]
                position += len(view)
        return PageResult(page, True, None, actual)
