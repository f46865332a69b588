"""The cross-process writer lock: a writer waits for another process's lock, gets it
promptly once released, and reports `MetadataUnavailable` when it is held too long;
timed-out waits under a hung holder leave one helper thread, not one each."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.meta_builders import keys, register

from hf3fsctl.errors import MetadataUnavailable
from hf3fsctl.meta.sqlite import database
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.meta.sqlite.writer_lock import WriterLock

HOLDER = """
import fcntl, sys, time
fd = open(sys.argv[1], "a+")
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold_lock(db: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process holding the writer lock of `db` for `seconds`."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, f"{db}.lock", str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_lock_held_past_the_timeout_is_unavailable(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db", busy_timeout_s=0.2)
    ns = register(store)
    holder = hold_lock(tmp_path / "m.db", 5)
    try:
        started = time.monotonic()
        with pytest.raises(MetadataUnavailable):
            store.allocate(ns, 0, keys(1))
        assert time.monotonic() - started < 3.0  # gave up near 0.2 s, not at the holder's 5 s
    finally:
        holder.kill()
        holder.wait()


def test_waiting_writer_proceeds_promptly_after_release(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db", busy_timeout_s=5)
    ns = register(store)
    holder = hold_lock(tmp_path / "m.db", 0.3)
    started = time.monotonic()
    assert len(store.allocate(ns, 0, keys(1)).allocated) == 1
    waited = time.monotonic() - started
    holder.wait()
    # It waited for the holder, and was woken by the release — not by its 5 s timeout
    # (a wide margin: a loaded 2-core machine delays wake-ups, never by seconds).
    assert 0.2 < waited < 3.0


def test_a_lookup_never_waits_for_a_held_writer_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server answers lookups on its event loop: a lookup whose counter flush is due
    # while another process holds the writer lock skips the flush instead of waiting.
    # Counters are flushed once a second; a 0.1 s interval makes one due sooner.
    monkeypatch.setattr(database, "_FLUSH_INTERVAL_S", 0.1)
    store = MetadataStore(tmp_path / "m.db", busy_timeout_s=5)
    ns = register(store)
    store.lookup(ns, keys(3))
    time.sleep(0.2)  # the next lookup's counter flush is due
    holder = hold_lock(tmp_path / "m.db", 5)
    try:
        started = time.monotonic()
        store.lookup(ns, keys(3))
        assert time.monotonic() - started < 2.0  # not the holder's 5 s, nor the busy timeout
    finally:
        holder.kill()
        holder.wait()
    assert store.namespace_stats(ns).lookups == 2  # the skipped flush is written later
    store.close()  # its descriptors, before the next test counts them


def _lock_helpers() -> int:
    return sum(t.name == "hf3fsctl-writer-lock" for t in threading.enumerate())


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_timed_out_waits_under_a_hung_holder_do_not_pile_up(tmp_path: Path) -> None:
    lock = WriterLock(str(tmp_path / "m.db.lock"))
    holder = hold_lock(tmp_path / "m.db", 60)  # hung: it would hold for a minute
    threads, fds = _lock_helpers(), _open_fds()  # (the holder's pipe counted)
    try:
        for _ in range(40):
            with lock.hold(0.005) as held:
                assert not held
        # one helper (and its one descriptor) waits on, for the next wait to take over
        assert (_lock_helpers() - threads, _open_fds() - fds) == (1, 1)
        assert lock.waiting_helpers() == 1
        holder.kill()
        holder.wait()
        # the helper gets the released lock, finds nobody waiting, and gives it back
        assert _eventually(lambda: _lock_helpers() == threads and _open_fds() == fds)
    finally:
        holder.kill()
        holder.wait()
    with lock.hold(1.0) as held:
        assert held
    lock.close()


def test_a_wait_after_timed_out_ones_still_wakes_at_the_release(tmp_path: Path) -> None:
    lock = WriterLock(str(tmp_path / "m.db.lock"))
    holder = hold_lock(tmp_path / "m.db", 0.5)
    for _ in range(5):
        with lock.hold(0.005) as held:
            assert not held
    started = time.monotonic()
    with lock.hold(10.0) as held:
        waited = time.monotonic() - started
        assert held
    holder.wait()
    assert waited < 5.0  # woken by the release (~0.5 s), not by its 10 s timeout
    assert lock.waiting_helpers() == 0
    lock.close()
