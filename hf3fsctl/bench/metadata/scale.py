"""`bench metadata --entries N[,N…]`: each backend's store FULL at N entries, measured.

For every N and backend — `embedded` (`sqlite:///`), `serve` (a real `hf3fsctl serve`
on that SQLite file), `redis` (clients straight to a private `redis-server`), when asked
`redis-cluster` and `redis-sharded` (a private 3-master Redis Cluster each: the one-slot
store, or `shards` shards; `scale_modes.measure_redis`) and, as
the reference, `in-tree` (vLLM's in-tree server, which has no capacity: its cells
allocate on a store with room) — the store is filled to N committed entries with
capacity N pages (watermarks high 1.0, low half a page below: every allocate evicts what
it needs), in big batches through the store's own API (8,192 keys per allocate and
commit; the SQLite fill runs in a child beside the Redis fill, its keys globally sorted
on a bulk connection, the Redis fill from 2 processes: `stores.py`). Then two cells of
`clients` client processes for `seconds` each:

- `lookup`: a 1,000-key chain starting anywhere in the store (`lookup_spread`), so the
  whole index is read, not one hot chain;
- `save`: allocate 64 new keys, then commit them (`full_1ns`): every allocate evicts.

JSON document (`benchmark: "metadata-scale"`):

- `settings`: `entries` (the N list), `modes`, `clients`, `seconds`, `workers`;
- `results[]`, one per (mode, N): `mode`, `entries`, `fill` (`seconds`,
  `entries_per_s`), `lookup` and `save` (the cells: `ops`, `keys_per_s`,
  `committed_keys_per_s`, `p50_ms`/`p99_ms`/`p999_ms`, `no_space_keys`,
  `server_cpu_us_per_call`, `client_cpu_us_per_call`, …; `save` adds `evicted_keys`
  and `evicted_per_call`; `redis` adds `redis_script_usec_per_call` and
  `redis_scripts_per_call`, from `INFO commandstats`: Redis's own wall-clock time in
  its scripts, above its process CPU when the cores are contended; the cluster modes add
  `master_cpu_s` and `busiest_master_cpu_share`, and `masters`, `shards`,
  `capacity_pages` and `memory.keys_by_master` to the row), `lookups_per_s`, `saved_keys_per_s`,
  `cpu_us_per_lookup` / `cpu_us_per_save` (the server's CPU per call; embedded: the
  client processes', where the store runs) with `cpu_of`, `memory` (`bytes_per_entry`
  and how: `serve` — the server's RSS after its cells less a server's on an empty
  store, ÷ N; `embedded` — a fresh process's RSS before/after its first lookup;
  `redis` — `memory_usage_bytes_per_entry` (`MEMORY USAGE` over every key or a
  sample, by key pattern) and `used_memory_bytes_per_entry` (`INFO used_memory`
  after the fill less before, ÷ N); `in-tree` — its RSS before/after the fill), and
  `in_tree` (ratios to the in-tree cells of the same N: `lookups`, `saved_keys`
  = ours ÷ its rate; `cpu_lookup`, `cpu_save` = its CPU per call ÷ ours; None when it
  did not run);
- `rate_ratios[]`, one per mode: `smallest`, `largest` (N), `saved_keys_per_s_ratio`
  and `lookups_per_s_ratio` (smallest N's rate ÷ largest N's), `goal` (1.5), `met`,
  and `marginal_bytes_per_entry`: what the process holds (`memory.held_bytes`: serve
  RSS after the cells, Redis used_memory after the fill, in-tree / embedded RSS after
  loading) at the largest N less at the smallest, ÷ the entries between — the
  per-entry cost without the fixed, bounded caches a single N's figure includes;
- `skipped_modes`: mode → why (its program is missing here);
- `failed`: `MODE@N` → the error of a mode that failed at that N (the run goes on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.bench.metadata.children import start_child
from hf3fsctl.bench.metadata.scale_modes import (
    empty_serve_rss,
    measure_embedded,
    measure_in_tree,
    measure_redis,
    measure_serve,
    timed_create,
)
from hf3fsctl.bench.metadata.settings import (
    BATCH,
    CLUSTER_MASTERS,
    CLUSTER_MODES,
    FILL_CHUNK,
    FULL_GOAL,
    LOOKUP_KEYS,
    ScaleSettings,
)
from hf3fsctl.errors import Hf3fsctlError, MetadataUnavailable


def run_scale(
    settings: ScaleSettings | None = None, progress: report.Progress | None = None
) -> dict[str, Any]:
    """Every mode at every N; return the JSON document (module docstring).

    Raises:
        InvalidRequest: settings that cannot run.
        MetadataUnavailable: a server would not start, or a client call failed.
    """
    settings = settings or ScaleSettings()
    settings.check()
    say = progress or (lambda message: None)
    run_id = secrets.token_hex(4)
    tag = f"bench-{run_id}"
    workdir = report.work_directory(settings.directory, "scale")
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    modes = list(settings.modes)
    try:
        baseline = None
        if "serve" in modes:
            baseline = empty_serve_rss(workdir / "empty", run_id, settings.workers)
        for entries in sorted(settings.entries):
            results += _one_size(
                entries, modes, settings, workdir / f"n{entries}", tag, run_id, baseline,
                skipped, failed, say,
            )  # fmt: skip
            modes = [m for m in modes if m not in skipped]
    finally:
        if not settings.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    _add_in_tree_ratios(results)
    return {
        "benchmark": "metadata-scale",
        "schema": report.SCHEMA,
        "machine": report.machine(),
        "settings": {
            **{
                k: v
                for k, v in dataclasses.asdict(settings).items()
                if k not in ("directory", "entries")
            },
            "entries": sorted(settings.entries),
            "directory": str(workdir.parent),
            "full_store": "capacity = N pages, filled with N committed keys; watermarks "
            "high 1.0, low 1 - 0.5/N: every allocate evicts what it needs",
            "fill_chunk": FILL_CHUNK,
            "lookup_keys": LOOKUP_KEYS,
            "save_keys": BATCH,
            "serve_baseline_rss_bytes": baseline,
        },
        "results": results,
        "rate_ratios": rate_ratios(results),
        "skipped_modes": skipped,
        "failed": failed,
        "seconds": time.monotonic() - started,
    }


def _one_size(
    entries: int,
    modes: list[str],
    settings: ScaleSettings,
    directory: Path,
    tag: str,
    run_id: str,
    baseline: int | None,
    skipped: dict[str, str],
    failed: dict[str, str],
    say: report.Progress,
) -> list[dict[str, Any]]:
    """Every mode at one N (the SQLite fill in a child beside the Redis fill)."""
    from hf3fsctl.bench.peers.redis_server import RedisServer

    stored = f"{tag}-stored"
    out: list[dict[str, Any]] = []
    child = None
    if "embedded" in modes or "serve" in modes:
        say(f"N = {entries:,}: filling the SQLite store (full)")
        child = start_child(timed_create, directory / "pristine", entries, stored, run_id)
    redis = None
    if "redis" in modes:
        try:
            redis = RedisServer(directory / "redis").start()
        except MetadataUnavailable as exc:
            if exc.hint is None:
                raise
            skipped["redis"] = str(exc)
    try:
        if redis is not None:
            say(f"N = {entries:,}: filling Redis (full)")
            with _failure_noted("redis", entries, failed, say):
                out.append(measure_redis(redis, entries, settings, directory, stored, run_id, say))
        for mode in [m for m in modes if m in CLUSTER_MODES]:
            out += _on_cluster(
                mode, entries, settings, directory, stored, run_id, skipped, failed, say
            )
        if child is not None:
            spec, db, fill_s = child.result()
            fill = {"seconds": fill_s, "entries_per_s": entries / fill_s if fill_s else None}
            if "embedded" in modes:
                with _failure_noted("embedded", entries, failed, say):
                    out.append(
                        measure_embedded(spec, db, entries, fill, settings, directory, tag, say)
                    )
            if "serve" in modes:
                with _failure_noted("serve", entries, failed, say):
                    out.append(measure_serve(spec, db, entries, fill, settings, baseline, tag, say))
    finally:
        if redis is not None:
            redis.stop()
    if "in-tree" in modes:
        try:
            out.append(measure_in_tree(entries, settings, directory / "in-tree", stored, tag, say))
        except MetadataUnavailable as exc:
            if exc.hint is None:
                raise
            skipped["in-tree"] = str(exc)
    return out


def _on_cluster(
    mode: str,
    entries: int,
    settings: ScaleSettings,
    directory: Path,
    stored: str,
    run_id: str,
    skipped: dict[str, str],
    failed: dict[str, str],
    say: report.Progress,
) -> list[dict[str, Any]]:
    """`redis-cluster` or `redis-sharded` at one N, on a private Redis Cluster of its own."""
    from hf3fsctl.bench.peers.redis_cluster import RedisCluster

    try:
        cluster = RedisCluster(directory / mode, CLUSTER_MASTERS).start()
    except MetadataUnavailable as exc:
        if exc.hint is None:
            raise
        skipped[mode] = str(exc)
        return []
    try:
        say(f"N = {entries:,}: filling {mode} (full)")
        with _failure_noted(mode, entries, failed, say):
            return [
                measure_redis(
                    cluster, entries, settings, directory / mode, stored, run_id, say, mode
                )
            ]
        return []
    finally:
        cluster.stop()


@contextlib.contextmanager
def _failure_noted(
    mode: str, entries: int, failed: dict[str, str], say: report.Progress
) -> Iterator[None]:
    """A mode that fails at one N is noted in `failed` and the run goes on (the stores
    change under the benchmark while their authors measure them)."""
    try:
        yield
    except (MetadataUnavailable, Hf3fsctlError) as exc:
        failed[f"{mode}@{entries}"] = str(exc)[-2000:]
        say(f"  {mode} at N = {entries:,} failed: {str(exc)[-300:]}")


def _add_in_tree_ratios(results: list[dict[str, Any]]) -> None:
    reference = {r["entries"]: r for r in results if r["mode"] == "in-tree"}
    for row in results:
        bar = reference.get(row["entries"])
        if row["mode"] == "in-tree" or bar is None:
            row["in_tree"] = None
            continue
        row["in_tree"] = {
            "lookups": report.ratio(row["lookups_per_s"], bar["lookups_per_s"]),
            "saved_keys": report.ratio(row["saved_keys_per_s"], bar["saved_keys_per_s"]),
            **{
                f"cpu_{name}": report.ratio(
                    bar.get(f"cpu_us_per_{name}"), row.get(f"cpu_us_per_{name}")
                )
                for name in ("lookup", "locate", "save")
                if f"cpu_us_per_{name}" in row
            },
        }


def rate_ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the smallest N's rates ÷ the largest N's (the goal: within 1.5×)."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        rows = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["entries"])
        if len(rows) < 2:
            continue
        small, large = rows[0], rows[-1]
        saved = report.ratio(small["saved_keys_per_s"], large["saved_keys_per_s"])
        held = [r["memory"].get("held_bytes") for r in (small, large)]
        marginal = (
            (held[1] - held[0]) / (large["entries"] - small["entries"])
            if None not in held
            else None
        )
        out.append(
            {
                "mode": mode,
                "smallest": small["entries"],
                "largest": large["entries"],
                "saved_keys_per_s_ratio": saved,
                "lookups_per_s_ratio": report.ratio(small["lookups_per_s"], large["lookups_per_s"]),
                "goal": FULL_GOAL,
                "met": None if saved is None else saved <= FULL_GOAL,
                "marginal_bytes_per_entry": marginal,
            }
        )
    return out
