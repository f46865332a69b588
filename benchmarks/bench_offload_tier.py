"""The hf3fsctl offload tier beside vLLM's own `fs` tier, in one run, through one driver.

Both tiers are built by vLLM itself (`TieringOffloadingSpec.get_manager()`: the CPU primary
tier on its shared-memory region, the secondary tier by `SecondaryTierFactory`) and driven
through the `SecondaryTierManager` interface that `TieringOffloadingManager` uses: the same
`TransferJob`s (store: primary chunks → tier; load: tier → primary chunks), the same async
lookups (`lookup` until it stops answering RETRY, `on_schedule_end` once per step).

    python benchmarks/bench_offload_tier.py                 # ~2-4 min on 2 cores
    python benchmarks/bench_offload_tier.py --quick         # seconds
    python benchmarks/bench_offload_tier.py --json          # one JSON document
    sudo python benchmarks/bench_offload_tier.py --full-disk-mib 64   # + a full tmpfs

Phases: `store` and `load` GB/s (`--chunks` chunks of `--chunk-mib` MiB in jobs of
`--job-chunks`; loads are verified byte-equal); `lookup` latency with `--lookup-blocks`
small blocks stored (each step asks for `--lookup-batch` keys, all present: the time from
the first lookup() to the answer, and the cost of one lookup() call); throughput also for
hf3fsctl with `storage.o_direct` (vLLM's fs tier uses O_DIRECT where the file system
has it; hf3fsctl's default is the page cache); `full_disk` (root
only: a tmpfs of `--full-disk-mib` MiB holds each tier's files; 3x its size is stored:
which stores succeed, and whether the newest chunks still load). The hf3fsctl store keeps
its SQLite metadata outside the tmpfs and records a capacity of 90% of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

END = ScheduleEndContext((), ())
_engines = 0


def tier_entry(kind: str, root: Path, meta: Path) -> dict[str, Any]:
    if kind == "fs":
        return {"type": "fs", "root_dir": str(root)}
    entry: dict[str, Any] = {
        "type": "Hf3fsctlOffloadTier",
        "module_path": "hf3fsctl_connector.offload_tier",
        "storage_path": str(root),
        "metadata_url": f"sqlite:///{meta}",
    }
    if kind == "hf3fsctl-odirect":
        entry["storage.o_direct"] = True
    return entry


class Bench:
    """One tier on vLLM's primary CPU tier, driven through the SecondaryTierManager calls."""

    def __init__(self, entry: dict[str, Any], chunk_bytes: int, chunks: int) -> None:
        global _engines
        _engines += 1
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, tuple(f"layer.{i}" for i in range(2)), 0),),
            worker_kv_bytes_per_block=chunk_bytes,
            enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": chunks * chunk_bytes, "secondary_tiers": [entry]},
            engine_id=f"bench-{os.getpid()}-{_engines}",
            model=OffloadingModelConfig(f"bench-{chunk_bytes}", "bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        )
        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        self.tier: SecondaryTierManager = self.manager.secondary_tiers[0]  # type: ignore[attr-defined]
        self.view = np.frombuffer(self.manager.primary_tier.get_kv_memoryview(), dtype=np.uint8)  # type: ignore[attr-defined]
        self.view = self.view.reshape(-1, chunk_bytes)
        self.job_id = 1 << 30
        self.ctx = ReqContext("bench")
        self.tier.on_new_request(self.ctx)

    def close(self) -> None:
        self.tier.on_request_finished(self.ctx)
        del self.view
        self.manager.shutdown()

    def run(self, keys: list[Any], chunk_ids: list[int], promotion: bool) -> list[bool]:
        """Submit one job per slice and wait for all; each job's success."""
        self.job_id += 1
        job = TransferJob(
            self.job_id, keys, np.array(chunk_ids, dtype=np.int32), promotion, self.ctx
        )
        (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        return self.collect({self.job_id})

    def run_many(self, jobs: list[tuple[list[Any], list[int]]], promotion: bool) -> list[bool]:
        ids = set()
        for keys, chunk_ids in jobs:
            self.job_id += 1
            ids.add(self.job_id)
            job = TransferJob(
                self.job_id, keys, np.array(chunk_ids, dtype=np.int32), promotion, self.ctx
            )
            (self.tier.submit_load if promotion else self.tier.submit_store)(job)
        return self.collect(ids)

    def collect(self, ids: set[int]) -> list[bool]:
        done: dict[int, bool] = {}
        while len(done) < len(ids):
            for result in self.tier.get_finished_jobs():
                done[result.job_id] = result.success
            time.sleep(0.0005)
        return [done[i] for i in sorted(ids)]

    def lookup(self, keys: list[Any]) -> tuple[float, float, int]:
        """(seconds until every key is answered, mean seconds per lookup() call, hits)."""
        self.job_id += 1
        ctx = ReqContext(f"lookup-{self.job_id}")  # a new request: no cached verdicts
        self.tier.on_new_request(ctx)
        started = time.perf_counter()
        pending, hits, calls, call_time = list(keys), 0, 0, 0.0
        while pending:
            retry = []
            for key in pending:
                t0 = time.perf_counter()
                result = self.tier.lookup(key, ctx)
                call_time += time.perf_counter() - t0
                calls += 1
                if result is LookupResult.RETRY:
                    retry.append(key)
                elif result is LookupResult.HIT:
                    hits += 1
            pending = retry
            self.tier.on_schedule_end(END)  # one scheduler step
            if pending:
                time.sleep(0.0002)
        elapsed = time.perf_counter() - started
        self.tier.on_request_finished(ctx)
        return elapsed, call_time / max(1, calls), hits


def fill(view: np.ndarray, rng: np.random.Generator) -> None:
    view[:] = rng.integers(0, 256, size=view.shape, dtype=np.uint8)


def keys_for(n: int, salt: int) -> list[Any]:
    return [make_offload_key(salt.to_bytes(8, "big") + os.urandom(24), 0) for _ in range(n)]


def throughput(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    chunk_bytes = args.chunk_mib << 20
    root = work / f"{kind}-data"
    root.mkdir()
    bench = Bench(tier_entry(kind, root, work / f"{kind}.db"), chunk_bytes, args.chunks)
    try:
        rng = np.random.default_rng(0)
        fill(bench.view, rng)
        expected = bench.view.copy()
        keys = keys_for(args.chunks, 1)
        ids = list(range(args.chunks))
        per = args.job_chunks
        jobs = [(keys[i : i + per], ids[i : i + per]) for i in range(0, args.chunks, per)]
        t0 = time.perf_counter()
        stored = bench.run_many(jobs, promotion=False)
        store_s = time.perf_counter() - t0
        bench.view[:] = 0
        subprocess.run(["sync"], check=False)
        t0 = time.perf_counter()
        loaded = bench.run_many(jobs, promotion=True)
        load_s = time.perf_counter() - t0
        equal = bool(np.array_equal(bench.view, expected))
    finally:
        bench.close()
    total = args.chunks * chunk_bytes
    return {
        "store_gbps": total / store_s / 1e9,
        "load_gbps": total / load_s / 1e9,
        "stored_jobs_ok": sum(stored),
        "loaded_jobs_ok": sum(loaded),
        "jobs": len(jobs),
        "byte_equal": equal,
    }


def lookups(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    chunk_bytes = 4096  # one page: the lookup phase stores many tiny blocks
    root = work / f"{kind}-lookup"
    root.mkdir()
    per = 1024
    bench = Bench(tier_entry(kind, root, work / f"{kind}-lookup.db"), chunk_bytes, per)
    try:
        keys = keys_for(args.lookup_blocks, 2)
        t0 = time.perf_counter()
        for i in range(0, len(keys), per):
            batch = keys[i : i + per]
            bench.run(batch, list(range(len(batch))), promotion=False)
        fill_s = time.perf_counter() - t0
        rng = np.random.default_rng(1)
        waits, calls, hits = [], [], 0
        for _ in range(args.lookup_rounds):
            picked = [keys[int(j)] for j in rng.choice(len(keys), args.lookup_batch, replace=False)]
            wait, call, found = bench.lookup(picked)
            waits.append(wait)
            calls.append(call)
            hits += found
        missing, _, miss_hits = bench.lookup(keys_for(args.lookup_batch, 3))
    finally:
        bench.close()
    waits.sort()
    return {
        "stored_blocks": args.lookup_blocks,
        "fill_s": fill_s,
        "batch": args.lookup_batch,
        "answer_ms_p50": 1e3 * statistics.median(waits),
        "answer_ms_p99": 1e3 * waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "call_us_mean": 1e6 * statistics.mean(calls),
        "hit_rate": hits / (args.lookup_rounds * args.lookup_batch),
        "miss_batch_ms": 1e3 * missing,
        "false_hits": miss_hits,
    }


@contextlib.contextmanager
def tmpfs(path: Path, mib: int) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def full_disk(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    chunk_bytes = 1 << 20
    disk = args.full_disk_mib << 20
    chunks = 3 * args.full_disk_mib
    with tmpfs(work / f"{kind}-tmpfs", args.full_disk_mib) as root:
        meta = work / f"{kind}-full.db"
        if kind != "fs":
            from hf3fsctl.meta.sqlite.store import MetadataStore

            store = MetadataStore(meta)
            store.set_capacity(int(disk * 0.9))
            store.close()
        bench = Bench(tier_entry(kind, root, meta), chunk_bytes, 32)
        try:
            fill(bench.view, np.random.default_rng(2))
            expected = bench.view.copy()
            ok: list[bool] = []
            all_keys = []
            for start in range(0, chunks, 32):
                keys = keys_for(32, 4 + start)
                all_keys.append(keys)
                ok += bench.run_many([([k], [i]) for i, k in enumerate(keys)], promotion=False)
            newest = all_keys[-1][-16:]  # the newest 16 MiB (below any capacity tried)
            bench.view[:] = 0
            last = bench.run_many([([k], [i]) for i, k in enumerate(newest)], promotion=True)
            newest_equal = bool(np.array_equal(bench.view[:16], expected[16:]))
            # After the disk filled: does a new store still work?
            bench.view[:] = expected
            again = bench.run_many([([k], [i]) for i, k in enumerate(keys_for(32, 999))], False)
            used = int(
                subprocess.run(
                    ["df", "-B1", "--output=used", str(root)], capture_output=True, text=True
                ).stdout.split()[-1]
            )
        finally:
            bench.close()
    first_fail = next((i for i, good in enumerate(ok) if not good), None)
    return {
        "disk_mib": args.full_disk_mib,
        "stored_mib": chunks,
        "stores_ok": sum(ok),
        "stores_failed": len(ok) - sum(ok),
        "first_failed_store": first_fail,
        "newest_16_loaded": sum(last),
        "newest_byte_equal": newest_equal,
        "stores_ok_after_full": sum(again),
        "disk_used_mib": used >> 20,
    }


KINDS = ("hf3fsctl", "hf3fsctl-odirect", "fs")
LABELS = {"hf3fsctl": "hf3fsctl", "hf3fsctl-odirect": "hf3fsctl O_DIRECT", "fs": "vLLM fs"}


def render(results: dict[str, Any]) -> str:
    kinds = [k for k in KINDS if k in results]
    rows = [("phase", "metric", *(LABELS[k] for k in kinds))]
    for phase in ("throughput", "lookup", "full_disk"):
        if phase not in results["fs"]:
            continue
        for metric in results["fs"][phase]:
            cells = []
            for kind in kinds:
                value = results[kind].get(phase, {}).get(metric, "-")
                cells.append(f"{value:.3f}" if isinstance(value, float) else str(value))
            rows.append((phase, metric, *cells))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--chunk-mib", type=int, default=2)
    parser.add_argument("--job-chunks", type=int, default=16)
    parser.add_argument("--lookup-blocks", type=int, default=100_000)
    parser.add_argument("--lookup-batch", type=int, default=64)
    parser.add_argument("--lookup-rounds", type=int, default=200)
    parser.add_argument("--full-disk-mib", type=int, default=0, help="root: tmpfs MiB (0: skip)")
    parser.add_argument("--work", type=Path, default=None, help="where the files go (a tmp dir)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.chunks, args.chunk_mib, args.lookup_blocks, args.lookup_rounds = 32, 1, 4096, 20
    work = Path(tempfile.mkdtemp(prefix="bench-offload-", dir=args.work))
    results: dict[str, Any] = {k: {} for k in KINDS}
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    try:
        for kind in KINDS:
            results[kind]["throughput"] = throughput(kind, args, work)
            if kind == "hf3fsctl-odirect":
                continue  # the other phases do not depend on O_DIRECT
            results[kind]["lookup"] = lookups(kind, args, work)
            if args.full_disk_mib:
                results[kind]["full_disk"] = full_disk(kind, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(render(results))
        print(json.dumps(results))


if __name__ == "__main__":
    main()
