"""KV events for cache-aware routers: what the shared store holds, as vLLM's events.

Contract:
    * `BlockStored` for each block this engine planned to save, once its key is committed
      on every rank of the namespace (what `lookup` counts as a hit), with the block
      hash, its parent, the block's token ids, the block size, the LoRA id and name and
      vLLM's per-block extra keys (cache salt, multimodal, prompt embeds), as vLLM's own
      block-pool events carry them, and the KV cache group: one `StoreEvents` follows
      each stored group's namespace and stamps its events with the group's index
      (`group_idx`), spec kind (`kv_cache_spec_kind`) and sliding window, as vLLM's own
      hybrid-manager events do (a Mamba group announces its boundary-state blocks).
    * `BlockRemoved` for every committed key of the namespace that loses a rank, whoever
      removed it: this engine, `hf3fsctl evict`, another instance's eviction, an
      invalidation of a corrupt page. One removal per key until it is stored again.
    * The source of both is the store's change log (`MetadataClient.changes`), read on a
      background thread every `connector.kv_events_poll_s`; the engine thread only
      queues payloads and drains events, never waits for the store. vLLM publishes what
      `take_events` returns at the end of each scheduler step, so a change reaches the
      publisher within one poll interval plus one step (an idle engine publishes at its
      next step).
    * Events name the store in `medium` (`connector.kv_events_medium`, default "HF3FS")
      so a router can tell this shared tier from GPU and CPU residency.
    * Why not the worker-side event API (`get_kv_connector_kv_cache_events`, aggregated
      across TP workers): "committed on every rank" is already decided by the store, and
      removals made by other processes are only visible there; the scheduler side sees
      both through one log, with no cross-worker quorum to rebuild.
    * Bounded memory: at most `MAX_TRACKED` payloads wait for their commit (the oldest are
      dropped: a failed save never completes), `MAX_TRACKED` keys remember their last
      published state, and an engine that stops stepping keeps at most `MAX_TRACKED`
      queued events (the newest; logged once).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf3fsctl.errors import MetadataUnavailable

from .service import MetadataGuard

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

MAX_TRACKED = 1 << 17
CHANGES_PER_POLL = 10_000


@dataclass(frozen=True)
class BlockPayload:
    """What a `BlockStored` says about one block, captured while its request is alive."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None


def block_payloads(request: Request, start: int, end: int, block_size: int) -> list[BlockPayload]:
    """Payloads of blocks `start..end` of `request` (their hashes, tokens and extra keys)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    lora = request.lora_request
    hashes = request.block_hashes
    tokens = request.all_token_ids
    payloads = []
    mm_index = 0
    for index in range(start, end):
        first = index * block_size
        extra, mm_index = generate_block_hash_extra_keys(
            request, first, first + block_size, mm_index
        )
        payloads.append(
            BlockPayload(
                block_hash=bytes(hashes[index]),
                parent_hash=bytes(hashes[index - 1]) if index > 0 else None,
                token_ids=tuple(tokens[first : first + block_size]),
                lora_id=lora.adapter_id if lora else None,
                lora_name=lora.name if lora else None,
                extra_keys=extra,
            )
        )
    return payloads


class StoreEvents:
    """Follows the store's change log for one namespace and queues vLLM KV events."""

    def __init__(
        self,
        guard: MetadataGuard,
        namespace: str,
        *,
        num_ranks: int,
        block_size: int,
        medium: str,
        poll_s: float,
        group_idx: int = 0,
        spec_kind: str | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self._group_idx = group_idx  # the KV cache group whose namespace this follows
        self._spec_kind = spec_kind  # vLLM's KVCacheSpecKind value of that group
        self._sliding_window = sliding_window  # its window (sliding-window groups)
        self._guard = guard
        self._namespace = namespace
        self._num_ranks = num_ranks
        self._block_size = block_size
        self._medium = medium
        self._poll_s = poll_s
        self._lock = threading.Lock()
        # One read of the log at a time: two reads that both started from the same `_since`
        # would queue its changes twice (the follower thread's and a caller's `poll`).
        self._poll_lock = threading.Lock()
        self._waiting: OrderedDict[str, tuple[BlockPayload, int]] = OrderedDict()
        self._published: OrderedDict[str, bool] = OrderedDict()  # key → last was "stored"
        self._stored: list[BlockPayload] = []
        self._removed: list[bytes] = []
        self._since = -1  # where the next read of the log starts (-1: at its end)
        self._missed_logged = False
        self._overflow_logged = False
        self._failure_logged = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf3fsctl-events", daemon=True)
        self._thread.start()

    # --- engine thread -----------------------------------------------------------------

    def record_saves(self, payloads: list[BlockPayload]) -> None:
        """Remember blocks planned for saving, to announce once they are committed."""
        with self._lock:
            for payload in payloads:
                self._waiting[payload.block_hash.hex()] = (payload, 0)
            while len(self._waiting) > MAX_TRACKED:
                self._waiting.popitem(last=False)

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, as vLLM's `BlockStored`/`BlockRemoved`."""
        with self._lock:
            stored, self._stored = self._stored, []
            removed, self._removed = self._removed, []
        if not stored and not removed:
            return []
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import (
            BlockHash,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        events: list[KVCacheEvent] = [
            BlockStored(
                block_hashes=[maybe_convert_block_hash(BlockHash(p.block_hash))],
                parent_block_hash=(
                    maybe_convert_block_hash(BlockHash(p.parent_hash)) if p.parent_hash else None
                ),
                token_ids=list(p.token_ids),
                block_size=self._block_size,
                lora_id=p.lora_id,
                medium=self._medium,
                lora_name=p.lora_name,
                extra_keys=to_event_extra_keys([p.extra_keys]),
                group_idx=self._group_idx,
                kv_cache_spec_kind=self._spec_kind,
                kv_cache_spec_sliding_window=self._sliding_window,
            )
            for p in stored
        ]
        if removed:
            events.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in removed],
                    medium=self._medium,
                    group_idx=self._group_idx,
                )
            )
        return events

    def close(self) -> None:
        """Stop following the log (pending events are dropped)."""
        self._stop.set()
        self._thread.join(timeout=max(1.0, 2 * self._poll_s))

    # --- follower thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._guard.available():
                try:
                    self.poll()
                except MetadataUnavailable:
                    pass  # the guard logs outages; the next poll resumes from _since
                except Exception:  # a bug, not an outage: in full once, then at debug
                    if self._failure_logged:
                        logger.debug("KV events: reading the change log failed", exc_info=True)
                    else:
                        self._failure_logged = True
                        logger.exception("KV events: reading the store's change log failed")
            self._stop.wait(self._poll_s)

    def poll(self) -> None:
        """Read the log once (up to `CHANGES_PER_POLL` rows) and queue the events it implies."""
        with self._poll_lock:
            self._poll_once()

    def _poll_once(self) -> None:
        namespace = self._namespace
        log = self._guard.call(
            lambda client: client.changes(self._since, namespace, CHANGES_PER_POLL)
        )
        if log.missed and not self._missed_logged:
            self._missed_logged = True
            logger.warning(
                "KV events: the store pruned changes before this engine read them; "
                "some removals were not published"
            )
        with self._lock:
            for change in log.changes:
                if change.delta > 0:
                    self._on_commit(change.key)
                else:
                    self._on_removal(change.key)
            self._since = log.next_seq
            # An engine that does not step does not take its events: keep the newest.
            queued = len(self._stored) + len(self._removed)
            if queued > MAX_TRACKED:
                del self._stored[: max(0, len(self._stored) - MAX_TRACKED // 2)]
                del self._removed[: max(0, len(self._removed) - MAX_TRACKED // 2)]
                if not self._overflow_logged:
                    self._overflow_logged = True
                    logger.warning(
                        "KV events: %d events queued while the engine took none; the "
                        "oldest were dropped",
                        queued,
                    )

    def _on_commit(self, key: str) -> None:
        waiting = self._waiting.get(key)
        if waiting is None:
            if self._published.get(key) is False:
                self._published.pop(key)  # stored again elsewhere: a later removal counts
            return
        payload, ranks = waiting
        ranks += 1
        if ranks < self._num_ranks:
            self._waiting[key] = (payload, ranks)
            return
        del self._waiting[key]
        self._stored.append(payload)
        self._remember(key, True)

    def _on_removal(self, key: str) -> None:
        self._waiting.pop(key, None)
        if self._published.get(key) is False:
            return  # already announced (another rank of the same key)
        self._removed.append(bytes.fromhex(key))
        self._remember(key, False)

    def _remember(self, key: str, stored: bool) -> None:
        self._published[key] = stored
        self._published.move_to_end(key)
        while len(self._published) > MAX_TRACKED:
            self._published.popitem(last=False)
