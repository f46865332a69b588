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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.offload_tier_driver import BLOCK_BYTES, Driver, make_spec, payload, tier_entry
from hf3fsctl_connector.offload_tier import Hf3fsctlOffloadTier
from hf3fsctl_connector.offload_tier_store import DOOR
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from hf3fsctl.errors import ConfigError
from hf3fsctl.meta.sqlite.store import MetadataStore


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


def test_lookup_before_any_store_is_a_quiet_miss(
    driver: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        assert driver.load([make_offload_key(os.urandom(32), 0)]) == [None]
    assert not [r for r in caplog.records if "lookup" in r.getMessage()]


def test_kv_events_name_the_chunks_this_tier_stored(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import Medium

    (tmp_path / "store").mkdir()
    d = Driver(make_spec(tier_entry(tmp_path, enable_kv_events=True), events=True))
    try:
        keys = [make_offload_key(os.urandom(32), 0) for _ in range(2)]
        d.store(keys, [payload(1), payload(2)])
        stored = [
            key
            for event in d.manager.take_events()
            if event.medium is Medium.STORAGE and not event.removed
            for key in event.keys
        ]
        assert stored == keys
    finally:
        d.shutdown()


def test_vllm_cpu_refuses_the_worker_side_of_its_offloading_stack(tmp_path: Path) -> None:
    """Why no engine runs the OffloadingConnector here: on the CPU platform vLLM's worker
    side stops at start-up (the engine hits this same call from register_kv_caches). When
    this test fails, vLLM runs it on CPU: add the end-to-end greedy-tokens comparison."""
    spec = make_spec(tier_entry(tmp_path))
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU GPUs"):
        spec.get_worker(None)  # type: ignore[arg-type]
