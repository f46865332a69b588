"""The hf3fsctl store as a secondary tier of vLLM's own offloading stack.

vLLM's `OffloadingConnector` with `TieringOffloadingSpec` keeps a CPU DRAM primary tier
in front and cascades chunks to secondary tiers behind it. `Hf3fsctlOffloadTier` is one
of those tiers (docs/design.md decision 17), loaded by `SecondaryTierFactory` from:

    "secondary_tiers": [{"type": "Hf3fsctlOffloadTier",
                         "module_path": "hf3fsctl_connector.offload_tier",
                         "config": "/etc/hf3fsctl/config.yaml"}]

(`hf3fsctl vllm-config --offloading` prints the whole kv-transfer-config.)

Contract:
    * Bytes move between the primary tier's memoryview (`primary_kv_view`, one chunk per
      `strides[0]` bytes) and the store through `hf3fsctl.tier.Tier`: the same
      allocate → write with checksums → commit, locate → read and verify path, page files,
      metadata client and capacity (LRU eviction, pins, quotas) as the connector.
    * Every call vLLM makes returns at once: stores and loads run on a small thread pool
      (`threads`, default 4), lookups on vLLM's `AsyncLookupManager` thread (RETRY until
      the batch of a step is answered). `drain_jobs` waits for the pool.
    * A store or load the store cannot serve (metadata down, no space, an I/O error, a
      corrupt page, a missing page) is a failed `JobResult`, never an exception into vLLM:
      vLLM keeps the chunk only in DRAM, or recomputes it. A failed load's keys are
      marked misses so the scheduler does not retry them; a corrupt page is dropped from
      the store (`Tier.load` invalidates it).
    * Configuration errors (an unknown key, a missing config file) raise one
      `ConfigError` line at construction, naming the key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hf3fsctl.errors import Hf3fsctlError
from hf3fsctl.tier import EXISTING, LOADED, SAVED, PagePieces

from .offload_tier_store import TierStore, offload_key, offload_manifest, tier_settings

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

__all__ = ["Hf3fsctlOffloadTier"]

_WARN_EVERY_S = 30.0


class _StoreLookups(AsyncLookupManager):
    """vLLM's async lookup state, answered by the store's metadata service."""

    def __init__(self, store: TierStore, tier_type: str) -> None:
        self._store = store
        self._warned_at = -_WARN_EVERY_S
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Committed or not, per key; a store that cannot answer is all misses (one
        warning per `_WARN_EVERY_S`, not one per step)."""
        try:
            self._store.ensure_registered()  # the namespace exists before the first store
            return self._store.present([offload_key(k) for k in keys])
        except Hf3fsctlError as exc:
            now = time.monotonic()
            if now - self._warned_at >= _WARN_EVERY_S:
                self._warned_at = now
                logger.warning("hf3fsctl offload tier: lookups are misses: %s", exc.message)
            return [False] * len(keys)


class Hf3fsctlOffloadTier(SecondaryTierManager):
    """A `SecondaryTierManager` on the hf3fsctl store (see the module doc)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **kwargs: Any,
    ) -> None:
        """Open the store a `secondary_tiers` entry names (see `tier_settings`).

        Raises:
            ConfigError: an unknown key or a bad value in the entry.
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        config = tier_settings(kwargs)
        locality = kwargs.get("locality")
        self.locality = Locality(locality) if locality is not None else None
        flat = primary_kv_view.ndim == 1 and primary_kv_view.format == "B"
        self._flat = primary_kv_view if flat else primary_kv_view.cast("B")
        self.store = TierStore(config, offload_manifest(offloading_spec, self.block_size_bytes))
        events_on = bool(kwargs.get("enable_kv_events", False))
        enabled = events_on and offloading_spec.kv_events_config.enable_kv_cache_events
        # Appended by job threads, taken by the scheduler: a deque, never swapped.
        self._events: deque[OffloadingEvent] | None = deque() if enabled else None
        self._pool = ThreadPoolExecutor(
            max_workers=int(kwargs.get("threads", 4)), thread_name_prefix="hf3fsctl-tier"
        )
        self._finished: deque[JobResult] = deque()
        self._pending: set[Future[None]] = set()
        self._pending_lock = threading.Lock()
        self._failed_keys: dict[int, list[OffloadKey]] = {}  # load job -> keys not loaded
        cache = offloading_spec.config.cache
        self._chunk_tokens = max(1, int(cache.tokens_per_hash) * int(cache.blocks_per_chunk))
        self._lookups = _StoreLookups(self.store, tier_type)

    # --- the pieces of the primary view ------------------------------------------

    def _chunk(self, chunk_id: int) -> memoryview:
        start = int(chunk_id) * self.block_size_bytes
        return self._flat[start : start + self.block_size_bytes]

    def _first_depth(self, job: TransferJob, keys: list[OffloadKey]) -> int:
        """The chain position of the job's first chunk (eviction takes tails first)."""
        position = job.req_context.get_offload_key_position(keys[0]) if keys else None
        return 0 if position is None else max(0, int(position) // self._chunk_tokens - 1)

    # --- jobs --------------------------------------------------------------------

    def _submit(self, job: TransferJob, work: Any) -> None:
        def run() -> None:
            started = time.monotonic()
            try:
                result = work()
            except Exception as exc:  # never into vLLM: a failed job, vLLM recomputes
                logger.warning("hf3fsctl offload tier job %d failed: %s", job.job_id, exc)
                if job.is_promotion:
                    self._failed_keys[job.job_id] = list(job.keys)
                result = JobResult(job_id=job.job_id, success=False)
            result.transfer_time = time.monotonic() - started
            self._finished.append(result)

        future = self._pool.submit(run)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Future[None]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def _store_job(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        try:
            tier = self.store.ensure_registered()
        except Hf3fsctlError as exc:
            logger.warning("hf3fsctl offload tier: store unusable: %s", exc.message)
            return JobResult(job_id=job.job_id, success=False)
        pages = [self._chunk(cid) for cid in job.chunk_ids]
        retention = self.store.config.retention  # no per-request params on this door
        outcome = tier.save(
            [offload_key(k) for k in keys],
            pages,
            self._first_depth(job, keys),
            retention_s=retention.default,
            renew_on_read=retention.default is not None and retention.renew_on_read,
        )
        ok = all(kind in (SAVED, EXISTING) for kind in outcome.kinds)
        if outcome.unregistered:  # the store's metadata was reset: register with the next
            self.store.forget_registration()
        if not ok:
            logger.info(
                "hf3fsctl offload tier: store of %d chunks: %s", len(keys), outcome.failures()
            )
        elif self._events is not None:
            self._events.append(
                OffloadingEvent(
                    keys=keys, medium=Medium.STORAGE, removed=False, locality=self.locality
                )
            )
        saved = outcome.count(SAVED)
        return JobResult(
            job_id=job.job_id, success=ok, transfer_bytes=saved * self.block_size_bytes
        )

    def _load_job(self, job: TransferJob) -> JobResult:
        keys = list(job.keys)
        try:
            tier = self.store.ensure_registered()
        except Hf3fsctlError as exc:
            logger.warning("hf3fsctl offload tier: store unusable: %s", exc.message)
            return self._failed_load(job, keys, [])
        into = PagePieces([[self._chunk(cid)] for cid in job.chunk_ids])
        outcome = tier.load([offload_key(k) for k in keys], into)
        loaded = [keys[i] for i, kind in enumerate(outcome.kinds) if kind == LOADED]
        if len(loaded) == len(keys):
            return JobResult(
                job_id=job.job_id, success=True, transfer_bytes=len(keys) * self.block_size_bytes
            )
        logger.info("hf3fsctl offload tier: load of %d chunks: %s", len(keys), outcome.failures())
        return self._failed_load(job, keys, loaded)

    def _failed_load(
        self, job: TransferJob, keys: list[OffloadKey], loaded: list[OffloadKey]
    ) -> JobResult:
        done = set(loaded)
        self._failed_keys[job.job_id] = [k for k in keys if k not in done]
        return JobResult(
            job_id=job.job_id,
            success=False,
            successful_keys=tuple(loaded) if loaded else None,
            transfer_bytes=len(loaded) * self.block_size_bytes,
        )

    # --- SecondaryTierManager ----------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT / MISS from the store, RETRY while the step's batch is being answered."""
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's primary chunks to the store, in the background."""
        self._submit(job_metadata, lambda: self._store_job(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's chunks from the store into the primary slots, in the background."""
        self._submit(job_metadata, lambda: self._load_job(job_metadata))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs that ended since the last call; a failed load's keys become misses."""
        results = []
        while self._finished:
            result = self._finished.popleft()
            failed = self._failed_keys.pop(result.job_id, None)
            if failed:
                self._lookups.mark_miss(failed)
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        """Whether jobs are still running (vLLM keeps stepping to collect them)."""
        with self._pending_lock:
            return bool(self._pending) or bool(self._finished)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """BlockStored events of chunks this tier stored (`enable_kv_events`)."""
        while self._events:
            yield self._events.popleft()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        """Block until every submitted job has ended (its result is queued)."""
        while True:
            with self._pending_lock:
                pending = list(self._pending)
            if not pending:
                return
            for future in pending:
                future.exception()

    def shutdown(self) -> None:
        """Stop the lookup thread and the pool, then close the store."""
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self.store.close()
        if self._flat is not self._primary_kv_view:
            self._flat.release()  # the primary tier's mmap closes after us
