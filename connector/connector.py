"""`Hf3fsctlConnector`: vLLM's KVConnectorBase_V1, as a facade.

Each method delegates to the scheduler-side object (`connector.scheduler`) in the
engine-core process or the worker-side object (`connector.worker`) in each worker
process; in-process vLLM builds one of each in the same process. Load with
`kv_connector="Hf3fsctlConnector"` and either the plugin entry point or
`kv_connector_module_path="hf3fsctl_connector.connector"`.

Implements vLLM's `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on: every
stored KV cache group (full attention, MLA, sliding window, chunked local attention,
Mamba "align" state) has its own namespace and worker side (`connector.group_workers`);
the scheduler side looks up the longest prefix every group can serve
(`hf3fsctl.kv_groups`).

Start-up checks: the configuration (`kv_connector_extra_config`) must load, every
transferable KV cache group must be one the connector stores (`namespace.kv_groups`:
one line naming what is not) and there is no pipeline parallelism, and a
`kv_load_failure_policy` other than "recompute" is warned about (a failed load would end
the request in an error instead of recomputing it).

Fixed costs (docs/design.md "Fixed costs"): the facade times its own calls on the engine
thread with `time.thread_time_ns` and records one CPU-time sample per engine step and
side (`StatsRecorder.step`): the scheduler's step ends with `build_connector_meta` (it
holds that step's matching and planning, and the previous step's output and events);
the worker's with `get_kv_connector_stats`, its calls after the forward timed as one span
from the first of them (`start_load_kv`, or `get_transfer_results` in a step whose
synchronous load ran before the forward) on. The clock costs ~0.7-2 µs a read here: 2
reads a worker step with nothing to load or save, 2 per call on the scheduler side (2 in
a step with nothing to plan); scheduler calls with nothing to do (`update_connector_output`
with nothing reported, `get_kv_connector_stats` with nothing to take, `take_events` with
KV events off) return before reading it.

Idle steps (docs/design.md "Idle steps, in the engine"): what vLLM calls every step is
cache-cold after a forward pass, so each Python call and object costs microseconds. A
step with nothing to do takes the shortest path: `has_connector_metadata` answers False
(the connector has no per-layer work, so vLLM's attention wrapper skips
`wait_for_layer_load` and `save_kv_layer` on every layer), `bind_connector_metadata`
opens the save gate only after a step that saved, the scheduler hands out one shared
empty metadata (`scheduler.NO_WORK`), and an idle `get_transfer_results` asks its side
once and lets `get_block_ids_with_load_errors` skip its calls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from time import thread_time_ns
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hf3fsctl.health import LEVELS
from hf3fsctl.kv_groups import GroupPlan

from .group_workers import GroupWorkers
from .metadata import Hf3fsctlConnectorMetadata
from .namespace import build_manifests, load_settings
from .scheduler import SchedulerSide
from .service import MetadataGuard
from .stats import STEP_SHIP_SAMPLES, StatsRecorder, hold_steps
from .vllm_stats import Hf3fsctlConnectorStats, Hf3fsctlPromMetrics
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# The step metadata is a plain dataclass (the worker side imports no vLLM); vLLM's base
# class is an ABC with no behaviour, so registering it is all the subclassing it needs.
KVConnectorMetadata.register(Hf3fsctlConnectorMetadata)


def _adopt_vllm_logging() -> None:
    """Send our loggers' records through vLLM's handlers (vLLM configures only "vllm")."""
    host = logging.getLogger("vllm")
    for name in ("hf3fsctl_connector", "hf3fsctl"):
        ours = logging.getLogger(name)
        if ours.handlers or logging.getLogger().handlers or not host.handlers:
            continue
        for handler in host.handlers:
            ours.addHandler(handler)
        ours.setLevel(host.level or logging.INFO)
        ours.propagate = False


class Hf3fsctlConnector(KVConnectorBase_V1, SupportsHMA):
    """Persistent, shareable KV pages on 3FS (or any POSIX file system)."""

    _cache_hit_source = getattr(CacheHitSource, "DISK", CacheHitSource.EXTERNAL_UNSPECIFIED)

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _adopt_vllm_logging()
        self.settings = load_settings(vllm_config)
        strict = None
        if self.settings.connector.strict_numerics:  # docs/design.md decision 15
            from hf3fsctl.vllm_tools.numerics import engine_numerics, strict_hash

            strict = strict_hash(engine_numerics(vllm_config))
        stored = build_manifests(vllm_config, kv_cache_config, numerics=strict)
        self.manifest = stored[0][1]  # the first group's (the only one of most models)
        self.groups = [
            GroupPlan(g.index, g.kind, m.namespace_id, g.window_tokens) for g, m in stored
        ]
        self.stats = StatsRecorder()
        # This step's connector CPU time on the engine thread so far (ns), and where the
        # worker's open span began (0: none open).
        self._step_ns = 0
        self._span_from = 0
        # Step samples kept here and recorded every `STEP_SHIP_SAMPLES` steps (and when
        # `process_totals` or `shutdown` asks, `flush_steps`): one list append per step
        # instead of the recorder's locks and histogram (cache-cold after a forward pass,
        # that costs tens of µs).
        self._steps: list[int] = []
        hold_steps(self)
        # This step's `get_transfer_results` found nothing in flight, so there are no
        # load errors either (reset by `get_block_ids_with_load_errors`).
        self._idle_step = False
        self._saved = False  # a step gathered saves: the next bind opens their gate
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None  # the first group's
        self.workers: GroupWorkers | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = self._kv_transfer_config.kv_load_failure_policy
            if policy != "recompute":
                logger.warning(
                    "kv_load_failure_policy=%r: a failed hf3fsctl load will fail the request "
                    "instead of recomputing it; set kv_load_failure_policy='recompute' "
                    "(`hf3fsctl vllm-config` does)",
                    policy,
                )
            events_config = vllm_config.kv_events_config
            self.scheduler_side = SchedulerSide(
                self.settings,
                self.manifest,
                MetadataGuard(self.settings),
                self.stats,
                kv_events=bool(events_config and events_config.enable_kv_cache_events),
                groups=self.groups,
                kv_role=self._kv_transfer_config.kv_role,
            )
            logger.info(
                "hf3fsctl connector scheduler (%s): namespace %s, storage %s, metadata %s%s",
                self.scheduler_side.kv_role,
                ", ".join(f"{p.namespace} ({p.kind} group {p.index})" for p in self.groups)
                if len(self.groups) > 1
                else self.manifest.namespace_id,
                self.settings.storage.path,
                self.settings.metadata_target.url,  # a password shows as ***
                "; hybrid KV cache groups: loads are asynchronous"
                if self.scheduler_side.hybrid and self.settings.connector.load_mode == "sync"
                else "",
            )
        else:
            batched = vllm_config.scheduler_config.max_num_batched_tokens
            step_blocks = -(-int(batched) // self.manifest.block_size)
            sides: dict[int, WorkerSide] = {}
            for group, manifest in stored:
                first = not sides
                sides[group.index] = WorkerSide(
                    self.settings,
                    manifest,
                    kv_cache_config,
                    self.stats,
                    staging_prewarm_bytes=step_blocks * manifest.page_bytes if first else 0,
                    pool=None if first else next(iter(sides.values())).pool,
                    group=group.index,
                )
            self.workers = GroupWorkers(sides)
            self.worker_side = self.workers.primary
            # One call to ask whether anything can have ended, and the health to report
            # (one group: its side's; several: `GroupWorkers` merges them).
            hybrid = self.workers.hybrid
            self._nothing_ended = self.workers.idle if hybrid else self.worker_side.idle
            self._health = None if hybrid else self.worker_side.health

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future miss, never lost data: no delivery guarantee."""
        return False

    # --- worker side ---------------------------------------------------------------

    @property
    def _worker(self) -> GroupWorkers:
        assert self.workers is not None, "worker-side method called on the scheduler"
        return self.workers

    @property
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "scheduler-side method called on a worker"
        return self.scheduler_side

    def _meta(self) -> Hf3fsctlConnectorMetadata:
        meta = self._connector_metadata
        return meta if isinstance(meta, Hf3fsctlConnectorMetadata) else Hf3fsctlConnectorMetadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from hf3fsctl.meta.models import WriterInfo
        from hf3fsctl.vllm_tools.numerics import engine_numerics, numerics_hash

        numerics = engine_numerics(self._vllm_config)  # the model is loaded: its backends
        for side in self._worker.sides.values():  # recorded with the first committed page
            side.writer = WriterInfo(id=numerics_hash(numerics), numerics=numerics)
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """A worker step begins: the last step's saves may start (`WorkerSide.step_began`)."""
        self._connector_metadata = connector_metadata  # what the base class does
        if self._saved:  # (only a step that gathered saves closes their gate)
            self._saved = False
            self._worker.step_began()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls it before each forward: saves still reading a preempted request's
        blocks (written from the blocks themselves) are not committed."""
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted:
            self._worker.handle_preemptions(preempted)

    def has_connector_metadata(self) -> bool:
        """False: no per-layer work, so vLLM's attention wrapper (`maybe_transfer_kv_layer`,
        its only caller) skips `wait_for_layer_load` and `save_kv_layer` on every layer."""
        return False

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads. With a synchronous load vLLM calls it before the
        forward (timed alone); otherwise after it, and the step's last timed span opens
        here (`get_kv_connector_stats` closes it)."""
        loads = getattr(self._connector_metadata, "loads", None)
        if loads and any(job.sync for job in loads):  # before the forward
            started = thread_time_ns()
            self._worker.start_load_kv(self._meta())
            self._step_ns += thread_time_ns() - started
            return
        self._span_from = thread_time_ns()
        if loads:
            self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        """Gather this step's saves (inside the step's last span when it is open; timed
        alone when vLLM calls it outside, after a draft model's forward)."""
        if not getattr(self._connector_metadata, "saves", None):  # most steps
            return
        self._saved = True
        if self._span_from:
            self._worker.wait_for_save(self._meta())
            return
        started = thread_time_ns()
        self._worker.wait_for_save(self._meta())
        self._step_ns += thread_time_ns() - started

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        started = thread_time_ns()
        sending, recving, _ = self._worker.transfer_results(finished_req_ids)
        self._step_ns += thread_time_ns() - started
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished saves and loads; with several groups, failed loads as requests.

        Inside the step's last timed span (opened here unless `start_load_kv` opened it;
        closed by `get_kv_connector_stats`: vLLM calls `get_block_ids_with_load_errors`
        and it right after this)."""
        if not self._span_from:
            self._span_from = thread_time_ns()
        if self._nothing_ended(finished_req_ids):
            self._idle_step = True
            # A fresh result with empty sets: vLLM's multiprocess aggregator and
            # MultiConnector combine them with `|=` and `update` (None would fail).
            return KVConnectorTransferResults()
        self._idle_step = False
        sending, recving, failed = self._worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._idle_step:  # nothing in flight: no load can have failed since
            self._idle_step = False
            return set()
        return self._worker.load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's counts; on a worker it also ends the step's connector time."""
        workers = self.workers
        if workers is not None:
            health = self._health  # one group's (None: several, the worst of them)
            data = self.stats.take(
                LEVELS[health.state] if health is not None else workers.health_level()
            )
            now = thread_time_ns()
            if self._span_from:
                self._step_ns += now - self._span_from
                self._span_from = 0
            steps = self._steps  # kept; recorded in batches
            steps.append(self._step_ns)
            self._step_ns = 0
            if len(steps) >= STEP_SHIP_SAMPLES:
                self.flush_steps()
        else:
            level = LEVELS[self._scheduler.health.state]
            if not self.stats.due(level):  # an idle interval (most steps): not timed
                return None
            started = thread_time_ns()
            data = self.stats.take(level)
            self._step_ns += thread_time_ns() - started  # the next step's sample
        return None if data is None else Hf3fsctlConnectorStats(data=data)

    def flush_steps(self) -> None:
        """Record the step samples kept so far (`stats.process_totals` calls it too)."""
        steps, self._steps = self._steps, []
        self.stats.steps("worker" if self.workers is not None else "scheduler", steps)

    def shutdown(self) -> None:
        self.flush_steps()
        if self.workers is not None:
            self.workers.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # --- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        started = thread_time_ns()
        matched = self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        self._step_ns += thread_time_ns() - started
        return matched

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:  # nothing to plan (most requests): not timed
            return
        started = thread_time_ns()
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        self._step_ns += thread_time_ns() - started

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's work for the workers; ends the scheduler side's step time."""
        started = thread_time_ns()
        meta = self._scheduler.build_connector_meta(scheduler_output)
        steps = self._steps  # kept; recorded in batches
        steps.append(self._step_ns + thread_time_ns() - started)
        self._step_ns = 0
        if len(steps) >= STEP_SHIP_SAMPLES:
            self.flush_steps()
        # A registered virtual subclass (above), which mypy cannot see.
        return meta  # type: ignore[return-value]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        scheduler = self.scheduler_side
        assert scheduler is not None, "scheduler-side method called on a worker"
        if not (
            connector_output.finished_recving
            or connector_output.failed_recving
            or connector_output.invalid_block_ids
            or scheduler.syncing
        ):  # nothing reported and no load to settle (most steps): not timed
            return
        started = thread_time_ns()
        scheduler.update_connector_output(connector_output)
        self._step_ns += thread_time_ns() - started

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        started = thread_time_ns()
        held = self._scheduler.request_finished(request)
        self._step_ns += thread_time_ns() - started
        return held

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`: hold every group's blocks while the request's saves run."""
        return self.request_finished(request, [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events of the shared store since the last step (connector/events.py)."""
        scheduler = self.scheduler_side
        if scheduler is None or not scheduler.group_events:  # KV events off: not timed
            return ()
        started = thread_time_ns()
        events = self._scheduler.take_events()
        self._step_ns += thread_time_ns() - started
        return events

    # --- stats ---------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return Hf3fsctlConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return Hf3fsctlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
