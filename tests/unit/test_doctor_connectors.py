"""`doctor`'s connector checks read this store's status files, and not those of the past.

Found running engines over several stores on one host: `doctor --config A` warned of
every store's exited connectors, and a connector that had exited disabled (a read-only
mount, a full disk) was reported for good, even after a restarted engine ran healthy.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from helpers.cli_store import Store, cli, make_store

from hf3fsctl.health import ConnectorHealth, read_status


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "state"
    monkeypatch.setenv("HF3FSCTL_STATE_DIR", str(directory))
    return directory


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return make_store(tmp_path / "a")


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _record(storage: Path, *, rank: int = 0, state: str = "disabled", age_s: float = 60) -> Any:
    """What an exited connector's ConnectorHealth left (its pid no longer running)."""
    health = ConnectorHealth(
        role="worker", rank=rank, namespace="ns", storage_path=str(storage), record=False
    )
    health.state, health.reason, health.fix = state, "storage unusable: read-only", "remount"
    data = asdict(health.snapshot())
    data.update(pid=_dead_pid(), updated=time.time() - age_s, since=time.time() - age_s)
    return data


def _write(directory: Path, data: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"connector-{data['pid']}-{data['role']}-rank{data['rank']}.json"
    path.write_text(json.dumps(data))
    return path


def _checks(store: Store) -> dict[str, dict[str, Any]]:
    result = cli(store, "doctor", "--json")
    return {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def test_only_this_stores_connectors_are_reported(
    state: Path, store: Store, tmp_path: Path
) -> None:
    here = _record(store.root)
    _write(state, here)
    _write(state, _record(tmp_path / "another-store"))
    checks = _checks(store)
    troubled = [name for name in checks if name.startswith("connector.")]
    assert troubled == [f"connector.{here['pid']}.worker"]
    assert checks[troubled[0]]["status"] == "warn"
    assert (
        "exited" in checks[troubled[0]]["detail"] and "read-only" in checks[troubled[0]]["detail"]
    )
    assert "1 of other stores not shown" in checks["connectors"]["detail"]


def test_an_exited_connector_restarted_since_is_not_reported(state: Path, store: Store) -> None:
    _write(state, _record(store.root, age_s=600))
    newer = _record(store.root, state="ok", age_s=5)  # the restarted engine's, also exited
    _write(state, newer)
    assert not [name for name in _checks(store) if name.startswith("connector.")]


def test_a_healthy_connector_retiring_removes_its_troubled_predecessors(
    state: Path, tmp_path: Path
) -> None:
    storage = tmp_path / "store"
    predecessor = _write(state, _record(storage))
    other_rank = _write(state, _record(storage, rank=1))
    other_store = _write(state, _record(tmp_path / "elsewhere"))
    health = ConnectorHealth(role="worker", rank=0, namespace="ns", storage_path=str(storage))
    health.publish()
    health.retire()
    left = {Path(r["file"]) for r in read_status(state)}
    assert left == {other_rank, other_store}
    assert not predecessor.exists()


def test_a_troubled_connector_retiring_keeps_its_file_for_doctor(
    state: Path, tmp_path: Path
) -> None:
    health = ConnectorHealth(
        role="worker", rank=0, namespace="ns", storage_path=str(tmp_path / "store")
    )
    health.disable("storage unusable: read-only", "remount")
    health.retire()
    assert [r["state"] for r in read_status(state)] == ["disabled"]
