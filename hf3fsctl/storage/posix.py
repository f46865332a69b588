"""The POSIX I/O engine: parallel, vectored ``preadv``/``pwritev`` straight into caller buffers.

Contract (beyond `hf3fsctl.storage.engine.IOEngine`):
    * No copies: the kernel reads into / writes from the caller's buffers themselves;
      `read_pages_scattered` reads each page into several buffers (its iovecs), verified
      over them as one page.
    * Pages whose slots are adjacent in the file are moved by one vectored call; the
      gap between ``page_bytes`` and ``slot_bytes`` is bridged by a scratch (read) or zero
      (write) iovec, which touches only the unused tail of a slot, never a neighbour page.
    * A batch is split into tasks of at most ``max_task_bytes`` (and about ``io_threads``
      of them, but none below ``MIN_TASK_BYTES``, 2 MiB) run on a thread pool (the calls
      release the GIL, and so does xxhash); tasks go to threads in shares of at least
      ``MIN_TASK_BYTES`` (runs of pages that are not adjacent in the file are separate
      tasks, but not separate shares), and a batch of one share runs in the calling
      thread, so a call of a few small pages never wakes a thread, adjacent or not.
      With a pool, the checksums of a write task of at least ``MIN_TASK_BYTES`` are
      computed by another thread while its bytes are written; a smaller task checksums
      its pages itself. A buffered write (a copy into the page cache) runs on at most as
      many threads as the process has CPUs; reads and O_DIRECT writes on ``io_threads``.
    * Short transfers are resumed; end of file leaves the uncovered pages "short". An
      error in a multi-page call is retried page by page so it is attributed exactly.
    * With ``o_direct``, a task uses the file's O_DIRECT descriptor only when every buffer
      address, length and the offset are 4096-aligned, and falls back to the page cache
      if the kernel refuses (EINVAL).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import operator
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from xxhash import xxh3_64

from hf3fsctl.errors import InvalidRequest, StorageError
from hf3fsctl.storage.checksum import DEFAULT_ALGORITHM, checksum_views, page_checksum
from hf3fsctl.storage.engine import (
    ERROR_BOUNDS,
    ERROR_CHECKSUM,
    ERROR_IO,
    ERROR_SHORT,
    Buffer,
    PageResult,
)
from hf3fsctl.storage.layout import PAGE_ALIGN, PageFile

logger = logging.getLogger(__name__)

# Smallest share of a batch worth handing to another thread, and smallest write task
# whose checksum is worth computing on another thread. Waking a thread and waiting for
# it costs tens of microseconds (more where the other core is an idle virtual CPU),
# about what moving 256 KiB through the page cache costs, so smaller calls run inline.
# Measured on 2 cores with the loops of `hf3fsctl bench storage`, 16 threads, old and
# new rules interleaved, as a ratio of a plain loop: one 256 KiB page per call wrote at
# 0.32-0.45 under the old rules (256 KiB tasks, every write's checksum on another
# thread) and 0.54-0.76 under these (1 thread: 0.57-0.71); 4 pages of 256 KiB
# 0.23-0.47 -> 0.69-0.91; 16 pages of 64 KiB read 0.37-0.41 -> 0.57-0.81. Calls of
# 4 MiB pages still gain from threads.
MIN_TASK_BYTES = 2 * 1024 * 1024
# Largest single vectored call: big enough to amortise the syscall, small enough that the
# checksum pass that follows finds the bytes still in the CPU cache, and that one thread's
# checksumming overlaps another's transfer.
MAX_TASK_BYTES = 4 * 1024 * 1024
_ZEROS = bytes(PAGE_ALIGN)
_XXH3_PREFIX = DEFAULT_ALGORITHM + ":"
_XXH3_CHARS = len(_XXH3_PREFIX)


@dataclass(slots=True)  # slots: one per page moved
class _Op:
    """One page of a request: where it goes and the caller's bytes."""

    index: int  # position in the caller's request
    page: int
    offset: int
    views: list[memoryview]  # the bytes to transfer, in file order (one unless scattered)
    nbytes: int  # bytes this op moves (the views' total)
    expected: str | None = None


_PAGE_OF = operator.attrgetter("page")  # an op's sort key, without a Python call per op

# One task as a thread runs it: the task's pages and their results.
_Job = Callable[[], list[tuple[_Op, PageResult]]]


def _byte_view(buffer: Buffer) -> memoryview:
    view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("buffer is not contiguous")
        view = view.cast("B")
    elif not view.c_contiguous:
        raise ValueError("buffer is not contiguous")
    return view


def _address(view: memoryview) -> int:
    import numpy as np  # only on the O_DIRECT path

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class PosixEngine:
    """Parallel vectored POSIX I/O on page files."""

    name = "posix"

    def __init__(
        self, *, io_threads: int = 16, o_direct: bool = False, max_task_bytes: int = MAX_TASK_BYTES
    ) -> None:
        """Start the engine.

        Args:
            io_threads: the most threads one batch is spread over.
            o_direct: bypass the page cache where everything is 4096-aligned.
            max_task_bytes: the most bytes one vectored call moves (at least one page).
        """
        if io_threads < 1:
            raise InvalidRequest(f"io_threads must be at least 1, got {io_threads}")
        self.io_threads = io_threads
        # A buffered write is a copy into the page cache: more threads than CPUs only add
        # contention (192 MiB from 16 threads cost 1.3–1.4x the CPU of 2 on 2 cores).
        # Reads and O_DIRECT writes wait on the device or the network: all io_threads.
        self.write_threads = io_threads if o_direct else max(1, min(io_threads, usable_cpus()))
        self.o_direct = o_direct
        self.max_task_bytes = max_task_bytes
        self._iov_max = max(2, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
        self._pool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(max_workers=io_threads - 1, thread_name_prefix="hf3fs-io")
            if io_threads > 1
            else None
        )
        self._closed = False

    def write_pages(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        *,
        checksums: bool = True,
    ) -> list[PageResult]:
        """Write `buffers[i]` into page `pages[i]`; see `IOEngine.write_pages`."""
        results, ops = self._prepare(file, pages, buffers, None, reading=False)
        self._run(file, ops, results, reading=False, checksums=checksums)
        return _finish(results)

    def read_pages(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PageResult]:
        """Read page `pages[i]` into `buffers[i]`; see `IOEngine.read_pages`."""
        results, ops = self._prepare(file, pages, buffers, expected, reading=True)
        self._run(file, ops, results, reading=True, checksums=False)
        return _finish(results)

    def read_pages_scattered(
        self,
        file: PageFile,
        pages: Sequence[int],
        pieces: Sequence[Sequence[Buffer]],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PageResult]:
        """Read page `pages[i]` into the buffers `pieces[i]`; see `IOEngine`.

        Each page's pieces are checked and become its op in one pass (a host KV cache's
        block ranges: a few pieces per page, tens of pages per step).
        """
        results, ops = self._piece_ops(file, pages, pieces, expected, reading=True)
        self._run(file, ops, results, reading=True, checksums=False)
        return _finish(results)

    def write_pages_gathered(
        self,
        file: PageFile,
        pages: Sequence[int],
        pieces: Sequence[Sequence[Buffer]],
        *,
        checksums: bool = True,
    ) -> list[PageResult]:
        """Write the buffers `pieces[i]`, in order, as page `pages[i]`; see `IOEngine`."""
        results, ops = self._piece_ops(file, pages, pieces, None, reading=False)
        self._run(file, ops, results, reading=False, checksums=checksums)
        return _finish(results)

    def _piece_ops(
        self,
        file: PageFile,
        pages: Sequence[int],
        pieces: Sequence[Sequence[Buffer]],
        expected: Sequence[str | None] | None,
        *,
        reading: bool,
    ) -> tuple[list[PageResult | None], list[_Op]]:
        """One op per page of pieces: a read fills exactly `page_bytes` of writable
        pieces; a write takes 1..`page_bytes` bytes of any."""
        if len(pages) != len(pieces):
            raise InvalidRequest(
                f"{len(pages)} pages, {len(pieces)} piece lists: the lengths must match"
            )
        results = self._results_for(file, pages, expected)
        ops: list[_Op] = []
        page_bytes, num_pages, slot_bytes = file.page_bytes, file.num_pages, file.slot_bytes
        for index, (page, buffers) in enumerate(zip(pages, pieces, strict=True)):
            # The usual pieces (a host KV cache's block ranges) are 1-D byte memoryviews
            # of an in-range page: checked inline, without a call per piece.
            views: list[Any] | None = None
            total = 0
            if type(page) is int and 0 <= page < num_pages:
                views = list(buffers)  # checked here
                for view in views:
                    if (
                        type(view) is not memoryview
                        or (reading and view.readonly)
                        or view.ndim != 1
                        or view.format != "B"
                        or not view.c_contiguous
                    ):
                        views = None
                        break
                    total += len(view)
            if views is None:
                try:
                    file.offset(page)
                    views = [_byte_view(buffer) for buffer in buffers]
                except (InvalidRequest, ValueError, TypeError) as exc:
                    results[index] = _failed(page, ERROR_BOUNDS, str(exc))
                    continue
                total = sum(map(len, views))
                if reading and any(v.readonly for v in views):
                    results[index] = _failed(page, ERROR_BOUNDS, "a read piece is read-only")
                    continue
            if total != page_bytes if reading else not 0 < total <= page_bytes:
                problem = f"pieces hold {total} bytes, page has {page_bytes}"
                results[index] = _failed(page, ERROR_BOUNDS, problem)
                continue
            checksum = None if expected is None else expected[index]
            ops.append(_Op(index, page, page * slot_bytes, views, total, checksum))
        return results, ops

    def close(self) -> None:
        """Stop the I/O threads (idempotent)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> PosixEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- planning -----------------------------------------------------------------------

    def _prepare(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        expected: Sequence[str | None] | None,
        *,
        reading: bool,
    ) -> tuple[list[PageResult | None], list[_Op]]:
        results = self._results_for(file, pages, expected)
        if len(pages) != len(buffers):
            raise InvalidRequest(
                f"{len(pages)} pages, {len(buffers)} buffers: the lengths must match"
            )
        ops: list[_Op] = []
        for index, (page, buffer) in enumerate(zip(pages, buffers, strict=True)):
            try:
                offset = file.offset(page)
                view = _byte_view(buffer)
            except (InvalidRequest, ValueError, TypeError) as exc:
                results[index] = _failed(page, ERROR_BOUNDS, str(exc))
                continue
            problem = None
            if reading and view.readonly:
                problem = "read buffer is read-only"
            elif reading and len(view) < file.page_bytes:
                problem = f"read buffer has {len(view)} bytes, page has {file.page_bytes}"
            elif not reading and not 0 < len(view) <= file.page_bytes:
                problem = f"write buffer has {len(view)} bytes, page holds 1..{file.page_bytes}"
            if problem is not None:
                results[index] = _failed(page, ERROR_BOUNDS, problem)
                continue
            if reading:
                view = view[: file.page_bytes]
            checksum = None if expected is None else expected[index]
            ops.append(_Op(index, page, offset, [view], len(view), checksum))
        return results, ops

    def _results_for(
        self, file: PageFile, pages: Sequence[int], expected: Sequence[str | None] | None
    ) -> list[PageResult | None]:
        """One empty result per page, once the engine, the file and `expected` are usable."""
        if self._closed:
            raise StorageError("the I/O engine is closed")
        if file.fd < 0:
            raise StorageError(f"page file {file.relpath} is closed")
        if expected is not None and len(expected) != len(pages):
            raise InvalidRequest(
                f"{len(pages)} pages, {len(expected)} checksums: the lengths must match"
            )
        return [None] * len(pages)

    def _plan(self, file: PageFile, ops: list[_Op]) -> list[list[_Op]]:
        """Group ops into tasks: runs of adjacent full pages, cut to share the threads."""
        if not ops:
            return []
        ops = sorted(ops, key=_PAGE_OF)
        per_task = max(
            math.ceil(len(ops) / self.io_threads), math.ceil(MIN_TASK_BYTES / file.slot_bytes)
        )
        iov_per_op = max([len(op.views) for op in ops]) + 1  # + the gap
        per_task = min(
            per_task,
            max(1, self._iov_max // iov_per_op),
            max(1, self.max_task_bytes // file.slot_bytes),
        )
        tasks: list[list[_Op]] = [[ops[0]]]
        for prev, op in itertools.pairwise(ops):
            current = tasks[-1]
            adjacent = op.page == prev.page + 1 and prev.nbytes == file.page_bytes
            if adjacent and len(current) < per_task:
                current.append(op)
            else:
                tasks.append([op])
        return tasks

    def _run(
        self,
        file: PageFile,
        ops: list[_Op],
        results: list[PageResult | None],
        *,
        reading: bool,
        checksums: bool,
    ) -> None:
        tasks = self._plan(file, ops)
        if not tasks:
            return
        # With threads to spare, a big write task's checksum is computed by another
        # thread while its bytes are written (both only read the caller's buffer),
        # hiding its cost; a small one is cheaper to checksum than to hand over.
        can_split = not reading and checksums and self._pool is not None
        digests: dict[int, str] = {}
        # What one thread runs: tasks of at least MIN_TASK_BYTES together (a step's
        # scattered small pages are many tasks; each hand-off costs more than moving them).
        shares: list[list[_Job]] = []
        small: list[_Job] = []  # the share being filled with small tasks
        small_bytes = 0
        for task in tasks:
            nbytes = sum([op.nbytes for op in task])
            split = can_split and nbytes >= MIN_TASK_BYTES
            job = functools.partial(self._task, file, task, reading, checksums and not split)
            if split:  # a big write and its checksum: on two threads at once
                shares += [[job], [functools.partial(_checksum_task, task, digests)]]
                continue
            if not small:
                shares.append(small)
            small.append(job)
            small_bytes += nbytes
            if small_bytes >= MIN_TASK_BYTES:
                small, small_bytes = [], 0
        if small and small_bytes < MIN_TASK_BYTES and len(shares) > 1:
            shares = [share for share in shares if share is not small]  # too short alone:
            shares[0] += small  # it joins the first share
        threads = self.write_threads
        if not reading and len(shares) > threads:  # one list per thread, shares dealt round
            shares = [
                [job for share in shares[i::threads] for job in share] for i in range(threads)
            ]
        if self._pool is None or len(shares) == 1:
            outcomes = [job() for share in shares for job in share]
        else:
            futures = [self._pool.submit(_run_share, share) for share in shares[1:]]
            outcomes = [job() for job in shares[0]]
            for future in futures:
                outcomes.extend(future.result())
        for outcome in outcomes:
            for op, result in outcome:
                if result.ok and op.index in digests:
                    result = dataclasses.replace(result, checksum=digests[op.index])
                results[op.index] = result

    # -- execution (runs on I/O threads) ------------------------------------------------

    def _task(
        self, file: PageFile, ops: list[_Op], reading: bool, checksums: bool, direct: bool = True
    ) -> list[tuple[_Op, PageResult]]:
        fd = self._choose_fd(file, ops) if direct else file.fd
        try:
            done = self._transfer(file, fd, ops, reading)
        except OSError as exc:
            if fd != file.fd:  # O_DIRECT refused: the page cache still works
                logger.debug("O_DIRECT transfer failed (%s); retrying buffered", exc)
                return self._task(file, ops, reading, checksums, direct=False)
            if len(ops) > 1:  # find out which page failed
                return [
                    pair
                    for op in ops
                    for pair in self._task(file, [op], reading, checksums, direct=False)
                ]
            failed = _failed(ops[0].page, ERROR_IO, os.strerror(exc.errno or 0), exc.errno)
            return [(ops[0], failed)]
        return self._results(file, ops, done, reading, checksums)

    def _choose_fd(self, file: PageFile, ops: list[_Op]) -> int:
        if not self.o_direct or ops[0].offset % PAGE_ALIGN:
            return file.fd
        for op in ops:
            for view in op.views:
                if len(view) % PAGE_ALIGN or _address(view) % PAGE_ALIGN:
                    return file.fd
        direct = file.direct_fd()
        return file.fd if direct is None else direct

    def _transfer(self, file: PageFile, fd: int, ops: list[_Op], reading: bool) -> int:
        """Move the ops' bytes with as few vectored calls as possible; return bytes moved."""
        iov: list[memoryview] = []
        scratch: memoryview | None = None
        gap = file.slot_bytes - file.page_bytes
        if reading and gap and len(ops) > 1:
            scratch = memoryview(bytearray(gap))
        if not gap:
            iov = [view for op in ops for view in op.views]
        for position, op in enumerate(ops if gap else ()):
            iov.extend(op.views)
            if position + 1 < len(ops):
                iov.append(scratch if scratch is not None else memoryview(_ZEROS)[:gap])
        total = sum([op.nbytes for op in ops]) + gap * (len(ops) - 1)
        done = 0
        start = ops[0].offset
        while done < total:
            batch = iov if len(iov) <= self._iov_max else iov[: self._iov_max]
            moved = (
                os.preadv(fd, batch, start + done)
                if reading
                else os.pwritev(fd, batch, start + done)
            )
            if moved <= 0:
                break
            done += moved
            if done < total:
                iov = _advance(iov, moved)
        return done

    def _results(
        self, file: PageFile, ops: list[_Op], done: int, reading: bool, checksums: bool
    ) -> list[tuple[_Op, PageResult]]:
        slot_bytes = file.slot_bytes
        if reading and done >= (len(ops) - 1) * slot_bytes + ops[-1].nbytes:
            return [(op, _verified(op)) for op in ops]  # complete: only the checksums to check
        out: list[tuple[_Op, PageResult]] = []
        for position, op in enumerate(ops):
            end = position * slot_bytes + op.nbytes
            if done < end:
                kind = ERROR_SHORT if reading else ERROR_IO
                got = max(0, min(op.nbytes, done - position * slot_bytes))
                out.append((op, _failed(op.page, kind, f"moved {got} of {op.nbytes} bytes")))
            elif reading:
                out.append((op, _verified(op)))
            else:
                digest = _written_checksum(op) if checksums else None
                out.append((op, PageResult(op.page, True, None, digest)))
        return out


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _run_share(share: list[_Job]) -> list[list[tuple[_Op, PageResult]]]:
    """One thread's tasks, in turn."""
    return [job() for job in share]


def _checksum_task(ops: list[_Op], digests: dict[int, str]) -> list[tuple[_Op, PageResult]]:
    """Checksum the pages of a write task (on another thread than the write itself)."""
    for op in ops:
        digests[op.index] = _written_checksum(op)
    return []


def _written_checksum(op: _Op) -> str:
    """The recorded checksum of a written page: its one buffer, or its gathered pieces
    as if they were one."""
    views = op.views
    return page_checksum(views[0]) if len(views) == 1 else checksum_views(views)


def _verified(op: _Op) -> PageResult:
    """A read page's result: verified against its expected checksum, when it has one."""
    expected = op.expected
    if expected is None:
        return PageResult(op.page, True, None, None)
    if expected[:_XXH3_CHARS] == _XXH3_PREFIX:  # what commits record: no lookup, no format
        state = xxh3_64()
        for view in op.views:
            state.update(view)
        if state.hexdigest() == expected[_XXH3_CHARS:]:
            return PageResult(op.page, True, None, expected)
    algorithm = expected.partition(":")[0]
    try:
        actual = checksum_views(op.views, algorithm)
    except InvalidRequest as exc:
        return _failed(op.page, ERROR_CHECKSUM, exc.message)
    if actual != expected:
        return PageResult(
            op.page, False, ERROR_CHECKSUM, actual, f"checksum {actual}, expected {expected}"
        )
    return PageResult(op.page, True, None, actual)


def _advance(iov: list[memoryview], moved: int) -> list[memoryview]:
    """Drop `moved` bytes from the front of an iovec list."""
    for position, view in enumerate(iov):
        if moved < len(view):
            return [view[moved:], *iov[position + 1 :]]
        moved -= len(view)
    return []


def _failed(page: Any, kind: str, detail: str, errno: int | None = None) -> PageResult:
    return PageResult(page if isinstance(page, int) else -1, False, kind, None, detail, errno)


def _finish(results: list[PageResult | None]) -> list[PageResult]:
    out = [r for r in results if r is not None]
    if len(out) != len(results):  # every op is answered by construction
        raise AssertionError("an I/O result went missing")
    failed = [r for r in out if not r.ok]
    if failed:
        logger.debug("%d of %d pages failed; first: %s", len(failed), len(out), failed[0])
    return out
