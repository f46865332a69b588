"""Keys saved per second on a FULL SQLite store (every allocate evicting), at N entries.

    .venv/bin/python benchmarks/bench_full_store.py --entries 100000 1000000 [--seconds 5]

Each size: a fresh store whose one capacity is N pages, filled with N committed entries
in one SQL transaction (last access spread over the past hour, chains of 16), then
allocate + commit of 16 new keys in a loop for `--seconds`: every allocate evicts the
16 least-recently-used keys. Prints one JSON line per size (keys/s, µs per cycle, the
database's size per entry); the issue-21 bar is keys/s at 10⁶ within 1.5× of 10⁵.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import sqlite3
import tempfile
import time
from pathlib import Path

from hf3fsctl.bench.metadata.stores import PAGE_BYTES, bench_manifest, bench_rank_file, namespace_id
from hf3fsctl.meta.models import CommitItem
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.storage.layout import PageFile

BATCH = 16


def _key(tag: str, index: int) -> str:
    return hashlib.sha256(f"{tag}-{index}".encode()).hexdigest()


def fill(db: Path, root: Path, entries: int) -> tuple[MetadataStore, str]:
    """A store of capacity `entries` pages holding `entries` committed keys."""
    high, low = 1.0, 1.0 - 0.5 / entries
    store = MetadataStore(
        db, high_watermark=high, low_watermark=low, policy=StorePolicy(storage_root=str(root))
    )
    store.set_capacity(entries * PAGE_BYTES)
    manifest = bench_manifest(f"bench-full-store/{entries}")
    ns = namespace_id(manifest)
    store.register_namespace(ns, manifest)
    rank_file = bench_rank_file(ns)
    store.register_rank(ns, rank_file)
    PageFile.create_growable(root, ns, 0, PAGE_BYTES).close()
    now = time.time()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA cache_size = -1000000")  # the fill's random index inserts
    conn.execute("BEGIN IMMEDIATE")
    ages = list(range(entries))
    random.Random(entries).shuffle(ages)  # access order unrelated to key or page order
    keys = sorted(_key("fill", i) for i in range(entries))  # the key indexes fill in order
    conn.executemany(
        "INSERT INTO entries (namespace, key, rank, page, state, checksum, size, depth,"
        " created, last_access) VALUES (?,?,0,?,1,?,?,?,?,?)",
        (
            (ns, key, i, f"xxh3:{i:016x}", PAGE_BYTES, i % 16, now - 3600, t)
            for i, key in enumerate(keys)
            for t in (now - 3600 + 3000 * ages[i] / entries,)
        ),
    )
    conn.execute(
        "UPDATE rank_files SET used = ?, next_unused = ? WHERE namespace = ?",
        (entries, entries, ns),
    )
    conn.execute("DELETE FROM changes")
    conn.execute("COMMIT")
    conn.close()
    return store, ns


def cycles(store: MetadataStore, ns: str, seconds: float) -> dict[str, float]:
    """Allocate + commit BATCH new keys until `seconds` pass; the rate of keys saved."""
    saved = cycle = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        keys = [_key("new", cycle * BATCH + j) for j in range(BATCH)]
        result = store.allocate(ns, 0, keys, first_depth=0)
        store.commit(
            ns,
            0,
            [
                CommitItem.model_construct(
                    key=a.key, page=a.page, checksum=f"xxh3:{a.page:016x}", size=PAGE_BYTES
                )
                for a in result.allocated
            ],
        )
        saved += len(result.allocated)
        cycle += 1
    elapsed = time.perf_counter() - started
    return {"keys_per_s": saved / elapsed, "us_per_cycle": 1e6 * elapsed / max(cycle, 1)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe(db: str, root: str, entries: int, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In a fresh process: RSS of an opened store before and after lookups, locates and
    allocate + commit cycles touch it (what a `serve` holds for it), and lookup rates."""
    high, low = 1.0, 1.0 - 0.5 / entries
    before = _rss_bytes()
    store = MetadataStore(
        db, high_watermark=high, low_watermark=low, policy=StorePolicy(storage_root=root)
    )
    ns = store.namespaces()[0].id
    conn = sqlite3.connect(db)
    stored = [
        k
        for (k,) in conn.execute(
            "SELECT key FROM entries WHERE state = 1 ORDER BY page DESC LIMIT 1000"
        )
    ]
    conn.close()
    opened = _rss_bytes()
    calls = 0
    started = time.perf_counter()
    while time.perf_counter() - started < 2.0:
        assert store.lookup(ns, stored[:64]) == 64
        calls += 1
    lookup_64 = calls / (time.perf_counter() - started)
    calls = 0
    started = time.perf_counter()
    while time.perf_counter() - started < 2.0:
        store.lookup(ns, stored)
        calls += 1
    lookup_1000 = calls / (time.perf_counter() - started)
    cycles(store, ns, 2.0)
    after = _rss_bytes()
    store.close()
    queue.put(
        {
            "rss_open_mib": round((opened - before) / 2**20, 1),
            "rss_after_work_mib": round((after - before) / 2**20, 1),
            "rss_bytes_per_entry": round((after - before) / entries, 1),
            "lookups_64_per_s": round(lookup_64),
            "lookups_1000_per_s": round(lookup_1000),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    for entries in args.entries:
        with tempfile.TemporaryDirectory(prefix="bench-full-store-") as work:
            root = Path(work) / "root"
            root.mkdir()
            db = Path(work) / "meta.db"
            t0 = time.perf_counter()
            store, ns = fill(db, root, entries)
            filled_s = time.perf_counter() - t0
            try:
                figures = cycles(store, ns, args.seconds)
                problems = store.check_invariants() if entries <= 100_000 else []
            finally:
                store.close()
            queue: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()  # type: ignore[type-arg]
            child = multiprocessing.get_context("spawn").Process(
                target=probe, args=(str(db), str(root), entries, queue)
            )
            child.start()
            figures.update(queue.get(timeout=600))
            child.join()
            size = sum(p.stat().st_size for p in Path(work).glob("meta.db*"))
            print(
                json.dumps(
                    {
                        "entries": entries,
                        "fill_s": round(filled_s, 1),
                        **{k: round(v, 1) for k, v in figures.items()},
                        "db_bytes_per_entry": round(size / entries, 1),
                        "invariant_violations": len(problems),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
