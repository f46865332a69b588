"""`hf3fsctl doctor`'s checks of what is on disk against what the metadata says.

- `check_namespaces`: every registered namespace has its manifest on disk, equal to the
  registered one, and every registered rank file exists with the registered geometry.
- `check_checksums`: committed pages read back with the configured I/O engine match the
  checksums recorded at commit. A page that fails is re-located (taking a read lease)
  and read again: if its entry moved or vanished meanwhile (evicted and reused by a live
  writer) it is not counted as corrupt; if it fails again under the lease, it is.
"""

from __future__ import annotations

import functools
import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hf3fsctl.cli import output
from hf3fsctl.errors import Hf3fsctlError, NotFound
from hf3fsctl.keys import shown_key

if TYPE_CHECKING:
    from hf3fsctl.cli.checks import Report
    from hf3fsctl.config import Config
    from hf3fsctl.meta.models import EntryInfo, NamespaceInfo, RankFile
    from hf3fsctl.meta.protocol import MetadataClient
    from hf3fsctl.storage.engine import IOEngine
    from hf3fsctl.storage.layout import PageFile

LIST_WINDOW = 500  # entries per list_entries call
READ_BATCH_BYTES = 64 * 1024**2  # bytes read per engine call
MAX_SHOWN = 5  # failures named in a check's detail


def check_namespaces(report: Report, config: Config, client: MetadataClient) -> None:
    """Manifests on disk match the registered ones; page files exist with their size."""
    from hf3fsctl.storage.layout import read_manifest

    root = Path(config.storage.path)
    namespaces = client.namespaces()
    if not namespaces:
        report.add("namespaces", "ok", "none registered yet (vLLM registers on first start)")
        return
    for ns in namespaces:
        try:
            stored = read_manifest(root, ns.id).to_dict()
        except NotFound as exc:
            report.add(
                f"manifest {ns.id}",
                "fail",
                exc.message,
                "re-run `hf3fsctl init --namespace-manifest`, or evict the namespace",
            )
            continue
        except Hf3fsctlError as exc:
            report.add(f"manifest {ns.id}", "fail", exc.message, exc.hint)
            continue
        if stored != ns.manifest:
            changed = sorted(
                k for k in stored.keys() | ns.manifest.keys() if stored.get(k) != ns.manifest.get(k)
            )
            report.add(
                f"manifest {ns.id}",
                "fail",
                f"on-disk manifest differs from the registered one in {', '.join(changed)}",
                "a store and its metadata were mixed up: check storage.path and metadata.url",
            )
            continue
        report.add(f"manifest {ns.id}", "ok", f"{stored.get('model')} matches the registered one")
        problems = [
            problem for rf in ns.rank_files if (problem := _rank_file_problem(root, rf)) is not None
        ]
        missing_ranks = ns.num_ranks - len(ns.rank_files)
        if problems:
            report.add(
                f"pages {ns.id}",
                "fail",
                "; ".join(problems[:MAX_SHOWN]),
                "restore the files, or evict the namespace and let vLLM recreate them",
            )
        else:
            detail = f"{len(ns.rank_files)} rank files with the registered size"
            if missing_ranks:
                detail += f" ({missing_ranks} of {ns.num_ranks} ranks not registered yet)"
            report.add(f"pages {ns.id}", "ok", detail)


def _rank_file_problem(root: Path, rf: RankFile) -> str | None:
    from hf3fsctl.storage.layout import resolve_under

    try:
        path = resolve_under(root, rf.path)
        size = path.stat().st_size
    except Hf3fsctlError as exc:
        return f"rank {rf.rank}: {exc.message}"
    except FileNotFoundError:
        return f"rank {rf.rank}: {rf.path} is missing"
    except OSError as exc:
        return f"rank {rf.rank}: {rf.path}: {exc.strerror}"
    needed = rf.num_pages * rf.slot_bytes
    if rf.preallocated and size < needed:  # a growing file holds only what was written
        return f"rank {rf.rank}: {rf.path} has {size} bytes, needs {needed}"
    return None


def committed_entries(
    client: MetadataClient, namespace: str, total: int, sample: int | None
) -> list[EntryInfo]:
    """Committed entries of a namespace: all of them (`sample=None`) or a random sample.

    A sample is drawn from random windows of the entry listing (which is ordered by last
    use), so it covers old and recent pages alike without listing everything.
    """
    seen: dict[tuple[str, int], EntryInfo] = {}

    def take(offset: int, limit: int) -> int:
        batch = client.list_entries(namespace, limit=limit, offset=offset)
        for entry in batch:
            if entry.state == "committed" and entry.checksum:
                seen[(entry.key, entry.rank)] = entry
        return len(batch)

    if sample is None or total <= sample:
        offset = 0
        while take(offset, LIST_WINDOW) == LIST_WINDOW:
            offset += LIST_WINDOW
        return list(seen.values())
    window = min(LIST_WINDOW, sample)
    starts = range(0, total - window + 1)
    for offset in sorted(random.sample(starts, k=min(len(starts), -(-sample // window)))):
        take(offset, window)
    entries = list(seen.values())
    return random.sample(entries, sample) if len(entries) > sample else entries


def _read_batch(
    engine: IOEngine, file: PageFile, entries: list[EntryInfo]
) -> list[tuple[EntryInfo, str]]:
    """Read entries' pages, returning (entry, reason) for each that failed."""
    buffers = [bytearray(file.page_bytes) for _ in entries]
    results = engine.read_pages(
        file, [e.page for e in entries], buffers, expected=[e.checksum for e in entries]
    )
    return [
        (e, r.detail or r.error or "failed")
        for e, r in zip(entries, results, strict=True)
        if not r.ok
    ]


def _confirmed(
    engine: IOEngine, client: MetadataClient, file: PageFile, failures: list[tuple[EntryInfo, str]]
) -> list[str]:
    """Failures that hold when re-read under a read lease of an unchanged entry."""
    confirmed = []
    for entry, reason in failures:
        location = client.locate(entry.namespace, entry.rank, [entry.key])[0]
        if location is None or location.page != entry.page or location.checksum != entry.checksum:
            continue  # evicted or moved while we read: not corruption
        if _read_batch(engine, file, [entry]):
            confirmed.append(
                f"rank {entry.rank} page {entry.page} key {shown_key(entry.key)}: {reason}"
            )
    return confirmed


def check_checksums(
    report: Report,
    config: Config,
    client: MetadataClient,
    *,
    sample: int | None,
    show_progress: bool,
) -> None:
    """Verify committed pages of every namespace against their recorded checksums."""
    from hf3fsctl.storage.factory import open_engine

    root = Path(config.storage.path)
    totals = {s.id: s.pages_used for s in client.stats().namespaces}
    plan: list[tuple[NamespaceInfo, dict[int, list[EntryInfo]]]] = []
    for ns in client.namespaces():
        by_rank: dict[int, list[EntryInfo]] = defaultdict(list)
        for entry in committed_entries(client, ns.id, totals.get(ns.id, 0), sample):
            by_rank[entry.rank].append(entry)
        plan.append((ns, by_rank))
    engine = open_engine(config.storage.engine, io_threads=config.storage.io_threads, root=root)
    try:
        with output.progress(show_progress) as bar:
            for ns, by_rank in plan:
                pages = sum(len(v) for v in by_rank.values())
                task = bar.add_task(f"verify {ns.id}", total=pages, visible=pages > 0)
                verified, bad = _verify_namespace(
                    engine, client, root, ns, by_rank, functools.partial(bar.advance, task)
                )
                what = "all committed pages" if sample is None else f"a sample of {verified} pages"
                if bad:
                    report.add(
                        f"checksums {ns.id}",
                        "fail",
                        f"{len(bad)} of {verified} pages corrupt: " + "; ".join(bad[:MAX_SHOWN]),
                        "loads of these pages are misses (recomputed); evict the "
                        "namespace if the file system is suspect",
                    )
                elif verified == 0:
                    report.add(f"checksums {ns.id}", "ok", "no committed pages to verify")
                else:
                    report.add(f"checksums {ns.id}", "ok", f"{what} match ({verified} read)")
    finally:
        engine.close()


def _verify_namespace(
    engine: IOEngine,
    client: MetadataClient,
    root: Path,
    ns: NamespaceInfo,
    by_rank: dict[int, list[EntryInfo]],
    advance: Callable[[int], None],
) -> tuple[int, list[str]]:
    from hf3fsctl.storage.layout import PageFile

    files = {rf.rank: rf for rf in ns.rank_files}
    verified, bad = 0, []
    for rank, entries in sorted(by_rank.items()):
        rf = files.get(rank)
        if rf is None:
            bad.append(f"rank {rank}: entries but no registered page file")
            continue
        try:
            file = PageFile.open(
                root,
                rf.path,
                rf.page_bytes,
                rf.num_pages,
                writable=False,
                growable=not rf.preallocated,
            )
        except Hf3fsctlError as exc:
            bad.append(f"rank {rank}: {exc.message}")
            continue
        with file:
            step = max(1, READ_BATCH_BYTES // rf.slot_bytes)
            entries.sort(key=lambda e: e.page)
            for start in range(0, len(entries), step):
                batch = entries[start : start + step]
                failures = _read_batch(engine, file, batch)
                bad.extend(_confirmed(engine, client, file, failures))
                verified += len(batch)
                advance(len(batch))
    return verified, bad
