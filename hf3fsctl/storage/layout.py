"""Page-file layout: where a namespace's pages and manifest live, and the geometry of a file.

Contract:
    * A namespace has one page file per rank, ``<root>/<namespace_id>/rank-NNNN.pages``,
      and its manifest beside them, ``<root>/<namespace_id>/manifest.json``.
    * Page ``i`` of a file sits in a fixed slot at ``i * slot_bytes``, where
      ``slot_bytes = round_up(page_bytes, PAGE_ALIGN)`` so O_DIRECT can be used;
      ``num_pages = file_size // slot_bytes``.
    * Every path handed in stays under the storage root: absolute paths and ``..`` are
      rejected with `InvalidRequest`.
    * The manifest is written atomically (temp file, then link/rename). Writing an identical
      manifest again is a no-op; a different one for the same namespace is
      `NamespaceConflict`.
    * Page files grow on demand (`PageFile.create_growable`): a sparse file that holds
      only the pages written to it; a writer claims each granted run of pages just before
      writing it (`PageFile.reserve`), and the store gives freed pages back to the file
      system (`punch_pages`) when another namespace needs the space. Its address space is
      `GROWABLE_MAX_BYTES`; the store's capacity is what bounds it.
    * `PageFile.create` makes a fixed-size file preallocated up front (opt-in, `hf3fsctl
      init --preallocate`). It is idempotent and resumable: the file is preallocated
      under a ``.partial`` name and renamed into place only when it has its full size.

This module imports only the standard library and `hf3fsctl.errors`/`hf3fsctl.keys`, so it
runs on a GPU node that lacks the service's dependencies.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from hf3fsctl.errors import InvalidRequest, NamespaceConflict, NotFound, StorageError
from hf3fsctl.keys import NamespaceManifest, check_namespace_id
from hf3fsctl.storage.extents import page_runs, punch, reserve

logger = logging.getLogger(__name__)

PAGE_ALIGN = 4096
MANIFEST_NAME = "manifest.json"
PREALLOCATE_CHUNK = 256 * 1024 * 1024
# The address space of a growing page file (its pages are numbered below this / slot).
GROWABLE_MAX_BYTES = 1 << 46
_PARTIAL_SUFFIX = ".partial"
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

ProgressCallback = Callable[[int, int], None]


def root_problem(root: str | os.PathLike[str], *, creatable: bool = False) -> StorageError | None:
    """Why the storage root `root` cannot be used here, or None when it is a directory:
    missing (its file system not mounted?), not a directory, or on a file system gone
    from under its mount point (`StorageError.from_os_error`: a FUSE daemon that exited).

    With `creatable`, a missing root is fine when its parent is a directory (the
    connector makes it there): a root is only ever made inside an existing directory,
    so that a missing mount (its parent gone too) never becomes a store on the local disk.
    """
    try:
        mode = os.stat(root).st_mode
    except (FileNotFoundError, NotADirectoryError):
        parent = os.path.dirname(os.path.abspath(root))
        if creatable and root_problem(parent) is None:
            return None
        return StorageError(
            f"storage path {os.fspath(root)} does not exist (missing mount?)",
            hint="mount its file system, or create the store: `hf3fsctl init "
            f"--storage-path {os.fspath(root)} --create-path`",
        )
    except OSError as exc:
        return StorageError.from_os_error(exc)
    if stat.S_ISDIR(mode):
        return None
    return StorageError(
        f"storage path {os.fspath(root)} is not a directory",
        hint="set storage.path to the store's directory (on 3FS: one under the mount)",
    )


class RootCheck:
    """`root_problem(root)` on a daemon thread, for a caller that must not block: on a
    hung file system (a FUSE daemon stopped, an NFS server gone) a `stat` waits until
    it answers, which may be never. A daemon thread, so that a process exiting does not
    wait for it either."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)
        self.started = time.monotonic()
        self.problem: StorageError | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, name="hf3fsctl-root-check", daemon=True).start()

    def _run(self) -> None:
        try:
            self.problem = root_problem(self.root)
        finally:
            self._done.set()

    def done(self, wait_s: float = 0.0) -> bool:
        """Whether the check finished (waiting up to `wait_s` for it)."""
        return self._done.wait(wait_s) if wait_s > 0 else self._done.is_set()

    def hung(self) -> StorageError:
        """The problem of a check that has not answered yet."""
        waited = time.monotonic() - self.started
        return StorageError(
            f"storage path {self.root} does not answer (a stat has waited {waited:.1f} s): "
            "a hung file system (a FUSE daemon stopped, a network mount unreachable)",
            hint="check the mount's daemon or server; `hf3fsctl doctor` waits on it too",
        )


def slot_bytes(page_bytes: int) -> int:
    """The slot size of a page: `page_bytes` rounded up to `PAGE_ALIGN`.

    Args:
        page_bytes: bytes of one page (one block of one rank, all layers, K and V).

    Returns:
        The distance between two consecutive pages in a page file.
    """
    if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
        raise InvalidRequest(f"page_bytes must be a positive integer, got {page_bytes!r}")
    return -(-page_bytes // PAGE_ALIGN) * PAGE_ALIGN


def rank_file_name(namespace_id: str, rank: int) -> str:
    """The page file of one rank, relative to the storage root: ``<ns>/rank-0000.pages``."""
    check_namespace_id(namespace_id)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= 9999:
        raise InvalidRequest(f"rank must be an integer in 0..9999, got {rank!r}")
    return f"{namespace_id}/rank-{rank:04d}.pages"


def manifest_file_name(namespace_id: str) -> str:
    """The manifest of a namespace, relative to the storage root: ``<ns>/manifest.json``."""
    check_namespace_id(namespace_id)
    return f"{namespace_id}/{MANIFEST_NAME}"


def resolve_under(root: str | os.PathLike[str], relpath: str) -> Path:
    """Join `relpath` to `root`, refusing anything that would leave the root.

    Args:
        root: the storage root.
        relpath: a relative POSIX path such as ``<ns>/rank-0000.pages``.

    Returns:
        The absolute path of the file.

    Raises:
        InvalidRequest: `relpath` is empty, absolute, contains ``..``, or resolves
            (through symbolic links) outside the root.
    """
    if not isinstance(relpath, str) or not relpath or "\0" in relpath:
        raise InvalidRequest(f"page file path {relpath!r} is empty or malformed")
    parts = PurePosixPath(relpath).parts
    if relpath.startswith(("/", "\\")) or ".." in parts or "\\" in relpath or not parts:
        raise InvalidRequest(
            f"page file path {relpath!r} must be relative and stay under the storage root"
        )
    base = Path(root).resolve()
    path = (base / relpath).resolve()
    if path != base and base not in path.parents:
        raise InvalidRequest(f"page file path {relpath!r} resolves outside the storage root")
    return path


def _manifest_bytes(manifest: NamespaceManifest) -> bytes:
    return (json.dumps(manifest.to_dict(), sort_keys=True, indent=2) + "\n").encode()


def _load_manifest_file(path: Path) -> NamespaceManifest:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise NotFound(f"no manifest at {path}") from None
    except (OSError, ValueError) as exc:
        raise StorageError(f"manifest {path} is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise StorageError(f"manifest {path} is not a JSON object")
    try:
        return NamespaceManifest.from_dict(data)
    except InvalidRequest as exc:
        raise StorageError(f"manifest {path} is malformed: {exc.message}") from None


def write_manifest(root: str | os.PathLike[str], manifest: NamespaceManifest) -> Path:
    """Store a namespace's manifest beside its page files, atomically.

    Args:
        root: the storage root.
        manifest: the namespace manifest; its `namespace_id` names the directory.

    Returns:
        The manifest's path.

    Raises:
        NamespaceConflict: a different manifest is already stored for this namespace.
        StorageError: the directory or file cannot be written.
    """
    ns = manifest.namespace_id
    path = resolve_under(root, manifest_file_name(ns))
    payload = _manifest_bytes(manifest)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            return _check_same_manifest(path, manifest)
        tmp = path.with_name(f".{MANIFEST_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            # link() refuses to replace: of two concurrent writers exactly one wins, and
            # the other compares against the winner instead of silently overwriting it.
            os.link(tmp, path)
        except FileExistsError:
            return _check_same_manifest(path, manifest)
        except OSError:  # file systems without hard links: last identical writer wins
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot write manifest {path}: {exc}", errno=exc.errno) from None
    logger.info("wrote manifest of namespace %s to %s", ns, path)
    return path


def _check_same_manifest(path: Path, manifest: NamespaceManifest) -> Path:
    stored = _load_manifest_file(path)
    if stored != manifest:
        changed = sorted(k for k, v in manifest.to_dict().items() if stored.to_dict().get(k) != v)
        raise NamespaceConflict(
            f"namespace {manifest.namespace_id} already has a different manifest at {path} "
            f"(fields differ: {', '.join(changed) or 'unknown'})"
        )
    return path


def read_manifest(root: str | os.PathLike[str], namespace_id: str) -> NamespaceManifest:
    """Read a namespace's stored manifest.

    Raises:
        NotFound: the namespace has no manifest under `root`.
        StorageError: the manifest is unreadable, malformed, or belongs to another namespace.
    """
    path = resolve_under(root, manifest_file_name(namespace_id))
    manifest = _load_manifest_file(path)
    if manifest.namespace_id != namespace_id:
        raise StorageError(
            f"manifest {path} hashes to namespace {manifest.namespace_id}, "
            f"not {namespace_id}: it was edited or copied into the wrong directory"
        )
    return manifest


def _preallocate(
    fd: int, start: int, total: int, preallocate: bool, progress: ProgressCallback | None
) -> bool:
    """Grow `fd` to `total` bytes from `start`, in chunks; True when progress reached total."""
    if not preallocate:
        os.ftruncate(fd, total)
        return False
    done = start
    while done < total:
        length = min(PREALLOCATE_CHUNK, total - done)
        try:
            os.posix_fallocate(fd, done, length)
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            logger.warning(
                "fallocate is not supported here (%s); page file sized with ftruncate "
                "instead (sparse: space is claimed as pages are written)",
                os.strerror(exc.errno or 0),
            )
            os.ftruncate(fd, total)
            return False
        done += length
        if progress is not None:
            progress(done, total)
    return done > start


class PageFile:
    """One (namespace, rank) page file: geometry, bounds-checked offsets, an open fd.

    Attributes:
        root: the storage root.
        relpath: the file's path relative to `root`.
        path: the file's absolute path.
        page_bytes: bytes of one page.
        slot_bytes: distance between consecutive pages (`page_bytes` rounded up to 4096).
        num_pages: pages the file holds.
        fd: the open file descriptor (-1 once closed).
        writable: whether `fd` was opened for writing.
        growable: a sparse file that grows as pages are written (else preallocated).
    """

    def __init__(
        self,
        root: Path,
        relpath: str,
        path: Path,
        page_bytes: int,
        num_pages: int,
        fd: int,
        writable: bool,
        growable: bool = False,
    ) -> None:
        self.root = root
        self.relpath = relpath
        self.path = path
        self.page_bytes = page_bytes
        self.slot_bytes = slot_bytes(page_bytes)
        self.num_pages = num_pages
        self.fd = fd
        self.writable = writable
        self.growable = growable
        self._reserve_supported = True
        self._direct_fd: int | None = None
        self._direct_tried = False
        self._lock = threading.Lock()

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str],
        namespace_id: str,
        rank: int,
        page_bytes: int,
        file_size: int,
        *,
        preallocate: bool = True,
        progress: ProgressCallback | None = None,
    ) -> PageFile:
        """Create (or open, when it already exists with this size) one rank's page file.

        Args:
            root: the storage root; directories are created as needed.
            namespace_id: the namespace the file belongs to.
            rank: the rank whose pages the file holds.
            page_bytes: bytes of one page.
            file_size: bytes of the file; it holds `file_size // slot_bytes` pages.
            preallocate: reserve the space now (`posix_fallocate`) rather than sparsely.
            progress: called as `progress(done, total)` after each preallocated chunk
                and once with `done == total` at the end.

        Returns:
            The open, writable page file.

        Raises:
            InvalidRequest: the geometry is invalid (no page fits) or the path escapes.
            NamespaceConflict: the file exists with a different size.
            StorageError: the file cannot be created or sized (permissions, no space).
        """
        slot = slot_bytes(page_bytes)
        if isinstance(file_size, bool) or not isinstance(file_size, int) or file_size < slot:
            raise InvalidRequest(
                f"file_size {file_size!r} holds no page of {slot} bytes (page_bytes={page_bytes})"
            )
        relpath = rank_file_name(namespace_id, rank)
        path = resolve_under(root, relpath)
        partial = path.with_name(path.name + _PARTIAL_SUFFIX)
        reported = False
        if not path.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    start = os.fstat(fd).st_size
                    if start > file_size:
                        os.ftruncate(fd, file_size)
                        start = file_size
                    logger.info(
                        "creating page file %s: %d bytes (%s)",
                        path,
                        file_size,
                        f"resuming at {start}" if start else "new",
                    )
                    reported = _preallocate(fd, start, file_size, preallocate, progress)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(partial, path)
            except FileNotFoundError:
                if not path.exists():  # another creator renamed it first: fine if it exists
                    raise StorageError(f"page file {path} vanished while being created") from None
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    partial.unlink(missing_ok=True)
                raise StorageError(
                    f"cannot create page file {path}: {exc}", errno=exc.errno
                ) from None
        size = cls._size_of(path)
        if size != file_size:
            raise NamespaceConflict(
                f"page file {path} exists with {size} bytes, not the {file_size} requested",
                hint="use the storage.file_size it was created with, or evict the namespace "
                "and remove its directory",
            )
        if progress is not None and not reported:
            progress(file_size, file_size)
        return cls.open(root, relpath, page_bytes, file_size // slot)

    @classmethod
    def create_growable(
        cls, root: str | os.PathLike[str], namespace_id: str, rank: int, page_bytes: int
    ) -> PageFile:
        """Open one rank's growing page file, creating it empty when missing.

        An existing file (grown earlier, or preallocated by an older version) is opened
        as it is; its pages stay where they are.

        Raises:
            StorageError: the directory or file cannot be created or opened (permissions,
                a read-only or missing mount, no space for the directory entry).
        """
        slot = slot_bytes(page_bytes)
        relpath = rank_file_name(namespace_id, rank)
        path = resolve_under(root, relpath)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot create page file {path}: {exc}", errno=exc.errno) from None
        return cls(
            Path(root).resolve(),
            relpath,
            path,
            page_bytes,
            GROWABLE_MAX_BYTES // slot,
            fd,
            True,
            growable=True,
        )

    def reserve(self, pages: Sequence[int]) -> None:
        """Claim the disk space of `pages` before writing them (growing files only).

        One `fallocate` per run of consecutive pages. Where the file system has no
        `fallocate`, the writes claim the space themselves.

        Raises:
            InvalidRequest: a page is out of range.
            StorageError: the file system is full or failing (``errno`` kept on the error).
        """
        if not self.growable or not self._reserve_supported:
            return
        for first, count in page_runs(pages):
            self.offset(first + count - 1)
            try:
                if not reserve(self.fd, first * self.slot_bytes, count * self.slot_bytes):
                    self._reserve_supported = False
                    return
            except OSError as exc:
                raise StorageError(
                    f"cannot claim {count} pages of {self.relpath}: {exc.strerror}",
                    errno=exc.errno,
                ) from None

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        relpath: str,
        page_bytes: int,
        num_pages: int,
        *,
        writable: bool = True,
        growable: bool = False,
    ) -> PageFile:
        """Open an existing page file (a growing one may be shorter than `num_pages`).

        Args:
            root: the storage root.
            relpath: the file relative to `root` (as `rank_file_name` returns it).
            page_bytes: bytes of one page.
            num_pages: pages the caller expects; the file must be at least this large.
            writable: open for reading and writing (else read-only).

        Raises:
            InvalidRequest: the path escapes the root or the geometry is invalid.
            NotFound: the file does not exist.
            StorageError: the file is too small or cannot be opened.
        """
        slot = slot_bytes(page_bytes)
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise InvalidRequest(f"num_pages must be a positive integer, got {num_pages!r}")
        path = resolve_under(root, relpath)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise NotFound(
                f"page file {path} does not exist", hint="create it with `hf3fsctl init`"
            ) from None
        except OSError as exc:
            raise StorageError(f"cannot open page file {path}: {exc}", errno=exc.errno) from None
        size = os.fstat(fd).st_size
        if not growable and size < num_pages * slot:
            os.close(fd)
            raise StorageError(
                f"page file {path} has {size} bytes, too small for {num_pages} pages of "
                f"{slot} bytes"
            )
        return cls(
            Path(root).resolve(), relpath, path, page_bytes, num_pages, fd, writable, growable
        )

    @staticmethod
    def _size_of(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError as exc:
            raise StorageError(f"cannot stat page file {path}: {exc}", errno=exc.errno) from None

    def offset(self, page: int) -> int:
        """Byte offset of `page`'s slot. Raises `InvalidRequest` when out of range."""
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise InvalidRequest(
                f"page {page!r} is out of range for {self.relpath} ({self.num_pages} pages)"
            )
        return page * self.slot_bytes

    def direct_fd(self) -> int | None:
        """A second descriptor opened with O_DIRECT, or None where the file system refuses it."""
        with self._lock:
            if not self._direct_tried and self.fd >= 0:
                self._direct_tried = True
                flags = (os.O_RDWR if self.writable else os.O_RDONLY) | os.O_CLOEXEC
                try:
                    self._direct_fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0))
                except OSError as exc:
                    logger.warning(
                        "O_DIRECT refused for %s (%s); using the page cache", self.path, exc
                    )
            return self._direct_fd

    def sync(self) -> None:
        """Flush written pages to stable storage (`fdatasync`)."""
        os.fdatasync(self.fd)

    @property
    def removed(self) -> bool:
        """Whether its path no longer names this open file (unlinked or replaced: its
        namespace was removed while it was open)."""
        try:
            here, there = os.fstat(self.fd), os.stat(self.path)
        except OSError:
            return True
        return (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino)

    def close(self) -> None:
        """Close the file's descriptors (idempotent)."""
        with self._lock:
            for fd in (self.fd, self._direct_fd):
                if fd is not None and fd >= 0:
                    os.close(fd)
            self.fd = -1
            self._direct_fd = None
            self._direct_tried = True

    def __enter__(self) -> PageFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PageFile({self.relpath!r}, page_bytes={self.page_bytes}, "
            f"num_pages={self.num_pages}, fd={self.fd})"
        )

    def describe(self) -> dict[str, Any]:
        """The file's geometry as plain values (for `stats`/`doctor`)."""
        return {
            "path": str(self.path),
            "relpath": self.relpath,
            "page_bytes": self.page_bytes,
            "slot_bytes": self.slot_bytes,
            "num_pages": self.num_pages,
        }


def punch_pages(
    root: str | os.PathLike[str], relpath: str, slot: int, pages: Sequence[int]
) -> bool:
    """Give the disk space of free `pages` of a page file back to the file system.

    Returns:
        True when every run was punched (or the file is gone: nothing to give back);
        False when the file system cannot punch holes or refused.
    """
    path = resolve_under(root, relpath)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError as exc:
        logger.warning("cannot open %s to give back %d pages: %s", path, len(pages), exc)
        return False
    try:
        return all(punch(fd, first * slot, count * slot) for first, count in page_runs(pages))
    except OSError as exc:
        logger.warning("cannot give back %d pages of %s: %s", len(pages), path, exc)
        return False
    finally:
        os.close(fd)


def remove_namespace_files(root: str | os.PathLike[str], namespace_id: str) -> int:
    """Delete a namespace's directory (page files, manifest); returns the disk bytes freed.

    Raises:
        StorageError: a file cannot be removed.
    """
    directory = resolve_under(root, check_namespace_id(namespace_id))
    if not directory.is_dir():
        return 0
    freed = 0
    try:
        for child in directory.iterdir():
            freed += child.stat().st_blocks * 512
            child.unlink()
        directory.rmdir()
    except OSError as exc:
        raise StorageError(f"cannot remove namespace directory {directory}: {exc}") from None
    logger.info("removed namespace directory %s (%d bytes)", directory, freed)
    return freed
