"""A store problem never stops vLLM: the worker side with missing, full or failing storage.

Start-up storage failures leave the connector disabled (no exception into vLLM; loads
fail fast and recompute, saves are dropped) and it recovers by itself; a save that hits
ENOSPC fails alone, releases its pages and pauses saves; the state reaches the status
files `doctor` reads and the stats shipped to Prometheus.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import hf3fsctl_connector
import pytest
from helpers.connector_harness import (
    BLOCK_SIZE,
    Harness,
    make_harness,
    make_kv_caches,
    make_request,
    prompt_tokens,
)
from hf3fsctl_connector.metadata import Hf3fsctlConnectorMetadata, LoadJob, SaveJob
from hf3fsctl_connector.namespace import load_settings
from hf3fsctl_connector.stats import STATE, StatsRecorder
from hf3fsctl_connector.worker import WorkerSide
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.errors import StorageError
from hf3fsctl.health import read_status
from hf3fsctl.meta.sqlite.store import MetadataStore


@pytest.fixture
def harness(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Harness]:
    made = make_harness(
        tiny_model_dir, tmp_path / "store", extra={"connector.storage_retry_s": 0.0}
    )
    yield made
    made.close()


def _worker_over(harness: Harness, storage: Path, retry_s: float = 0.0) -> WorkerSide:
    settings = load_settings(harness.vllm_config)
    from hf3fsctl.config import build_config

    config = build_config(
        [
            ("base", settings.to_dict()),
            (
                "test",
                {
                    "storage.path": str(storage),
                    "metadata.url": f"sqlite:///{storage}/metadata.db",
                    "connector.storage_retry_s": retry_s,
                },
            ),
        ]
    )
    return WorkerSide(config, harness.worker.manifest, harness.kv_cache_config, StatsRecorder())


def test_missing_storage_at_start_up_disables_instead_of_raising(
    harness: Harness, tmp_path: Path
) -> None:
    worker = _worker_over(harness, tmp_path / "not-mounted" / "kv")
    try:
        worker.register_kv_caches(make_kv_caches(harness.kv_cache_config)[1])
        assert (worker.disabled or "").startswith("storage unusable")
    finally:
        worker.shutdown()


def test_a_missing_mount_is_never_made_on_the_local_disk(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The worker never creates a storage root whose parent is missing, but the
    scheduler's embedded metadata store (in that root, by default) made every directory
    to it; the worker then found the root and cached on the local disk."""
    root = tmp_path / "not-mounted" / "kv"
    engine = make_harness(tiny_model_dir, root)
    try:
        engine.run(make_request("r", prompt_tokens(2 * BLOCK_SIZE + 1), max_tokens=1))
        assert hf3fsctl_connector.wait_for_saves(10)
        assert "r" not in engine.scheduler.requests
    finally:
        engine.close()
    assert not (tmp_path / "not-mounted").exists()
    with pytest.raises(StorageError, match="not mounted"):
        MetadataStore(str(root / "metadata.db"))


def test_a_storage_path_that_is_a_file_says_so(harness: Harness, tmp_path: Path) -> None:
    """It said "[Errno 17] File exists" (the page file's directory could not be made)."""
    a_file = tmp_path / "kv"
    a_file.write_text("not a directory")
    worker = _worker_over(harness, a_file)
    try:
        worker.register_kv_caches(make_kv_caches(harness.kv_cache_config)[1])
        assert "is not a directory" in (worker.disabled or ""), worker.disabled
    finally:
        worker.shutdown()
    result = CliRunner().invoke(
        app, ["doctor", "--json"], env={"HF3FSCTL_STORAGE_PATH": str(a_file)}
    )
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["storage.path"]["status"] == "fail"
    assert "is not a directory" in checks["storage.path"]["detail"]


def test_a_disabled_worker_fails_loads_at_once_and_drops_saves(
    harness: Harness, tmp_path: Path
) -> None:
    worker = _worker_over(harness, tmp_path / "not-mounted" / "kv", retry_s=3600)
    try:
        worker.register_kv_caches(make_kv_caches(harness.kv_cache_config)[1])
        keys = [f"{i + 1:032x}" for i in range(2)]
        worker.start_load_kv(Hf3fsctlConnectorMetadata(loads=[LoadJob("w", [3, 4], keys, True)]))
        worker.wait_for_save(Hf3fsctlConnectorMetadata(saves=[SaveJob("s", [5, 6], keys, 0)]))
        assert worker.drain(5)
        assert worker.get_block_ids_with_load_errors() == {3, 4}
        assert worker.get_finished({"s"}) == ({"s"}, None)
    finally:
        worker.shutdown()


def test_a_disabled_worker_is_recorded_for_doctor(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A private status directory: records of earlier tests in this process (a scheduler
    # disabled by another file's test has this pid too) must not be read as this worker's.
    monkeypatch.setenv("HF3FSCTL_STATE_DIR", str(tmp_path / "state"))
    worker = _worker_over(harness, tmp_path / "not-mounted" / "kv", retry_s=3600)
    try:
        worker.register_kv_caches(make_kv_caches(harness.kv_cache_config)[1])
        mine = [r for r in read_status() if r["pid"] == worker.health.snapshot().pid]
        assert [(r["state"], r["role"]) for r in mine if r["state"] != "ok"] == [
            ("disabled", "worker")
        ]
        assert "not-mounted" in mine[0]["reason"] and mine[0]["fix"]
    finally:
        worker.shutdown()


def test_storage_that_appears_later_is_picked_up_without_a_restart(
    harness: Harness, tmp_path: Path
) -> None:
    storage = tmp_path / "late" / "kv"
    worker = _worker_over(harness, storage)
    try:
        worker.register_kv_caches(make_kv_caches(harness.kv_cache_config)[1])
        assert worker.disabled is not None
        storage.mkdir(parents=True)
        keys = [f"{i + 1:032x}" for i in range(2)]
        meta = Hf3fsctlConnectorMetadata(saves=[SaveJob("s", [5, 6], keys, 0)])
        worker.wait_for_save(meta)  # dropped; starts the retry
        assert worker.drain(10)
        assert worker.disabled is None
        worker.wait_for_save(meta)
        assert worker.drain(10)
        assert worker.guard.call(lambda c: c.lookup(worker.namespace, keys)) == 2
    finally:
        worker.shutdown()


def test_an_unwritable_metadata_db_disables_instead_of_raising(
    harness: Harness, tmp_path: Path
) -> None:
    storage = tmp_path / "store-ro-db"
    storage.mkdir()
    (storage / "metadata.db").mkdir()  # a directory where the database should be
    worker = _worker_over(harness, storage, retry_s=3600)
    try:
        worker.register_kv_caches(make_kv_caches(harness.kv_cache_config)[1])
        assert worker.disabled is not None
    finally:
        worker.shutdown()


def _no_space(*_: object) -> None:
    raise StorageError("cannot claim pages: No space left on device", errno=errno.ENOSPC)


def test_a_full_file_system_fails_the_save_and_releases_its_pages(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = harness.worker.worker_side
    assert worker.page_file is not None
    monkeypatch.setattr(worker.page_file, "reserve", _no_space)
    before = hf3fsctl_connector.process_totals()["failed_no_space"]
    request = make_request("r", prompt_tokens(2 * BLOCK_SIZE + 1), max_tokens=1)
    harness.run(request)
    assert hf3fsctl_connector.wait_for_saves(10)
    assert hf3fsctl_connector.process_totals()["failed_no_space"] - before == 2
    store = MetadataStore(Path(worker.config.storage.path) / "metadata.db")
    try:
        assert store.stats().pages_used == 0  # nothing left pending
        assert store.check_invariants() == []
    finally:
        store.close()
    assert (worker.health.state, "r" in harness.scheduler.requests) == ("degraded", False)


def test_saves_resume_once_the_file_system_has_room_again(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = harness.worker.worker_side
    assert worker.page_file is not None
    monkeypatch.setattr(worker.page_file, "reserve", _no_space)
    harness.run(make_request("full", prompt_tokens(2 * BLOCK_SIZE + 1), max_tokens=1))
    assert hf3fsctl_connector.wait_for_saves(10)
    monkeypatch.undo()
    request = make_request("room", prompt_tokens(2 * BLOCK_SIZE + 1, salt=7), max_tokens=1)
    harness.run(request)
    assert hf3fsctl_connector.wait_for_saves(10)
    keys = [bytes(h).hex() for h in request.block_hashes[:2]]
    assert worker.guard.call(lambda c: c.lookup(worker.namespace, keys)) == 2
    assert worker.health.state == "ok"


def test_stats_carry_the_health_state_while_degraded_and_once_after(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    connector = harness.worker
    worker = connector.worker_side
    assert worker.page_file is not None
    connector.get_kv_connector_stats()
    monkeypatch.setattr(worker.page_file, "reserve", _no_space)
    harness.run(make_request("r", prompt_tokens(BLOCK_SIZE + 1), max_tokens=1))
    assert hf3fsctl_connector.wait_for_saves(10)
    degraded = connector.get_kv_connector_stats()
    worker.storage_worked()
    recovered = connector.get_kv_connector_stats()
    quiet = connector.get_kv_connector_stats()
    assert degraded is not None and degraded.data[STATE] == 1
    assert recovered is not None and recovered.data[STATE] == 0
    assert quiet is None


def test_storage_removed_under_a_running_worker_fails_saves_not_the_engine(
    harness: Harness,
) -> None:
    worker = harness.worker.worker_side
    root = Path(worker.config.storage.path)
    shutil.rmtree(root / worker.namespace)  # the page file's directory is gone
    harness.run(make_request("r", prompt_tokens(2 * BLOCK_SIZE + 1), max_tokens=1))
    assert hf3fsctl_connector.wait_for_saves(10)
    assert "r" not in harness.scheduler.requests
