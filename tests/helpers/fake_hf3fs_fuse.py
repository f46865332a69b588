"""FAKE of 3FS's USRBIO Python binding `hf3fs_fuse.io`: no 3FS mount can exist here.

This is not 3FS. It is the binding's documented behaviour (3FS's `src/lib/api/UsrbIo.md`,
`hf3fs_fuse/io.py` and `src/lib/py/usrbio_binding.cc`), acted out on real files, real
shared memory and a thread standing in for the FUSE daemon, so the USRBIO engine can be
tested against the contract it has to meet:

* A `FakeMount` is a directory standing in for a mount point, with `3fs-virt/iovs/`.
  `extract_mount_point(path)` finds it.
* `make_iovec(shm, mount)` links `/dev/shm/<name>` as `3fs-virt/iovs/<uuid>`; the fake
  daemon maps that file as the link appears (so the caller may unlink the shm right
  after) and moves bytes only through its own mapping: data reaches the file only if
  the caller put it in the shared memory. Dropping the iovec removes the link. The
  binding keeps a raw pointer, not the buffer: an iov whose SharedMemory the caller
  closed is refused at `prepare` (`EFAULT`, where the real one would touch freed memory).
* `register_fd(fd)`: the fd must be on a fake mount (else `EBADF`) and not registered
  already (`EINVAL`); the daemon does I/O through a dup of it, as 3FS does.
  `deregister_fd` of an unknown fd does nothing.
* `ring.prepare(iov_slice, read, fd, offset, userdata=)` raises `OSError` like the
  binding: `EINVAL` for a direction other than the ring's or an empty or out-of-range
  slice, `EBADF` for an unregistered fd, `EACCES` for a write on a read-only fd,
  `EAGAIN` when `entries` I/Os are prepared and not yet reaped (a slot is freed when
  `wait` returns its completion).
* io_depth 0 issues whatever is queued; > 0 issues only full batches of io_depth (a
  smaller batch never runs: the binding warns `wait` then hangs); < 0 at most -io_depth
  at a time. The daemon also scans on its own, so I/O may run before `submit`.
* `ring.wait(*, max_results=0, min_results=0, timeout=None)` returns completions (each
  with `result`: bytes moved, short past EOF, or -errno; and `userdata`): at least
  `min_results` unless `timeout` (a `datetime.timedelta`) passes first, then what there
  is, maybe none; at most max(max_results, min_results), and fewer when fewer are done.

Test controls on `FakeMount`: `fail(path, offset, err)` (I/O at that file offset
completes with -err), `stall()` / `resume()` (new I/O waits, as on a hung daemon),
`max_results_per_wait` (a wait returns at most that many, as when completions trickle
in); `io_log` (every executed I/O) and `peak_in_flight` record what happened.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

FAKE = True  # this module is a fake: see its docstring

_MOUNTS: dict[str, FakeMount] = {}
_REGISTERED: dict[int, _Registration] = {}
_STATE_LOCK = threading.Lock()


@dataclass
class _Registration:
    dupfd: int
    flags: int


@dataclass
class _Sqe:
    mapping: _DaemonMapping
    offset: int  # in the iov
    length: int
    dupfd: int
    file_offset: int
    path: str
    userdata: Any


@dataclass
class Completion:
    """What `wait` returns per I/O (the binding returns the iov slice with these)."""

    result: int
    userdata: Any


@dataclass
class _DaemonMapping:
    """The daemon's own mapping of an iov's shared memory."""

    map: mmap.mmap
    closed: bool = False


@dataclass
class FakeMount:
    """A directory standing in for a 3FS mount point, and the fault controls."""

    root: str
    max_results_per_wait: int | None = None
    peak_in_flight: int = 0  # most I/Os one ring held at once
    io_log: list[tuple[bool, str, int, int]] = field(default_factory=list)
    _faults: dict[tuple[str, int], int] = field(default_factory=dict)
    _stalled: threading.Event = field(default_factory=threading.Event)

    def fail(self, path: str | os.PathLike[str], offset: int, err: int) -> None:
        """I/O on `path` at `offset` completes with -err from now on."""
        self._faults[(os.path.realpath(path), offset)] = err

    def stall(self) -> None:
        """I/O issued from now on does not complete until `resume` (a hung daemon)."""
        self._stalled.set()

    def resume(self) -> None:
        """Let stalled I/O run."""
        self._stalled.clear()


def mount(root: str | os.PathLike[str]) -> FakeMount:
    """Make `root` a fake 3FS mount (creates it and its `3fs-virt/iovs/`)."""
    path = Path(root)
    (path / "3fs-virt" / "iovs").mkdir(parents=True, exist_ok=True)
    fake = FakeMount(os.path.realpath(path))
    with _STATE_LOCK:
        _MOUNTS[fake.root] = fake
    return fake


def unmount(fake: FakeMount) -> None:
    """Forget `fake` (and stop stalling its I/O)."""
    fake.resume()
    with _STATE_LOCK:
        _MOUNTS.pop(fake.root, None)


def _mount_of(path: str) -> FakeMount | None:
    real = os.path.realpath(path)
    with _STATE_LOCK:
        for root, fake in _MOUNTS.items():
            if real == root or real.startswith(root + os.sep):
                return fake
    return None


def extract_mount_point(path: str) -> str | None:
    """The fake mount holding `path`, or None."""
    fake = _mount_of(path)
    return None if fake is None else fake.root


def register_fd(fd: int, flags: int = 0) -> None:
    """Register `fd` for USRBIO (see the module docstring for the errors)."""
    del flags
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF)) from None
    if _mount_of(path) is None:
        raise OSError(errno.EBADF, "not a file on a 3FS mount")
    with _STATE_LOCK:
        if fd in _REGISTERED:
            raise OSError(errno.EINVAL, "fd already registered")
        _REGISTERED[fd] = _Registration(os.dup(fd), fcntl.fcntl(fd, fcntl.F_GETFL))


def deregister_fd(fd: int) -> None:
    """Deregister `fd`; nothing happens when it is not registered."""
    with _STATE_LOCK:
        registration = _REGISTERED.pop(fd, None)
    if registration is not None:
        os.close(registration.dupfd)


class FakeIovec:
    """An iov over a caller's SharedMemory; slice it to name the bytes of one I/O."""

    def __init__(self, shm: SharedMemory, link: str, mapping: _DaemonMapping) -> None:
        self._shm = shm
        self.link = link
        self.mapping = mapping
        self.size = shm.size
        weakref.finalize(self, _drop_iov, link, mapping)

    def __getitem__(self, key: slice) -> FakeIovSlice:
        if not isinstance(key, slice):
            raise TypeError("iovec indices must be slices")
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise ValueError("step not 1 when slicing iovec")
        return FakeIovSlice(self, start, max(0, stop - start))

    def mapped_by_caller(self) -> bool:
        """The caller's SharedMemory is still mapped (the real iov keeps a raw pointer)."""
        return self._shm.buf is not None


def _drop_iov(link: str, mapping: _DaemonMapping) -> None:
    try:
        os.unlink(link)
    except FileNotFoundError:
        pass
    mapping.closed = True  # the daemon unmaps once in-flight I/O is done with it


@dataclass
class FakeIovSlice:
    """A range of an iov (the binding's iov slice)."""

    iov: FakeIovec
    start: int
    length: int


def make_iovec(
    shm: SharedMemory, hf3fs_mount_point: str, block_size: int = 0, numa: int = -1
) -> FakeIovec:
    """Link `shm` under the mount's `3fs-virt/iovs/`; the daemon maps it now."""
    del numa
    fake = _MOUNTS.get(os.path.realpath(hf3fs_mount_point))
    link = os.path.join(
        hf3fs_mount_point,
        "3fs-virt",
        "iovs",
        f"{uuid.uuid4()}{f'.b{block_size}' if block_size > 0 else ''}",
    )
    os.symlink(os.path.normpath(f"/dev/shm/{shm.name}"), link)  # ENOENT off a mount
    if fake is None:
        os.unlink(link)
        raise OSError(errno.EINVAL, f"{hf3fs_mount_point} is not a 3FS mount")
    try:
        fd = os.open(link, os.O_RDWR)
    except OSError:
        os.unlink(link)
        raise
    try:
        mapping = _DaemonMapping(mmap.mmap(fd, shm.size))
    finally:
        os.close(fd)
    return FakeIovec(shm, link, mapping)


class _RingState:
    """The ring's shared state, and the fake daemon thread that serves it."""

    def __init__(self, fake: FakeMount, entries: int, for_read: bool, io_depth: int) -> None:
        self.fake = fake
        self.entries = entries
        self.for_read = for_read
        self.io_depth = io_depth
        self.cond = threading.Condition()
        self.queued: deque[_Sqe] = deque()  # prepared, not yet issued
        self.done: deque[Completion] = deque()  # completed, not yet reaped
        self.slots = 0  # prepared and not yet reaped
        self.alive = True
        self.thread = threading.Thread(target=self._serve, name="fake-3fs-daemon", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.alive = False
            self.cond.notify_all()

    def _take(self) -> list[_Sqe]:
        depth = self.io_depth
        if depth > 0:
            if len(self.queued) < depth:
                return []
            count = depth
        elif depth < 0:
            count = min(-depth, len(self.queued))
        else:
            count = len(self.queued)
        return [self.queued.popleft() for _ in range(count)]

    def _serve(self) -> None:
        while True:
            with self.cond:
                batch = self._take()
                while self.alive and not batch:
                    self.cond.wait(0.05)  # a submit wakes us; we also scan on our own
                    batch = self._take()
                if not self.alive:
                    return
            for sqe in batch:
                while self.fake._stalled.is_set() and self.alive:
                    time.sleep(0.01)
                result = self._execute(sqe)
                with self.cond:
                    self.done.append(Completion(result, sqe.userdata))
                    self.cond.notify_all()

    def _execute(self, sqe: _Sqe) -> int:
        self.fake.io_log.append((self.for_read, sqe.path, sqe.file_offset, sqe.length))
        fault = self.fake._faults.get((sqe.path, sqe.file_offset))
        if fault is not None:
            return -fault
        if sqe.mapping.closed:
            return -errno.EFAULT
        view = memoryview(sqe.mapping.map)[sqe.offset : sqe.offset + sqe.length]
        try:
            if self.for_read:
                return os.preadv(sqe.dupfd, [view], sqe.file_offset)
            return os.pwrite(sqe.dupfd, view, sqe.file_offset)
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        finally:
            view.release()


class FakeIoring:
    """A USRBIO ring of one direction (the binding's `ioring`)."""

    def __init__(self, fake: FakeMount, entries: int, for_read: bool, io_depth: int) -> None:
        self._state = _RingState(fake, entries, for_read, io_depth)
        weakref.finalize(self, self._state.stop)

    def prepare(
        self, iov: FakeIovSlice | FakeIovec, read: bool, fd: int, off: int, userdata: Any = None
    ) -> FakeIoring:
        """Queue one I/O of the slice's bytes at file offset `off` (see the module docs)."""
        state = self._state
        piece = iov[:] if isinstance(iov, FakeIovec) else iov
        if read != state.for_read or piece.length == 0:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        if piece.start + piece.length > piece.iov.size:
            raise OSError(errno.EINVAL, "slice outside the iov")
        if not piece.iov.mapped_by_caller():
            raise OSError(errno.EFAULT, "iov memory unmapped by its owner (FAKE check)")
        with _STATE_LOCK:
            registration = _REGISTERED.get(abs(fd))
        if registration is None:
            raise OSError(errno.EBADF, "fd not registered")
        mode = registration.flags & os.O_ACCMODE
        if (read and mode == os.O_WRONLY) or (not read and mode == os.O_RDONLY):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        path = os.path.realpath(f"/proc/self/fd/{registration.dupfd}")
        sqe = _Sqe(
            piece.iov.mapping, piece.start, piece.length, registration.dupfd, off, path, userdata
        )
        with state.cond:
            if state.slots >= state.entries:
                raise OSError(errno.EAGAIN, "ring is full")
            state.slots += 1
            state.fake.peak_in_flight = max(state.fake.peak_in_flight, state.slots)
            state.queued.append(sqe)
        return self

    def submit(self) -> FakeIoring:
        """Tell the daemon new I/O is queued."""
        with self._state.cond:
            self._state.cond.notify_all()
        return self

    def wait(
        self,
        *,
        max_results: int = 0,
        min_results: int = 0,
        timeout: timedelta | None = None,
    ) -> list[Completion]:
        """Reap completions (see the module docstring for how many)."""
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError("timeout must be a datetime.timedelta")
        state = self._state
        cap = max(max_results, min_results, 1)
        if state.fake.max_results_per_wait is not None:
            cap = min(cap, state.fake.max_results_per_wait)
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        with state.cond:
            while len(state.done) < min(min_results, cap):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                state.cond.wait(left)
            out = [state.done.popleft() for _ in range(min(cap, len(state.done)))]
            state.slots -= len(out)
        return out


def make_ioring(
    hf3fs_mount_point: str,
    entries: int,
    for_read: bool = True,
    io_depth: int = 0,
    priority: int | None = None,
    timeout: int | None = None,
    numa: int = -1,
    flags: int = 0,
) -> FakeIoring:
    """A ring of `entries` slots for reads or writes on the mount."""
    del priority, timeout, numa, flags
    fake = _MOUNTS.get(os.path.realpath(hf3fs_mount_point))
    if fake is None or entries <= 0:
        raise OSError(errno.EINVAL, f"{hf3fs_mount_point} is not a 3FS mount")
    return FakeIoring(fake, entries, for_read, io_depth)
