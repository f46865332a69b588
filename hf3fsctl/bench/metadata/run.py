"""`run(settings)`: every mode's cells, in one work directory, as one JSON document.

Contract: the work directory is removed afterwards unless `keep`; an optional mode whose
program is missing here is skipped and named in `skipped_modes` (with why); a mode that
started and then failed raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.bench.metadata.cells import cutoff_s, measure_cell, measure_cells
from hf3fsctl.bench.metadata.figures import (
    IN_TREE_MODE,
    add_memory_ratios,
    add_ratios,
    eviction_figures,
    full_store_figures,
    in_tree_bytes_per_key,
    memory_figures,
)
from hf3fsctl.bench.metadata.processes import (
    Server,
    cpu_seconds,
    probe_embedded,
    rss_bytes,
    serving,
)
from hf3fsctl.bench.metadata.settings import (
    BATCH,
    CLUSTER_MASTERS,
    CLUSTER_MODES,
    FILL_CHUNK,
    FULL_NAMESPACES,
    FULL_OPS,
    LOOKUP_KEYS,
    OPS,
    OPTIONAL_MODES,
    PAGE_BYTES,
    URL_FILL_CHUNK,
    MetadataSettings,
)
from hf3fsctl.bench.metadata.stores import (
    StoreSpec,
    bench_manifest,
    bench_rank_file,
    copy_store,
    create_store,
    fill_spec,
    fill_url,
    key,
    namespace_id,
    register_main,
    store_keys,
)
from hf3fsctl.errors import MetadataUnavailable


def _stores_needed(ops: Sequence[str]) -> list[str]:
    names = ["main"]
    names += [op for op in FULL_OPS if op in ops]
    return names


def _ordered(ops: Sequence[str]) -> list[str]:
    """`ping` first (the ceiling), then the rest in the canonical order."""
    wanted = {"ping", *ops}
    return [op for op in OPS if op in wanted]


def run(
    settings: MetadataSettings | None = None, progress: report.Progress | None = None
) -> dict[str, Any]:
    """Run every mode's cells; return the JSON document.

    Raises:
        InvalidRequest: settings that cannot run.
        MetadataUnavailable: a server would not start, or a client call failed.
    """
    settings = settings or MetadataSettings()
    settings.check()
    say = progress or (lambda message: None)
    ops = _ordered(settings.ops)
    run_id = secrets.token_hex(4)
    tag = f"bench-{run_id}"
    workdir = report.work_directory(settings.directory, "metadata")
    started = time.monotonic()
    modes: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    skipped_modes: dict[str, str] = {}
    try:
        if settings.url is not None:
            skipped = [op for op in ops if op in FULL_OPS]
            mode_doc, mode_rows = _run_url(
                settings, [o for o in ops if o not in FULL_OPS], tag, run_id, say
            )
            modes.append(mode_doc)
            rows += mode_rows
        else:
            pristine: dict[str, tuple[StoreSpec, Path]] = {}
            fill_started = time.monotonic()
            sqlite_modes = [m for m in settings.modes if m not in OPTIONAL_MODES]
            for name in _stores_needed(ops) if sqlite_modes else []:
                say(f"filling store {name}: {settings.entries:,} entries")
                pristine[name] = create_store(
                    workdir / "pristine", name, settings.entries, f"{tag}-stored", run_id
                )
            fill_s = time.monotonic() - fill_started
            fill = {
                "entries_per_store": settings.entries,
                "stores": list(pristine),
                "seconds": fill_s,
                "entries_per_s": settings.entries * len(pristine) / fill_s if fill_s else None,
                "chunk": FILL_CHUNK,
            }
            for mode in settings.modes:
                if mode in OPTIONAL_MODES:
                    try:
                        mode_doc, mode_rows = _run_peer(
                            mode, settings, ops, workdir / mode, tag, run_id, say
                        )
                    except MetadataUnavailable as exc:
                        if exc.hint is None:  # it started and then failed: a real error
                            raise
                        say(f"mode {mode} skipped: {exc} ({exc.hint})")
                        skipped_modes[mode] = str(exc)
                        continue
                else:
                    mode_doc, mode_rows = _run_mode(
                        mode, settings, ops, pristine, workdir / mode, tag, say
                    )
                    mode_doc["fill"] = fill
                modes.append(mode_doc)
                rows += mode_rows
    finally:
        if not settings.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    add_ratios(rows)
    add_memory_ratios(modes)
    measured_in_tree = any(r["mode"] == IN_TREE_MODE for r in rows)
    return {
        "benchmark": "metadata",
        "schema": report.SCHEMA,
        "machine": report.machine(),
        "settings": {
            **{
                k: v
                for k, v in dataclasses.asdict(settings).items()
                if k not in ("token", "directory")
            },
            "directory": str(workdir.parent),
            "ops": ops,
            "clients_are": "processes (fork), each with its own client",
            "cutoff_s": cutoff_s(settings.seconds),
            "batch_keys": BATCH,
            "lookup_keys": LOOKUP_KEYS,
            "page_bytes": PAGE_BYTES,
            "full_store": f"capacity = entries pages, filled; watermarks high 1.0, low "
            f"1 - 0.5/entries (each allocate evicts what it needs); "
            f"{FULL_NAMESPACES} namespaces for full_8ns, each call the next one",
        },
        "ceiling": {
            "name": "ping",
            "description": "a 1-key lookup: the cheapest hot call over the same path "
            "(embedded store, or HTTP to the server), with the same clients, in this run",
            "ratio": "ratio_to_ping = ops/s ÷ ping ops/s of the same mode and client count",
        },
        "reference": {
            "name": "in-tree vLLM hf3fs metadata server",
            "measured": "in this run (mode in-tree), for the cells that have an in-tree twin; "
            "every other cell has no in-tree figure (never one recorded elsewhere)",
            "measured_in_this_run": measured_in_tree,
            "rss_bytes_per_key": in_tree_bytes_per_key(modes),
        },
        "modes": modes,
        "rows": rows,
        "full_store": full_store_figures(rows),
        "skipped": skipped,
        "skipped_modes": skipped_modes,
        "seconds": time.monotonic() - started,
    }


def _run_mode(
    mode: str,
    settings: MetadataSettings,
    ops: list[str],
    pristine: dict[str, tuple[StoreSpec, Path]],
    directory: Path,
    tag: str,
    say: report.Progress,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    label = mode if mode == "embedded" or settings.workers == 1 else f"serve w{settings.workers}"
    say(f"mode {label}")
    rows: list[dict[str, Any]] = []
    main_ops = [op for op in ops if op not in FULL_OPS]
    spec, db = copy_store(*pristine["main"], directory / "main")
    if mode == "embedded":
        probe = probe_embedded(spec)
        memory = memory_figures(settings.entries, probe["before"], probe["after"], db)
        memory["process"] = "a fresh embedded client process, before/after its first lookup"
        rows += measure_cells(label, spec, main_ops, settings, tag, say)
        url = spec.url
    else:
        with serving(directory, spec, db, settings.workers) as server:
            served = server.store_spec()
            before = server.rss()
            probe_client = served.client()
            try:
                probe_client.lookup(served.namespaces[0], [key(served.stored_tag, 0)])
            finally:
                probe_client.close()
            memory = memory_figures(settings.entries, before, server.rss(), db)
            memory["process"] = (
                f"the hf3fsctl serve process tree ({settings.workers} worker"
                f"{'s' if settings.workers > 1 else ''}), before/after its first lookup"
            )
            rows += measure_cells(label, served, main_ops, settings, tag, say, server.cpu)
            memory["rss_end_bytes"] = server.rss()
            url = server.url
    # Every full-store cell starts from its own copy of the same full store, so the
    # first allocate of each cell meets the store exactly at its capacity.
    for name in FULL_OPS:
        if name not in pristine or name not in ops:
            continue
        for clients in settings.clients:
            cell_dir = directory / f"{name}-x{clients}"
            full_spec, full_db = copy_store(*pristine[name], cell_dir)
            if mode == "embedded":
                row = measure_cell(label, full_spec, name, clients, settings, tag, say)
                keys_after = store_keys(full_spec)
            else:
                with serving(cell_dir, full_spec, full_db, settings.workers) as server:
                    row = measure_cell(
                        label, server.store_spec(), name, clients, settings, tag, say, server.cpu
                    )
                    # A call cut off is still running in the server: kill it (its
                    # transaction rolls back) rather than wait for it.
                    server.stop(timeout_s=0.0 if row["truncated"] else 15.0)
                keys_after = store_keys(full_spec)  # from the file, the server gone
            row.update(eviction_figures(row, settings.entries, keys_after))
            say(
                f"  {'':<9} {'':<13} {'':<4} evicted {row['evicted_keys']:,} keys, "
                f"{report.fmt(row['evicted_per_call'], 1)} per call "
                f"(the store held {settings.entries:,}, then {keys_after:,})"
            )
            rows.append(row)
            if not settings.keep:
                shutil.rmtree(cell_dir, ignore_errors=True)
    say(f"  {label}: {memory['bytes_per_entry']:.0f} bytes/entry of RSS")
    return {"mode": label, "url": url, "memory": memory}, rows


IN_TREE_SPARE_PAGES = 1 << 20  # pages beyond the filled ones, for the alloc_commit cells


def _run_peer(
    mode: str,
    settings: MetadataSettings,
    ops: list[str],
    directory: Path,
    tag: str,
    run_id: str,
    say: report.Progress,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One of the `OPTIONAL_MODES`, on a store of its own (no full-store cells).

    `in-tree`: vLLM's in-tree server; `redis`: clients straight to a private Redis;
    `serve-redis`: two `hf3fsctl serve` replicas on that Redis, clients split between them;
    `redis-cluster`, `redis-sharded`: clients straight to a private Redis Cluster
    (`_run_cluster`).

    Raises:
        MetadataUnavailable: with a hint when the program is missing here (the mode is
            skipped), without one when it started and failed.
    """
    from hf3fsctl.bench.peers.in_tree import InTreeServer
    from hf3fsctl.bench.peers.redis_server import RedisServer

    say(f"mode {mode}")
    directory.mkdir(parents=True, exist_ok=True)
    main_ops = [op for op in ops if op not in FULL_OPS]
    stored_tag = f"{tag}-stored"
    fill: dict[str, Any] = {"entries_per_store": settings.entries, "stores": ["main"]}
    note = "its own store: no full-store cells (they need capacity, files and eviction)"
    if mode == "in-tree":
        with InTreeServer(directory, settings.entries + IN_TREE_SPARE_PAGES) as server:
            assert server.process is not None
            spec = StoreSpec("main", server.url, None, ("in-tree",), stored_tag, settings.entries)
            before = rss_bytes(server.process.pid)
            fill["seconds"] = fill_spec(spec, FILL_CHUNK)
            memory = memory_figures(settings.entries, before, rss_bytes(server.process.pid), None)
            memory["process"] = "vLLM's in-tree metadata server, before/after the fill"
            pid = server.process.pid
            rows = measure_cells(mode, spec, main_ops, settings, tag, say, lambda: cpu_seconds(pid))
        url = server.url
    elif mode in CLUSTER_MODES:
        rows, url, memory, fill = _run_cluster(
            mode, settings, main_ops, directory, tag, run_id, say
        )
    else:
        manifest = bench_manifest(f"hf3fsctl-bench/{run_id}/{mode}")
        namespace = namespace_id(manifest)
        with RedisServer(directory / "redis") as redis:
            assert redis.process is not None
            spec = StoreSpec("main", redis.url(), None, (namespace,), stored_tag, settings.entries)
            register_main(spec, manifest)
            before = rss_bytes(redis.process.pid)
            fill["seconds"] = fill_spec(spec, FILL_CHUNK)
            memory = memory_figures(settings.entries, before, rss_bytes(redis.process.pid), None)
            memory["process"] = "redis-server, before/after the fill"
            redis_pid = redis.process.pid
            if mode == "redis":
                rows = measure_cells(
                    mode, spec, main_ops, settings, tag, say, lambda: cpu_seconds(redis_pid)
                )
                url = redis.url()
            else:
                rows, url = _cells_on_replicas(
                    mode, spec, redis.url(), directory, settings, main_ops, tag, say, redis_pid
                )
    fill["entries_per_s"] = settings.entries / fill["seconds"] if fill["seconds"] else None
    return {"mode": mode, "url": url, "memory": memory, "fill": fill, "note": note}, rows


def _run_cluster(
    mode: str,
    settings: MetadataSettings,
    ops: list[str],
    directory: Path,
    tag: str,
    run_id: str,
    say: report.Progress,
) -> tuple[list[dict[str, Any]], str, dict[str, Any], dict[str, Any]]:
    """The cells on a private Redis Cluster of `CLUSTER_MASTERS` masters: the one-slot
    store (`redis-cluster`) or the store split into `settings.shards` shards
    (`redis-sharded`). The server CPU of a call is every master's; each row adds each
    master's CPU seconds in its window and the busiest master's share of them."""
    from hf3fsctl.bench.peers.redis_cluster import MasterCpu, RedisCluster

    manifest = bench_manifest(f"hf3fsctl-bench/{run_id}/{mode}")
    namespace = namespace_id(manifest)
    shards = settings.shards if mode == "redis-sharded" else 1
    with RedisCluster(directory / "cluster", CLUSTER_MASTERS) as cluster:
        url = cluster.url(shards)
        spec = StoreSpec("main", url, None, (namespace,), f"{tag}-stored", settings.entries)
        register_main(spec, manifest)
        before = sum(cluster.rss_by_master())
        fill: dict[str, Any] = {"entries_per_store": settings.entries, "stores": ["main"]}
        fill["seconds"] = fill_spec(spec, FILL_CHUNK)
        memory = memory_figures(settings.entries, before, sum(cluster.rss_by_master()), None)
        memory["process"] = (
            f"the {CLUSTER_MASTERS} masters' redis-server RSS, before/after the fill"
        )
        memory["keys_by_master"] = cluster.keys_by_master()
        memory["used_memory_bytes"] = cluster.used_memory()
        cpu = MasterCpu(cluster)
        rows = []
        for op in ops:
            for clients in settings.clients:
                row = measure_cell(mode, spec, op, clients, settings, tag, say, cpu)
                row.update(cpu.window(), masters=CLUSTER_MASTERS, shards=shards)
                say(
                    f"  {'':<9} {'':<13} {'':<4} busiest master "
                    f"{report.fmt(row['busiest_master_cpu_share'])} of the masters' CPU"
                )
                rows.append(row)
    return rows, url, memory, fill


def _cells_on_replicas(
    mode: str,
    spec: StoreSpec,
    redis_url: str,
    directory: Path,
    settings: MetadataSettings,
    ops: list[str],
    tag: str,
    say: report.Progress,
    redis_pid: int,
) -> tuple[list[dict[str, Any]], str]:
    """The cells through two `serve` replicas of one Redis store (one shared token);
    the server CPU is both replicas' and Redis's."""
    first = Server(directory, spec, None, settings.workers, redis_url, name="replica-a")
    second = Server(directory, spec, None, settings.workers, redis_url, name="replica-b")
    second.token = first.token
    try:
        first.start()
        second.start()
        served = dataclasses.replace(first.store_spec(), replicas=(first.url, second.url))

        def server_cpu() -> float:
            return first.cpu() + second.cpu() + cpu_seconds(redis_pid)

        rows = measure_cells(mode, served, ops, settings, tag, say, server_cpu)
        return rows, f"{first.url},{second.url}"
    finally:
        first.stop()
        second.stop()


def _run_url(
    settings: MetadataSettings, ops: list[str], tag: str, run_id: str, say: report.Progress
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    assert settings.url is not None
    manifest = bench_manifest(f"hf3fsctl-bench/{run_id}/main")
    ns = namespace_id(manifest)
    spec = StoreSpec(
        name="main",
        url=settings.url,
        token=settings.token,
        namespaces=(ns,),
        stored_tag=f"{tag}-stored",
        entries=settings.entries,
    )
    client = spec.client()
    try:
        client.health()
        client.register_namespace(ns, manifest)
        client.register_rank(ns, bench_rank_file(ns))
        say(f"filling namespace {ns} on {settings.url}: {settings.entries:,} entries")
        began = time.monotonic()
        fill_url(client, spec)
        fill_s = time.monotonic() - began
        rows = measure_cells("url", spec, ops, settings, tag, say)
    finally:
        if not settings.keep:
            with contextlib.suppress(Exception):
                client.drop_namespaces([ns])
        client.close()
    mode = {
        "mode": "url",
        "url": settings.url,
        "namespace": ns,
        "fill": {
            "entries_per_store": settings.entries,
            "stores": ["main"],
            "seconds": fill_s,
            "entries_per_s": settings.entries / fill_s if fill_s else None,
            "chunk": URL_FILL_CHUNK,
        },
        "memory": None,
        "note": "a running server: its memory is not measured, and the full-store cells "
        "need a store of their own (run without --url)",
    }
    return mode, rows
