"""The slow halves of save and load jobs, run on the worker's background threads.

Contract:
    * `run_save`: allocate pages for the job's keys (keys already stored are skipped by
      the store) → claim their disk space (a growing page file) → write the staged pages
      → commit with the checksums the engine computed. Pages that failed to write, and
      every allocation when the commit or an earlier step fails, are released, so nothing
      stays pending. A full or failing file system (ENOSPC, EIO) fails this save only:
      counted by kind, and `WorkerSide.storage_failed` pauses saves for a back-off.
    * `run_load`: lease staging → locate the keys (a read lease) → read with checksum
      verification → scatter the intact pages into their blocks. Returns the block ids
      that did not arrive intact and the kind of the first failure. A load cancelled by
      its timeout never scatters.
    * `run_load_direct` (synchronous loads into a host KV cache): locate → read each
      page straight into its block's byte ranges, verified there. Returns the same.
    * Both loads hand the pages that failed their checksum to
      `WorkerSide.report_corrupt`, which has the store forget them (`invalidate`) so no
      later request is offered them: inline on an asynchronous load's thread, on a
      background thread for a synchronous load (no metadata round trip in the step).
"""

from __future__ import annotations

import errno
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hf3fsctl.errors import Hf3fsctlError, MetadataUnavailable, StorageError
from hf3fsctl.meta.models import Allocation, CommitItem, Location
from hf3fsctl.staging import StagingBuffer
from hf3fsctl.storage.engine import ERROR_CHECKSUM

from .metadata import LoadJob, SaveJob

if TYPE_CHECKING:
    from .worker import WorkerSide

logger = logging.getLogger(__name__)

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


@dataclass
class LoadRun:
    """One load job in flight."""

    job: LoadJob  # what to load
    started: float  # monotonic start time (for the timeout and GB/s)
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards the flags below
    cancelled: bool = False  # timed out: must not scatter any more
    scattered: bool = False  # pages are in the KV cache
    reported: bool = False  # result handed to get_finished


def _release(worker: WorkerSide, allocations: list[Allocation]) -> None:
    if not allocations:
        return
    try:
        worker.guard.client().release(worker.namespace, worker.rank, allocations)
    except Exception as exc:  # best effort: the store reclaims abandoned pending pages
        logger.warning("could not release %d allocations: %s", len(allocations), exc)


def run_save(worker: WorkerSide, job: SaveJob, lease: StagingBuffer) -> None:
    """Store the staged pages of `job` (rows of `lease` in `job.keys` order)."""
    stats = worker.stats
    if not worker.ensure_registered():
        stats.add(save_dropped=len(job.keys))
        stats.fail("metadata_down", len(job.keys))
        return
    assert worker.page_file is not None and worker.engine is not None
    page_bytes = worker.manifest.page_bytes
    try:
        result = worker.guard.call(
            lambda c: c.allocate(worker.namespace, worker.rank, job.keys, job.first_depth)
        )
    except MetadataUnavailable:
        stats.add(save_dropped=len(job.keys))
        stats.fail("metadata_down", len(job.keys))
        return
    stats.add(save_existing=len(result.existing))
    if result.no_space:
        stats.add(save_dropped=len(result.no_space))
        stats.fail("no_space", len(result.no_space))
    allocated = list(result.allocated)
    if not allocated:
        return
    row_of = {key: row for row, key in enumerate(job.keys)}
    rows = lease.rows()
    committed_ok = False
    try:
        try:
            worker.page_file.reserve([a.page for a in allocated])
        except StorageError as exc:
            kind = "no_space" if exc.errno in _NO_SPACE else "io"
            stats.fail(kind, len(allocated))
            stats.add(save_dropped=len(allocated))
            worker.storage_failed(kind, len(allocated), exc.message)
            return
        results = worker.engine.write_pages(
            worker.page_file,
            [a.page for a in allocated],
            [rows[row_of[a.key]] for a in allocated],
            checksums=True,
        )
        items: list[CommitItem] = []
        failed: list[Allocation] = []
        for allocation, outcome in zip(allocated, results, strict=True):
            if outcome.ok and outcome.checksum:
                items.append(
                    CommitItem(
                        key=allocation.key,
                        page=allocation.page,
                        checksum=outcome.checksum,
                        size=page_bytes,
                    )
                )
            else:
                failed.append(allocation)
        if failed:
            detail = next(r.detail for r in results if not r.ok)
            kind = "no_space" if "space" in (detail or "").lower() else "io"
            stats.fail(kind, len(failed))
            stats.add(save_dropped=len(failed))
            worker.storage_failed(kind, len(failed), detail or "write failed")
            _release(worker, failed)
        if items:
            count = worker.guard.call(lambda c: c.commit(worker.namespace, worker.rank, items))
            stats.add(blocks_saved=count, bytes_saved=count * page_bytes)
            if not failed:
                worker.storage_worked()
        committed_ok = True
    except Hf3fsctlError as exc:
        logger.warning("save of request %s failed: %s", job.req_id, exc)
        kind = "metadata_down" if isinstance(exc, MetadataUnavailable) else "error"
        stats.fail(kind, len(allocated))
        stats.add(save_dropped=len(allocated))
    finally:
        if not committed_ok:
            _release(worker, allocated)


def _failure_kind(error: str | None) -> str:
    return "checksum" if error == ERROR_CHECKSUM else "io"


def invalidate_corrupt(worker: WorkerSide, pages: list[Location]) -> None:
    """Have the store drop the keys of `pages` (failed their checksum); best effort."""
    try:
        count = worker.guard.call(lambda c: c.invalidate(worker.namespace, worker.rank, pages))
    except Exception as exc:  # the page fails again on the next load and is reported again
        logger.warning("could not invalidate %d corrupt pages: %s", len(pages), exc)
        return
    worker.stats.add(invalidated=count)


def run_load_direct(worker: WorkerSide, run: LoadRun) -> tuple[set[int], str]:
    """Read `run.job`'s pages straight into its blocks of a host KV cache (no staging).

    Each page's per-layer byte ranges in the cache are the read's iovecs, and the checksum
    is verified over them. A block that failed may hold any bytes: it is returned as
    failed, and vLLM recomputes it before anything attends over it. Only for loads the
    engine step waits for (a timed-out background read could not be stopped from
    writing into blocks that were given to another request).
    """
    from hf3fsctl.staging import page_pieces

    job = run.job
    assert worker.page_file is not None and worker.engine is not None
    try:
        locations = worker.guard.call(lambda c: c.locate(worker.namespace, worker.rank, job.keys))
    except MetadataUnavailable:
        return set(job.block_ids), "metadata_down"
    page_bytes = worker.manifest.page_bytes
    wanted = [
        (i, loc) for i, loc in enumerate(locations) if loc is not None and loc.size == page_bytes
    ]
    failed = {job.block_ids[i] for i, loc in enumerate(locations) if loc is None}
    kind = "not_found" if failed else ""
    failed |= {
        job.block_ids[i]
        for i, loc in enumerate(locations)
        if loc is not None and loc.size != page_bytes
    }
    results = worker.engine.read_pages_scattered(
        worker.page_file,
        [loc.page for _, loc in wanted],
        page_pieces(worker.segments, [job.block_ids[i] for i, _ in wanted]),
        expected=[loc.checksum for _, loc in wanted],
    )
    corrupt: list[Location] = []
    for (i, loc), outcome in zip(wanted, results, strict=True):
        if not outcome.ok:
            failed.add(job.block_ids[i])
            kind = kind or _failure_kind(outcome.error)
            if outcome.error == ERROR_CHECKSUM:
                corrupt.append(loc)
    worker.report_corrupt(corrupt, background=job.sync)
    return failed, kind or "error"


def run_load(worker: WorkerSide, run: LoadRun, acquire_timeout_s: float) -> tuple[set[int], str]:
    """Load `run.job` into the KV cache; returns (failed block ids, failure kind)."""
    job = run.job
    all_blocks = set(job.block_ids)
    assert worker.page_file is not None and worker.engine is not None
    lease = worker.pool.acquire(len(job.keys), worker.manifest.page_bytes, acquire_timeout_s)
    if lease is None:
        return all_blocks, "pool_exhausted"
    try:
        try:
            locations = worker.guard.call(
                lambda c: c.locate(worker.namespace, worker.rank, job.keys)
            )
        except MetadataUnavailable:
            return all_blocks, "metadata_down"
        rows = lease.rows()
        wanted = [
            (i, loc)
            for i, loc in enumerate(locations)
            if loc is not None and loc.size == worker.manifest.page_bytes
        ]
        failed = {job.block_ids[i] for i, loc in enumerate(locations) if loc is None}
        kind = "not_found" if failed else ""
        results = worker.engine.read_pages(
            worker.page_file,
            [loc.page for _, loc in wanted],
            [rows[i] for i, _ in wanted],
            expected=[loc.checksum for _, loc in wanted],
        )
        good: list[int] = []
        corrupt: list[Location] = []
        for (i, loc), outcome in zip(wanted, results, strict=True):
            if outcome.ok:
                good.append(i)
            else:
                failed.add(job.block_ids[i])
                kind = kind or _failure_kind(outcome.error)
                if outcome.error == ERROR_CHECKSUM:
                    corrupt.append(loc)
        worker.report_corrupt(corrupt, background=job.sync)
        failed |= {job.block_ids[i] for i, loc in enumerate(locations) if loc and i not in good}
        with run.lock:
            if run.cancelled:
                return all_blocks, "timeout"
            if good:
                src: Any = lease.tensor if len(good) == len(job.keys) else lease.tensor[good]
                worker.scatter_ready([job.block_ids[i] for i in good], src)
            run.scattered = True
        return failed, kind or "error"
    finally:
        lease.release()
