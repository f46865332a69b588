"""I/O engines: the protocol every engine implements, its vocabulary, and mounts.

Contract:
    * An engine moves whole pages between caller-owned buffers and a `PageFile`, without
      copying, in parallel, and returns one `PageResult` per requested page, in request
      order. A per-page failure (out of range, short read, I/O error, checksum mismatch)
      is a result with ``ok=False``; it is never raised. A failure the OS reported keeps
      its ``errno`` on the result (``no_space``: ENOSPC or EDQUOT), so callers read the
      kind as data, never from the text.
    * Reads read exactly ``page_bytes`` into each buffer (buffers may be longer) and, when
      an expected checksum is given, verify it in the I/O thread before reporting ``ok``.
      Writes record the checksum of exactly what was written.
    * An engine that moves pages without a copy only from memory of its own (USRBIO: its
      shared iov) offers it as `host_memory` (`SharedHostMemory`); `engine_host_memory`
      returns it or None. The staging pool then allocates its buffers there, so a page
      is copied once between the KV cache and storage (the gather or the scatter).

Which engine opens is decided in `hf3fsctl.storage.factory` (`open_engine`); this module
imports no engine, so the engines can import it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hf3fsctl.errors import NO_SPACE_ERRNOS

if TYPE_CHECKING:
    from typing_extensions import Buffer as Buffer

    from hf3fsctl.storage.layout import PageFile
else:  # typing's Buffer is Python 3.12+; at run time any buffer-protocol object is accepted
    Buffer = Any

logger = logging.getLogger(__name__)

THREEFS_FSTYPES = frozenset({"fuse.hf3fs", "fuse.3fs", "hf3fs"})
# The binding the USRBIO engine is written against (3FS's hf3fs_fuse/io.py; the lower
# hf3fs_py_usrbio module alone has another API and does not count).
USRBIO_BINDING = "hf3fs_fuse.io"

# PageResult.error kinds.
ERROR_IO = "io"
ERROR_SHORT = "short"
ERROR_CHECKSUM = "checksum"
ERROR_BOUNDS = "bounds"


@dataclass(frozen=True, slots=True)  # slots: built once per page moved
class PageResult:
    """The outcome of reading or writing one page.

    Attributes:
        page: the page index in its file.
        ok: the page was transferred in full (and, for reads, verified when asked).
        error: None when ok, else one of "io", "short", "checksum", "bounds".
        checksum: for writes, the checksum of the bytes written (when asked); for reads,
            the checksum computed while verifying (None when nothing was verified).
        detail: a human-readable reason when not ok (errno text, sizes).
        errno: the OS error behind a failure, when the OS reported one.
    """

    page: int
    ok: bool
    error: str | None
    checksum: str | None
    detail: str | None = None
    errno: int | None = None

    @property
    def no_space(self) -> bool:
        """The page failed because the file system (or a quota) is full."""
        return self.errno in NO_SPACE_ERRNOS


class IOEngine(Protocol):
    """Moves pages between caller buffers and a page file."""

    name: str

    def write_pages(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        *,
        checksums: bool = True,
    ) -> list[PageResult]:
        """Write `buffers[i]` (at most `page_bytes`) into page `pages[i]`'s slot."""
        ...

    def write_pages_gathered(
        self,
        file: PageFile,
        pages: Sequence[int],
        pieces: Sequence[Sequence[Buffer]],
        *,
        checksums: bool = True,
    ) -> list[PageResult]:
        """Write the buffers `pieces[i]`, in order, as page `pages[i]` (at most
        `page_bytes` together): a KV block's per-layer byte ranges can be the pieces, so
        a page is saved from the KV cache without staging. The checksum covers the
        pieces as if they were one buffer (what `read_pages_scattered` verifies). The
        pieces must not change until the call returns."""
        ...

    def read_pages(
        self,
        file: PageFile,
        pages: Sequence[int],
        buffers: Sequence[Buffer],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PageResult]:
        """Read page `pages[i]` into writable `buffers[i]`, verifying `expected[i]` if set."""
        ...

    def read_pages_scattered(
        self,
        file: PageFile,
        pages: Sequence[int],
        pieces: Sequence[Sequence[Buffer]],
        *,
        expected: Sequence[str | None] | None = None,
    ) -> list[PageResult]:
        """Read page `pages[i]` into the writable buffers `pieces[i]`, in order.

        The pieces of a page must add up to exactly ``page_bytes``; the page's first
        bytes go to the first piece, and so on (a KV block's per-layer byte ranges can be
        the pieces, so a page lands in the KV cache without staging). `expected[i]` is
        verified over the pieces as if they were one buffer. A page that fails may have
        left any bytes in its pieces.
        """
        ...

    def close(self) -> None:
        """Release threads and resources."""
        ...


class SharedHostMemory(Protocol):
    """Host memory an engine moves pages from and into without copying them.

    USRBIO's is shared memory registered with the 3FS FUSE daemon (an iov per
    allocation). The staging pool allocates its buffers here when the engine offers it.
    """

    name: str

    def allocate(self, nbytes: int) -> memoryview | None:
        """A writable region of exactly `nbytes`, or None when none can be made (logged)."""
        ...

    def free(self, address: int) -> None:
        """Give back the region starting at `address` (from `allocate`)."""
        ...


def engine_host_memory(engine: IOEngine) -> SharedHostMemory | None:
    """The memory `engine` does I/O on without a copy, or None (any memory serves it)."""
    memory: SharedHostMemory | None = getattr(engine, "host_memory", None)
    return memory


def _unescape_mount_field(value: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\" and i + 4 <= len(value) and value[i + 1 : i + 4].isdigit():
            out.append(chr(int(value[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def find_mount(path: str | os.PathLike[str], mounts_text: str | None = None) -> tuple[str, str]:
    """The mount point and file-system type holding `path` (which need not exist yet).

    Args:
        path: a file or directory; missing trailing components are ignored.
        mounts_text: the contents of /proc/mounts (read when None; tests pass their own).

    Returns:
        `(mount_point, fstype)`; `("", "unknown")` when /proc/mounts is unreadable.
    """
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return "", "unknown"
    existing, missing = Path(path).absolute(), []
    while not existing.exists() and existing != existing.parent:
        missing.append(existing.name)
        existing = existing.parent
    target = existing.resolve().joinpath(*reversed(missing))
    best, best_type = "", "unknown"
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape_mount_field(fields[1])
        mount = Path(point)
        if (mount == target or mount in target.parents) and len(point) >= len(best):
            best, best_type = point, fields[2]
    return best, best_type
