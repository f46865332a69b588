"""The hf3fsctl store as a secondary tier of vLLM's offloading stack, driven by vLLM itself.

Every test builds a real `TieringOffloadingSpec` (vLLM's CPU primary tier on its shared
memory region, scheduler side) whose `secondary_tiers` entry names our tier by
`module_path`, so `SecondaryTierFactory` loads it, and drives the real
`TieringOffloadingManager`: prepare_store → bytes written into the primary memoryview (as
the GPU worker would) → complete_store (cascade to our tier) → the primary evicts the
chunk → lookup finds it in our tier → promotion (our load into the primary slot) →
prepare_load → the bytes read back from the primary memoryview.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hf3fsctl_connector.offload_tier import Hf3fsctlOffloadTier
from hf3fsctl_connector.offload_tier_store import DOOR
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
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from hf3fsctl.errors import ConfigError
from hf3fsctl.meta.sqlite.store import MetadataStore

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


def make_spec(entry: dict[str, Any], primary_chunks: int = 4) -> TieringOffloadingSpec:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=False,
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
        import time

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
        import time

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


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[Driver]:
    (tmp_path / "store").mkdir()
    spec = make_spec(tier_entry(tmp_path))
    d = Driver(spec)
    yield d
    d.shutdown()


def test_factory_loads_the_tier_by_module_path(tmp_path: Path) -> None:
    cls = SecondaryTierFactory.get_tier_class(tier_entry(tmp_path))
    assert cls is Hf3fsctlOffloadTier


def test_store_then_load_back_byte_equal_after_the_primary_evicted(driver: Driver) -> None:
    keys = [make_offload_key(os.urandom(32), 0) for _ in range(3)]
    data = [payload(i) for i in range(3)]
    driver.store(keys, data)
    assert driver.tier.store.present([k.hex() for k in keys]) == [True] * 3  # type: ignore[attr-defined]
    driver.flush_primary(4)  # the primary tier (4 chunks) no longer holds them
    assert all(
        driver.manager.primary_tier.lookup(k, ReqContext("x")) is LookupResult.MISS for k in keys
    )
    assert driver.load(keys) == data


def test_namespace_records_its_door(driver: Driver, tmp_path: Path) -> None:
    driver.store([make_offload_key(os.urandom(32), 0)], [payload(1)])
    manifest = driver.tier.store.manifest  # type: ignore[attr-defined]
    store = MetadataStore(tmp_path / "meta.db", read_only=True)
    try:
        info = store.get_namespace(manifest.namespace_id)
    finally:
        store.close()
    assert info.manifest["extra"]["door"] == DOOR
    assert info.num_ranks == 1  # one page holds every worker's bytes of a chunk


def test_eviction_under_a_small_capacity_keeps_storing(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    store = MetadataStore(tmp_path / "meta.db")
    store.set_capacity(6 * BLOCK_BYTES)
    store.close()
    d = Driver(make_spec(tier_entry(tmp_path)))
    try:
        batches = [[make_offload_key(os.urandom(32), 0) for _ in range(3)] for _ in range(4)]
        for n, keys in enumerate(batches):
            d.store(keys, [payload(n * 3 + i) for i in range(3)])
        present = [d.tier.store.present([k.hex() for k in keys]) for keys in batches]  # type: ignore[attr-defined]
        assert present[-1] == [True] * 3  # the newest batch was stored
        assert sum(map(sum, present)) <= 6  # the capacity held: older chunks were evicted
        assert present[0] == [False] * 3  # LRU: the oldest went first
    finally:
        d.shutdown()


def test_a_corrupt_page_is_a_failed_job_and_is_dropped(driver: Driver, tmp_path: Path) -> None:
    keys = [make_offload_key(os.urandom(32), 0)]
    driver.store(keys, [payload(3)])
    driver.flush_primary(4)
    page_file = driver.tier.store.page_file  # type: ignore[attr-defined]
    with open(page_file.path, "r+b") as handle:  # flip bytes inside the stored page
        handle.seek(page_file.offset(0) + 100)
        handle.write(b"\x00\xff" * 16)
    finished: list[Any] = []
    real = driver.tier.get_finished_jobs

    def spy() -> list[Any]:
        jobs = list(real())
        finished.extend(jobs)
        return jobs

    driver.tier.get_finished_jobs = spy  # type: ignore[method-assign]
    assert driver.load(keys) == [None]  # vLLM recomputes it
    assert [job.success for job in finished] == [False]
    assert driver.tier.store.present([keys[0].hex()]) == [False]  # type: ignore[attr-defined]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_metadata_service_down_is_a_failed_job_not_an_exception(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    entry = tier_entry(tmp_path, metadata_url=f"http://127.0.0.1:{_closed_port()}")
    d = Driver(make_spec(entry))
    finished: list[Any] = []
    real = d.tier.get_finished_jobs

    def spy() -> list[Any]:
        jobs = list(real())
        finished.extend(jobs)
        return jobs

    d.tier.get_finished_jobs = spy  # type: ignore[method-assign]
    try:
        keys = [make_offload_key(os.urandom(32), 0) for _ in range(2)]
        d.store(keys, [payload(1), payload(2)])  # the DRAM tier keeps them
        assert [job.success for job in finished] == [False]
        d.flush_primary(4)
        assert d.load(keys) == [None, None]  # lookups answer misses: recompute
    finally:
        d.shutdown()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"storage_pth": "/x"}, "storage_pth"),
        ({"config": "/nonexistent/hf3fsctl.yaml"}, "config"),
        ({"threads": 0}, "threads"),
        ({"metadata_url": ""}, "metadata_url"),
    ],
)
def test_bad_tier_config_is_one_line_naming_the_key(
    tmp_path: Path, extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        make_spec(tier_entry(tmp_path, **extra)).get_manager()
    message = caught.value.message
    assert named in message and "\n" not in message


def test_one_store_two_doors_stats_and_ls_show_each_namespace_door(tmp_path: Path) -> None:
    from helpers.cli_store import cli, make_store

    store = make_store(tmp_path / "s")  # a connector namespace, made by `hf3fsctl init`
    entry = {
        "type": "Hf3fsctlOffloadTier",
        "module_path": "hf3fsctl_connector.offload_tier",
        "config": str(store.config_file),
    }
    d = Driver(make_spec(entry))
    try:
        d.store([make_offload_key(os.urandom(32), 0)], [payload(5)])
        namespace = d.tier.store.namespace  # type: ignore[attr-defined]
    finally:
        d.shutdown()
    assert d.tier.store.config.storage.path == str(store.root)  # type: ignore[attr-defined]
    result = cli(store, "stats", env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.stderr
    table = result.stdout
    ids = (namespace, store.namespace)  # the table shows ids shortened
    rows = {ns: line for line in table.splitlines() for ns in ids if ns[:11] in line}
    assert "door" in table
    assert "offload-tier" in rows[namespace] and "connector" in rows[store.namespace]
    listing = cli(store, "ls", "--namespace", namespace, env={"COLUMNS": "300"})
    assert listing.exit_code == 0, listing.stderr
    assert "offload-tier" in listing.stdout


def test_vllm_config_offloading_prints_a_config_vllm_loads_and_runs(tmp_path: Path) -> None:
    import json

    from helpers.cli_store import cli, make_store
    from vllm.config import KVTransferConfig

    store = make_store(tmp_path / "s")
    result = cli(store, "vllm-config", "--offloading", "--cpu-size", "256KiB", "--compact")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    transfer = KVTransferConfig(**document)  # vLLM's own validation of the fields
    assert transfer.kv_connector == "OffloadingConnector"
    extra = dict(transfer.kv_connector_extra_config)
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] == 262144
    (entry,) = extra["secondary_tiers"]
    assert entry["config"] == str(store.config_file.resolve())
    d = Driver(make_spec(entry, primary_chunks=extra["cpu_bytes_to_use"] // BLOCK_BYTES))
    try:
        keys = [make_offload_key(os.urandom(32), 0) for _ in range(2)]
        data = [payload(7), payload(8)]
        d.store(keys, data)
        d.flush_primary(4)
        assert d.load(keys) == data
    finally:
        d.shutdown()
