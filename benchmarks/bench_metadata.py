"""Metadata benchmark: lookup, locate and allocate+commit, embedded and over HTTP.

Operations (the connector's hot calls):

- `lookup`: one batched lookup of a 1,000-key chain (all committed);
- `locate`: locate 64 committed keys (with read leases);
- `alloc_commit`: allocate 64 new keys, then commit them;
- `alloc_full`: the same on a rank file that is full, so allocate evicts (LRU, down to
  the low watermark) on its own path.

Each runs with 1 and 16 concurrent clients, embedded (`sqlite:///`, each client its own
process sharing one database file, as the workers of a node do) and over HTTP (a real
`hf3fsctl serve` process on loopback; each client its own process with its own pooled
`HttpMetadataClient`). Clients are processes, not threads, so that client-side Python
does not share a GIL with the server or each other; on a 2-core machine 16 client
processes and the server share the same two cores, so the HTTP figures include the
clients' own CPU. Every figure is printed beside the in-tree vLLM metadata server's
(measured on the same machine kind) and the ratio.

    python benchmarks/bench_metadata.py            # ~1-2 minutes
    python benchmarks/bench_metadata.py --quick    # ~20 seconds
    python benchmarks/bench_metadata.py --json -   # one JSON document on stdout
    python benchmarks/bench_metadata.py --workers 2  # serve with 2 worker processes
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from hf3fsctl.keys import NamespaceManifest  # noqa: E402
from hf3fsctl.meta.client import open_metadata_client  # noqa: E402
from hf3fsctl.meta.models import CommitItem, RankFile  # noqa: E402

TOKEN = "bench-token"
BATCH = 64
LOOKUP_KEYS = 1000
FULL_PAGES = 4096
# The in-tree vLLM hf3fs metadata server on this machine kind: ops/s, p50 ms, p99 ms.
IN_TREE: dict[tuple[str, int], dict[str, float]] = {
    ("lookup", 1): {"ops": 274, "p50_ms": 3.2},
    ("lookup", 16): {"ops": 560, "p99_ms": 57},
    ("alloc_commit", 1): {"ops": 141, "p50_ms": 7.5},
    ("alloc_commit", 16): {"ops": 141, "p50_ms": 103},
    ("alloc_full", 1): {"ops": 1.8},
    ("alloc_full", 16): {"ops": 1.8},
}


def _key(tag: str, i: int) -> str:
    return hashlib.sha256(f"{tag}-{i}".encode()).hexdigest()


def _manifest(model: str) -> dict[str, Any]:
    return NamespaceManifest(
        model=model,
        revision="bench",
        kv_dtype="bfloat16",
        block_size=16,
        layout="LBNHC",
        backend="FLASH_ATTN",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        tp_size=1,
        pp_size=1,
        page_bytes=2 * 1024 * 1024,
        hash_algorithm="sha256",
        none_hash="00" * 32,
    ).to_dict()


def _commit(client: Any, ns: str, chain: list[str]) -> None:
    result = client.allocate(ns, 0, chain)
    items = [
        CommitItem(key=a.key, page=a.page, checksum=f"{a.page:016x}", size=2 << 20)
        for a in result.allocated
    ]
    client.commit(ns, 0, items)


def prepare(url: str, token: str | None, locate_keys: int) -> dict[str, str]:
    """Register the namespaces and store the committed keys the reads will find."""
    client = open_metadata_client(url, timeout_s=60, token=token)
    namespaces = {}
    for name, pages in (("main", 4_000_000), ("full", FULL_PAGES)):
        manifest = _manifest(name)
        ns = NamespaceManifest(**manifest).namespace_id
        client.register_namespace(ns, manifest)
        client.register_rank(
            ns,
            RankFile(
                rank=0,
                path=f"{ns}/rank-0000.pages",
                page_bytes=2 << 20,
                slot_bytes=2 << 20,
                num_pages=pages,
            ),
        )
        namespaces[name] = ns
    main = namespaces["main"]
    for start in range(0, max(locate_keys, LOOKUP_KEYS), 1000):
        _commit(client, main, [_key("stored", i) for i in range(start, start + 1000)])
    for start in range(0, FULL_PAGES, 1000):  # fill the small file: every allocate evicts
        chain = [_key("full", i) for i in range(start, min(start + 1000, FULL_PAGES))]
        _commit(client, namespaces["full"], chain)
    client.close()
    return namespaces


def worker(
    url: str,
    token: str | None,
    namespaces: dict[str, str],
    op: str,
    worker_id: int,
    locate_keys: int,
    start_at: float,
    duration_s: float,
) -> list[float]:
    """Run `op` from `start_at` for `duration_s`; returns each call's latency (s)."""
    client = open_metadata_client(url, timeout_s=30, token=token)
    main = namespaces["main"]
    lookup_chain = [_key("stored", i) for i in range(LOOKUP_KEYS)]
    counter = 0
    latencies: list[float] = []
    while time.time() < start_at:
        time.sleep(0.001)
    end = start_at + duration_s
    while True:
        now = time.perf_counter()
        if time.time() >= end:
            break
        if op == "lookup":
            client.lookup(main, lookup_chain)
        elif op == "locate":
            first = (worker_id * 7919 + counter * BATCH) % (locate_keys - BATCH)
            client.locate(main, 0, [_key("stored", first + i) for i in range(BATCH)])
        else:
            ns = main if op == "alloc_commit" else namespaces["full"]
            base = counter * BATCH
            _commit(client, ns, [_key(f"{op}-{worker_id}", base + i) for i in range(BATCH)])
        latencies.append(time.perf_counter() - now)
        counter += 1
    client.close()
    return latencies


def measure(
    url: str,
    token: str | None,
    namespaces: dict[str, str],
    op: str,
    clients: int,
    locate_keys: int,
    duration_s: float,
) -> dict[str, Any]:
    """One (operation, concurrency) cell: ops/s and latency percentiles."""
    context = multiprocessing.get_context("fork")
    start_at = time.time() + 0.5 + 0.05 * clients
    args = [
        (url, token, namespaces, op, w, locate_keys, start_at, duration_s) for w in range(clients)
    ]
    with context.Pool(clients) as pool:
        results = pool.starmap(worker, args)
    latencies = sorted(x for r in results for x in r)
    n = len(latencies)
    return {
        "op": op,
        "clients": clients,
        "calls": n,
        "ops": n / duration_s,
        "p50_ms": 1e3 * latencies[n // 2] if n else None,
        "p99_ms": 1e3 * latencies[min(n - 1, int(n * 0.99))] if n else None,
        "mean_ms": 1e3 * statistics.fmean(latencies) if n else None,
    }


def run(
    mode: str,
    workdir: Path,
    ops: list[str],
    concurrency: list[int],
    duration_s: float,
    locate_keys: int,
    workers: int = 1,
) -> list[dict[str, Any]]:
    """Every cell of one mode (embedded or http; `workers` server processes)."""
    from helpers.servers import start_server

    db = workdir / mode / "metadata.db"
    db.parent.mkdir(parents=True)
    server = None
    url, token = f"sqlite:///{db}", None
    if mode == "http":
        server = start_server(
            workdir / mode / "server",
            token=TOKEN,
            db_path=db,
            extra_config=f"server:\n  workers: {workers}\n",
        )
        url, token = server.url, TOKEN
    try:
        namespaces = prepare(url, token, locate_keys)
        rows = []
        for op in ops:
            for clients in concurrency:
                row = measure(url, token, namespaces, op, clients, locate_keys, duration_s)
                row["mode"] = mode if mode == "embedded" else f"{mode} w{workers}"
                bar = IN_TREE.get((op, clients), {})
                row["in_tree"] = bar
                row["ratio"] = row["ops"] / bar["ops"] if bar.get("ops") else None
                rows.append(row)
                print(
                    f"  {row['mode']:8} {op:12} x{clients:<3} {row['ops']:9.1f} ops/s  "
                    f"p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms",
                    file=sys.stderr,
                )
        return rows
    finally:
        if server is not None:
            server.stop()


def render(rows: list[dict[str, Any]]) -> None:
    """A Rich table of every cell with the in-tree figure and the ratio."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hf3fsctl metadata (ratio = ops/s ÷ in-tree vLLM metadata server)")
    for column in ("mode", "op", "clients", "ops/s", "p50 ms", "p99 ms", "in-tree", "ratio"):
        table.add_column(column, justify="right" if column not in ("mode", "op") else "left")
    for r in rows:
        bar = r["in_tree"]
        in_tree = ", ".join(
            f"{v:g} {k.replace('_ms', ' ms').replace('ops', 'ops/s')}" for k, v in bar.items()
        )
        table.add_row(
            r["mode"],
            r["op"],
            str(r["clients"]),
            f"{r['ops']:.0f}",
            f"{r['p50_ms']:.2f}",
            f"{r['p99_ms']:.2f}",
            in_tree or "—",
            f"{r['ratio']:.1f}×" if r["ratio"] else "—",
        )
    Console(stderr=True).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (~20 s)")
    parser.add_argument("--json", metavar="PATH", help="write one JSON document (- = stdout)")
    parser.add_argument("--modes", default="embedded,http", help="embedded,http")
    parser.add_argument("--ops", default="lookup,locate,alloc_commit,alloc_full")
    parser.add_argument("--clients", default="1,16", help="concurrency levels")
    parser.add_argument("--duration", type=float, help="seconds per cell")
    parser.add_argument("--workers", type=int, default=1, help="server processes (http)")
    args = parser.parse_args()
    duration = args.duration or (1.0 if args.quick else 3.0)
    locate_keys = 5000 if args.quick else 20000
    ops = args.ops.split(",")
    concurrency = [int(c) for c in args.clients.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-metadata-") as tmp:
        for mode in args.modes.split(","):
            rows += run(mode, Path(tmp), ops, concurrency, duration, locate_keys, args.workers)
    render(rows)
    doc = {
        "benchmark": "metadata",
        "machine": {"cpus": multiprocessing.cpu_count(), "python": platform.python_version()},
        "duration_s": duration,
        "clients_are": "processes",
        "rows": rows,
    }
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
