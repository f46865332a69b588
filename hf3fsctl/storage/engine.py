"""I/O engines: the protocol every engine implements, and how one is chosen.

Contract:
    * An engine moves whole pages between caller-owned buffers and a `PageFile`, without
      copying, in parallel, and returns one `PageResult` per requested page, in request
      order. A per-page failure (out of range, short read, I/O error, checksum mismatch)
      is a result with ``ok=False``; it is never raised.
    * Reads read exactly ``page_bytes`` into each buffer (buffers may be longer) and, when
      an expected checksum is given, verify it in the I/O thread before reporting ``ok``.
      Writes record the checksum of exactly what was written.
    * `open_engine("auto")` picks USRBIO only when the root is on a 3FS mount and the
      USRBIO binding (`hf3fs_fuse.io`) imports; otherwise POSIX. The choice, the reason
      and whether staging is one copy from storage are logged. `open_engine("usrbio")`
      where USRBIO cannot work raises `StorageError` naming `storage.engine` and the fix;
      "auto" whose USRBIO engine fails to start logs a warning and opens POSIX. Nothing
      falls back silently to a slower path (docs/design.md decision 10).
    * An engine that moves pages without a copy only from memory of its own (USRBIO: its
      shared iov) offers it as `host_memory` (`SharedHostMemory`); `engine_host_memory`
      returns it or None. The staging pool then allocates its buffers there, so a page
      is copied once between the KV cache and storage (the gather or the scatter).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hf3fsctl.errors import InvalidRequest, StorageError

if TYPE_CHECKING:
    from typing_extensions import Buffer as Buffer

    from hf3fsctl.storage.layout import PageFile
else:  # typing's Buffer is Python 3.12+; at run time any buffer-protocol object is accepted
    Buffer = Any

logger = logging.getLogger(__name__)

ENGINE_KINDS = ("auto", "posix", "usrbio")
THREEFS_FSTYPES = frozenset({"fuse.hf3fs", "fuse.3fs", "hf3fs"})
# The binding the USRBIO engine is written against (3FS's hf3fs_fuse/io.py; the lower
# hf3fs_py_usrbio module alone has another API and does not count).
USRBIO_BINDING = "hf3fs_fuse.io"
USRBIO_FIX = (
    "set storage.engine to auto or posix, or run on a 3FS mount with 3FS's USRBIO "
    "Python binding (hf3fs_fuse) installed"
)

# PageResult.error kinds.
ERROR_IO = "io"
ERROR_SHORT = "short"
ERROR_CHECKSUM = "checksum"
ERROR_BOUNDS = "bounds"


@dataclass(frozen=True)
class PageResult:
    """The outcome of reading or writing one page.

    Attributes:
        page: the page index in its file.
        ok: the page was transferred in full (and, for reads, verified when asked).
        error: None when ok, else one of "io", "short", "checksum", "bounds".
        checksum: for writes, the checksum of the bytes written (when asked); for reads,
            the checksum computed while verifying (None when nothing was verified).
        detail: a human-readable reason when not ok (errno text, sizes).
    """

    page: int
    ok: bool
    error: str | None
    checksum: str | None
    detail: str | None = None


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


def usrbio_import_error(binding: str = USRBIO_BINDING) -> str | None:
    """None when the USRBIO Python binding imports, else why it does not."""
    try:
        importlib.import_module(binding)
    except Exception as exc:
        return f"{binding}: {type(exc).__name__}: {exc}"
    return None


def describe_engine_choice(
    kind: str,
    root: str | os.PathLike[str] | None,
    *,
    binding: str = USRBIO_BINDING,
    mounts_text: str | None = None,
) -> dict[str, Any]:
    """Which engine `open_engine(kind, root=root)` would use, and why (for `doctor`).

    Args:
        kind: "auto", "posix" or "usrbio".
        root: the storage root.
        binding: the USRBIO binding module (tests pass a fake).
        mounts_text: /proc/mounts' contents (read when None).

    Returns:
        A dict with `requested`, `root`, `mount_point`, `fstype`, `on_3fs`,
        `usrbio_importable`, `usrbio_error`, `engine` ("posix", "usrbio" or None when the
        request cannot be met), `reason`, `one_copy` (staging buffers are the engine's
        own I/O memory, so a page is copied once between GPU and storage) and `staging`
        (that in words).
    """
    if kind not in ENGINE_KINDS:
        raise InvalidRequest(f"unknown I/O engine {kind!r}; expected one of {ENGINE_KINDS}")
    mount_point, fstype = find_mount(root, mounts_text) if root is not None else ("", "unknown")
    on_3fs = fstype in THREEFS_FSTYPES
    error = usrbio_import_error(binding) if kind != "posix" else None
    importable = kind != "posix" and error is None
    info: dict[str, Any] = {
        "requested": kind,
        "root": None if root is None else str(root),
        "mount_point": mount_point,
        "fstype": fstype,
        "on_3fs": on_3fs,
        "usrbio_importable": importable,
        "usrbio_error": error,
    }
    where = f"{root} is on {mount_point or '?'} ({fstype})"
    if kind == "posix":
        engine, reason = "posix", "posix requested"
    elif on_3fs and importable:
        engine, reason = "usrbio", f"{where} and the USRBIO binding imports"
    elif kind == "usrbio":
        missing = [] if on_3fs else [f"{where}, not a 3FS mount"]
        if not importable:
            missing.append(f"no USRBIO binding ({error})")
        engine, reason = None, "usrbio requested but unavailable: " + "; ".join(missing)
    elif not on_3fs:
        engine, reason = "posix", f"{where}, not a 3FS mount"
    else:
        engine, reason = "posix", f"{where} but no USRBIO binding imports ({error})"
    info["engine"] = engine
    info["reason"] = reason
    info["one_copy"] = engine == "usrbio"
    info["staging"] = _STAGING_WORDS.get(engine or "", "no engine can be opened")
    return info


_STAGING_WORDS = {
    "usrbio": "staging buffers are allocated inside the USRBIO iov: one copy each way "
    "(KV cache to staging, then 3FS reads or writes the staging memory itself)",
    "posix": "preadv/pwritev go straight between staging buffers and the file system "
    "(the kernel's copy; no USRBIO iov)",
}


def open_engine(
    kind: str,
    *,
    io_threads: int = 16,
    o_direct: bool = False,
    root: str | os.PathLike[str] | None = None,
    binding: str = USRBIO_BINDING,
    mounts_text: str | None = None,
) -> IOEngine:
    """Open an I/O engine.

    Args:
        kind: "auto", "posix" or "usrbio".
        io_threads: parallel I/O threads (1..256).
        o_direct: use O_DIRECT where buffer address, length and offset are 4096-aligned.
        root: the storage root (decides "auto" and is required for "usrbio").
        binding: the USRBIO binding module (tests pass a fake).
        mounts_text: /proc/mounts' contents (read when None).

    Raises:
        StorageError: "usrbio" was requested where it cannot work (the message names
            `storage.engine`, the hint says how to fix it).
        InvalidRequest: an unknown kind or thread count.
    """
    if (
        isinstance(io_threads, bool)
        or not isinstance(io_threads, int)
        or not 1 <= io_threads <= 256
    ):
        raise InvalidRequest(f"io_threads must be in 1..256, got {io_threads!r}")
    choice = describe_engine_choice(kind, root, binding=binding, mounts_text=mounts_text)
    if choice["engine"] is None:
        raise StorageError(f"storage.engine: {choice['reason']}", hint=USRBIO_FIX)
    if choice["engine"] == "usrbio":
        from hf3fsctl.storage.usrbio import UsrbioEngine

        try:
            engine: IOEngine = UsrbioEngine(
                root=Path(str(root)), io_threads=io_threads, binding=binding
            )
        except StorageError as exc:
            if kind == "usrbio":
                raise StorageError(
                    f"storage.engine: usrbio requested but it did not start: {exc.message}",
                    hint=USRBIO_FIX,
                ) from None
            logger.warning(
                "I/O engine: posix, not usrbio (%s, but USRBIO did not start: %s); %s",
                choice["reason"],
                exc.message,
                _STAGING_WORDS["posix"],
            )
        else:
            logger.info("I/O engine: usrbio (%s); %s", choice["reason"], choice["staging"])
            return engine
    else:
        logger.info("I/O engine: posix (%s); %s", choice["reason"], choice["staging"])
    from hf3fsctl.storage.posix import PosixEngine

    return PosixEngine(io_threads=io_threads, o_direct=o_direct)
