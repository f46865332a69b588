"""`init`, `stats`, `ls`, `evict` and `doctor` against a real embedded (SQLite) store
with real page files, driven through Typer's CliRunner."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from helpers.cli_store import PAGE_BYTES, Store, corrupt_page, fill, make_store, manifest
from helpers.meta_builders import keys as make_keys
from helpers.meta_builders import lookup_in_a_process_that_exits
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.config import Config, load_config
from hf3fsctl.errors import NotFound
from hf3fsctl.meta.client import connect

runner = CliRunner()
NUM_KEYS = 6
PAGES_PER_RANK = 64  # 1 MiB file / 16 KiB pages
WIDE = {"COLUMNS": "200"}  # tables are not wrapped


def cli(store: Store, *args: str) -> Any:
    return runner.invoke(app, ["--config", str(store.config_file), *args])


def cli_json(store: Store, *args: str) -> Any:
    result = cli(store, *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return make_store(tmp_path)


@pytest.fixture
def filled(store: Store) -> tuple[Store, list[str]]:
    keys = make_keys(NUM_KEYS)
    fill(store, keys)
    return store, keys


# --- init ---------------------------------------------------------------------------


def test_init_writes_a_config_that_points_at_the_store(store: Store) -> None:
    config = load_config(store.config_file, environ={})
    assert Path(config.storage.path) == store.root.resolve()
    assert config.storage.file_size == 1024**2


def test_init_creates_the_sqlite_database(store: Store) -> None:
    assert (store.root / "metadata.db").is_file()


def test_init_preallocates_every_rank_file_at_full_size(store: Store) -> None:
    files = sorted((store.root / store.namespace).glob("rank-*.pages"))
    assert [f.stat().st_size for f in files] == [1024**2, 1024**2]


def test_preallocated_rank_files_hold_their_whole_size_of_the_capacity(store: Store) -> None:
    document = cli_json(store, "stats")
    assert document["bytes_used"] == 2 * PAGES_PER_RANK * PAGE_BYTES
    assert document["capacity_bytes"] >= document["bytes_used"]


def test_init_refuses_to_overwrite_a_config_without_force(store: Store, tmp_path: Path) -> None:
    before = store.config_file.read_text()
    result = runner.invoke(
        app,
        [
            "init",
            "--storage-path",
            str(tmp_path / "other"),
            "--write-config",
            str(store.config_file),
        ],
    )
    assert result.exit_code == 2
    assert "--force" in result.stderr
    assert store.config_file.read_text() == before


def test_init_refuses_more_ranks_than_the_manifest_has(tmp_path: Path) -> None:
    manifest_file = tmp_path / "m.json"
    manifest_file.write_text(json.dumps(manifest(tp_size=2).to_dict()))
    result = runner.invoke(
        app,
        [
            "init",
            "--storage-path",
            str(tmp_path / "s"),
            "--namespace-manifest",
            str(manifest_file),
            "--ranks",
            "3",
        ],
    )
    assert result.exit_code == 2
    assert not (tmp_path / "s").exists()


def test_init_json_is_one_document_without_progress(tmp_path: Path) -> None:
    manifest_file = tmp_path / "m.json"
    manifest_file.write_text(json.dumps(manifest().to_dict()))
    result = runner.invoke(
        app,
        [
            "init",
            "--storage-path",
            str(tmp_path / "s"),
            "--create-path",
            "--file-size",
            "1MiB",
            "--namespace-manifest",
            str(manifest_file),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert len(document["namespace"]["rank_files"]) == 2
    assert "rank 0" not in result.stderr  # no progress bar


def test_init_is_idempotent(store: Store, tmp_path: Path) -> None:
    again = make_store(tmp_path)
    assert again.namespace == store.namespace


def test_init_reports_an_unwritable_storage_path_as_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = runner.invoke(app, ["init", "--storage-path", str(blocker / "store"), "--create-path"])
    assert result.exit_code == 5
    assert "storage" in result.stderr


def _init_naming_its_config(tmp_path: Path, config: Path, named_by: str) -> Any:
    """`init --write-config CONFIG`, with CONFIG also named as the config to read."""
    base = ["init", "--storage-path", str(tmp_path / "s"), "--create-path"]
    base += ["--write-config", str(config)]
    args, env = {
        "env": (base, {"HF3FSCTL_CONFIG": str(config)}),
        "global-flag": (["--config", str(config), *base], {}),
        "command-flag": ([*base, "--config", str(config)], {}),
    }[named_by]
    return runner.invoke(app, args, env=env)


@pytest.mark.parametrize("named_by", ["env", "global-flag", "command-flag"])
def test_init_writes_the_config_it_is_named_before_that_exists(
    tmp_path: Path, named_by: str
) -> None:
    config = tmp_path / "c.yaml"
    result = _init_naming_its_config(tmp_path, config, named_by)
    assert result.exit_code == 0, result.stderr
    assert Path(load_config(config, environ={}).storage.path) == (tmp_path / "s").resolve()


def test_init_named_a_missing_config_ignores_hf3fs_yaml_in_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hf3fs.yaml").write_text("storage:\n  io_threads: 3\n")
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    result = _init_naming_its_config(tmp_path, config, "env")
    assert result.exit_code == 0, result.stderr
    assert load_config(config, environ={}).storage.io_threads == Config().storage.io_threads


# --- stats / ls ---------------------------------------------------------------------


def test_stats_json_counts_committed_keys(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    document = cli_json(store, "stats")
    (ns,) = document["namespaces"]
    assert (ns["keys"], ns["pages_used"]) == (NUM_KEYS, 2 * NUM_KEYS)
    assert document["bytes_live"] == 2 * NUM_KEYS * PAGE_BYTES


def test_stats_json_reports_the_lookup_hit_rate(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    client = connect(store.config())
    try:
        client.lookup(store.namespace, keys + make_keys(2, salt="miss"))  # 6 of 8 hit
    finally:
        client.close()
    (ns,) = cli_json(store, "stats")["namespaces"]
    assert ns["lookup_hit_rate"] == pytest.approx(6 / 8)


def test_stats_table_shows_the_hit_rate_of_a_process_that_exited_without_close(
    filled: tuple[Store, list[str]],
) -> None:
    store, keys = filled
    chain = keys + make_keys(2, salt="miss")  # 6 of 8 hit
    lookup_in_a_process_that_exits(store.config().metadata_url, store.namespace, chain)
    result = runner.invoke(app, ["--config", str(store.config_file), "stats"], env=WIDE)
    assert "75.0% (6 of 8 keys)" in result.stdout


def test_stats_table_shows_the_namespace_and_model(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    result = cli(store, "stats")
    assert result.exit_code == 0
    assert store.namespace in result.stdout
    assert "tiny-llama" in result.stdout


def test_ls_json_lists_every_entry_of_every_rank(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    entries = cli_json(store, "ls")["entries"]
    assert sorted((e["key"], e["rank"]) for e in entries) == sorted(
        (k, r) for k in keys for r in (0, 1)
    )


def test_ls_respects_the_limit(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    assert len(cli_json(store, "ls", "--limit", "3")["entries"]) == 3


def test_ls_accepts_a_namespace_prefix(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    entries = cli_json(store, "ls", "--namespace", store.namespace[:6])["entries"]
    assert {e["namespace"] for e in entries} == {store.namespace}


def test_ls_unknown_namespace_is_not_found(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    result = cli(store, "ls", "--namespace", "ffffffffffffffff")
    assert result.exit_code == NotFound.exit_code


# --- evict --------------------------------------------------------------------------


def test_evict_dry_run_reports_but_keeps_everything(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    document = cli_json(store, "evict", "--all", "--dry-run")
    assert (document["keys"], document["dry_run"]) == (NUM_KEYS, True)
    assert cli_json(store, "stats")["namespaces"][0]["keys"] == NUM_KEYS


def test_evict_refuses_without_yes_when_stdin_is_not_a_tty(
    filled: tuple[Store, list[str]],
) -> None:
    store, _ = filled
    result = cli(store, "evict", "--all")
    assert result.exit_code == 2
    assert "--yes" in result.stderr
    assert cli_json(store, "stats")["namespaces"][0]["keys"] == NUM_KEYS


def test_evict_all_with_yes_empties_the_namespace(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    document = cli_json(store, "evict", "--all", "--yes", "--namespace", store.namespace)
    assert (document["keys"], document["pages"]) == (NUM_KEYS, 2 * NUM_KEYS)
    assert cli_json(store, "stats")["pages_used"] == 0


def test_evict_max_entries_bounds_the_count(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    assert cli_json(store, "evict", "--max-entries", "2", "-y")["keys"] == 2
    assert cli_json(store, "stats")["namespaces"][0]["keys"] == NUM_KEYS - 2


def test_evict_older_than_keeps_recent_entries(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    assert cli_json(store, "evict", "--older-than", "1h", "-y")["keys"] == 0


# --- doctor -------------------------------------------------------------------------


def checks(document: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in document["checks"]}


def doctor(store: Store, *args: str) -> tuple[int, dict[str, Any]]:
    result = cli(store, "doctor", "--json", *args)
    return result.exit_code, json.loads(result.stdout)


def test_doctor_passes_on_a_healthy_store(filled: tuple[Store, list[str]]) -> None:
    store, _ = filled
    code, document = doctor(store, "--checksums")
    assert code == 0, document
    assert document["counts"]["fail"] == 0
    assert checks(document)[f"checksums {store.namespace}"] == "ok"


def test_doctor_detects_a_corrupt_page(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    page = corrupt_page(store, rank=1, key=keys[2])
    code, document = doctor(store, "--checksums", "--all-pages")
    assert code == 1
    failed = next(c for c in document["checks"] if c["name"] == f"checksums {store.namespace}")
    assert failed["status"] == "fail"
    assert f"rank 1 page {page}" in failed["detail"]


def test_doctor_without_checksums_does_not_read_pages(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    corrupt_page(store, rank=0, key=keys[0])
    code, document = doctor(store)
    assert code == 0
    assert not any(name.startswith("checksums") for name in checks(document))


def test_doctor_detects_a_missing_page_file(store: Store) -> None:
    (store.root / store.namespace / "rank-0001.pages").unlink()
    code, document = doctor(store)
    assert code == 1
    assert checks(document)[f"pages {store.namespace}"] == "fail"


def test_doctor_detects_an_edited_manifest(store: Store) -> None:
    path = store.root / store.namespace / "manifest.json"
    data = json.loads(path.read_text())
    data["kv_dtype"] = "bfloat16"
    path.write_text(json.dumps(data))
    code, document = doctor(store)
    assert code == 1
    assert checks(document)[f"manifest {store.namespace}"] == "fail"


def test_doctor_detects_a_broken_store_invariant(filled: tuple[Store, list[str]]) -> None:
    store, keys = filled
    with sqlite3.connect(store.root / "metadata.db") as db:
        db.execute("UPDATE entries SET page = 9999 WHERE key = ? AND rank = 0", (keys[0],))
    code, document = doctor(store)
    assert code == 1
    assert checks(document)["metadata.invariants"] == "fail"


def test_doctor_reports_a_missing_storage_path(store: Store, tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["doctor", "--json"], env={"HF3FSCTL_STORAGE_PATH": str(tmp_path / "gone")}
    )
    assert result.exit_code == 1
    assert checks(json.loads(result.stdout))["storage.path"] == "fail"


def test_doctor_reports_a_bad_config_as_a_failed_check(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("metadata:\n  timeout_s: soon\n")
    result = runner.invoke(app, ["doctor", "--json", "--config", str(bad)])
    assert result.exit_code == 1
    check = json.loads(result.stdout)["checks"][0]
    assert (check["name"], check["status"]) == ("config", "fail")
    assert "metadata.timeout_s" in check["detail"]
