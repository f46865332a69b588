"""The CPU a cold request's save costs, part by part, outside vLLM (issue 23).

The worker's save path over the tiny model's geometry (one host KV cache of 2 layers,
64 KiB pages): a staging lease and `gather_blocks` of a request's 18 blocks (the engine
thread), then `Tier.save` of 18 new keys over an embedded SQLite store and a growing page
file (a save thread). Each run is a fresh store, as each `bench e2e` engine's, with one
untimed warm-up request (the whole first run is untimed: the process's first calls);
then `--requests` timed requests, and `--steps` timed steps of the bench's cold step
(jobs of 18, 2, 18 and 2 new pages: 2 prefixes x 2 suffixes once the shared blocks are
left out), saved job by job and, where the tree has it, as one `Tier.save_many`. All figures are `time.thread_time_ns` of the calling thread, in µs,
medians over the runs; the floor is the same bytes copied, hashed (xxh3) and written
(one `pwritev` into a new file) in the same process.

    python benchmarks/bench_save_path.py                   # ~30 s on 2 cores
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_save_path.py --json

Run two checkouts alternately (a `git worktree` on PYTHONPATH) to compare them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from xxhash import xxh3_64

import hf3fsctl.tier as tiers
from hf3fsctl.keys import NamespaceManifest, namespace_id
from hf3fsctl.meta.models import RankFile
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.staging import KVSegment, StagingPool, gather_blocks
from hf3fsctl.storage.layout import PageFile
from hf3fsctl.storage.posix import PosixEngine

LAYER_PAGE = 32 * 1024  # one block of one layer
PAGE = 2 * LAYER_PAGE  # one block of both layers: a stored page
BLOCKS = 64  # blocks of the host KV cache
PER_REQUEST = 18  # (512 + 64) / 32
STEP_JOBS = (18, 2, 18, 2)
CLOCK = time.thread_time_ns


def _open_store(root: Path) -> tuple[MetadataStore, str, PageFile]:
    store = MetadataStore(root / "meta.db", policy=StorePolicy(storage_root=str(root)))
    store.set_capacity(1 << 34)
    manifest = NamespaceManifest(
        model="tiny-llama",
        revision="main",
        kv_dtype="float16",
        block_size=32,
        layout="LBHNC",
        backend="CPU_ATTN",
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        tp_size=1,
        pp_size=1,
        page_bytes=PAGE,
        hash_algorithm="sha256",
        none_hash="00" * 32,
    ).to_dict()
    ns = namespace_id(manifest)
    store.register_namespace(ns, manifest)
    file = PageFile.create_growable(root, ns, 0, PAGE)
    store.register_rank(
        ns, RankFile(rank=0, path=file.relpath, page_bytes=PAGE, slot_bytes=file.slot_bytes,
                     num_pages=file.num_pages, preallocated=False)
    )  # fmt: skip
    return store, ns, file


def _timed(parts: dict[str, int], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = CLOCK()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[label] = parts.get(label, 0) + CLOCK() - start

    return call


class _Keys:
    def __init__(self) -> None:
        self.next = 0

    def take(self, count: int) -> list[str]:
        first, self.next = self.next, self.next + count
        return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(first, first + count)]


def run(runs: int, requests: int, steps: int) -> dict[str, Any]:
    """Medians (µs) of the parts of a request's save, of a step's, and of the floor."""
    engine = PosixEngine(io_threads=16)
    cache = torch.randint(0, 255, (2 * BLOCKS * LAYER_PAGE,), dtype=torch.uint8)
    segments = [KVSegment(cache, 0, BLOCKS * LAYER_PAGE, LAYER_PAGE, 2, BLOCKS, LAYER_PAGE)]
    pool = StagingPool(64 << 20)
    names = ("gather", "allocate", "reserve", "write+xxh3", "commit", "bookkeeping", "save")
    request: dict[str, list[float]] = {name: [] for name in names}
    floor: dict[str, list[float]] = {name: [] for name in ("memcpy", "xxh3", "pwritev", "all")}
    step: dict[str, list[float]] = {"job by job": [], "save_many": []}
    keys = _Keys()
    base = Path(tempfile.mkdtemp(prefix="bench-save-path"))
    try:
        for number in range(runs):
            root = base / str(number)
            root.mkdir()
            store, ns, file = _open_store(root)
            parts: dict[str, int] = {}
            for name in ("allocate", "allocate_pages"):  # the models or the tuples
                if hasattr(store, name):
                    setattr(store, name, _timed(parts, "allocate", getattr(store, name)))
            for name in ("commit", "commit_pages"):
                if hasattr(store, name):
                    setattr(store, name, _timed(parts, "commit", getattr(store, name)))
            file.reserve = _timed(parts, "reserve", file.reserve)  # type: ignore[method-assign]
            writes = engine.write_pages
            engine.write_pages = _timed(parts, "write+xxh3", writes)  # type: ignore[method-assign]
            tier = tiers.Tier(ns, 0, file, engine, lambda fn, s=store: fn(s))
            for index in range(requests + 1):  # the first: the store's warm-up request
                blocks = [(keys.next + 3 * j) % BLOCKS for j in range(PER_REQUEST)]
                parts.clear()
                start = CLOCK()
                lease = pool.acquire(PER_REQUEST, PAGE)
                assert lease is not None
                gather_blocks(segments, blocks, lease.tensor)
                gathered = CLOCK()
                outcome = tier.save(keys.take(PER_REQUEST), lease.rows(), 0)
                saved = CLOCK()
                assert outcome.kinds == [tiers.SAVED] * PER_REQUEST, outcome
                if index and number:  # (the first run: the process's first calls)
                    got = {"gather": gathered - start, "save": saved - gathered, **parts}
                    got["bookkeeping"] = got["save"] - sum(parts.values())
                    for name, value in got.items():
                        request[name].append(value / 1000)
                    _floor(root / f"floor-{index}", cache, lease.tensor, blocks, floor)
                lease.release()
            engine.write_pages = writes  # type: ignore[method-assign]
            rows = list(torch.randint(0, 255, (sum(STEP_JOBS), PAGE), dtype=torch.uint8).numpy())
            for index in range(steps):
                batches, first = [], 0
                for size in STEP_JOBS:
                    depth = 0 if size == PER_REQUEST else 16
                    batches.append((keys.take(size), rows[first : first + size], depth))
                    first += size
                batched = hasattr(tier, "save_many") and (number + index) % 2 == 1
                start = CLOCK()
                if batched:
                    outcomes = tier.save_many([tiers.SaveBatch(*b) for b in batches])
                else:
                    outcomes = [tier.save(*b) for b in batches]
                if number:
                    step["save_many" if batched else "job by job"].append((CLOCK() - start) / 1000)
                assert all(kind == tiers.SAVED for o in outcomes for kind in o.kinds)
            store.close()
            file.close()
            shutil.rmtree(root, ignore_errors=True)
    finally:
        engine.close()
        shutil.rmtree(base, ignore_errors=True)

    def medians(samples: dict[str, list[float]]) -> dict[str, float]:
        return {name: round(statistics.median(v)) for name, v in samples.items() if v}

    return {
        "load_average": round(os.getloadavg()[0], 2),
        "request_us": medians(request),
        "floor_us": medians(floor),
        "step_us": medians(step),
        "samples": {"requests": len(request["save"]), "steps": sum(map(len, step.values()))},
    }


def _floor(
    path: Path,
    cache: torch.Tensor,
    stage: torch.Tensor,
    blocks: list[int],
    floor: dict[str, list[float]],
) -> None:
    """The bytes' own cost: copy the blocks' layer ranges, hash each page, write them."""
    source, rows = cache.numpy(), stage.numpy()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        start = CLOCK()
        for row, block in enumerate(blocks):
            for layer in range(2):
                at = layer * BLOCKS * LAYER_PAGE + block * LAYER_PAGE
                rows[row, layer * LAYER_PAGE : (layer + 1) * LAYER_PAGE] = source[
                    at : at + LAYER_PAGE
                ]
        copied = CLOCK()
        views = [memoryview(rows[i]) for i in range(len(blocks))]
        for view in views:
            xxh3_64(view).hexdigest()
        hashed = CLOCK()
        os.pwritev(fd, views, 0)
        written = CLOCK()
    finally:
        os.close(fd)
    for name, value in (
        ("memcpy", copied - start),
        ("xxh3", hashed - copied),
        ("pwritev", written - hashed),
        ("all", written - start),
    ):
        floor[name].append(value / 1000)


def main() -> None:
    """Parse arguments, run, print a summary (or one JSON document)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="fresh stores")
    parser.add_argument("--requests", type=int, default=4, help="timed requests per store")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per store")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    result = run(args.runs, args.requests, args.steps)
    if args.json:
        print(json.dumps(result))
        return
    print(f"load average {result['load_average']}, {result['samples']}")
    for section in ("request_us", "floor_us", "step_us"):
        print(f"{section}: " + "  ".join(f"{k}={v}" for k, v in result[section].items()))


if __name__ == "__main__":
    main()
