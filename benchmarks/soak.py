"""Soak: the metadata load test held for minutes against one real `hf3fsctl serve`.

    python benchmarks/soak.py [--minutes 5] [--clients-per-op N] [--json-out soak.json]
                                                                        # `make soak`

Starts `hf3fsctl serve` (a token, loopback, a bounded store: `--capacity-pages` pages of
2 MiB, so allocations keep evicting and the entry count stays flat), fills it with
`--entries` committed keys, then runs the cells of `hf3fsctl bench metadata`
(`hf3fsctl.bench.metadata.measure`) *at once* for the whole duration: 8 client processes
doing allocate + commit of 64 keys (evicting), 4 doing lookups of 1,000 keys, 4 locating
64 — 16 clients (`--clients-per-op N`: N of each instead, for a shared machine). Every `--sample-s` seconds it records the server's RSS and open file
descriptors, and the database's size (each SQLite connection caches up to 2 MiB of it,
so RSS may grow towards that while the file does). It prints and writes one JSON
document: per operation the calls, failed and unfinished calls, ops/s and latency
percentiles; the samples; and the least-squares slope of RSS (bytes/min) and fds (per
min) after the first minute (warm-up), and `rss_slope_mb_per_min` beside the goal
(`rss_goal_mb_per_min`: issue 21's 0.1 MB/min, `rss_goal_met`). A clean soak has zero failed or unfinished calls
and slopes near zero.

Loopback only, bounded in time (`--minutes`, plus set-up), never part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf3fsctl.bench.loopback import free_port
from hf3fsctl.bench.metadata import (
    PAGE_BYTES,
    StoreSpec,
    bench_manifest,
    bench_rank_file,
    fill_spec,
    measure,
    rss_bytes,
)
from hf3fsctl.keys import NamespaceManifest
from hf3fsctl.storage.layout import slot_bytes

TOKEN = "soak-token-0123456789abcdef"
MIX = {"alloc_commit": 8, "lookup": 4, "locate": 4}  # clients per operation: 16
STORED_TAG = "soak-stored"


def _start_server(directory: Path, capacity_pages: int) -> tuple[subprocess.Popen[bytes], str]:
    """`hf3fsctl serve` on a free loopback port over a store of `capacity_pages` pages."""
    (directory / "storage").mkdir(parents=True)
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    config = directory / "hf3fs.yaml"
    capacity = capacity_pages * slot_bytes(PAGE_BYTES)
    config.write_text(
        f"storage:\n  path: {directory / 'storage'}\n  capacity: {capacity}\n"
        f"metadata:\n  url: sqlite:///{directory / 'metadata.db'}\n"
    )
    port = free_port()
    log = (directory / "serve.log").open("wb")
    flags = ["--host", "127.0.0.1", "--port", str(port), "--token-file", str(token_file)]
    flags += ["--log-level", "warning"]
    process = subprocess.Popen(
        [sys.executable, "-m", "hf3fsctl", "serve", "--config", str(config), *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"serve exited {process.returncode}: see {directory / 'serve.log'}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=1):
                return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("serve did not answer /healthz in 60 s")


def _fill(spec: StoreSpec) -> None:
    """Register the namespace and commit `spec.entries` keys through the server."""
    client = spec.client()
    try:
        ns = spec.namespaces[0]
        client.register_namespace(ns, bench_manifest("soak"))
        client.register_rank(ns, bench_rank_file(ns))
    finally:
        client.close()
    fill_spec(spec, 4096)


def _cell(spec: StoreSpec, op: str, clients: int, seconds: float, out: Any) -> None:
    """One operation's clients for the whole soak (a spawned process; result to `out`)."""
    try:
        out.put((op, measure(spec, op, clients, seconds, f"soak-{op}")))
    except Exception as exc:  # reported as the cell's error
        out.put((op, {"error": f"{type(exc).__name__}: {exc}"}))


def _open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _db_bytes(directory: Path, name: str) -> int:
    """Size of the database file or its WAL (0 when absent)."""
    try:
        return (directory / name).stat().st_size
    except OSError:
        return 0


def _slope_per_min(samples: list[dict[str, float]], field: str, skip_s: float) -> float | None:
    """Least-squares slope of `field` over time (per minute), samples after `skip_s`."""
    points = [(s["t_s"], s[field]) for s in samples if s["t_s"] >= skip_s]
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return 60.0 * cov / var if var > 0 else None


RSS_GOAL_MB_PER_MIN = 0.1  # issue 21: RSS flat after warm-up


def soak(
    minutes: float,
    entries: int,
    capacity_pages: int,
    sample_s: float,
    keep: Path | None = None,
    mix: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Run the soak; returns the JSON document. `keep`: work there and leave it behind;
    `mix`: client processes per operation (default `MIX`)."""
    mix = dict(mix or MIX)
    seconds = minutes * 60.0
    with tempfile.TemporaryDirectory(prefix="hf3fsctl-soak-") as scratch:
        tmp = str(keep) if keep is not None else scratch
        server, url = _start_server(Path(tmp), capacity_pages)
        try:
            ns = NamespaceManifest(**bench_manifest("soak")).namespace_id
            spec = StoreSpec("soak", url, TOKEN, (ns,), STORED_TAG, entries)
            _fill(spec)
            context = multiprocessing.get_context("spawn")
            results = context.Queue()
            cells = [
                context.Process(target=_cell, args=(spec, op, n, seconds, results))
                for op, n in mix.items()
            ]
            samples: list[dict[str, float]] = []
            start = time.monotonic()
            for cell in cells:
                cell.start()
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    samples.append(
                        {
                            "t_s": round(time.monotonic() - start, 1),
                            "rss_bytes": float(rss_bytes(server.pid)),
                            "open_fds": float(_open_fds(server.pid)),
                            "db_bytes": float(_db_bytes(Path(tmp), "metadata.db")),
                            "wal_bytes": float(_db_bytes(Path(tmp), "metadata.db-wal")),
                        }
                    )
                    stop.wait(sample_s)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            by_op = dict(results.get(timeout=seconds + 600) for _ in cells)
            stop.set()
            sampler.join()
            for cell in cells:
                cell.join(30)
            elapsed = time.monotonic() - start
            alive = server.poll() is None
        finally:
            server.terminate()
            server.wait(30)
    errors = sum(
        int(r.get("failed_calls", 0)) + int(r.get("unfinished_calls", 0)) + ("error" in r)
        for r in by_op.values()
    )
    rss_slope = _slope_per_min(samples, "rss_bytes", 60.0)
    return {
        "minutes": minutes,
        "elapsed_s": round(elapsed, 1),
        "clients": mix,
        "entries_prefilled": entries,
        "capacity_pages": capacity_pages,
        "server_alive_at_end": alive,
        "operations": by_op,
        "total_calls": sum(int(r.get("calls", 0)) for r in by_op.values()),
        "errors": errors,
        "rss_slope_bytes_per_min": rss_slope,
        "rss_slope_mb_per_min": None if rss_slope is None else rss_slope / 1e6,
        "rss_goal_mb_per_min": RSS_GOAL_MB_PER_MIN,
        "rss_goal_met": None if rss_slope is None else rss_slope / 1e6 <= RSS_GOAL_MB_PER_MIN,
        "fds_slope_per_min": _slope_per_min(samples, "open_fds", 60.0),
        "rss_first_last_bytes": [samples[0]["rss_bytes"], samples[-1]["rss_bytes"]]
        if samples
        else None,
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run the soak, print a summary and write the JSON document."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--entries", type=int, default=20_000, help="keys committed first")
    parser.add_argument("--capacity-pages", type=int, default=40_000, help="store capacity")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="work here and keep it")
    parser.add_argument(
        "--clients-per-op",
        type=int,
        default=None,
        help="client processes of each operation (default: the 8/4/4 mix, 16 in all)",
    )
    args = parser.parse_args(argv)
    mix = None if args.clients_per_op is None else dict.fromkeys(MIX, args.clients_per_op)
    document = soak(args.minutes, args.entries, args.capacity_pages, args.sample_s, args.dir, mix)
    text = json.dumps(document, indent=2)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    summary = {k: v for k, v in document.items() if k not in ("samples", "operations")}
    summary["ops_per_s"] = {op: r.get("ops") for op, r in document["operations"].items()}
    summary["p99_ms"] = {op: r.get("p99_ms") for op, r in document["operations"].items()}
    print(json.dumps(summary, indent=2))
    return 0 if document["errors"] == 0 and document["server_alive_at_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
