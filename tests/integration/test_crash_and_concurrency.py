"""Durability and concurrency against real processes.

- kill -9 of `hf3fsctl serve` during a stream of commits: after a restart on the same
  database every acknowledged commit is there and no page is owned twice.
- several spawned processes allocating, committing, locating and evicting at once
  against one database (embedded) or one server: the store stays sound and every
  acknowledged commit is either still there or was logged as evicted.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from helpers.meta_builders import commit_items, keys, register
from helpers.meta_workload import run_worker
from helpers.servers import TOKEN, start_server

from hf3fsctl.errors import MetadataUnavailable
from hf3fsctl.meta.http import HttpMetadataClient
from hf3fsctl.meta.store import MetadataStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_kill_9_loses_no_acknowledged_commit(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", token=TOKEN)
    client = HttpMetadataClient(server.url, token=TOKEN, timeout_s=2)
    ns = register(client, num_pages=100_000)
    acknowledged: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        for i in range(100_000):
            chain = keys(4, start=i * 4)
            try:
                allocated = client.allocate(ns, 0, chain).allocated
                if client.commit(ns, 0, commit_items(allocated)) == len(allocated):
                    acknowledged.extend(a.key for a in allocated)
            except MetadataUnavailable:
                stop.set()
                return

    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(1.5)
    server.kill()
    thread.join(timeout=30)
    assert stop.is_set() and len(acknowledged) > 0
    server.start()
    try:
        missing = 0
        for start in range(0, len(acknowledged), 4096):
            located = client.locate(ns, 0, acknowledged[start : start + 4096])
            missing += sum(loc is None for loc in located)
        assert missing == 0
        assert MetadataStore(server.db_path).check_invariants() == []
    finally:
        server.stop()


def _evicted_keys(db_path: Path) -> set[str]:
    with sqlite3.connect(db_path) as conn:
        return {row[0] for row in conn.execute("SELECT key FROM changes WHERE delta < 0")}


@pytest.mark.parametrize("mode", ["embedded", "server"], ids=["embedded", "server"])
def test_concurrent_processes_keep_store_sound(tmp_path: Path, mode: str) -> None:
    db_path = tmp_path / "meta.db"
    store = MetadataStore(db_path)
    ns = register(store, num_pages=40)  # small: allocate evicts under pressure
    server = None
    url, token = f"sqlite:///{db_path}", None
    if mode == "server":
        server = start_server(tmp_path / "server", token=TOKEN, db_path=db_path)
        url, token = server.url, TOKEN
    try:
        context = multiprocessing.get_context("spawn")
        with context.Pool(3) as pool:
            results = pool.starmap(run_worker, [(url, token, ns, w, 25) for w in range(3)])
    finally:
        if server is not None:
            server.stop()
    assert store.check_invariants() == []
    acknowledged = {key for result in results for key in result}
    located = store.locate(ns, 0, sorted(acknowledged))
    lost = {
        loc_key for loc_key, loc in zip(sorted(acknowledged), located, strict=True) if loc is None
    }
    assert lost <= _evicted_keys(db_path)
    assert len(acknowledged) > 0
