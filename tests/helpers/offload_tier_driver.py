"""Drives vLLM's `TieringOffloadingManager` with the hf3fsctl offload tier behind it.

`make_spec` builds a real `TieringOffloadingSpec` (vLLM's CPU primary tier on its shared
memory region, scheduler side) whose `secondary_tiers` entry is given; `Driver` makes the
calls the OffloadingConnector's scheduler makes: prepare_store → bytes written into the
primary memoryview (as the GPU worker would) → complete_store (the cascade to the tier)
→ lookups until answered (a promotion: the tier's load into a primary slot) →
prepare_load → the bytes read back from the primary memoryview.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

BLOCK_BYTES = 64 * 1024  # one chunk of the primary tier (aligned already)
END = ScheduleEndContext((), ())


def tier_entry(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "type": "Hf3fsctlOffloadTier",
        "module_path": "hf3fsctl_connector.offload_tier",
        "storage_path": str(tmp_path / "store"),
        "metadata_url": f"sqlite:///{tmp_path / 'meta.db'}",
    }
    entry.update(extra)
    return entry


def make_spec(
    entry: dict[str, Any], primary_chunks: int = 4, *, events: bool = False
) -> TieringOffloadingSpec:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": primary_chunks * BLOCK_BYTES, "secondary_tiers": [entry]},
        engine_id=f"test-{os.getpid()}-{id(entry)}",
        model=OffloadingModelConfig("tiny-llama", "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    return TieringOffloadingSpec(config)


class Driver:
    """Drives vLLM's `TieringOffloadingManager` the way the OffloadingConnector does."""

    def __init__(self, spec: TieringOffloadingSpec) -> None:
        manager = spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        self.tier = manager.secondary_tiers[0]
        self.view = manager.primary_tier.get_kv_memoryview().cast("B")
        self.block = self.tier.block_size_bytes
        self._n = 0

    def shutdown(self) -> None:
        self.view.release()
        self.manager.shutdown()

    def request(self) -> ReqContext:
        self._n += 1
        ctx = ReqContext(f"req-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def chunk(self, chunk_id: int) -> memoryview:
        return self.view[chunk_id * self.block : (chunk_id + 1) * self.block]

    def step(self) -> None:
        """One scheduler step's end, after the tier's jobs and lookups had time to end."""
        self.tier.drain_jobs()
        self.manager.on_schedule_end(END)

    def settle(self, steps: int = 50) -> None:
        for _ in range(steps):
            self.step()
            if not self.manager.has_pending_work():
                return
            time.sleep(0.01)

    def store(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> None:
        ctx = self.request()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == list(keys)
        for chunk_id, payload in zip(out.store_spec.chunk_ids, payloads, strict=True):  # type: ignore[attr-defined]
            self.chunk(int(chunk_id))[:] = payload
        self.manager.complete_store(keys, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def lookup_until_done(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Repeat vLLM's per-step lookup until it is neither RETRY nor HIT_PENDING."""
        result = LookupResult.RETRY
        for _ in range(200):
            result = self.manager.lookup(key, ctx)
            if result not in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                return result
            self.step()
            time.sleep(0.005)
        return result

    def load(self, keys: Sequence[OffloadKey]) -> list[bytes | None]:
        """What a request reading `keys` gets back from the primary tier (None: a miss)."""
        ctx = self.request()
        got: list[bytes | None] = []
        for key in keys:
            if self.lookup_until_done(key, ctx) is LookupResult.HIT:
                spec = self.manager.prepare_load([key], ctx)
                got.append(bytes(self.chunk(int(spec.chunk_ids[0]))))  # type: ignore[attr-defined]
                self.manager.complete_load([key], ctx)
            else:
                got.append(None)
        self.manager.on_request_finished(ctx)
        self.settle()
        return got

    def flush_primary(self, count: int) -> None:
        """Store `count` other chunks so the primary tier's LRU evicts what it held."""
        keys = [make_offload_key(os.urandom(32), 0) for _ in range(count)]
        self.store(keys, [b"\xee" * self.block] * count)


def payload(i: int, size: int = BLOCK_BYTES) -> bytes:
    return (bytes([i % 251]) + os.urandom(7)) * (size // 8)
