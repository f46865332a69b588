"""`bench metadata --entries N[,N…]`: each backend's store FULL at N entries, measured.

For every N and backend — `embedded` (`sqlite:///`), `serve` (a real `hf3fsctl serve`
on that SQLite file), `redis` (clients straight to a private `redis-server`) and, as
the reference, `in-tree` (vLLM's in-tree server, which has no capacity: its cells
allocate on a store with room) — the store is filled to N committed entries with
capacity N pages (watermarks high 1.0, low half a page below: every allocate evicts what
it needs), in big batches through the store's own API (8,192 keys per allocate and
commit; the SQLite fill runs in a child beside the Redis fill). Then two cells of
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
  its scripts, above its process CPU when the cores are contended), `lookups_per_s`, `saved_keys_per_s`,
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
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.bench.metadata.cells import measure
from hf3fsctl.bench.metadata.children import start_child
from hf3fsctl.bench.metadata.figures import eviction_figures
from hf3fsctl.bench.metadata.processes import (
    cpu_seconds,
    probe_embedded,
    rss_bytes,
    serving,
)
from hf3fsctl.bench.metadata.settings import BATCH, FILL_CHUNK, FULL_GOAL, LOOKUP_KEYS, PAGE_BYTES
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
from hf3fsctl.errors import Hf3fsctlError, InvalidRequest, MetadataUnavailable

SCALE_MODES = ("embedded", "serve", "redis", "in-tree")


# (name, operation, keys per call) of each cell, in order: see the module docstring.
SCALE_CELLS = (("lookup", "lookup_spread", LOOKUP_KEYS), ("save", "full_1ns", BATCH))


IN_TREE_SPARE_PAGES = 1 << 16  # pages beyond the filled ones, for its save cell


@dataclass(frozen=True)
class ScaleSettings:
    """What one `bench metadata --entries N[,N…]` run measures.

    Attributes:
        entries: the store sizes N (each store full at N: capacity N pages).
        modes: of `SCALE_MODES`.
        clients: client processes of each cell.
        seconds: timed window of each cell.
        workers: server processes of each `serve`.
        directory: where the work directory is made.
        keep: leave the work directory behind.
        cells: (name, operation, keys per call) of the cells at each N (`--fleet`
            measures its routes with its own).
    """

    entries: tuple[int, ...] = (100_000, 1_000_000)
    modes: tuple[str, ...] = SCALE_MODES
    clients: int = 2
    seconds: float = 3.0
    workers: int = 1
    directory: Path | None = None
    keep: bool = False
    cells: tuple[tuple[str, str, int], ...] = SCALE_CELLS

    @classmethod
    def quick(cls, **overrides: Any) -> ScaleSettings:
        """Small stores, short cells."""
        base: dict[str, Any] = {"entries": (10_000, 50_000), "seconds": 0.5}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def check(self) -> None:
        """Refuse settings that cannot run.

        Raises:
            InvalidRequest: naming the setting.
        """
        if not self.entries or min(self.entries) < LOOKUP_KEYS + BATCH:
            raise InvalidRequest(
                f"--entries: every size must be at least {LOOKUP_KEYS + BATCH}, "
                f"got {list(self.entries)}"
            )
        if max(self.entries) > 100_000_000:
            raise InvalidRequest(f"--entries: at most 10^8, got {max(self.entries):,}")
        for mode in self.modes:
            if mode not in SCALE_MODES:
                raise InvalidRequest(
                    f"--mode {mode!r} has no full-store scale run; one of {', '.join(SCALE_MODES)}"
                )
        if not self.modes:
            raise InvalidRequest("--mode: no mode to measure")
        if not 1 <= self.clients <= 256:
            raise InvalidRequest(f"--clients must be in 1..256, got {self.clients}")
        if not 0 < self.seconds <= 3600:
            raise InvalidRequest(f"--seconds must be in (0, 3600], got {self.seconds}")


def _timed_create(directory: Path, entries: int, tag: str, run_id: str) -> Any:
    began = time.monotonic()
    spec, db = create_store(directory, "full_1ns", entries, tag, run_id, fork=False)
    return spec, db, time.monotonic() - began


def _empty_serve_rss(directory: Path, run_id: str, workers: int) -> int:
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
    parent = Path(settings.directory) if settings.directory else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="hf3fsctl-bench-scale-", dir=parent))
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    modes = list(settings.modes)
    try:
        baseline = None
        if "serve" in modes:
            baseline = _empty_serve_rss(workdir / "empty", run_id, settings.workers)
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
        child = start_child(_timed_create, directory / "pristine", entries, stored, run_id)
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
                out.append(_redis(redis, entries, settings, directory, stored, run_id, say))
        if child is not None:
            spec, db, fill_s = child.result()
            fill = {"seconds": fill_s, "entries_per_s": entries / fill_s if fill_s else None}
            if "embedded" in modes:
                with _failure_noted("embedded", entries, failed, say):
                    out.append(_embedded(spec, db, entries, fill, settings, directory, tag, say))
            if "serve" in modes:
                with _failure_noted("serve", entries, failed, say):
                    out.append(_serve(spec, db, entries, fill, settings, baseline, tag, say))
    finally:
        if redis is not None:
            redis.stop()
    if "in-tree" in modes:
        try:
            out.append(_in_tree(entries, settings, directory / "in-tree", stored, tag, say))
        except MetadataUnavailable as exc:
            if exc.hint is None:
                raise
            skipped["in-tree"] = str(exc)
    return out


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


def _cells(
    mode: str,
    spec: StoreSpec,
    entries: int,
    settings: ScaleSettings,
    tag: str,
    say: report.Progress,
    server_cpu: Any = None,
    keys_after: Any = None,
) -> dict[str, Any]:
    """`settings.cells` in order (the lookups first: saves evict the oldest keys)."""
    own = server_cpu is not None
    figures: dict[str, Any] = {
        "mode": mode,
        "entries": entries,
        "cpu_of": "server process" if own else "client processes (the store runs there)",
    }
    for name, op, keys in settings.cells:
        if mode == "in-tree" and op == "full_1ns":
            op = "alloc_commit"  # it has no capacity: it never evicts
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


def _embedded(
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
    figures = _cells(
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


def _serve(
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
        figures = _cells(
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


def _redis(
    redis: Any,
    entries: int,
    settings: ScaleSettings,
    directory: Path,
    stored: str,
    run_id: str,
    say: report.Progress,
) -> dict[str, Any]:
    from hf3fsctl.storage.layout import PageFile

    manifest = bench_manifest(f"hf3fsctl-bench/{run_id}/redis")
    ns = namespace_id(manifest)
    root = directory / "storage-redis"
    root.mkdir(parents=True, exist_ok=True)
    high, low = full_watermarks(entries)
    spec = StoreSpec("full_1ns", redis.url(), None, (ns,), stored, entries, str(root), high, low)
    client = spec.client()
    try:
        client.set_capacity(entries * PAGE_BYTES)
        client.register_namespace(ns, manifest)
        client.register_rank(ns, bench_rank_file(ns))
    finally:
        client.close()
    PageFile.create_growable(root, ns, 0, PAGE_BYTES).close()
    before = redis.used_memory()
    fill_s = fill_spec(spec, FILL_CHUNK)
    after = redis.used_memory()
    usage = redis.memory_usage()
    assert redis.process is not None
    pid = redis.process.pid
    accounted: list[tuple[int, int]] = []  # INFO commandstats as each window opens and ends

    def server_cpu() -> float:
        accounted.append(redis.script_usec())
        return cpu_seconds(pid)

    figures = _cells(
        "redis", spec, entries, settings, stored, say, server_cpu=server_cpu,
        keys_after=lambda: store_keys(spec),
    )  # fmt: skip
    for number, (cell, _, _) in enumerate(settings.cells):
        began, ended = accounted[2 * number : 2 * number + 2]
        calls = figures[cell]["calls"]
        figures[cell]["redis_scripts_per_call"] = (ended[0] - began[0]) / calls if calls else None
        figures[cell]["redis_script_usec_per_call"] = (
            (ended[1] - began[1]) / calls if calls else None
        )
    figures["fill"] = {"seconds": fill_s, "entries_per_s": entries / fill_s if fill_s else None}
    figures["memory"] = {
        "bytes_per_entry": usage["bytes"] / entries,
        "method": "MEMORY USAGE over every key (or a sample, scaled), after the fill, ÷ N",
        "memory_usage_bytes_per_entry": usage["bytes"] / entries,
        "used_memory_bytes_per_entry": max(0, after - before) / entries,
        "used_memory_before_bytes": before,
        "used_memory_after_bytes": after,
        "used_memory_end_bytes": redis.used_memory(),
        "held_bytes": after,
        "rss_bytes": rss_bytes(pid),
        "keys": usage["keys"],
        "sampled_keys": usage["sampled_keys"],
        "by_pattern": usage["by_pattern"],
    }
    return figures


def _in_tree(
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
        figures = _cells(
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
