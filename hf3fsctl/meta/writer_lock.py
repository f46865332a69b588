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

    def _descriptor(self) -> int:
        # a forked child shares the parent's open file description, and so its flock:
        # reopen so that parent and child exclude each other
        if self._fd < 0 or os.getpid() != self._pid:
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._pid = os.getpid()
        return self._fd

    def _wait(self, timeout_s: float) -> int | None:
        """Block in the kernel for the lock, up to `timeout_s`; the descriptor holding it.

        A blocked `flock` is woken the moment the holder releases (polling sleepers miss
        that moment and starve), but cannot time out; so a helper thread blocks on its own
        descriptor, and gives the lock back at once if the caller stopped waiting.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        got = threading.Event()
        state = threading.Lock()
        abandoned = False

        def block() -> None:
            nonlocal abandoned
            fcntl.flock(fd, fcntl.LOCK_EX)
            with state:
                if abandoned:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    return
                got.set()

        threading.Thread(target=block, name="hf3fsctl-writer-lock", daemon=True).start()
        got.wait(max(timeout_s, 0))
        with state:
            if got.is_set():
                return fd
            abandoned = True
        return None

    def close(self) -> None:
        """Close the lock file's descriptor."""
        with self._mutex:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
