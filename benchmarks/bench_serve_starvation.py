"""Allocate + commit on one SQLite `hf3fsctl serve`, alone and beside saturating lookups.

    .venv/bin/python benchmarks/bench_serve_starvation.py [--lookers 2] [--seconds 6]

Starts a real `serve` on a fresh store, stores 1,000 keys, then times a writer
(allocate + commit of 16 new keys per cycle, over HTTP) for `--seconds` alone, and again
while `--lookers` processes send 64-key lookups in tight loops. Prints one JSON line:
keys saved/s solo and beside, the ratio (issue 21's bar: >= 0.3), lookups/s beside.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from hf3fsctl.bench.metadata.stores import PAGE_BYTES, bench_manifest, bench_rank_file, namespace_id
from hf3fsctl.meta.client import open_metadata_client
from hf3fsctl.meta.models import CommitItem

BATCH = 16


def _key(tag: str, index: int) -> str:
    return hashlib.sha256(f"{tag}-{index}".encode()).hexdigest()


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    (work / "storage").mkdir()
    config = work / "hf3fs.yaml"
    config.write_text(
        f"storage:\n  path: {work / 'storage'}\nmetadata:\n  url: sqlite:///{work / 'm.db'}\n"
    )
    port = _port()
    log = (work / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "hf3fsctl", "serve", "--config", str(config), "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "HF3FSCTL_CONFIG": str(config)},
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/healthz", timeout=1).read()
            return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit(f"serve did not start: {(work / 'serve.log').read_text()[-2000:]}")


def _save(client: Any, ns: str, tag: str, start: int, count: int) -> int:
    result = client.allocate(ns, 0, [_key(tag, start + j) for j in range(count)], 0)
    client.commit(
        ns,
        0,
        [
            CommitItem.model_construct(
                key=a.key, page=a.page, checksum=f"xxh3:{a.page:016x}", size=PAGE_BYTES
            )
            for a in result.allocated
        ],
    )
    return len(result.allocated)


def _writer(url: str, ns: str, tag: str, seconds: float) -> float:
    client = open_metadata_client(url)
    saved = cycle = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        saved += _save(client, ns, tag, cycle * BATCH, BATCH)
        cycle += 1
    rate = saved / (time.perf_counter() - started)
    client.close()
    return rate


def _looker(url: str, ns: str, stop: Any, count: Any) -> None:
    client = open_metadata_client(url)
    keys = [_key("stored", i) for i in range(64)]
    done = 0
    while not stop.is_set():
        client.lookup(ns, keys)
        done += 1
    with count.get_lock():
        count.value += done
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-starvation-") as tmp:
        process, url = _serve(Path(tmp))
        try:
            client = open_metadata_client(url)
            manifest = bench_manifest("bench-starvation")
            ns = namespace_id(manifest)
            client.register_namespace(ns, manifest)
            client.register_rank(ns, bench_rank_file(ns))
            _save(client, ns, "stored", 0, 1000)
            client.close()
            solo = _writer(url, ns, "solo", args.seconds)
            ctx = multiprocessing.get_context("spawn")
            stop, count = ctx.Event(), ctx.Value("q", 0)
            lookers = [
                ctx.Process(target=_looker, args=(url, ns, stop, count))
                for _ in range(args.lookers)
            ]
            for looker in lookers:
                looker.start()
            time.sleep(1.0)
            started = time.perf_counter()
            beside = _writer(url, ns, "beside", args.seconds)
            elapsed = time.perf_counter() - started
            stop.set()
            for looker in lookers:
                looker.join()
        finally:
            process.terminate()
            process.wait(10)
        print(
            json.dumps(
                {
                    "lookers": args.lookers,
                    "solo_keys_per_s": round(solo, 1),
                    "beside_keys_per_s": round(beside, 1),
                    "ratio": round(beside / solo, 3),
                    "lookups_per_s_beside": round(count.value / (elapsed + 1.0)),
                }
            )
        )


if __name__ == "__main__":
    main()
