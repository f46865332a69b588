"""Allocate + commit on one SQLite `hf3fsctl serve`, alone and beside saturating lookups.

    .venv/bin/python benchmarks/bench_serve_starvation.py [--lookers 2,4] [--seconds 4]
        [--rounds 3] [--looker-nice 0] [--baseline-tree DIR] [--json-out F]

Starts a real `serve` on a fresh store and stores 1,000 keys. A writer (allocate +
commit of 16 new keys per cycle, over HTTP) is timed in alternating windows of
`--seconds`: alone, then beside `L` looker processes sending 64-key lookups in tight
loops (paused, blocked on an event, while the writer is alone), for each `L` of
`--lookers`, `--rounds` times. Alternating solo and beside windows in one run cancels
the drift of a shared machine's load; the figures are medians over the rounds.
`--baseline-tree DIR` (a `git worktree` of another revision) starts a second `serve`
from that source tree and interleaves its rounds with this tree's: an A/B in one run.

Prints one JSON document: per looker count, the writer's keys saved/s solo and beside
(median), `ratio` = median of each round's beside ÷ solo (issue 21's bar: >= 0.3),
lookups/s beside, and the server process's CPU share in each kind of window (a server
that is not busy is not what starves the writer).

`--looker-nice N` lowers the lookers' CPU priority by N. On a 2-core machine the
writer's client process competes for a core with the lookers' clients: on a real
deployment those run on other hosts, and only the server's own scheduling (event loop,
writer thread, GIL, writer lock) is shared. A niced looker still saturates the server
whenever the writer's client does not need the core; both figures are worth stating.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf3fsctl.bench.metadata.processes import cpu_seconds
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


def _serve(work: Path, tree: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A `serve` on a fresh store in `work`; from the source tree `tree` if given."""
    work.mkdir()
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
        env={**os.environ, "HF3FSCTL_CONFIG": str(config)}
        | ({"PYTHONPATH": str(tree)} if tree else {}),
        cwd=tree,  # `python -m` puts the working directory first on the path
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


class Writer:
    """The timed writer: one client, a fresh key range per window."""

    def __init__(self, url: str, ns: str) -> None:
        self.client = open_metadata_client(url)
        self.ns = ns
        self.cycle = 0
        self.slowest_s = 0.0  # the slowest cycle of the last window

    def window(self, seconds: float) -> float:
        """Keys saved per second over `seconds`."""
        saved = 0
        self.slowest_s = 0.0
        started = time.perf_counter()
        while (now := time.perf_counter()) - started < seconds:
            saved += _save(self.client, self.ns, "writer", self.cycle * BATCH, BATCH)
            self.cycle += 1
            self.slowest_s = max(self.slowest_s, time.perf_counter() - now)
        return saved / (time.perf_counter() - started)


def _looker(url: str, ns: str, nice: int, go: Any, quit: Any, count: Any, errors: Any) -> None:
    """Tight 64-key lookups while `go` is set; counts them in `count` every ~0.1 s."""
    if nice:
        os.nice(nice)
    client = open_metadata_client(url)
    keys = [_key("stored", i) for i in range(64)]
    done = 0
    flushed = time.monotonic()
    while not quit.is_set():
        if not go.wait(0.2):
            continue
        try:
            client.lookup(ns, keys)
            done += 1
        except Exception:
            with errors.get_lock():
                errors.value += 1
        if time.monotonic() - flushed > 0.1 or not go.is_set():
            with count.get_lock():
                count.value += done
            done, flushed = 0, time.monotonic()
    client.close()


@dataclass
class Target:
    """One server under test, its writer and its lookers' controls."""

    label: str
    url: str
    ns: str
    pid: int
    go: Any = None
    count: Any = None
    writer: Writer | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)


def _round(target: Target, seconds: float) -> dict[str, Any]:
    """One solo window, then one beside window, of `target`'s writer."""
    assert target.writer is not None
    writer = target.writer
    time.sleep(0.3)  # the lookers' last calls drain
    cpu0, t0 = cpu_seconds(target.pid), time.monotonic()
    solo = writer.window(seconds)
    slowest_solo = writer.slowest_s
    cpu1, t1 = cpu_seconds(target.pid), time.monotonic()
    target.go.set()
    time.sleep(0.5)  # every looker in its loop
    before, cpu2, t2 = target.count.value, cpu_seconds(target.pid), time.monotonic()
    beside = writer.window(seconds)
    looked, cpu3, t3 = target.count.value - before, cpu_seconds(target.pid), time.monotonic()
    target.go.clear()
    return {
        "solo_keys_per_s": round(solo, 1),
        "beside_keys_per_s": round(beside, 1),
        "ratio": round(beside / solo, 3) if solo else None,
        "lookups_per_s_beside": round(looked / (t3 - t2)),
        "slowest_cycle_ms_solo": round(1e3 * slowest_solo, 1),
        "slowest_cycle_ms_beside": round(1e3 * writer.slowest_s, 1),
        "server_cpu_share_solo": round((cpu1 - cpu0) / (t1 - t0), 2),
        "server_cpu_share_beside": round((cpu3 - cpu2) / (t3 - t2), 2),
    }


def _measure(targets: list[Target], lookers: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """`args.rounds` rounds at `lookers` lookers, each round every target in turn."""
    ctx = multiprocessing.get_context("spawn")
    quit, errors = ctx.Event(), ctx.Value("q", 0)
    processes = []
    for target in targets:
        target.go, target.count, target.rounds = ctx.Event(), ctx.Value("q", 0), []
        processes += [
            ctx.Process(
                target=_looker,
                args=(
                    target.url,
                    target.ns,
                    args.looker_nice,
                    target.go,
                    quit,
                    target.count,
                    errors,
                ),
            )
            for _ in range(lookers)
        ]
    for process in processes:
        process.start()
    try:
        for target in targets:
            target.writer = Writer(target.url, target.ns)
            target.go.set()  # connect and warm every looker once
        time.sleep(1.5)
        for target in targets:
            target.go.clear()
        for _ in range(args.rounds):
            for target in targets:
                target.rounds.append(_round(target, args.seconds))
    finally:
        quit.set()
        for target in targets:
            target.go.set()
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        for target in targets:
            if target.writer is not None:
                target.writer.client.close()
    return [_summary(target, lookers, args, errors.value) for target in targets]


def _summary(target: Target, lookers: int, args: argparse.Namespace, errors: int) -> dict[str, Any]:
    rounds = target.rounds

    def median(name: str) -> float:
        return statistics.median(r[name] for r in rounds if r[name] is not None)

    return {
        "server": target.label,
        "lookers": lookers,
        "looker_nice": args.looker_nice,
        "solo_keys_per_s": median("solo_keys_per_s"),
        "beside_keys_per_s": median("beside_keys_per_s"),
        "ratio": median("ratio"),
        "lookups_per_s_beside": median("lookups_per_s_beside"),
        "server_cpu_share_solo": median("server_cpu_share_solo"),
        "server_cpu_share_beside": median("server_cpu_share_beside"),
        "looker_errors": errors,
        "goal": 0.3,
        "met": median("ratio") >= 0.3,
        "rounds": rounds,
    }


def _prepare(url: str) -> str:
    """Register the namespace and store the lookers' 1,000 keys; the namespace id."""
    client = open_metadata_client(url)
    manifest = bench_manifest("bench-starvation")
    ns = namespace_id(manifest)
    client.register_namespace(ns, manifest)
    client.register_rank(ns, bench_rank_file(ns))
    _save(client, ns, "stored", 0, 1000)
    client.close()
    return ns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookers", default="2,4", help="looker counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=4.0, help="each timed window")
    parser.add_argument("--rounds", type=int, default=3, help="solo/beside pairs per count")
    parser.add_argument("--looker-nice", type=int, default=0, help="lookers' nice increment")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="also measure a serve run from this source tree (a git worktree of another "
        "revision), its rounds interleaved with this tree's: an A/B in one run",
    )
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    trees = [("this tree", None)]
    if args.baseline_tree is not None:
        trees.append((f"baseline {args.baseline_tree}", args.baseline_tree.resolve()))
    with tempfile.TemporaryDirectory(prefix="bench-starvation-") as tmp:
        servers = []
        try:
            targets = []
            for number, (label, tree) in enumerate(trees):
                process, url = _serve(Path(tmp) / f"serve-{number}", tree)
                servers.append(process)
                targets.append(Target(label, url, _prepare(url), process.pid))
            results = [
                row for n in args.lookers.split(",") for row in _measure(targets, int(n), args)
            ]
        finally:
            for process in servers:
                process.terminate()
                process.wait(10)
    document = {
        "benchmark": "serve-starvation",
        "seconds": args.seconds,
        "rounds": args.rounds,
        "batch_keys": BATCH,
        "lookup_keys": 64,
        "results": results,
    }
    text = json.dumps(document, indent=2)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
