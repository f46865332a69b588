"""The measurements of `bench metadata --entries` per backend (`scale.py` runs them).

Each `measure_*` takes a store filled FULL at N entries and returns that backend's row of
the scale document (`scale.py`'s docstring lists its keys): the cells (`measure_cells`),
the server's or the clients' CPU per call, and the memory per entry measured the way that
backend allows.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.bench.metadata.cells import measure
from hf3fsctl.bench.metadata.figures import eviction_figures
from hf3fsctl.bench.metadata.processes import (
    cpu_seconds,
    probe_embedded,
    rss_bytes,
    serving,
)
from hf3fsctl.bench.metadata.settings import (
    BATCH,
    FILL_CHUNK,
    LOOKUP_KEYS,
    PAGE_BYTES,
    ScaleSettings,
)
from hf3fsctl.bench.metadata.stores import (
    StoreSpec,
    bench_manifest,
    bench_rank_file,
    copy_store,
    create_store,
    fill_spec,
    full_watermarks,
    key,
    namespace_id,
    store_keys,
)

IN_TREE_SPARE_PAGES = 1 << 16  # pages beyond the filled ones, for its save cell

STORE_LEASE_S = 30.0  # the stores' default lease_s: how long a located page stays unevictable

REDIS_FILL_WORKERS = 2  # client processes filling Redis at once (its client side is Python)


def timed_create(directory: Path, entries: int, tag: str, run_id: str) -> Any:
    began = time.monotonic()
    spec, db = create_store(directory, "full_1ns", entries, tag, run_id, fork=False)
    return spec, db, time.monotonic() - began


def empty_serve_rss(directory: Path, run_id: str, workers: int) -> int:
    """RSS of a `serve` on an empty store after the same kinds of calls (the baseline)."""
    spec, db = create_store(directory, "main", 0, "empty", run_id)
    with serving(directory, spec, db, workers) as server:
        client = server.store_spec().client()
        try:
            ns = spec.namespaces[0]
            client.lookup(ns, [key("empty", i) for i in range(LOOKUP_KEYS)])
            from hf3fsctl.meta.models import CommitItem

            granted = client.allocate(ns, 0, [key("empty", i) for i in range(BATCH)]).allocated
            client.commit(
                ns,
                0,
                [
                    CommitItem(key=a.key, page=a.page, checksum="xxh3:0", size=PAGE_BYTES)
                    for a in granted
                ],
            )
        finally:
            client.close()
        return server.rss()


def measure_cells(
    mode: str,
    spec: StoreSpec,
    entries: int,
    settings: ScaleSettings,
    tag: str,
    say: report.Progress,
    server_cpu: Any = None,
    keys_after: Any = None,
) -> dict[str, Any]:
    """`settings.cells` in order (the lookups first: saves evict the oldest keys).

    A save after a locate cell waits for the locates' read leases to lapse first: a
    fast backend's locates lease much of the store in a few seconds, and a leased page
    may not be evicted, so every allocate of the save would refuse its keys.
    """
    own = server_cpu is not None
    figures: dict[str, Any] = {
        "mode": mode,
        "entries": entries,
        "cpu_of": "server process" if own else "client processes (the store runs there)",
    }
    leased = False
    for name, op, keys in settings.cells:
        if mode == "in-tree" and op == "full_1ns":
            op = "alloc_commit"  # it has no capacity: it never evicts
        if op == "full_1ns" and leased:
            say(f"  {mode:<9} waiting {STORE_LEASE_S + 1:.0f} s for the locates' leases to lapse")
            time.sleep(STORE_LEASE_S + 1)
        leased = leased or (op == "locate" and mode != "in-tree")
        cell = measure(spec, op, settings.clients, settings.seconds, tag, server_cpu, keys)
        if name == "save" and keys_after is not None:
            cell.update(eviction_figures(cell, entries, keys_after()))
        figures[name] = cell
        figures[f"cpu_us_per_{name}"] = cell[
            "server_cpu_us_per_call" if own else "client_cpu_us_per_call"
        ]
        say(
            f"  {mode:<9} N {entries:>11,}  {name:<7} {report.fmt(cell['ops'], 1)} calls/s "
            f"of {keys:,} keys, {report.fmt(figures[f'cpu_us_per_{name}'], 0)} µs CPU/call"
            + (
                f", {report.fmt(cell['committed_keys_per_s'], 0)} keys saved/s"
                if name == "save"
                else ""
            )
        )
    figures["lookups_per_s"] = figures["lookup"]["ops"] if "lookup" in figures else None
    figures["saved_keys_per_s"] = (
        figures["save"]["committed_keys_per_s"] if "save" in figures else None
    )
    return figures


def measure_embedded(
    spec: StoreSpec,
    db: Path,
    entries: int,
    fill: dict[str, Any],
    settings: ScaleSettings,
    directory: Path,
    tag: str,
    say: report.Progress,
) -> dict[str, Any]:
    copy, copy_db = copy_store(spec, db, directory / "embedded")
    probe = probe_embedded(copy)
    figures = measure_cells(
        "embedded", copy, entries, settings, tag, say, keys_after=lambda: store_keys(copy)
    )
    figures["fill"] = fill
    figures["memory"] = {
        "bytes_per_entry": max(0, probe["after"] - probe["before"]) / entries,
        "method": "a fresh embedded client process's RSS before/after its first lookup, ÷ N",
        "rss_before_bytes": probe["before"],
        "rss_after_bytes": probe["after"],
        "held_bytes": probe["after"],
        "db_bytes_per_entry": copy_db.stat().st_size / entries,
    }
    if not settings.keep:
        shutil.rmtree(directory / "embedded", ignore_errors=True)
    return figures


def measure_serve(
    spec: StoreSpec,
    db: Path,
    entries: int,
    fill: dict[str, Any],
    settings: ScaleSettings,
    baseline: int | None,
    tag: str,
    say: report.Progress,
) -> dict[str, Any]:
    directory = db.parent
    with serving(directory, spec, db, settings.workers) as server:
        started_rss = server.rss()
        figures = measure_cells(
            "serve", server.store_spec(), entries, settings, tag, say, server_cpu=server.cpu
        )
        end_rss = server.rss()
    figures["save"].update(eviction_figures(figures["save"], entries, store_keys(spec)))
    figures["fill"] = fill
    reference = baseline if baseline is not None else started_rss
    figures["memory"] = {
        "bytes_per_entry": max(0, end_rss - reference) / entries,
        "method": "the serve process tree's RSS after its cells, less a serve's on an "
        "empty store after the same kinds of calls, ÷ N",
        "rss_empty_store_bytes": baseline,
        "rss_started_bytes": started_rss,
        "rss_end_bytes": end_rss,
        "held_bytes": end_rss,
        "db_bytes_per_entry": db.stat().st_size / entries,
    }
    return figures


def measure_redis(
    redis: Any,
    entries: int,
    settings: ScaleSettings,
    directory: Path,
    stored: str,
    run_id: str,
    say: report.Progress,
    mode: str = "redis",
) -> dict[str, Any]:
    """`redis`: a `RedisServer` (mode `redis`) or a `RedisCluster`: `redis-cluster`, the
    one-slot store on it, or `redis-sharded`, `settings.shards` shards. A cluster's CPU
    and memory are every master's; each cell adds each master's CPU in its window and the
    busiest master's share. A sharded store is full when its fullest shard is: capacity
    = shards × the most filled keys any shard holds (capacity is split evenly, keys by
    hash), so the fill evicts nothing and the other shards start a little short of full."""
    from hf3fsctl.bench.peers.redis_cluster import MasterCpu, RedisCluster
    from hf3fsctl.storage.layout import PageFile

    cluster = redis if isinstance(redis, RedisCluster) else None
    shards = settings.shards if mode == "redis-sharded" else 1
    manifest = bench_manifest(f"hf3fsctl-bench/{run_id}/{mode}")
    ns = namespace_id(manifest)
    root = directory / f"storage-{mode}"
    root.mkdir(parents=True, exist_ok=True)
    url = redis.url() if cluster is None else cluster.url(shards)
    spec = StoreSpec("full_1ns", url, None, (ns,), stored, entries, str(root))
    client = spec.client()
    try:
        pages = entries if shards == 1 else shards * _fullest_shard(client, stored, entries)
        client.set_capacity(pages * PAGE_BYTES)
        client.register_namespace(ns, manifest)
        client.register_rank(ns, bench_rank_file(ns))
    finally:
        client.close()
    high, low = full_watermarks(pages)
    spec = dataclasses.replace(spec, high=high, low=low)
    PageFile.create_growable(root, ns, 0, PAGE_BYTES).close()
    before = redis.used_memory()
    fill_s = fill_spec(spec, FILL_CHUNK, workers=REDIS_FILL_WORKERS)
    after = redis.used_memory()
    usage = redis.memory_usage()
    if cluster is None:
        assert redis.process is not None
        pid = redis.process.pid
        cpu: Any = lambda: cpu_seconds(pid)  # noqa: E731
        rss = rss_bytes(pid)
    else:
        cpu = MasterCpu(cluster)
        rss = sum(cluster.rss_by_master())
    accounted: list[tuple[int, int]] = []  # INFO commandstats as each window opens and ends

    def server_cpu() -> float:
        accounted.append(redis.script_usec())
        return float(cpu())

    figures = measure_cells(
        mode, spec, entries, settings, stored, say, server_cpu=server_cpu,
        keys_after=lambda: store_keys(spec),
    )  # fmt: skip
    for number, (cell, _, _) in enumerate(settings.cells):
        began, ended = accounted[2 * number : 2 * number + 2]
        calls = figures[cell]["calls"]
        figures[cell]["redis_scripts_per_call"] = (ended[0] - began[0]) / calls if calls else None
        figures[cell]["redis_script_usec_per_call"] = (
            (ended[1] - began[1]) / calls if calls else None
        )
        if cluster is not None:
            figures[cell].update(cpu.window(number))
    figures["fill"] = {"seconds": fill_s, "entries_per_s": entries / fill_s if fill_s else None}
    figures["memory"] = {
        "bytes_per_entry": usage["bytes"] / entries,
        "method": "MEMORY USAGE over every key (or a sample, scaled), after the fill, ÷ N"
        + ("" if cluster is None else " (summed over the masters)"),
        "memory_usage_bytes_per_entry": usage["bytes"] / entries,
        "used_memory_bytes_per_entry": max(0, after - before) / entries,
        "used_memory_before_bytes": before,
        "used_memory_after_bytes": after,
        "used_memory_end_bytes": redis.used_memory(),
        "held_bytes": after,
        "rss_bytes": rss,
        "keys": usage["keys"],
        "sampled_keys": usage["sampled_keys"],
        "by_pattern": usage["by_pattern"],
    }
    if cluster is not None:
        figures["memory"]["keys_by_master"] = cluster.keys_by_master()
        figures.update(masters=len(cluster.ports), shards=shards, capacity_pages=pages)
    return figures


def _fullest_shard(client: Any, stored: str, entries: int) -> int:
    """The most of the `entries` prefilled keys any shard of a sharded store will hold
    (the store's own `shard_of`)."""
    counts = Counter(client.shard_of(key(stored, i)) for i in range(entries))
    return max(counts.values())


def measure_in_tree(
    entries: int,
    settings: ScaleSettings,
    directory: Path,
    stored: str,
    tag: str,
    say: report.Progress,
) -> dict[str, Any]:
    from hf3fsctl.bench.peers.in_tree import InTreeServer

    directory.mkdir(parents=True, exist_ok=True)
    with InTreeServer(directory, entries + IN_TREE_SPARE_PAGES) as server:
        assert server.process is not None
        pid = server.process.pid
        spec = StoreSpec("main", server.url, None, ("in-tree",), stored, entries)
        say(f"N = {entries:,}: filling the in-tree server")
        before = rss_bytes(pid)
        fill_s = fill_spec(spec, FILL_CHUNK)
        after = rss_bytes(pid)
        figures = measure_cells(
            "in-tree", spec, entries, settings, tag, say,
            server_cpu=lambda: cpu_seconds(pid),
        )  # fmt: skip
    figures["fill"] = {"seconds": fill_s, "entries_per_s": entries / fill_s if fill_s else None}
    figures["memory"] = {
        "bytes_per_entry": max(0, after - before) / entries,
        "method": "its RSS before/after the fill, ÷ N",
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "held_bytes": after,
    }
    figures["note"] = "no capacity in the in-tree server: its saves allocate on a store with room"
    return figures
