"""The USRBIO I/O engine: 3FS's user-space ring I/O, through its Python binding.

Contract (beyond `hf3fsctl.storage.engine.IOEngine`):
    * Written against the public API of 3FS's binding ``hf3fs_fuse.io`` (`make_iovec`,
      `make_ioring`, `register_fd`, `deregister_fd`; ``ior.prepare(iov, for_read, fd,
      offset, userdata=...)``, ``ior.submit().wait(min_results=n)``). That library cannot
      exist on a machine without a 3FS mount, so this engine is untested here; the unit
      tests drive it against a mock binding named as such.
    * USRBIO moves data only through a shared-memory iov registered with the FUSE
      process, so pages are copied once between the caller's buffers and the iov (a
      memory copy, far cheaper than the network transfer it replaces). The iov holds
      `iov_pages` slots; larger batches go through it in rounds.
    * Page files' descriptors are registered on first use and deregistered by `close()`;
      close the engine before the page files it served.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

from hf3fsctl.errors import InvalidRequest, StorageError
from hf3fsctl.storage.checksum import checksum, page_checksum
from hf3fsctl.storage.engine import (
    ERROR_BOUNDS,
    ERROR_CHECKSUM,
    ERROR_IO,
    ERROR_SHORT,
    Buffer,
    PageResult,
    find_mount,
)
from hf3fsctl.storage.layout import PageFile

logger = logging.getLogger(__name__)

DEFAULT_IOV_BYTES = 256 * 1024 * 1024
RING_ENTRIES = 1024


class UsrbioEngine:
    """Page I/O through 3FS USRBIO rings (one read ring, one write ring)."""

    name = "usrbio"

    def __init__(
        self,
        *,
        root: Path,
        io_threads: int = 16,
        iov_bytes: int = DEFAULT_IOV_BYTES,
        binding: str = "hf3fs_fuse.io",
    ) -> None:
        """Create the shared iov and rings on the 3FS mount holding `root`.

        Args:
            root: the storage root (on a 3FS mount).
            io_threads: I/O depth of the rings (requests 3FS keeps in flight).
            iov_bytes: size of the shared-memory bounce region.
            binding: the module providing the USRBIO API.

        Raises:
            StorageError: the binding is missing or refuses the mount.
        """
        try:
            self._io: Any = importlib.import_module(binding)
        except ImportError as exc:
            raise StorageError(f"USRBIO binding {binding} does not import: {exc}") from None
        self.mount_point = find_mount(root)[0]
        self.iov_bytes = iov_bytes
        self.io_depth = io_threads
        self._registered: set[int] = set()
        self._lock = threading.Lock()
        self._rings: dict[bool, Any] = {}
        try:
            shm = SharedMemory(size=iov_bytes, create=True)
            try:
                self._iov: Any = self._io.make_iovec(shm, self.mount_point, 0, -1)
            finally:
                shm.close()
                shm.unlink()  # the iov keeps the mapping; the name is no longer needed
        except Exception as exc:
            raise StorageError(f"USRBIO refused {self.mount_point}: {exc}") from None
        logger.info("USRBIO engine on %s, iov %d bytes", self.mount_point, iov_bytes)

    def _ring(self, for_read: bool) -> Any:
        if for_read not in self._rings:
            self._rings[for_read] = self._io.make_ioring(
                self.mount_point, RING_ENTRIES, for_read, self.io_depth
            )
        return self._rings[for_read]

    def _register(self, file: PageFile) -> None:
        if file.fd not in self._registered:
            self._io.register_fd(file.fd)
            self._registered.add(file.fd)

    def write_pages(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        *,
        checksums: bool = True,
    ) -> list[PageResult]:
        """Write `buffers[i]` into page `pages[i]`; see `IOEngine.write_pages`."""
        return self._batch(file, pages, buffers, None, reading=False, checksums=checksums)

    def read_pages(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PageResult]:
        """Read page `pages[i]` into `buffers[i]`; see `IOEngine.read_pages`."""
        return self._batch(file, pages, buffers, expected, reading=True, checksums=False)

    def read_pages_scattered(
        self,
        file: PageFile,
        pages: Sequence[int],
        pieces: Sequence[Sequence[Buffer]],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PageResult]:
        """Read page `pages[i]` into the buffers `pieces[i]`; see `IOEngine`.

        USRBIO copies out of its shared iov anyway; here each verified page is copied
        piece by piece through one page-sized bounce buffer.
        """
        if len(pages) != len(pieces):
            raise InvalidRequest("pages and piece lists must have the same length")
        results: list[PageResult] = []
        bounce = bytearray(file.page_bytes)
        for i, page in enumerate(pages):
            views = [memoryview(piece).cast("B") for piece in pieces[i]]
            if sum(len(v) for v in views) != file.page_bytes or any(v.readonly for v in views):
                results.append(PageResult(page, False, ERROR_BOUNDS, None, "bad piece sizes"))
                continue
            want = None if expected is None else [expected[i]]
            result = self.read_pages(file, [page], [bounce], expected=want)[0]
            if result.ok:
                position = 0
                for view in views:
                    view[:] = memoryview(bounce)[position : position + len(view)]
                    position += len(view)
            results.append(result)
        return results

    def _batch(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        expected: Sequence[str | None] | None,
        *,
        reading: bool,
        checksums: bool,
    ) -> list[PageResult]:
        if len(pages) != len(buffers) or (expected is not None and len(expected) != len(pages)):
            raise InvalidRequest("pages, buffers and checksums must have the same length")
        per_round = max(1, min(self.iov_bytes // file.slot_bytes, RING_ENTRIES))
        results: list[PageResult] = []
        with self._lock:
            self._register(file)
            for start in range(0, len(pages), per_round):
                stop = min(len(pages), start + per_round)
                results.extend(
                    self._round(
                        file,
                        pages[start:stop],
                        buffers[start:stop],
                        None if expected is None else expected[start:stop],
                        reading,
                        checksums,
                    )
                )
        return results

    def _round(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        expected: Sequence[str | None] | None,
        reading: bool,
        checksums: bool,
    ) -> list[PageResult]:
        results: list[PageResult | None] = [None] * len(pages)
        views: dict[int, memoryview] = {}
        ring = self._ring(reading)
        submitted = 0
        for i, (page, buffer) in enumerate(zip(pages, buffers, strict=True)):
            try:
                offset = file.offset(page)
                view = memoryview(buffer).cast("B")
            except (InvalidRequest, TypeError, ValueError) as exc:
                results[i] = PageResult(page, False, ERROR_BOUNDS, None, str(exc))
                continue
            size = file.page_bytes if reading else len(view)
            if (reading and (view.readonly or len(view) < size)) or not 0 < size <= file.page_bytes:
                results[i] = PageResult(page, False, ERROR_BOUNDS, None, "bad buffer size")
                continue
            slot = self._iov[i * file.slot_bytes : i * file.slot_bytes + size]
            if not reading:
                memoryview(slot)[:] = view
            views[i] = view[:size]
            ring.prepare(slot, reading, file.fd, offset, userdata=i)
            submitted += 1
        if submitted:
            for done in ring.submit().wait(min_results=submitted):
                i = int(done.userdata)
                results[i] = self._complete(
                    file, pages[i], i, views[i], done.result, expected, reading, checksums
                )
        return [
            r if r is not None else PageResult(-1, False, ERROR_IO, None, "lost") for r in results
        ]

    def _complete(
        self,
        file: PageFile,
        page: int,
        index: int,
        view: memoryview,
        moved: int,
        expected: Sequence[str | None] | None,
        reading: bool,
        checksums: bool,
    ) -> PageResult:
        if moved < 0:
            return PageResult(page, False, ERROR_IO, None, f"USRBIO error {moved}")
        if moved < len(view):
            return PageResult(
                page, False, ERROR_SHORT if reading else ERROR_IO, None, f"moved {moved}"
            )
        if not reading:
            return PageResult(page, True, None, page_checksum(view) if checksums else None)
        start = index * file.slot_bytes
        view[:] = memoryview(self._iov[start : start + len(view)])
        want = None if expected is None else expected[index]
        if want is None:
            return PageResult(page, True, None, None)
        try:
            actual = checksum(view, want.split(":", 1)[0])
        except InvalidRequest as exc:
            return PageResult(page, False, ERROR_CHECKSUM, None, exc.message)
        if actual != want:
            return PageResult(page, False, ERROR_CHECKSUM, actual, f"expected {want}")
        return PageResult(page, True, None, actual)

    def close(self) -> None:
        """Deregister the page files' descriptors and drop the rings and iov."""
        with self._lock:
            for fd in self._registered:
                try:
                    self._io.deregister_fd(fd)
                except Exception as exc:  # a closed fd must not stop the others
                    logger.warning("USRBIO deregister of fd %s failed: %s", fd, exc)
            self._registered.clear()
            self._rings.clear()
