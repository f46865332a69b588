"""Per-step metadata (scheduler → workers) and the scheduler's per-request state.

Contract: `Hf3fsctlConnectorMetadata` is everything a worker needs for one step and is
pickled to worker processes, so it holds plain data only. Block ids index the KV
cache's blocks (one pool for every group under vLLM's hybrid manager); keys are hex
block hashes, one per block id, in prefix order; each job moves the pages of one KV
cache group (`group`), stored in that group's namespace.

Imports no vLLM, so the worker side runs (and is tested on a GPU machine) without it:
`connector.connector` registers `Hf3fsctlConnectorMetadata` as a virtual subclass of
vLLM's `KVConnectorMetadata` (an ABC with no behaviour of its own).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .request_params import DEFAULT_PARAMS, RequestParams

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class LoadJob:
    """Read stored pages into blocks the scheduler allocated for a waiting request."""

    req_id: str  # the request whose blocks are filled; reported in finished_recving
    block_ids: list[int]  # destination KV blocks, one per key
    keys: list[str]  # block keys, in prefix order
    sync: bool = False  # load before this step's forward; errors reported in this step
    group: int = 0  # the KV cache group (index in vLLM's kv_cache_groups) loaded into


@dataclass
class SaveJob:
    """Store blocks that became full in this step (gathered before the step returns, or
    written from the blocks themselves: `WorkerSide.wait_for_save`)."""

    req_id: str  # the request owning the blocks (held until saves finish)
    block_ids: list[int]  # source KV blocks, one per key
    keys: list[str]  # block keys, in prefix order
    first_depth: int  # chain position of keys[0] (eviction drops tails first)
    group: int = 0  # the KV cache group (index in vLLM's kv_cache_groups) saved from
    retention_s: float | None = None  # the entries' expiry after commit (None: never)
    renew_on_read: bool = False  # a load of the entries renews their expiry
    pin: bool = False  # pin the keys once committed (the request's kv_transfer_params)
    pin_ttl_s: float | None = None  # with `pin`: the pin's TTL (None: until unpinned)


@dataclass
class Hf3fsctlConnectorMetadata:
    """One step's work for the workers (a `KVConnectorMetadata`, registered by the facade)."""

    loads: list[LoadJob] = field(default_factory=list)  # sync: before the forward; async: after
    saves: list[SaveJob] = field(default_factory=list)  # gather in wait_for_save
    # requests vLLM preempted this step that had save jobs: their blocks may be reused
    # by this step's forward (`WorkerSide.handle_preemptions`, before it)
    preempted: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        """Whether the step carries no transfer."""
        return not self.loads and not self.saves and not self.preempted


@dataclass
class RequestState:
    """What the scheduler side remembers about one live request."""

    request: Request  # vLLM's live request (block_hashes grows with its tokens)
    params: RequestParams = DEFAULT_PARAMS  # its kv_transfer_params, parsed once
    saves: bool = True  # its blocks may be saved (kv_role and its `save`)
    loads: bool = True  # stored blocks may be loaded for it (kv_role and its `load`)
    # lookup (and admission) running off the engine thread: (hit blocks, admitted_upto)
    lookup: Future[tuple[int, int | None]] | None = None
    lookup_started: float = 0.0  # monotonic time the lookup was submitted
    hit_blocks: int | None = None  # leading prompt blocks stored (None: not known yet)
    local_computed_tokens: int = 0  # locally cached tokens at the last match query
    stored_upto: int = 0  # blocks [0, stored_upto) are stored, loading or being saved
    # connector.store_after_hits: blocks [0, admitted_upto) may be saved (None: any);
    # kept across a preemption, so a resumed request is not counted as seen twice
    admitted_upto: int | None = None
    admission_done: bool = False  # the store was asked (or no admission applies)
    save_jobs: int = 0  # save jobs issued; >0 means request_finished holds the blocks
    load_first: int = 0  # block index of the first block of the load in flight
    load_block_ids: list[int] = field(default_factory=list)  # blocks of the load in flight
    load_failed_at: int | None = None  # index (in the load) of its first failed block
    load_sync: bool = False  # the load in flight is synchronous (settled at its step)
