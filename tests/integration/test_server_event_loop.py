"""A real `hf3fsctl serve` keeps answering while a write waits for another process's
writer lock: the store is called off the event loop, so `/healthz` and lookups do not
queue behind a write stuck on the lock (before, `/healthz` took seconds there)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.meta_builders import checksum, keys, manifest, rank_file
from helpers.servers import TOKEN, ServerProcess

from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.http.client import HttpMetadataClient
from hf3fsctl.meta.models import AllocateResult, CommitItem

pytestmark = pytest.mark.integration

# holds the store's writer lock (a flock on `<db>.lock`, see meta/writer_lock.py) until
# its standard input closes
HOLD_WRITER_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


@contextmanager
def writer_lock_held_elsewhere(db_path: Path) -> Iterator[None]:
    """Another process holds the store's writer lock for the block."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_WRITER_LOCK, f"{db_path}.lock"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()  # the holder exits: the kernel releases its flock
        try:
            holder.wait(10)
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait()


def test_healthz_and_lookups_answer_while_a_write_waits_for_the_writer_lock(
    metadata_server: ServerProcess,
) -> None:
    server = metadata_server
    client = HttpMetadataClient(server.url, token=TOKEN, timeout_s=20)
    data = manifest()
    ns = namespace_id(data)
    client.register_namespace(ns, data)
    client.register_rank(ns, rank_file(ns, 0, 256))
    chain = keys(8)
    allocated = client.allocate(ns, 0, chain).allocated
    items = [
        CommitItem(key=a.key, page=a.page, checksum=checksum(a.key, a.page), size=4096)
        for a in allocated
    ]
    assert client.commit(ns, 0, items) == len(chain)

    writer_done = threading.Event()
    written: list[object] = []

    def write() -> None:  # an allocation needs the writer lock: it waits in the server
        writer = HttpMetadataClient(server.url, token=TOKEN, timeout_s=20)
        try:
            written.append(writer.allocate(ns, 0, keys(4, start=100)))
        except Exception as exc:  # reported by the assertions below
            written.append(exc)
        finally:
            writer.close()
            writer_done.set()

    with writer_lock_held_elsewhere(server.db_path):
        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        assert not writer_done.wait(0.5), f"the write did not wait for the lock: {written}"

        started = time.perf_counter()
        health = client.health()
        healthz_s = time.perf_counter() - started
        healthz_before_writer = not writer_done.is_set()

        started = time.perf_counter()
        hits = client.lookup(ns, chain)
        lookup_s = time.perf_counter() - started
        lookup_before_writer = not writer_done.is_set()

    assert health["status"] == "ok"
    assert healthz_s < 1.0, f"/healthz took {healthz_s:.3f} s while a write waited"
    assert healthz_before_writer, "/healthz answered only after the waiting write"
    assert hits == len(chain)
    assert lookup_s < 1.0, f"lookup took {lookup_s:.3f} s while a write waited"
    assert lookup_before_writer, "the lookup answered only after the waiting write"
    assert writer_done.wait(15), "the write never finished after the lock was released"
    thread.join(5)
    (result,) = written
    assert isinstance(result, AllocateResult), result
    assert len(result.allocated) == 4
    client.close()
