"""vLLM's save and load jobs as tier calls, and the tier's outcomes as vLLM's answers.

The save and load logic itself is `hf3fsctl.tier` (no vLLM in it); the worker side
(`connector.worker`) owns the threads, staging and streams. This module is what is
left between them, and imports neither.

Contract:
    * `LoadRun`: one load job in flight: its job, its start time, the `LoadCancel` its
      timeout uses (a cancelled load never scatters), and whether its result was
      reported (once).
    * `run_saves(tier, jobs, rows, stats)`: `Tier.save_many` of a step's jobs' staged
      rows (each with its retention; one allocate and one commit transaction for them
      all with the embedded store); counts existing, saved and dropped blocks and
      failures by kind, and returns an outcome per job (the worker turns its
      `storage_failure`/`storage_worked` into the back-off and the health state).
    * `without_repeats(jobs, ended)`: a step's save jobs less the leading keys an earlier
      job of the step saves (requests that share a prefix each plan it);
      `merged_host_loads(jobs)`: a step's synchronous loads as one job when their keys
      are distinct (one locate, one batch of reads).
    * `run_load(tier, run, into, stats, invalidate_with)`: `Tier.load` of the job's keys
      into `into`; returns the block ids that did not arrive intact and the kind their
      failure is counted under (a cancel counts as `timeout`). Corrupt pages invalidated
      inline are counted here; those handed to `invalidate_with` by its caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from hf3fsctl.meta.models import Location
from hf3fsctl.tier import (
    CANCELLED,
    EXISTING,
    SAVED,
    LoadCancel,
    LoadTarget,
    Pages,
    SaveBatch,
    SaveOutcome,
    Tier,
)

from .metadata import LoadJob, SaveJob
from .stats import StatsRecorder

_STORED = (SAVED, EXISTING)


@dataclass
class LoadRun:
    """One load job in flight."""

    job: LoadJob  # what to load
    started: float = field(default_factory=time.monotonic)  # for the timeout and GB/s
    cancel: LoadCancel = field(default_factory=LoadCancel)  # set by the timeout
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards `reported`
    reported: bool = False  # result handed to get_finished (or to this step)


def run_saves(
    tier: Tier, jobs: Sequence[SaveJob], rows: Sequence[Pages], stats: StatsRecorder
) -> list[SaveOutcome]:
    """Store the pages of a step's jobs (`rows[i]` for `jobs[i]`, in its keys' order:
    staged rows, or the blocks' ranges) through one `Tier.save_many` — with the embedded
    store one allocate and one commit transaction for the step instead of two per job
    (issue 23) — and count each job's outcome."""
    batches = [
        SaveBatch(job.keys, job_rows, job.first_depth, job.retention_s, job.renew_on_read)
        for job, job_rows in zip(jobs, rows, strict=True)
    ]
    outcomes = tier.save_many(batches)
    for outcome in outcomes:
        _count(tier, outcome, stats)
    return outcomes


def _count(tier: Tier, outcome: SaveOutcome, stats: StatsRecorder) -> None:
    stats.add(save_existing=outcome.count(EXISTING))
    for kind, blocks in outcome.failures().items():
        stats.add(save_dropped=blocks)
        stats.fail(kind, blocks)
    if outcome.committed:
        stats.add(blocks_saved=outcome.committed, bytes_saved=outcome.committed * tier.page_bytes)


def stored_keys(job: SaveJob, outcome: SaveOutcome) -> list[str]:
    """The job's keys the store holds after its save (saved now, or already there)."""
    return [key for key, kind in zip(job.keys, outcome.kinds, strict=True) if kind in _STORED]


def run_load(
    tier: Tier,
    run: LoadRun,
    into: LoadTarget,
    stats: StatsRecorder,
    invalidate_with: Callable[[list[Location]], None] | None = None,
) -> tuple[set[int], str]:
    """Load `run.job` into `into`; returns (failed block ids, failure kind)."""
    job = run.job
    outcome = tier.load(job.keys, into, cancel=run.cancel, invalidate_with=invalidate_with)
    if outcome.invalidated:
        stats.add(invalidated=outcome.invalidated)
    kind = outcome.failure_kind or "error"
    return {job.block_ids[i] for i in outcome.failed}, "timeout" if kind == CANCELLED else kind


def without_repeats(jobs: list[SaveJob], ended: Callable[[str], None]) -> list[SaveJob]:
    """A step's save jobs less the leading keys an earlier job of the step already saves
    (requests sharing a prefix plan it each); a job left with nothing ends at once
    (`ended`). Jobs that pin keep every key (the pin names what the store holds)."""
    seen: set[str] = set()
    kept: list[SaveJob] = []
    for job in jobs:
        skip = 0
        if not job.pin:
            while skip < len(job.keys) and job.keys[skip] in seen:
                skip += 1
        seen.update(job.keys)
        if skip == len(job.keys):
            ended(job.req_id)
        elif skip:
            kept.append(
                replace(
                    job,
                    block_ids=job.block_ids[skip:],
                    keys=job.keys[skip:],
                    first_depth=job.first_depth + skip,
                )
            )
        else:
            kept.append(job)
    return kept


def merged_host_loads(jobs: list[LoadJob]) -> list[LoadJob]:
    """A step's synchronous loads as one job (one `Tier.load`) when their keys are
    distinct and they fill one group; asynchronous ones stay per request (each is
    reported in `finished_recving` on its own)."""
    sync = [job for job in jobs if job.sync]
    keys = [key for job in sync for key in job.keys]
    if len(sync) < 2 or len(set(keys)) != len(keys) or len({job.group for job in sync}) > 1:
        return jobs
    merged = LoadJob(
        ",".join(job.req_id for job in sync),
        [block for job in sync for block in job.block_ids],
        keys,
        True,
        sync[0].group,
    )
    return [merged, *(job for job in jobs if not job.sync)]
