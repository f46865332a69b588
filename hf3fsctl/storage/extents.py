"""Disk space of page files, claimed and given back by byte range.

Page files are sparse and grow on demand: a writer claims the byte ranges of the pages
it was granted just before writing them (`reserve`), and the store gives back the ranges
of pages it freed for another namespace (`punch`). Both call Linux `fallocate(2)`
directly (through ctypes), not `os.posix_fallocate`: glibc emulates the latter by writing
a byte into every block where the file system lacks `fallocate` (FUSE mounts), which
would double the bytes written; here an unsupported file system simply reports False and
the write claims the space itself.

Contract:
    * `reserve(fd, offset, length)` makes the range take disk space now; it raises
      `OSError` (``ENOSPC``, ``EDQUOT``, ``EIO``) when the file system cannot, so a full
      disk fails before any page is written. Returns False where unsupported.
    * `punch(fd, offset, length)` frees the range's disk space (a hole; the file keeps
      its size, reads of the range return zeros, so a stale reader fails its checksum).
      Returns False where unsupported.
    * `page_runs(pages)` groups page numbers into runs of consecutive pages, so one call
      covers a whole prefix chain.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Iterable

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _fallocate = _libc.fallocate
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _fallocate.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux/glibc: no fallocate(2)
    _libc = None


def _call(fd: int, mode: int, offset: int, length: int) -> bool:
    if length <= 0:
        return True
    if _libc is None:
        return False
    if _fallocate(fd, mode, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err))


def reserve(fd: int, offset: int, length: int) -> bool:
    """Claim disk space for `[offset, offset + length)` of `fd` (extends the file).

    Raises:
        OSError: the file system refused (``ENOSPC`` when full).
    """
    return _call(fd, 0, offset, length)


def punch(fd: int, offset: int, length: int) -> bool:
    """Give `[offset, offset + length)` of `fd` back to the file system (keeps the size)."""
    return _call(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)


def page_runs(pages: Iterable[int]) -> list[tuple[int, int]]:
    """`(first_page, count)` of each run of consecutive pages, in page order."""
    runs: list[tuple[int, int]] = []
    for page in sorted(set(pages)):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def disk_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of disk a file holds (its allocated blocks, not its size); 0 if absent."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
