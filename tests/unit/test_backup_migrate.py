"""Store formats, `hf3fsctl migrate` and `hf3fsctl backup`, on real SQLite files.

A store of the previous format is built with that format's own DDL
(`helpers.old_stores`); the refusal to open it, the dry run, the migration and its
backup are checked through the library and the real CLI. Backups are taken while a
separate writer process keeps allocating and committing, then restored by copying the
file into place and reopened.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.meta_builders import keys, register, store_keys
from helpers.old_stores import schema_1_store
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.errors import InvalidRequest, StoreFormatError
from hf3fsctl.meta.sqlite import schema
from hf3fsctl.meta.sqlite.backup import backup_database
from hf3fsctl.meta.sqlite.migration import migrate, plan
from hf3fsctl.meta.sqlite.store import MetadataStore


def files_digest(db: Path) -> str:
    """One digest of what the store holds: the database file and its WAL (an absent WAL
    holds what an empty one does; `-shm` is only an index of the WAL, rebuilt on open)."""
    digest = hashlib.sha256(db.read_bytes())
    wal = Path(f"{db}-wal")
    digest.update(b"wal:" + (wal.read_bytes() if wal.exists() else b""))
    return digest.hexdigest()


def run_cli(*args: str, env: dict[str, str] | None = None) -> object:
    return CliRunner().invoke(app, list(args), env=env)


def stored_format(db: Path) -> int | None:
    conn = sqlite3.connect(db)
    try:
        return schema.stored_version(conn)
    finally:
        conn.close()


@pytest.fixture
def old_store(tmp_path: Path) -> tuple[Path, str, list[str]]:
    """A format-1 store with a committed chain of 3 keys."""
    db = tmp_path / "store" / "metadata.db"
    db.parent.mkdir()
    chain = keys(3, salt="old")
    return db, schema_1_store(db, chain), chain


# --- refusing other formats --------------------------------------------------------------


def test_an_older_store_is_refused_on_open_with_the_migrate_command(
    old_store: tuple[Path, str, list[str]],
) -> None:
    db, _, _ = old_store
    before = files_digest(db)
    with pytest.raises(StoreFormatError) as refused:
        MetadataStore(db)
    assert (refused.value.stored, refused.value.supported) == (1, schema.SCHEMA_VERSION)
    assert "hf3fsctl migrate" in refused.value.hint
    assert files_digest(db) == before


def test_a_newer_store_is_refused_with_upgrade_hf3fsctl(tmp_path: Path) -> None:
    db = tmp_path / "metadata.db"
    MetadataStore(db).close()
    conn = sqlite3.connect(db)
    with conn:
        conn.execute(
            "UPDATE store_info SET value = ? WHERE name = 'schema_version'",
            (str(schema.SCHEMA_VERSION + 1),),
        )
    conn.close()
    with pytest.raises(StoreFormatError) as refused:
        MetadataStore(db)
    assert f"written by a newer hf3fsctl (format {schema.SCHEMA_VERSION + 1})" in str(refused.value)
    assert "upgrade hf3fsctl" in refused.value.hint


def test_the_cli_refuses_an_older_store_with_the_fix(
    old_store: tuple[Path, str, list[str]],
) -> None:
    db, _, _ = old_store
    result = run_cli("stats", env={"HF3FSCTL_METADATA_URL": f"sqlite:///{db}"})
    assert result.exit_code == StoreFormatError.exit_code  # type: ignore[attr-defined]
    assert "hf3fsctl migrate" in result.stderr  # type: ignore[attr-defined]


# --- migrate ------------------------------------------------------------------------------


def test_migrate_dry_run_shows_the_steps_and_changes_nothing(
    old_store: tuple[Path, str, list[str]],
) -> None:
    db, _, _ = old_store
    before = files_digest(db)
    result = run_cli("migrate", "--db", str(db), "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr  # type: ignore[attr-defined]
    document = json.loads(result.stdout)  # type: ignore[attr-defined]
    steps = [(s["from"], s["to"], "rank_files" in s["tables"]) for s in document["steps"]]
    assert (steps, document["migrated"]) == ([(1, 2, True)], False)
    assert files_digest(db) == before
    assert list(db.parent.glob("*.bak")) == []


def test_migrate_backs_up_then_migrates_and_keeps_every_entry(
    old_store: tuple[Path, str, list[str]],
) -> None:
    db, ns, chain = old_store
    result = run_cli("migrate", "--db", str(db), "--yes", "--json")
    assert result.exit_code == 0, result.stderr  # type: ignore[attr-defined]
    document = json.loads(result.stdout)  # type: ignore[attr-defined]
    assert document["migrated"] is True
    assert stored_format(Path(document["backup"])) == 1  # the backup is of the old store
    store = MetadataStore(db)
    try:
        assert store.lookup(ns, chain) == len(chain)
        assert (store.check_invariants(), store.check_integrity()) == ([], [])
    finally:
        store.close()


def test_migrate_no_backup_writes_no_backup_file(
    old_store: tuple[Path, str, list[str]],
) -> None:
    db, _, _ = old_store
    result = run_cli("migrate", "--db", str(db), "--yes", "--no-backup")
    assert result.exit_code == 0, result.stderr  # type: ignore[attr-defined]
    assert (stored_format(db), list(db.parent.glob("*.bak"))) == (schema.SCHEMA_VERSION, [])


def test_migrate_refuses_without_yes_when_nobody_is_at_a_terminal(
    old_store: tuple[Path, str, list[str]],
) -> None:
    db, _, _ = old_store
    result = run_cli("migrate", "--db", str(db))
    assert result.exit_code == InvalidRequest.exit_code, result.stderr  # type: ignore[attr-defined]
    assert stored_format(db) == 1


def test_a_current_store_has_nothing_to_migrate(tmp_path: Path) -> None:
    db = tmp_path / "metadata.db"
    MetadataStore(db).close()
    before = files_digest(db)
    assert (plan(db).steps, migrate(db).steps) == ([], [])
    assert files_digest(db) == before


# --- backup -------------------------------------------------------------------------------

WRITER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from helpers.meta_builders import keys, store_keys
from hf3fsctl.meta.sqlite.store import MetadataStore

store = MetadataStore(sys.argv[1])
acked = open(sys.argv[2], "a", buffering=1)
stop = Path(sys.argv[2] + ".stop")
i = 0
while not stop.exists():
    batch = keys(8, start=i * 8, salt="load")
    store_keys(store, sys.argv[4], batch)  # allocate + commit, asserted
    acked.write("\\n".join(batch) + "\\n")  # only once commit returned
    i += 1
store.close()
"""


def test_backup_under_a_write_load_holds_every_commit_acknowledged_before_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "metadata.db"
    store = MetadataStore(db)
    ns = register(store, num_pages=200_000)
    store_keys(store, ns, keys(3000, salt="base"))  # a few hundred database pages
    store.close()
    acked = tmp_path / "acked.txt"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), str(acked), str(Path(__file__).parents[1]), ns]
    )
    try:
        deadline = time.monotonic() + 60
        while (not acked.exists() or len(acked.read_text().split()) < 80) and (
            time.monotonic() < deadline and writer.poll() is None
        ):
            time.sleep(0.05)
        before = set(acked.read_text().split())
        steps: list[tuple[int, int]] = []
        result = backup_database(
            db, tmp_path / "backup.db", progress=lambda d, t: steps.append((d, t)), pages_per_step=8
        )
        after = set(acked.read_text().split())
    finally:
        Path(f"{acked}.stop").touch()
        writer.wait(60)
    assert writer.returncode == 0
    assert len(steps) > 1 and steps[-1][0] == steps[-1][1] == result.pages  # copied in steps
    assert len(after) > len(before)  # writers kept committing while it ran
    restored = tmp_path / "restored" / "metadata.db"
    restored.parent.mkdir()
    shutil.copyfile(result.path, restored)  # restore: copy into place
    again = MetadataStore(restored)
    try:
        assert (again.check_integrity(), again.check_invariants()) == ([], [])
        assert again.lookup(ns, sorted(before)) == len(before)
    finally:
        again.close()


def test_backup_refuses_to_overwrite_a_file(tmp_path: Path) -> None:
    db = tmp_path / "metadata.db"
    MetadataStore(db).close()
    (tmp_path / "taken.db").write_text("an older backup")
    with pytest.raises(InvalidRequest):
        backup_database(db, tmp_path / "taken.db")
    assert (tmp_path / "taken.db").read_text() == "an older backup"


def test_backup_cli_of_an_embedded_store_is_accepted_by_doctor(tmp_path: Path) -> None:
    db = tmp_path / "metadata.db"
    store = MetadataStore(db)
    ns = register(store)
    store_keys(store, ns, keys(20))
    store.close()
    out = tmp_path / "backup.db"
    env = {"HF3FSCTL_METADATA_URL": f"sqlite:///{db}", "HF3FSCTL_STORAGE_PATH": str(tmp_path)}
    result = run_cli("backup", str(out), "--json", env=env)
    assert result.exit_code == 0, result.stderr  # type: ignore[attr-defined]
    assert json.loads(result.stdout)["path"] == str(out)  # type: ignore[attr-defined]
    env["HF3FSCTL_METADATA_URL"] = f"sqlite:///{out}"
    checked = run_cli("doctor", "--json", env=env)
    checks = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}  # type: ignore[attr-defined]
    assert checks["metadata.invariants"]["status"] == "ok", checks["metadata.invariants"]


@pytest.mark.parametrize(
    ("url", "hint"),
    [("http://127.0.0.1:18765", "--db"), ("redis://127.0.0.1:6379/0", "redis-cli")],
    ids=["served", "redis"],
)
def test_backup_of_a_remote_store_is_refused_with_where_to_run_it(
    tmp_path: Path, url: str, hint: str
) -> None:
    result = run_cli(
        "backup",
        str(tmp_path / "out.db"),
        env={"HF3FSCTL_METADATA_URL": url, "HF3FSCTL_STORAGE_PATH": str(tmp_path)},
    )
    assert result.exit_code != 0
    assert hint in result.stderr, result.stderr  # type: ignore[attr-defined]
    assert not (tmp_path / "out.db").exists()


# --- the connector ---------------------------------------------------------------------


def test_a_connector_over_an_older_store_is_disabled_with_the_fix_then_recovers(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from helpers.connector_harness import make_harness, make_kv_caches
    from hf3fsctl_connector.metadata import Hf3fsctlConnectorMetadata, SaveJob
    from hf3fsctl_connector.namespace import load_settings
    from hf3fsctl_connector.stats import StatsRecorder
    from hf3fsctl_connector.worker import WorkerSide

    from hf3fsctl.config import build_config
    from hf3fsctl.health import read_status

    harness = make_harness(tiny_model_dir, tmp_path / "fresh")
    storage = tmp_path / "old"
    storage.mkdir()
    schema_1_store(storage / "metadata.db", keys(3, salt="old"))
    config = build_config(
        [
            ("base", load_settings(harness.vllm_config).to_dict()),
            (
                "test",
                {
                    "storage.path": str(storage),
                    "metadata.url": f"sqlite:///{storage}/metadata.db",
                    "metadata.retry_backoff_s": 0,
                    "connector.storage_retry_s": 0,
                },
            ),
        ]
    )
    worker = WorkerSide(config, harness.worker.manifest, harness.kv_cache_config, StatsRecorder())
    try:
        worker.register_kv_caches(make_kv_caches(harness.kv_cache_config)[1])  # no exception
        assert "format 1" in (worker.disabled or "")
        mine = [r for r in read_status() if r["pid"] == worker.health.snapshot().pid]
        assert any("hf3fsctl migrate" in r["fix"] for r in mine if r["state"] == "disabled")
        migrate(storage / "metadata.db")
        save = Hf3fsctlConnectorMetadata(saves=[SaveJob("s", [5], [f"{1:032x}"], 0)])
        worker.wait_for_save(save)  # dropped while disabled; starts the retry
        assert worker.drain(10)
        assert worker.disabled is None
    finally:
        worker.shutdown()
        harness.close()
