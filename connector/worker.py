"""Worker side of the connector: page files, staging, threads, and vLLM's answers.

Saves and loads themselves are `hf3fsctl.tier` (`WorkerSide.tier`); `connector.jobs`
turns vLLM's jobs into tier calls and outcomes into counters and failed block ids.

Imports no vLLM (nor does anything it imports): vLLM's objects come in as arguments
(`KVCacheConfig` is read once into a `KVCacheGeometry`), so the worker side runs, and is
tested on a GPU machine, without vLLM installed (`tests/gpu/test_worker_cuda.py`).

Contract (storage, registration, `tier`, start-up failures and staging prewarm:
`connector.worker_storage`):
    * `register_kv_caches` derives the page geometry from `kv_cache_tensors`, checks it
      against the tensors (`connector.geometry`), then opens storage and registers this
      rank (`WorkerStorage`); on a host KV cache it first asks Linux for the AMX tile
      state vLLM's bf16 attention uses without asking (`allow_amx_tiles`). Only
      configuration errors (an unknown KV layout) raise from it; a storage failure
      leaves the connector disabled — loads fail fast and are recomputed, saves are
      dropped — and is retried off the engine step.
    * A save that hits ENOSPC/EIO fails alone (counted by kind, its pages released) and
      saves pause for `connector.storage_retry_s`; `ConnectorHealth` records the state
      for `doctor` and Prometheus.
    * Saves: keys an earlier job of the step saves are left out (`jobs.without_repeats`).
      A host KV cache of full attention is saved from its blocks themselves
      (`PageSources`: no staging, nothing copied on the engine thread): vLLM keeps a
      request's blocks while its saves run once it finished (`request_finished` holds
      them), and a preempted request's — which the next forward may reuse — are named by
      the scheduler (`preempted`), so `handle_preemptions`, before that forward, marks
      the saves still reading them: what they wrote is released, never committed
      (`reused`). Otherwise (device caches; sliding-window and Mamba groups, whose
      blocks are freed or rewritten while the request runs) `wait_for_save` gathers the
      step's save blocks into one staging lease *synchronously*, in one gather (on CUDA:
      on a side stream after an event, with the compute stream waiting for it), so the
      bytes are copied while the requests still own their blocks. One background task
      then saves the jobs in turn: `Tier.save`
      (allocation, the writes, commit with checksums and — on any failure — release of
      what was allocated) runs on background threads; its storage failure pauses saves
      (`storage_failed`), a clean save ends the degraded state (`storage_worked`). The
      threads start a step's saves once the next engine step begins (`step_began`, from
      the facade's `bind_connector_metadata`), or after `SAVE_GATE_S`: their Python work
      then never competes for the GIL with the tail of the step that produced the first
      tokens (docs/design.md "Fixed costs").
    * Loads: `start_load_kv` hands each asynchronous load job to a background thread:
      `Tier.load` into staging rows (locate with a lease → read with checksum
      verification → scatter into the KV cache, unless its timeout cancelled it) →
      reported by `get_finished`. Every block that did not arrive intact is
      returned by `get_block_ids_with_load_errors` in the same step its request is
      reported. A synchronous job (`LoadJob.sync`), every request's of the step in one
      `Tier.load` on a host KV cache (one locate, one batch of reads), runs on a load
      thread while `start_load_kv`, which vLLM calls before that step's forward, waits
      for it at most `SYNC_LOAD_DEADLINE_S` (a hung file system never answers: the
      load is then cancelled, its blocks recomputed). Loads always read into staging,
      never straight into the blocks, since a read that outlives its wait must not
      write into blocks given to another request. Failed blocks are returned by
      `get_block_ids_with_load_errors` in the same step, and vLLM recomputes them.
    * Pages a load found corrupt are dropped from the store (`Tier.invalidate`): inline
      on an asynchronous load's thread; for a synchronous load on a load thread, off
      the engine step; `drain` (and so `wait_for_saves`) also waits for those calls.
    * Nothing here raises into the engine step: errors are logged and become failed
      blocks or dropped saves, counted in the stats.
    * A request with save jobs is reported in `finished_sending` once vLLM has told us it
      finished and all its save jobs have ended.
    * A save job with `pin` (a request's kv_transfer_params) pins its keys the store
      holds after the save, on rank 0 (`request_params.pin_saved`: a failure is a warning).
    * Writers: after its first committed page, rank 0 records the engine's numerics
      (`writer`, set by the facade) with the namespace (`Registry.record_writer`).
    * Capture mode (`connector.capture`, `hf3fsctl verify`): no page file, no
      registration; save jobs are gathered into memory (`connector.capture`), never written.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from hf3fsctl.config import Config
from hf3fsctl.errors import ConfigError, InvalidRequest, NotFound
from hf3fsctl.keys import NamespaceManifest
from hf3fsctl.kv_groups import FULL
from hf3fsctl.meta.models import Location, WriterInfo
from hf3fsctl.staging import (
    HostBlockPieces,
    KVSegment,
    StagingBuffer,
    StagingPool,
    gather_blocks,
    scatter_blocks,
    total_page_bytes,
)
from hf3fsctl.tier import (
    IO,
    Pages,
    PageSources,
    SaveOutcome,
    StagingRows,
    Tier,
)

from .geometry import KVCacheGeometry, kv_segments
from .jobs import LoadRun, merged_host_loads, run_load, run_saves, stored_keys, without_repeats
from .metadata import Hf3fsctlConnectorMetadata, LoadJob, SaveJob
from .request_params import pin_saved
from .service import MetadataGuard
from .stats import StatsRecorder
from .worker_storage import WorkerStorage

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

SAVE_THREADS = 2
LOAD_THREADS = 2
# A load that has not finished after this long is reported failed (its blocks recompute).
LOAD_TIMEOUT_S = 60.0
# How long a synchronous load (the engine step waits for it) waits for staging memory
# held by saves before it gives up and its blocks are recomputed.
SYNC_STAGING_WAIT_S = 1.0
# The longest a step waits for its synchronous loads (a hung file system never answers).
SYNC_LOAD_DEADLINE_S = 5.0
# How long shutdown waits for in-flight saves, and then for load threads.
SHUTDOWN_DRAIN_S = 30.0
SHUTDOWN_LOAD_WAIT_S = 10.0
# How long a save thread waits for the next engine step to begin before it starts anyway.
SAVE_GATE_S = 0.05

_LIVE_WORKERS: weakref.WeakSet[WorkerSide] = weakref.WeakSet()


def wait_for_saves(timeout_s: float = 30.0) -> bool:
    """Wait until every worker side in this process has no save (or invalidation) in flight.

    Returns:
        True when all saves ended within the timeout.
    """
    deadline = time.monotonic() + timeout_s
    return all(w.drain(max(0.0, deadline - time.monotonic())) for w in list(_LIVE_WORKERS))


def live_namespaces() -> set[str]:
    """The namespace ids of the worker sides alive in this process (none with vLLM's
    worker processes: their worker sides live there)."""
    return {worker.namespace for worker in list(_LIVE_WORKERS)}


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit tests drive the worker directly)
        return 0


def allow_amx_tiles() -> None:
    """Ask Linux for this process's AMX tile state, once, where the CPU has AMX.

    vLLM 0.32's CPU attention runs AMX tile instructions for bf16 (`_get_attn_isa` picks
    "amx" for a bf16 model and a block size that is a multiple of 32) without asking the
    kernel for them (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); oneDNN asks on its first AMX
    matmul, which a prefill of many tokens runs before any attention. An engine whose
    first forward is a loaded prefix and a few new tokens — a fresh process warm from the
    store — reaches attention first and dies of SIGILL. torch's own call asks; a CPU or
    kernel without AMX is left alone. Idempotent.
    """
    try:
        if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
            logger.warning("the kernel refused AMX tile state: vLLM's bf16 attention may fail")
    except Exception as exc:  # a torch without these calls: nothing to ask
        logger.debug("asking for AMX tile state failed: %s", exc)


class WorkerSide(WorkerStorage):
    """Executes the transfers of one rank and reports their results.

    Engine, page file, registration and `tier` come from `WorkerStorage`.

    `kv_cache` is the engine's `KVCacheConfig` (with `group`, the index of the KV cache
    group this side stores; None: the only one) or, without vLLM, a `KVCacheGeometry`.
    """

    def __init__(
        self,
        config: Config,
        manifest: NamespaceManifest,
        kv_cache: KVCacheGeometry | KVCacheConfig,
        stats: StatsRecorder,
        *,
        rank: int | None = None,
        guard: MetadataGuard | None = None,
        staging_prewarm_bytes: int = 0,
        pool: StagingPool | None = None,
        group: int | None = None,
    ) -> None:
        geometry = (
            kv_cache
            if isinstance(kv_cache, KVCacheGeometry)
            else KVCacheGeometry.from_vllm(kv_cache, group)
        )
        super().__init__(
            config,
            manifest,
            rank=_tp_rank() if rank is None else rank,
            guard=guard or MetadataGuard(config),
            pool=pool if pool is not None else StagingPool(config.connector.staging_bytes),
            staging_prewarm_bytes=staging_prewarm_bytes,
        )
        self.geometry = geometry
        self.stats = stats
        self.segments: list[KVSegment] = []
        # A host KV cache's block byte ranges, worked out once (for `self.segments`).
        self._host_pieces: tuple[list[KVSegment], HostBlockPieces] | None = None
        self._saves_paused_until = 0.0  # saves skipped after a storage failure
        self._retrying = False  # a background retry of storage/registration is queued
        self._cuda = False
        self._save_stream: Any = None
        self._load_stream: Any = None
        self._save_pool = ThreadPoolExecutor(SAVE_THREADS, thread_name_prefix="hf3fsctl-save")
        self._load_pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="hf3fsctl-load")
        self._lock = threading.Condition()
        self._save_reqs: set[str] = set()  # requests that had save jobs, until reported
        self._outstanding: dict[str, int] = {}  # save jobs in flight per request
        # preemptions of requests with saves in flight: a save written from the blocks
        # themselves commits only if its request's count is unchanged after the write
        self._preempted: dict[str, int] = {}
        self._finished: set[str] = set()  # finished per vLLM, waiting for their saves
        self._loads: dict[str, LoadRun] = {}  # load jobs in flight
        self._hung_load: Future[None] | None = None  # a sync load past its deadline
        self._load_futures: set[Future[None]] = set()  # load-thread tasks not ended
        self._done_loads: dict[str, set[int]] = {}  # ended loads → failed block ids
        self._load_errors: set[int] = set()  # failed block ids not yet reported
        self._invalidating = 0  # background invalidate calls in flight
        # Set when an engine step begins; save threads wait for it (`SAVE_GATE_S` at most).
        self._step_gate = threading.Event()
        self._step_gate.set()
        self.capture = config.connector.capture  # `hf3fsctl verify`: connector.capture
        self.writer: WriterInfo | None = None  # this engine's numerics, set by the facade
        self._writer_recorded = False  # recorded with the first committed page
        _LIVE_WORKERS.add(self)

    # --- start-up ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check the KV geometry, open the page file and register this rank.

        Raises:
            ConfigError: the KV cache layout cannot be stored (unknown, non-uniform).
            StorageError: the page file cannot be created.
        """
        self.segments = kv_segments(kv_caches, self.geometry)
        page_bytes = total_page_bytes(self.segments)
        if page_bytes != self.manifest.page_bytes:
            raise ConfigError(
                f"KV tensors hold {page_bytes} bytes per block, the namespace says "
                f"{self.manifest.page_bytes}: unknown KV cache layout"
            )
        device = self.segments[0].buffer.device
        self._cuda = device.type == "cuda"
        if device.type == "cpu":
            allow_amx_tiles()
        if self.capture:  # no page file, no registration: nothing reaches the store
            self.disabled = "capture mode (hf3fsctl verify): pages are kept in memory"
            logger.info("hf3fsctl connector rank %d: %s", self.rank, self.disabled)
            return
        if self._cuda:
            self._save_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            self._load_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        if self._open_storage():
            self.disabled = "not registered with the metadata service yet"
        if self.page_file is not None and self.staging_prewarm_bytes > 0:
            threading.Thread(
                target=self._prewarm_staging, name="hf3fsctl-prewarm", daemon=True
            ).start()
        if self.ensure_registered():
            self._submit_load(self._warm_up_loads)  # where loads run
        from hf3fsctl.ops.status import describe_staging_path

        logger.info(
            "hf3fsctl connector rank %d: namespace %s (%s, %s, %s, block %d, %d B/page), "
            "engine %s, page file %s, staging: %s, %s MiB%s, metadata %s%s",
            self.rank,
            self.namespace,
            self.manifest.model,
            self.manifest.kv_dtype,
            self.manifest.layout,
            self.manifest.block_size,
            page_bytes,
            "-" if self.engine is None else self.engine.name,
            "-" if self.page_file is None else self._describe_file(self.page_file),
            describe_staging_path(),
            self.pool.capacity_bytes >> 20,
            (" pinned" if self.pool.pinned else "")
            + (
                f", in the {self.pool.host_memory.name} (one copy)" if self.pool.host_memory else ""
            ),
            self.guard.url,
            "" if self.disabled is None else f" — DISABLED: {self.disabled}",
        )

    # --- saves ---------------------------------------------------------------------

    def _save_ended(self, req_id: str) -> None:
        with self._lock:
            self._outstanding[req_id] -= 1
            if not self._outstanding[req_id]:
                del self._outstanding[req_id]
                self._preempted.pop(req_id, None)  # no save left to doubt
            self._lock.notify_all()

    def handle_preemptions(self, preempted: list[str]) -> None:
        """vLLM preempted these requests (their blocks are free) and runs the forward that
        may reuse the blocks next: a save still reading them from the KV cache
        (`_save_in_place`) must not commit what it wrote. Nothing waits."""
        with self._lock:
            for req_id in preempted:
                if req_id in self._outstanding:
                    self._preempted[req_id] = self._preempted.get(req_id, 0) + 1

    def _blocks_intact(self, req_id: str, preemptions: int) -> bool:
        """Whether `req_id` was not preempted since a save of its blocks began."""
        return self._preempted.get(req_id, 0) == preemptions

    def _saves_in_place(self) -> bool:
        """Whether saves are written from the blocks themselves: a host KV cache of full
        attention, whose blocks keep their bytes while vLLM holds them for the request —
        until its saves end once it finished (`request_finished` holds them), until the
        next forward once it is preempted (`handle_preemptions`). A sliding window's
        blocks are freed as the window moves and a Mamba state is rewritten in place, so
        those groups, and device caches, are gathered into staging in the step."""
        return not self._cuda and self.geometry.kind == FULL

    def step_began(self) -> None:
        """An engine step began: the previous step's saves may start."""
        if not self._step_gate.is_set():  # (setting takes the Event's lock)
            self._step_gate.set()

    def wait_for_save(self, meta: Hf3fsctlConnectorMetadata) -> None:
        """Save this step's blocks in the background, as one task: from the blocks
        themselves (`_saves_in_place`), else gathered into one staging lease now."""
        if not meta.saves:
            return
        self._step_gate.clear()
        jobs: list[SaveJob] = []
        for job in meta.saves:
            with self._lock:
                self._save_reqs.add(job.req_id)
                self._outstanding[job.req_id] = self._outstanding.get(job.req_id, 0) + 1
            if self.capture:
                self._capture(job)
                self._save_ended(job.req_id)
            elif self.disabled is not None or self.saves_paused():
                self._drop(job, "disabled" if self.disabled else "paused")
                self._retry_in_background()
            else:
                jobs.append(job)
        jobs = without_repeats(jobs, self._save_ended)
        if not jobs:
            return
        if self._saves_in_place():
            self._save_in_place(jobs)
            return
        lease = None
        try:
            lease = self.pool.acquire(sum(len(j.block_ids) for j in jobs), self.manifest.page_bytes)
            if lease is None:
                for job in jobs:
                    self._drop(job, "pool_exhausted")
                return
            started = time.monotonic()
            ready = self._gather([b for job in jobs for b in job.block_ids], lease.tensor)
            self._save_pool.submit(self._save_jobs, jobs, None, lease, ready, started)
        except Exception:
            logger.exception("saves of %d jobs failed before their I/O", len(jobs))
            if lease is not None:
                lease.release()
            for job in jobs:
                self.stats.fail("error", len(job.keys))
                self._save_ended(job.req_id)

    def _save_in_place(self, jobs: list[SaveJob]) -> None:
        """Hand the step's jobs to a save thread as the blocks' own byte ranges: no staging
        lease, no copy on the engine thread (`Tier.save_many` writes and checksums the
        ranges; a job whose request was preempted before its write ended is released,
        not committed: `PageSources`)."""
        try:
            sources = []
            for job in jobs:
                intact = functools.partial(
                    self._blocks_intact, job.req_id, self._preempted.get(job.req_id, 0)
                )
                pieces = self._page_pieces(job.block_ids)
                sources.append(PageSources(pieces, [intact] * len(pieces)))
            self._save_pool.submit(self._save_jobs, jobs, sources, None, None, time.monotonic())
        except Exception:
            logger.exception("saves of %d jobs failed before their I/O", len(jobs))
            for job in jobs:
                self.stats.fail("error", len(job.keys))
                self._save_ended(job.req_id)

    def _drop(self, job: SaveJob, kind: str) -> None:
        self.stats.add(save_dropped=len(job.keys))
        self.stats.fail(kind, len(job.keys))
        self._save_ended(job.req_id)

    def saves_paused(self) -> bool:
        """True while saves wait out the back-off after a storage failure."""
        return time.monotonic() < self._saves_paused_until

    def storage_failed(self, kind: str, blocks: int, reason: str) -> None:
        """A save hit the storage (no space, I/O error): pause saves, record the state."""
        self._saves_paused_until = time.monotonic() + self.config.connector.storage_retry_s
        fix = (
            "free space: `hf3fsctl evict`, a lower storage.capacity, or a larger file system"
            if kind == "no_space"
            else "check the storage with `hf3fsctl doctor`"
        )
        self.health.degrade(kind, f"{blocks} blocks not saved: {reason}", fix)

    def storage_worked(self) -> None:
        """A save reached the store: leave the degraded state if in it."""
        if self.health.state == "degraded":
            self.health.recover()

    def _retry_in_background(self) -> None:
        """While disabled, try storage and registration again off the engine step."""
        if self.disabled is None or time.monotonic() < self._storage_retry_at:
            return
        with self._lock:
            if self._retrying:
                return
            self._retrying = True

        def retry() -> None:
            try:
                self.retry_storage()
            except Exception:  # never let a retry kill the pool thread
                logger.debug("storage retry failed", exc_info=True)
            finally:
                with self._lock:
                    self._retrying = False
                    self._lock.notify_all()

        try:
            self._save_pool.submit(retry)
        except RuntimeError:  # shut down
            with self._lock:
                self._retrying = False

    def _gather(self, block_ids: list[int], out: torch.Tensor) -> Any:
        """Copy blocks into `out`; returns a CUDA event to wait on (None on CPU)."""
        if not self._cuda:
            gather_blocks(self.segments, block_ids, out)
            return None
        compute = torch.cuda.current_stream()
        self._save_stream.wait_stream(compute)
        with torch.cuda.stream(self._save_stream):
            gather_blocks(self.segments, block_ids, out)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._save_stream)
        compute.wait_event(done)  # the next step may not overwrite blocks before the copy
        return done

    def _save_jobs(
        self,
        jobs: list[SaveJob],
        sources: list[PageSources] | None,
        lease: StagingBuffer | None,
        ready: Any,
        started: float,
    ) -> None:
        """One step's save jobs, from their blocks' `sources` or staged in `lease` in job
        order."""
        self._step_gate.wait(SAVE_GATE_S)
        staged: list[Pages] = list(sources or [])
        if lease is not None:
            rows, first = lease.rows(), 0
            for job in jobs:
                staged.append(rows[first : first + len(job.keys)])
                first += len(job.keys)
        try:
            if ready is not None:
                ready.synchronize()
            self._save_step(jobs, staged)
        finally:
            if lease is not None:
                lease.release()
            elapsed = time.monotonic() - started
            self.stats.add(save_jobs=len(jobs), save_seconds=elapsed)
            self.stats.observe("save_s", elapsed)

    def _save_step(self, jobs: list[SaveJob], staged: list[Pages]) -> None:
        """A step's save jobs in one `run_saves` (one allocate and one commit transaction
        for them all with the embedded store), then each job's outcome in turn."""
        outcomes: list[SaveOutcome | None] = [None] * len(jobs)
        try:
            if not self.ensure_registered():
                for job in jobs:
                    self.stats.add(save_dropped=len(job.keys))
                    self.stats.fail("metadata_down", len(job.keys))
            else:
                tier = self.tier  # after registration, which may reopen the page file
                assert tier is not None
                outcomes = list(run_saves(tier, jobs, staged, self.stats))
                if any(o is not None and o.unregistered for o in outcomes):
                    self.forget_registration()
        except Exception:
            logger.exception("saves of %d jobs failed", len(jobs))
            for job in jobs:
                self.stats.fail("error", len(job.keys))
        for job, outcome in zip(jobs, outcomes, strict=True):
            self._save_done(job, outcome)

    def _save_done(self, job: SaveJob, outcome: SaveOutcome | None) -> None:
        """What a saved job leads to (its pin, the storage health); it then ends."""
        try:
            if outcome is None:  # not saved: counted already
                return
            if job.pin and self.rank == 0:  # the request's kv_transfer_params pin
                pin_saved(self.guard.call, self.namespace, stored_keys(job, outcome), job.pin_ttl_s)
            failure = outcome.storage_failure
            if failure is not None and not (failure.kind == IO and self.page_file_lost()):
                self.storage_failed(failure.kind, failure.pages, failure.reason)
            elif outcome.storage_worked:
                self.storage_worked()
                self._record_writer()
        except Exception:
            logger.exception("save of request %s failed", job.req_id)
            self.stats.fail("error", len(job.keys))
        finally:
            self._save_ended(job.req_id)

    def _capture(self, job: SaveJob) -> None:
        """Capture mode: gather the job's blocks as a save would, keep them in memory."""
        from .capture import keep

        rows = torch.empty(
            (len(job.block_ids), self.manifest.page_bytes),
            dtype=torch.uint8,
            device=self.segments[0].buffer.device,
        )
        gather_blocks(self.segments, job.block_ids, rows)
        keep(self.namespace, job.keys, rows)

    def _record_writer(self) -> None:
        """Record this engine's numerics with the namespace once (rank 0), after a page
        was committed; a failed call is tried again after the next save."""
        if self._writer_recorded or self.writer is None or self.rank != 0:
            return
        writer = self.writer
        try:
            self.guard.call(lambda c: c.record_writer(self.namespace, writer))
            self._writer_recorded = True
        except (NotFound, InvalidRequest) as exc:  # e.g. an older serve: not asked again
            self._writer_recorded = True
            logger.info("the store does not record writers (%s)", exc.message)
        except Exception as exc:  # down for now: tried again after the next save
            logger.debug("recording the writer of %s failed: %s", self.namespace, exc)

    # --- loads ---------------------------------------------------------------------

    def start_load_kv(self, meta: Hf3fsctlConnectorMetadata) -> None:
        """Run this step's synchronous loads; start its asynchronous ones on threads."""
        if not meta.loads:
            return
        if self.disabled is not None:  # a consumer saves nothing: its loads retry too
            self._retry_in_background()
        for job in merged_host_loads(meta.loads) if not self._cuda else meta.loads:
            run = LoadRun(job=job)
            if job.sync:
                self._run_sync_load(run)  # before this step's forward; errors this step
                continue
            with self._lock:
                self._loads[job.req_id] = run
            try:
                self._submit_load(self._run_load, run)
            except Exception:
                logger.exception("cannot start load of request %s", job.req_id)
                self._load_ended(run, set(job.block_ids), "error")

    def _submit_load(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        """`fn(*args)` on a load thread, tracked until it ends (`shutdown` waits for
        these before it closes the store they use)."""
        future = self._load_pool.submit(fn, *args)
        with self._lock:
            self._load_futures.add(future)
        future.add_done_callback(self._load_future_done)
        return future

    def _load_future_done(self, future: Future[None]) -> None:
        with self._lock:
            self._load_futures.discard(future)

    def _run_sync_load(self, run: LoadRun) -> None:
        """A synchronous load, on a load thread, the step waiting for it at most
        `SYNC_LOAD_DEADLINE_S`: a read on a hung file system (a FUSE daemon stopped)
        never returns, and the engine must not wait with it. Past the deadline the load
        is cancelled (it reads into staging, so a late read touches no KV block) and
        its blocks are recomputed; while that read has not returned, later synchronous
        loads fail at once (logged once per hang) instead of each waiting again."""
        hung = self._hung_load
        if hung is not None:
            if not hung.done():
                self._load_ended(run, set(run.job.block_ids), "timeout")
                return
            self._hung_load = None
            logger.info("a load that had hung returned: loads run again")
        try:
            future = self._submit_load(self._run_load, run)
        except RuntimeError:  # shut down
            self._load_ended(run, set(run.job.block_ids), "error")
            return
        wait([future], timeout=SYNC_LOAD_DEADLINE_S)
        if future.done() or not run.cancel.cancel():  # done, or delivering right now
            future.result()  # _run_load reports its own errors; never raises
            return
        self._hung_load = future
        logger.warning(
            "a load of request %s has not finished after %.0f s (a hung file system?): "
            "its blocks are recomputed, and loads fail at once until it returns",
            run.job.req_id,
            SYNC_LOAD_DEADLINE_S,
        )
        self._load_ended(run, set(run.job.block_ids), "timeout")

    def _run_load(self, run: LoadRun) -> None:
        """One load job, via staging: read and verified there, then scattered into the
        blocks unless cancelled meanwhile (a timeout). Never straight into the blocks
        (`PagePieces`): a read that outlives its timeout could not be stopped from
        writing into blocks given to another request meanwhile. A job larger than the
        staging pool loads in parts, one lease each."""
        job = run.job
        failed: set[int] = set(job.block_ids)
        kind = "error"
        try:
            tier = self.tier
            if self.disabled is not None or tier is None:
                kind = "disabled"
            else:
                size = max(1, self.pool.capacity_bytes // tier.page_bytes)
                if len(job.keys) <= size:
                    failed, kind = self._load_part(tier, run)
                else:
                    failed, kinds = set(), []
                    for start in range(0, len(job.keys), size):
                        end = start + size
                        part = dataclasses.replace(
                            job, block_ids=job.block_ids[start:end], keys=job.keys[start:end]
                        )
                        lost, part_kind = self._load_part(
                            tier, LoadRun(job=part, cancel=run.cancel.part())
                        )
                        failed |= lost
                        kinds += [part_kind] if lost else []
                    kind = kinds[0] if kinds else "error"
                    run.cancel.deliver(lambda: None)  # every part delivered (or failed)
        except Exception:
            logger.exception("load of request %s failed", job.req_id)
        self._load_ended(run, failed, kind)

    def _load_part(self, tier: Tier, run: LoadRun) -> tuple[set[int], str]:
        """`run`'s job (which fits the staging pool) through one staging lease."""
        job = run.job
        wait_s = SYNC_STAGING_WAIT_S if job.sync else LOAD_TIMEOUT_S / 2
        lease = tier.lease(len(job.keys), wait_s)
        if lease is None:
            return set(job.block_ids), "pool_exhausted"
        try:
            into = StagingRows(lease.rows(), self._scatter_rows(job, lease))
            later = self._invalidate_later if job.sync else None  # off the step
            return run_load(tier, run, into, self.stats, later)
        finally:
            lease.release()

    def _warm_up_loads(self) -> None:
        """Pay the first load's one-time costs here, on a load thread, not in the first
        request's step (issue 23): the host cache's byte views (saves use them too), and
        the store's statements (`Tier.warm_up`, which changes nothing a reader sees).
        Opens no file and reads no page."""
        tier = self.tier
        if tier is None or self.disabled is not None:
            return
        if not self._cuda:
            self._page_pieces([])
        tier.warm_up()

    def _page_pieces(self, block_ids: list[int]) -> list[list[memoryview]]:
        """The byte ranges of `block_ids`' pages in the host KV cache (its geometry's work
        done once per `register_kv_caches`)."""
        cached = self._host_pieces
        if cached is None or cached[0] is not self.segments:
            cached = self._host_pieces = (self.segments, HostBlockPieces(self.segments))
        return cached[1].pieces(block_ids)

    def _scatter_rows(self, job: LoadJob, lease: StagingBuffer) -> Callable[[list[int]], None]:
        """Scatters a load's intact staging rows into their blocks."""

        def scatter(good: list[int]) -> None:
            src = lease.tensor if len(good) == len(job.keys) else lease.tensor[good]
            self.scatter_ready([job.block_ids[i] for i in good], src)

        return scatter

    def scatter_ready(self, block_ids: list[int], src: torch.Tensor) -> None:
        """Scatter staged pages into the KV cache and wait until they are in place."""
        if not self._cuda:  # one memcpy per (block, layer) range (hf3fsctl.staging)
            scatter_blocks(self.segments, block_ids, src)
            return
        with torch.cuda.stream(self._load_stream):
            scatter_blocks(self.segments, block_ids, src)
        self._load_stream.synchronize()

    def _invalidate_later(self, pages: list[Location]) -> None:
        """Have the store forget a synchronous load's corrupt `pages`, on a load thread.

        The engine step must not wait for a metadata round trip; `drain` waits for it.
        """
        tier = self.tier
        if tier is None:
            return
        with self._lock:
            self._invalidating += 1
        try:
            self._submit_load(self._invalidate_job, tier, pages)
        except Exception as exc:  # pool shut down: best effort
            logger.warning("cannot invalidate %d corrupt pages: %s", len(pages), exc)
            self._invalidate_ended()

    def _invalidate_job(self, tier: Tier, pages: list[Location]) -> None:
        try:
            self.stats.add(invalidated=tier.invalidate(pages))
        finally:
            self._invalidate_ended()

    def _invalidate_ended(self) -> None:
        with self._lock:
            self._invalidating -= 1
            self._lock.notify_all()

    def _load_ended(self, run: LoadRun, failed: set[int], kind: str) -> None:
        with run.lock:
            if run.reported:
                return
            run.reported = True
        loaded = len(run.job.block_ids) - len(failed)
        elapsed = time.monotonic() - run.started
        if failed:
            self.stats.fail(kind, len(failed))
            if kind == IO:
                self.page_file_lost()  # its mount gone, or back as a new one: reopen it
            logger.warning(
                "load of request %s: %d of %d blocks failed (%s); they will be recomputed",
                run.job.req_id,
                len(failed),
                len(run.job.block_ids),
                kind,
            )
        self.stats.add(
            load_jobs=1,
            blocks_loaded=loaded,
            bytes_loaded=loaded * self.manifest.page_bytes,
            load_seconds=elapsed,
        )
        self.stats.observe("load_s", elapsed)
        with self._lock:
            if run.job.sync:  # never waited for through finished_recving
                self._load_errors.update(failed)
                return
            self._loads.pop(run.job.req_id, None)
            self._done_loads[run.job.req_id] = failed

    def _expire_loads(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [r for r in self._loads.values() if now - r.started > LOAD_TIMEOUT_S]
        for run in overdue:
            if run.cancel.cancel():  # else its pages are in the KV cache already
                self._load_ended(run, set(run.job.block_ids), "timeout")

    # --- reporting -----------------------------------------------------------------

    def idle(self, finished_req_ids: set[str]) -> bool:
        """Nothing can have ended since the last step: no load in flight or done, no
        failed block unreported, no finished request waiting for its saves (read
        unlocked: what a thread adds meanwhile is seen next step)."""
        return not (self._finished or self._loads or self._done_loads or self._load_errors) and (
            not (finished_req_ids and self._save_reqs)
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose saves ended (after vLLM finished them) and whose loads ended."""
        if self.idle(finished_req_ids):
            return None, None
        self._expire_loads()
        with self._lock:
            self._finished.update(r for r in finished_req_ids if r in self._save_reqs)
            sending = {r for r in self._finished if r not in self._outstanding}
            self._finished -= sending
            self._save_reqs -= sending
            recving = set(self._done_loads)
            for failed in self._done_loads.values():
                self._load_errors.update(failed)
            self._done_loads.clear()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids of loads that failed, reported once."""
        if not self._load_errors:
            return set()
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def drain(self, timeout_s: float) -> bool:
        """Wait until no save (or invalidation) is in flight; True if within the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._outstanding or self._invalidating or self._retrying:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(remaining)
        return True

    def shutdown(self) -> None:
        """Finish in-flight saves (bounded), then release threads, files and clients."""
        if not self.drain(SHUTDOWN_DRAIN_S):
            logger.warning("shutdown: saves still in flight after %.0f s", SHUTDOWN_DRAIN_S)
        self._save_pool.shutdown(wait=False, cancel_futures=True)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = set(self._load_futures)
        # A load thread still reading uses the engine, the file and the store: closing
        # them under it can crash the process (a SQLite connection closed mid-statement).
        # One stuck on a hung file system keeps them, for the process's exit to close.
        _, stuck = wait(running, timeout=SHUTDOWN_LOAD_WAIT_S)
        if stuck:
            logger.warning("shutdown: %d loads still running; their files stay open", len(stuck))
            self.health.retire()
            _LIVE_WORKERS.discard(self)
            return
        if self.engine is not None:
            self.engine.close()
        if self.page_file is not None:
            self.page_file.close()
        self.guard.close()
        self.health.retire()
        _LIVE_WORKERS.discard(self)
