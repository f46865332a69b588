"""`WriterLock`: one SQLite writer at a time across threads and processes, without starving.

SQLite serializes writers itself, but a writer that finds the database locked sleeps in
its busy handler (1, 2, 5, … up to 100 ms steps) while others keep winning: with 16
writer processes p99 reached seconds. A kernel `flock` on `<db>.lock` taken before
`BEGIN IMMEDIATE` hands the database over the moment it is released instead: threads of
one process queue on a mutex; a process that finds the lock taken blocks in the kernel
(in a helper thread, so that it can give up at the caller's timeout, after which the
caller raises `MetadataUnavailable`). The lock is advisory and only this package takes it; a writer
that does not (the `sqlite3` shell) is still handled by SQLite's busy timeout.
A process that dies holding it releases it (the kernel closes its descriptors).

A lock has at most one helper thread (and its one descriptor) at a time: a wait that
times out leaves the helper blocked in `flock` for the next wait to take over, instead of
starting another, so timed-out waits under a hung holder cannot pile up threads and
descriptors. A helper that gets the lock when nobody waits any more gives it back at once.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class WriterLock:
    """The write lock of one database file, for this process.

    Args:
        path: the lock file (created if missing), e.g. `<db>.lock`.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mutex = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._pid = os.getpid()
        self._reopen = False  # set by `reopen`: a new descriptor at the next hold
        self._waiter_state = threading.Lock()  # guards `_waiter` and its fields
        self._waiter: _Waiter | None = None  # the one helper blocked in flock, if any

    @contextmanager
    def hold(self, timeout_s: float) -> Iterator[bool]:
        """Hold the lock for the block; yields False when `timeout_s` passed without it."""
        deadline = time.monotonic() + timeout_s
        if not self._mutex.acquire(timeout=max(timeout_s, 0)):
            yield False
            return
        try:
            fd = self._descriptor()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = self._wait(deadline - time.monotonic())
                try:
                    yield waited is not None
                finally:
                    if waited is not None:
                        fcntl.flock(waited, fcntl.LOCK_UN)
                        os.close(waited)
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    @contextmanager
    def try_hold(self) -> Iterator[bool]:
        """Hold the lock for the block only if it is free now; never waits, no helper thread."""
        if not self._mutex.acquire(blocking=False):
            yield False
            return
        try:
            fd = self._descriptor()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    def held_elsewhere(self) -> bool:
        """Whether another thread of this process is inside `hold` (a cheap hint)."""
        return self._mutex.locked()

    def reopen(self) -> None:
        """Open the lock file again at the next hold: the descriptor no longer reaches it
        (its file system went from under the mount, or came back as a new mount)."""
        self._reopen = True

    def _descriptor(self) -> int:
        # a forked child shares the parent's open file description, and so its flock:
        # reopen so that parent and child exclude each other
        if self._fd < 0 or os.getpid() != self._pid or self._reopen:
            if self._fd >= 0:
                try:
                    os.close(self._fd)
                except OSError:  # a descriptor on a file system that went away
                    pass
                self._fd = -1
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._pid = os.getpid()
            self._reopen = False
        return self._fd

    def _wait(self, timeout_s: float) -> int | None:
        """Block in the kernel for the lock, up to `timeout_s`; the descriptor holding it.

        A blocked `flock` is woken the moment the holder releases (polling sleepers miss
        that moment and starve), but cannot time out; so a helper thread blocks on its own
        descriptor. The caller waits for the helper up to `timeout_s`; on a timeout the
        helper stays blocked, and the next wait takes it over (one helper per lock).
        """
        with self._waiter_state:
            waiter = self._waiter
            if waiter is not None and waiter.pid != os.getpid():
                os.close(waiter.fd)  # a forked child's copy; the parent's helper is its own
                waiter = None
            if waiter is None:
                waiter = _Waiter(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))
                self._waiter = waiter
                threading.Thread(
                    target=self._block, args=(waiter,), name="hf3fsctl-writer-lock", daemon=True
                ).start()
            waiter.wanted = True
        waiter.got.wait(max(timeout_s, 0))
        with self._waiter_state:
            waiter.wanted = False
            if not waiter.got.is_set():
                return None  # the helper stays blocked for the next wait
            if self._waiter is waiter:
                self._waiter = None
            return waiter.fd

    def _block(self, waiter: _Waiter) -> None:
        """The helper: take the lock, hand it to a waiting caller or give it straight back."""
        try:
            fcntl.flock(waiter.fd, fcntl.LOCK_EX)
        except OSError:  # its file system went away: the caller times out, a later one
            with self._waiter_state:  # starts a new helper
                if self._waiter is waiter:
                    self._waiter = None
            try:
                os.close(waiter.fd)
            except OSError:
                pass
            return
        with self._waiter_state:
            if waiter.wanted:
                waiter.got.set()
                return
            if self._waiter is waiter:
                self._waiter = None
        fcntl.flock(waiter.fd, fcntl.LOCK_UN)  # nobody waits for it any more
        os.close(waiter.fd)

    def waiting_helpers(self) -> int:
        """Helper threads of this lock blocked in `flock` now (0 or 1)."""
        with self._waiter_state:
            return int(self._waiter is not None and not self._waiter.got.is_set())

    def close(self) -> None:
        """Close the lock file's descriptor."""
        with self._mutex:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class _Waiter:
    """The helper thread's side of a wait: its descriptor, and whether a caller still waits."""

    __slots__ = ("fd", "got", "pid", "wanted")

    def __init__(self, fd: int) -> None:
        self.fd = fd  # blocked in (then holding) flock
        self.got = threading.Event()  # set when it holds the lock for a waiting caller
        self.pid = os.getpid()
        self.wanted = False  # a caller is waiting for it now
