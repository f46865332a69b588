"""Scheduler side of the connector: lookups, load plans, save plans, block holding.

Contract:
    * Block keys are vLLM's `request.block_hashes` in hex. One metadata `lookup` per
      waiting request runs on a small thread pool; `get_num_new_matched_tokens` waits
      for it at most `connector.lookup_wait_ms`, returns None while it is still in
      flight (vLLM asks again next step) and treats a lookup older than
      `metadata.timeout_s`, or any failure, as a miss. The last prompt token is never
      covered. `lookup_wait_ms` is the whole step's budget, all its requests together.
    * An embedded store (`sqlite:///`, in this process) is answered on the engine
      thread instead, in the same call, while the step's budget lasts (docs/design.md
      "Fixed costs": a thread hand-off per request cost more than the lookup): a hit is
      offered in the step that first asks, as vLLM's own prefix cache would be. Its time
      counts against the budget; a lookup that takes longer than `lookup_wait_ms` sends
      lookups back to the threads for `metadata.retry_backoff_s`, so a slow store costs
      a step at most one lookup per back-off (one that blocks, on a hung file system or
      a SQLite lock, holds that step until it returns or fails, as a synchronous load's
      read of the same file system would). A service (HTTP, Redis) is never asked on
      the engine thread. Admission lookups
      (they write) always run on the threads. The scheduler opens its client when it is
      built (an embedded store on the engine thread, as the worker's registration does;
      any other in the background), so no request pays for opening it.
    * With `connector.load_mode` "sync" a hit is `(tokens, False)`: the workers load it
      before the forward of the step that computes the rest of the prompt, and report
      failed blocks in that step (vLLM recomputes them); with "async" it is
      `(tokens, True)` and the request waits for `finished_recving`.
    * `build_connector_meta` drains the step's work: loads planned by
      `update_state_after_alloc`, and saves of prompt blocks that become full this step
      and are not already stored or being saved (decode blocks only with
      `connector.save_decode_blocks`). Each block is planned for saving once.
    * `request_finished` returns True (hold the blocks) when any save job was issued
      for the request; the workers report it in `finished_sending` once those saves end
      (both sides decide from the same metadata, so they agree).
    * A preempted request loses its blocks: its cached lookup is dropped, nothing is
      ever planned against blocks it no longer owns, and the step's metadata names it
      (`preempted`) when it had save jobs, so the workers stop trusting saves still
      reading those blocks before the forward that may reuse them.
    * While the metadata service is marked down: no lookups (misses) and no saves.
    * Roles and per-request params (`connector.request_params`): vLLM's `kv_role`
      `kv_producer` saves and never loads, `kv_consumer` loads and never saves,
      `kv_both` does both; a request's `kv_transfer_params` `save: false` / `load:
      false` narrow that further (never widen it). A request that neither saves nor
      loads is never looked up; one that only saves is looked up (its stored prefix is
      not saved again) and offered no tokens. Its `retention` (else
      `retention.default`) and `pin` travel in its save jobs: the worker commits the
      entries with that expiry and pins them; keys it found stored are pinned here.
    * Admission (`connector.store_after_hits` N > 1; never asked otherwise): with the
      lookup, off the engine thread, `admit` records one sighting of each prompt key
      past the stored prefix; only the admitted run right after it is saved
      (`request_params.admitted_upto`), decode blocks only when the whole prompt was.
      A failed `admit` saves nothing new; a preempted request is not asked again.
    * Hybrid models (several KV cache groups, `groups`): the lookup is
      `hf3fsctl.kv_groups.longest_hit` below the last prompt token (every group must
      hold what the hit needs, or no load); a load plans one job per group for the
      blocks vLLM allocated for the external tokens (its null block marks the rest);
      saves are per group: every full block of full-attention and sliding-window
      groups, and a Mamba group's state block when the step's chunk ended on that
      block's boundary. Loads are asynchronous: vLLM takes failures of a multi-group
      model only as failed requests, and one is never offered a load again.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from hf3fsctl.config import Config
from hf3fsctl.errors import Hf3fsctlError, StorageError
from hf3fsctl.health import ConnectorHealth
from hf3fsctl.keys import NamespaceManifest, block_keys
from hf3fsctl.kv_groups import CHUNKED, FULL, MAMBA, SLIDING, GroupPlan, longest_hit
from hf3fsctl.meta.protocol import PreparesLookups
from hf3fsctl.storage.layout import RootCheck

from .events import StoreEvents, block_payloads
from .metadata import Hf3fsctlConnectorMetadata, LoadJob, RequestState, SaveJob
from .request_params import admitted_upto, decide, parse_request_params, pin_saved, save_terms
from .service import MetadataGuard
from .stats import StatsRecorder

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LOOKUP_THREADS = 4
# The storage root's check (a stat, on its own thread): what a step waits for its answer,
# and how long an unanswered one may take before the root counts as hung (misses).
STORAGE_CHECK_WAIT_S = 0.05
STORAGE_CHECK_TIMEOUT_S = 1.0
# vLLM's BlockPool takes block 0 as its null block: the placeholder a sliding-window or
# Mamba group's block table holds where vLLM keeps no KV (never saved, never loaded).
NULL_BLOCK_ID = 0
# Our group kinds as vLLM's `KVCacheSpecKind` values (what its KV events carry).
_SPEC_KINDS = {
    FULL: "full_attention",
    SLIDING: "sliding_window",
    CHUNKED: "chunked_local_attention",
    MAMBA: "mamba",
}


# A step with no load to start and no save to plan: one shared metadata (workers only
# read it), not three objects per step.
NO_WORK = Hf3fsctlConnectorMetadata(loads=[], saves=[])


def _runs(positions: list[int]) -> list[list[int]]:
    """`positions` (ascending) cut into runs of consecutive positions."""
    runs: list[list[int]] = []
    for position in positions:
        if runs and runs[-1][-1] + 1 == position:
            runs[-1].append(position)
        else:
            runs.append([position])
    return runs


class SchedulerSide:
    """Bookkeeping of the scheduler process; never does I/O on the engine thread."""

    def __init__(
        self,
        config: Config,
        manifest: NamespaceManifest,
        guard: MetadataGuard,
        stats: StatsRecorder,
        *,
        kv_events: bool = False,
        groups: list[GroupPlan] | None = None,
        kv_role: str | None = "kv_both",
    ) -> None:
        self.config = config
        # vLLM's kv_role: what this engine does with the store (None: as kv_both).
        self.kv_role = kv_role or "kv_both"
        self.role_saves = self.kv_role in ("kv_producer", "kv_both")
        self.role_loads = self.kv_role in ("kv_consumer", "kv_both")
        self.after_hits = config.connector.store_after_hits
        self._admit_warned = False
        self.manifest = manifest
        self.namespace = manifest.namespace_id
        self.block_size = manifest.block_size
        # Every stored KV cache group; one full-attention group for most models.
        self.groups = groups or [GroupPlan(0, FULL, self.namespace)]
        self.hybrid = len(self.groups) > 1 or self.groups[0].kind != FULL
        self.guard = guard
        self.stats = stats
        self._requests: dict[str, RequestState] = {}
        # Per-step loops visit only requests with work (docs/design.md "Fixed costs"):
        self._saved_all: set[str] = set()  # requests with nothing left to plan a save for
        self.syncing: set[str] = set()  # requests whose synchronous load is unsettled
        self._pending_loads: list[LoadJob] = []
        self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="hf3fsctl-lookup")
        # vLLM takes no block-level load errors from a model with several KV cache
        # groups, only failed requests, which it reports for asynchronous loads alone.
        self._sync = config.connector.load_mode == "sync" and not self.hybrid
        self.health = ConnectorHealth(
            role="scheduler", rank=0, namespace=self.namespace, storage_path=config.storage.path
        )
        self._storage_checked_at = -1e9  # monotonic time of the last storage check
        self._storage_check: RootCheck | None = None  # the one in flight
        self._lookup_failing = False  # a typed lookup failure was logged, none succeeded since
        # What is left of this scheduler step's `lookup_wait_ms` (reset per step).
        self._wait_s = config.connector.lookup_wait_ms / 1000.0
        self._step_wait_left = self._wait_s
        # Lookups of an embedded store run on the engine thread (`_lookup_inline`) unless
        # one was slow: then on the threads until this monotonic time.
        self._embedded = config.metadata_target.embedded
        self._inline_paused_until = 0.0
        self._storage_ok = True
        # KV events for routers (vLLM's --kv-events-config): see connector/events.py;
        # one follower per stored group's namespace.
        self.group_events: dict[int, StoreEvents] = (
            {
                plan.index: StoreEvents(
                    guard,
                    plan.namespace,
                    num_ranks=manifest.num_ranks,
                    block_size=self.block_size,
                    medium=config.connector.kv_events_medium,
                    poll_s=config.connector.kv_events_poll_s,
                    group_idx=plan.index,
                    spec_kind=_SPEC_KINDS.get(plan.kind) if self.hybrid else None,
                    sliding_window=(plan.window_tokens or None) if plan.kind == SLIDING else None,
                )
                for plan in self.groups
            }
            if kv_events
            else {}
        )
        self.events = next(iter(self.group_events.values()), None)
        self._open_client()

    def _open_client(self) -> None:
        """Open the metadata client now, not in the first request's lookup: an embedded
        store here (a local file, opened on this thread, whose connection its inline
        lookups then use), any other on a lookup thread. A failure is left to the first
        lookup, which serves a miss and marks the service down."""
        if not self._embedded:
            self._pool.submit(self._open_quietly)
            return
        self._open_quietly(prepare=True)

    def _open_quietly(self, prepare: bool = False) -> None:
        """Open the client; with `prepare`, also have an embedded store compile its
        lookup statements on this thread's connection (`prepare_lookup`, reads only), so
        that the first requests' inline lookups compile nothing (issue 23)."""
        try:
            client = self.guard.client()
            if prepare and isinstance(client, PreparesLookups):
                client.prepare_lookup()
        except Exception as exc:  # the first lookup tries again (and reports it)
            logger.debug("opening metadata %s at start failed: %s", self.guard.url, exc)

    def take_events(self) -> list[Any]:
        """Every group's queued KV events (`StoreEvents.take_events`)."""
        return [event for events in self.group_events.values() for event in events.take_events()]

    def storage_available(self) -> bool:
        """Whether the storage root exists here (checked every `storage_retry_s`).

        With no storage there is nothing to load: every lookup is a miss, without
        asking the metadata service (which may still list pages nobody can read).
        """
        now = time.monotonic()
        check = self._storage_check
        if (
            check is None
            and now - self._storage_checked_at >= self.config.connector.storage_retry_s
        ):
            self._storage_checked_at = now
            # Off the engine thread: a stat on a hung file system never returns. A
            # healthy one answers within the short wait, so the step sees its result.
            check = self._storage_check = RootCheck(self.config.storage.path)
            check.done(STORAGE_CHECK_WAIT_S)
        if check is not None:
            if check.done():
                self._storage_check = None
                self._storage_checked(check.problem)
            elif now - check.started > STORAGE_CHECK_TIMEOUT_S and self._storage_ok:
                self._storage_checked(check.hung())  # misses until it answers
        return self._storage_ok

    def _storage_checked(self, problem: StorageError | None) -> None:
        self._storage_ok = problem is None
        if problem is not None:  # missing, not a directory, its file system gone or hung
            self.health.disable(
                problem.message,
                f"{problem.hint}; the connector serves misses until it is back",
            )
        elif self.health.state != "ok":
            self.health.recover()

    # --- matching ----------------------------------------------------------------

    def _state(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            params = parse_request_params(request.kv_transfer_params)
            saves, loads = decide(params, self.role_saves, self.role_loads)
            state = RequestState(request=request, params=params, saves=saves, loads=loads)
            self._requests[request.request_id] = state
        return state

    def _prompt_keys(self, request: Request) -> list[str]:
        full = min(request.num_prompt_tokens // self.block_size, len(request.block_hashes))
        return block_keys(request.block_hashes[:full])

    def _timed_lookup(
        self, keys: list[str], limit: int, admit: bool, admitted_upto: int | None
    ) -> tuple[int, int | None]:
        """(stored prefix blocks, blocks that may be saved) — the second is
        `admitted_upto` unchanged unless `admit`."""
        started = time.monotonic()
        hits = self.guard.call(
            lambda client: longest_hit(self.groups, keys, limit, self.block_size, client.lookup)
        )
        self.stats.observe("lookup_s", time.monotonic() - started)
        return hits, (self._admit(keys, hits) if admit else admitted_upto)

    def _inline_ok(self) -> bool:
        """Whether this lookup may run on the engine thread: an embedded store whose
        client is open, budget left in this step, and no slow lookup lately."""
        return (
            self._embedded
            and self._step_wait_left > 0
            and self.guard.is_open
            and time.monotonic() >= self._inline_paused_until
        )

    def _lookup_inline(
        self, keys: list[str], limit: int, admitted: int | None
    ) -> Future[tuple[int, int | None]]:
        """`_timed_lookup` on this (the engine) thread, as a finished future."""
        future: Future[tuple[int, int | None]] = Future()
        started = time.monotonic()
        try:
            future.set_result(self._timed_lookup(keys, limit, False, admitted))
        except Exception as exc:  # resolved as the threads' failures are
            future.set_exception(exc)
        took = time.monotonic() - started
        self._step_wait_left -= took
        if took > self._wait_s:
            self._inline_paused_until = time.monotonic() + self.guard.backoff_s
            logger.warning(
                "a lookup of the embedded metadata store took %.1f ms (connector."
                "lookup_wait_ms %.0f): lookups run off the engine step for %.0f s",
                took * 1000,
                self._wait_s * 1000,
                self.guard.backoff_s,
            )
        return future

    def _admit(self, keys: list[str], hits: int) -> int | None:
        """`request_params.admitted_upto` of the store's answer for the keys past `hits`."""
        rest = keys[hits:]
        if not rest:
            return None
        try:
            admitted = self.guard.call(lambda c: c.admit(self.namespace, rest, self.after_hits))
        except Exception as exc:  # saves nothing new; the request runs as a miss would
            if not self._admit_warned:
                self._admit_warned = True
                logger.warning("admission (store_after_hits) failed: %s; not saving", exc)
            return hits
        upto = admitted_upto(hits, admitted)
        if upto is not None:  # this engine's own count of what admission kept from saving
            self.stats.add(admission_skipped_blocks=len(keys) - upto)
        return upto

    def _pin_stored(self, keys: list[str], ttl_s: float | None) -> None:
        """Pin a request's keys the store already holds (off the engine thread)."""
        for plan in self.groups:
            self._pool.submit(pin_saved, self.guard.call, plan.namespace, keys, ttl_s)

    def _hit_limit(self, request: Request, keys: list[str]) -> int:
        """The most blocks a hit may cover: a windowed or state group needs the exact
        boundary, so its hit is looked up below the last prompt token; otherwise the
        whole stored prefix is asked for and clipped later."""
        if not self.hybrid:
            return len(keys)
        return min(len(keys), (request.num_tokens - 1) // self.block_size)

    def _resolve_lookup(self, state: RequestState) -> bool:
        """Fill `state.hit_blocks` if the lookup is done or overdue; False while pending."""
        if state.hit_blocks is not None:
            return True
        if state.lookup is None:
            keys = self._prompt_keys(state.request)
            capture = self.config.connector.capture  # capture mode: load nothing
            if not keys or capture or not (state.saves or state.loads):
                state.hit_blocks = 0
                return True
            admit = state.saves and self.after_hits > 1 and not state.admission_done
            if not self.guard.available() or not self.storage_available():
                self.stats.add(misses=1)
                state.hit_blocks = 0
                if admit:  # not admitted: nothing is saved if the service comes back
                    state.admitted_upto = 0
                return True
            state.lookup_started = time.monotonic()
            limit = self._hit_limit(state.request, keys)
            if admit:  # asked once per request; nothing is saved until it answers
                state.admission_done, state.admitted_upto = True, 0
            self.stats.add(lookup_blocks=len(keys))
            if not admit and self._inline_ok():
                state.lookup = self._lookup_inline(keys, limit, state.admitted_upto)
            else:
                state.lookup = self._pool.submit(
                    self._timed_lookup, keys, limit, admit, state.admitted_upto
                )
                # A fast store answers within this step; a slow or dead one costs the
                # whole step (all its requests together) at most `lookup_wait_ms`, and
                # is asked again on a later step.
                if self._step_wait_left <= 0:
                    return False
                waited = time.monotonic()
                wait([state.lookup], timeout=self._step_wait_left)
                self._step_wait_left -= time.monotonic() - waited
        future: Future[tuple[int, int | None]] = state.lookup
        if not future.done():
            if time.monotonic() - state.lookup_started < self.config.metadata.timeout_s:
                return False
            logger.warning(
                "lookup of request %s took longer than %.2f s: served as a miss",
                state.request.request_id,
                self.config.metadata.timeout_s,
            )
            self.stats.add(misses=1)
            state.hit_blocks = 0
            return True
        try:
            hits, state.admitted_upto = future.result()
        except Hf3fsctlError as exc:  # typed: one line until a lookup succeeds again (none
            # while the guard has the outage, which it logged: a down or unopenable store)
            quiet = self._lookup_failing or not self.guard.available()
            self._lookup_failing = True
            logger.log(
                logging.DEBUG if quiet else logging.WARNING,
                "lookup failed (%s): served as a miss",
                exc,
            )
            self.stats.add(misses=1)
            hits = 0
        except Exception:
            logger.exception("lookup failed unexpectedly: served as a miss")
            self.stats.add(misses=1)
            hits = 0
        else:
            self.stats.add(lookups=1)
            self._lookup_failing = False
        state.hit_blocks = int(hits)
        state.stored_upto = max(state.stored_upto, state.hit_blocks)
        if state.params.pin and state.hit_blocks:
            keys = self._prompt_keys(state.request)[: state.hit_blocks]
            self._pin_stored(keys, state.params.pin_ttl_s)
        return True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond `num_computed_tokens` (None while the lookup runs)."""
        state = self._state(request)
        if not self._resolve_lookup(state):
            return None, False
        assert state.hit_blocks is not None
        state.local_computed_tokens = num_computed_tokens
        if not state.loads:  # kv_producer, or the request's `load: false`
            return 0, False
        # Never cover the last token: vLLM must compute at least one to sample from.
        limit = (request.num_tokens - 1) // self.block_size
        loadable = min(state.hit_blocks, limit)
        if self.hybrid and state.hit_blocks > limit:
            loadable = 0  # a shorter prefix would need other window / state pages
        new_blocks = loadable - num_computed_tokens // self.block_size
        if new_blocks <= 0 or new_blocks < self.config.connector.min_hit_blocks:
            return 0, False
        return new_blocks * self.block_size, not self._sync

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load into the blocks vLLM just allocated for the external tokens."""
        if num_external_tokens <= 0:
            return
        state = self._state(request)
        first = state.local_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        hit = first + count
        if len(request.block_hashes) < hit:
            logger.error(
                "request %s: %d block hashes for a load of %d blocks; not loading",
                request.request_id,
                len(request.block_hashes),
                hit,
            )
            return
        per_group = blocks.blocks
        jobs: list[LoadJob] = []
        for plan in self.groups:
            table = per_group[plan.index]
            if len(table) < hit:
                logger.error(
                    "request %s: group %d has %d blocks for a load of %d; not loading",
                    request.request_id,
                    plan.index,
                    len(table),
                    hit,
                )
                return
            # What vLLM allocated for the external tokens: every block for full
            # attention, the window for sliding window, the boundary state for Mamba.
            positions = [p for p in range(first, hit) if not table[p].is_null]
            if not positions:
                continue
            jobs.append(
                LoadJob(
                    request.request_id,
                    [table[p].block_id for p in positions],
                    block_keys([request.block_hashes[p] for p in positions]),
                    self._sync,
                    plan.index,
                )
            )
        self._pending_loads.extend(jobs)
        state.load_first = first
        state.load_block_ids = [b for job in jobs for b in job.block_ids]
        state.load_failed_at, state.load_sync = None, self._sync
        if self._sync:
            self.syncing.add(request.request_id)
        self.stats.add(hit_blocks=count, hit_tokens=count * self.block_size)
        state.stored_upto = max(state.stored_upto, hit)

    # --- per step ----------------------------------------------------------------

    def _save_limit(self, request: Request, tokens_after_step: int) -> int:
        """Blocks of `request` whose KV is complete after this step and may be saved."""
        limit = tokens_after_step
        if not self.config.connector.save_decode_blocks:
            limit = min(limit, request.num_prompt_tokens)
        return min(limit // self.block_size, len(request.block_hashes))

    def _block_ids(self, output: SchedulerOutput, req_id: str) -> tuple[list[int], ...] | None:
        state = output.kv_connector_block_state
        if state is None or req_id not in state.req_ids:
            return None
        return tuple(list(ids) for ids in state.resolve_block_ids(req_id))

    def _group_saves(
        self,
        plan: GroupPlan,
        state: RequestState,
        table: list[int],
        span: tuple[int, int, int],
    ) -> list[SaveJob]:
        """One group's save jobs for blocks [start, full) (`tokens`: computed after the step)."""
        start, full, tokens = span
        request = state.request
        if plan.kind == MAMBA:
            # A state block holds the state after exactly its blocks only when the
            # step's chunk ended on that block boundary (vLLM "align" mode).
            positions = [full - 1] if tokens == full * self.block_size else []
        else:
            positions = list(range(start, full))
        positions = [p for p in positions if p < len(table) and table[p] != NULL_BLOCK_ID]
        terms = save_terms(state.params, self.config.retention)
        return [
            SaveJob(
                request.request_id,
                [table[p] for p in run],
                block_keys([request.block_hashes[p] for p in run]),
                run[0],
                plan.index,
                **terms,
            )
            for run in _runs(positions)
        ]

    def _plan_saves(self, output: SchedulerOutput) -> list[SaveJob]:
        saves: list[SaveJob] = []
        saving = self.guard.available() or self.config.connector.capture  # (kept in memory)
        decode = self.config.connector.save_decode_blocks
        for req_id, scheduled in output.num_scheduled_tokens.items():
            if req_id in self._saved_all:
                continue
            state = self._requests.get(req_id)
            if state is None or state.hit_blocks is None:
                continue
            if not state.saves:  # kv_consumer, or the request's `save: false`: never
                self._saved_all.add(req_id)
                continue
            request = state.request
            full = self._save_limit(request, request.num_computed_tokens + scheduled)
            cap = request.num_prompt_tokens // self.block_size
            if state.admitted_upto is not None:  # connector.store_after_hits
                full, cap = min(full, state.admitted_upto), min(cap, state.admitted_upto)
            start = state.stored_upto
            if full <= start:
                if not decode and start >= cap:  # every prompt block planned: never again
                    self._saved_all.add(req_id)
                continue
            state.stored_upto = full
            if not decode and full >= cap:  # its last prompt block: never visited again
                self._saved_all.add(req_id)
            if not saving:
                self.stats.add(save_dropped=full - start)
                continue
            tables = self._block_ids(output, req_id)
            if tables is None or any(
                len(tables[p.index]) < full for p in self.groups if p.kind == FULL
            ):
                logger.error("request %s: no block ids for blocks %d..%d", req_id, start, full)
                continue
            tokens = request.num_computed_tokens + scheduled
            jobs = [
                job
                for plan in self.groups
                for job in self._group_saves(plan, state, tables[plan.index], (start, full, tokens))
            ]
            saves.extend(jobs)
            for job in jobs:
                events = self.group_events.get(job.group)
                if events is not None:
                    first = job.first_depth
                    last = first + len(job.keys)
                    events.record_saves(block_payloads(request, first, last, self.block_size))
            state.save_jobs += len(jobs)
        return saves

    def build_connector_meta(self, output: SchedulerOutput) -> Hf3fsctlConnectorMetadata:
        """Drain this step's loads and plan its saves."""
        self._step_wait_left = self._wait_s  # a new step
        if (
            not (self._pending_loads or output.preempted_req_ids or output.finished_req_ids)
            and output.num_scheduled_tokens.keys() <= self._saved_all
        ):  # most decode steps: no per-request loop, no objects
            return NO_WORK
        preempted: list[str] = []
        if output.preempted_req_ids:
            self.stats.add(preempted=len(output.preempted_req_ids))
        for req_id in output.preempted_req_ids or ():
            state = self._requests.get(req_id)
            if state is not None:  # its blocks are gone: ask the store again on resume
                state.lookup, state.hit_blocks = None, None
                if state.save_jobs:  # saves may still be reading its blocks
                    preempted.append(req_id)
        meta = Hf3fsctlConnectorMetadata(
            loads=self._pending_loads, saves=self._plan_saves(output), preempted=preempted
        )
        self._pending_loads = []
        for req_id in output.finished_req_ids:
            self._requests.pop(req_id, None)
            self._saved_all.discard(req_id)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Learn which loads failed, so a request is never offered the same bad blocks."""
        for req_id in output.failed_recving or ():
            failed = self._requests.get(req_id)
            if failed is not None:  # vLLM recomputes it: never offer that load again
                failed.hit_blocks = 0
        invalid = output.invalid_block_ids or set()
        if invalid:
            for state in self._requests.values():
                for index, block in enumerate(state.load_block_ids):
                    if block in invalid:
                        failed_at = state.load_failed_at
                        state.load_failed_at = index if failed_at is None else min(index, failed_at)
                        break
        # A synchronous load ended in the step that reported it: it is never in
        # finished_recving, so settle it here.
        synced, self.syncing = list(self.syncing), set()
        for req_id in synced + list(output.finished_recving or ()):
            done = self._requests.get(req_id)
            if done is None or not done.load_block_ids:
                continue
            if done.load_failed_at is not None and done.hit_blocks is not None:
                done.hit_blocks = min(done.hit_blocks, done.load_first + done.load_failed_at)
            done.load_block_ids, done.load_failed_at, done.load_sync = [], None, False

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks while this request's saves may still be running."""
        state = self._requests.pop(request.request_id, None)
        self._saved_all.discard(request.request_id)
        return (state is not None and state.save_jobs > 0), None

    def shutdown(self) -> None:
        """Stop the lookup threads (pending lookups are abandoned); close the client.

        Closing flushes an embedded store's lookup counters (`hf3fsctl stats` shows them).
        """
        self._pool.shutdown(wait=False, cancel_futures=True)
        for events in self.group_events.values():
            events.close()
        self.guard.close()
        self.health.retire()
