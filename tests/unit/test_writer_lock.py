"""The cross-process writer lock: a writer waits for another process's lock, gets it
promptly once released, and reports `MetadataUnavailable` when it is held too long."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.meta_builders import keys, register

from hf3fsctl.errors import MetadataUnavailable
from hf3fsctl.meta.store import MetadataStore

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


def test_a_lookup_never_waits_for_a_held_writer_lock(tmp_path: Path) -> None:
    # The server answers lookups on its event loop: a lookup whose counter flush is due
    # while another process holds the writer lock skips the flush instead of waiting.
    store = MetadataStore(tmp_path / "m.db", busy_timeout_s=5)
    ns = register(store)
    store.lookup(ns, keys(3))
    time.sleep(1.1)  # the next lookup's counter flush is due
    holder = hold_lock(tmp_path / "m.db", 5)
    try:
        started = time.monotonic()
        store.lookup(ns, keys(3))
        assert time.monotonic() - started < 2.0  # not the holder's 5 s, nor the busy timeout
    finally:
        holder.kill()
        holder.wait()
    assert store.namespace_stats(ns).lookups == 2  # the skipped flush is written later
