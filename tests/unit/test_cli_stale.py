"""`evict --stale`: whole namespaces unused for a while, or whose local model directory
changed, are dropped (metadata, then page files), against a real embedded store."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.cli_store import (
    FILE_SIZE,
    Store,
    add_namespace,
    age_namespace,
    cli,
    cli_json,
    fill,
    heavy_imports,
    make_store,
    manifest,
)
from helpers.meta_builders import keys as make_keys

from hf3fsctl.config import parse_size
from hf3fsctl.keys import model_revision
from hf3fsctl.meta.client import connect

WIDE = {"COLUMNS": "240"}  # tables are not wrapped
NAMESPACE_BYTES = 2 * parse_size(FILE_SIZE)  # two preallocated rank files


@dataclass
class Stores:
    fresh: Store  # used just now
    old: Store  # last used 30 days ago
    changed: Store  # its local model directory's files changed since it was recorded
    elsewhere: Store  # a local model directory that is not on this node; used just now
    fresh_keys: list[str]


@pytest.fixture
def stores(tmp_path: Path) -> Stores:
    fresh = make_store(tmp_path)
    fresh_keys = make_keys(4)
    fill(fresh, fresh_keys)
    old = add_namespace(fresh, manifest(model="old-model"))
    fill(old, make_keys(3, salt="old"))
    age_namespace(old, time.time() - 30 * 86400)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 64}))
    changed = add_namespace(
        fresh,
        dataclasses.replace(manifest(model=str(model_dir)), revision=model_revision(model_dir)),
    )
    fill(changed, make_keys(2, salt="changed"))
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 128}))  # new weights
    elsewhere = add_namespace(
        fresh,
        dataclasses.replace(
            manifest(model=str(tmp_path / "on-another-node")), revision="local-0123456789abcdef"
        ),
    )
    return Stores(fresh, old, changed, elsewhere, fresh_keys)


def namespace_ids(store: Store) -> set[str]:
    return {ns["id"] for ns in cli_json(store, "stats")["namespaces"]}


def all_ids(stores: Stores) -> set[str]:
    return {s.namespace for s in (stores.fresh, stores.old, stores.changed, stores.elsewhere)}


def test_stale_dry_run_unused_for_0s_lists_every_namespace_and_removes_nothing(
    stores: Stores,
) -> None:
    store = stores.fresh
    document = cli_json(store, "evict", "--stale", "--unused-for", "0s", "--dry-run")
    assert document["dry_run"] is True
    assert {row["id"] for row in document["namespaces"]} == all_ids(stores)
    assert document["removed"] == 4
    assert document["bytes"] == 4 * NAMESPACE_BYTES
    assert namespace_ids(store) == all_ids(stores)
    assert all((store.root / ns).is_dir() for ns in all_ids(stores))


def test_stale_dry_run_lists_the_unused_and_the_changed_namespaces(stores: Stores) -> None:
    document = cli_json(stores.fresh, "evict", "--stale", "--dry-run")
    rows = {row["id"]: row for row in document["namespaces"]}
    assert set(rows) == {stores.old.namespace, stores.changed.namespace}
    assert rows[stores.old.namespace]["reasons"] == ["unused for 30d"]
    assert rows[stores.old.namespace]["model"] == "old-model"
    assert rows[stores.old.namespace]["keys"] == 3
    assert rows[stores.changed.namespace]["reasons"][0].startswith("model changed")
    assert rows[stores.changed.namespace]["bytes"] == NAMESPACE_BYTES
    (unchecked,) = document["unchecked"]
    assert unchecked["id"] == stores.elsewhere.namespace
    assert "not found here" in unchecked["note"]
    assert namespace_ids(stores.fresh) == all_ids(stores)


def test_stale_listing_says_a_missing_model_directory_was_not_checked(stores: Stores) -> None:
    result = cli(stores.fresh, "evict", "--stale", "--dry-run", env=WIDE)
    assert result.exit_code == 0, result.stderr
    assert "would remove 2 stale namespaces: 5 keys, 4.0 MiB" in result.stdout
    assert stores.old.namespace in result.stdout and "unused for 30d" in result.stdout
    assert stores.changed.namespace in result.stdout and "model changed" in result.stdout
    assert stores.elsewhere.namespace not in result.stdout
    assert stores.elsewhere.namespace in result.stderr
    assert "fingerprint not checked" in result.stderr


def test_stale_yes_removes_exactly_the_stale_namespaces_and_returns_their_bytes(
    stores: Stores,
) -> None:
    store = stores.fresh
    before = cli_json(store, "stats")["bytes_used"]
    document = cli_json(store, "evict", "--stale", "-y")
    assert (document["dry_run"], document["removed"]) == (False, 2)
    assert document["bytes"] == 2 * NAMESPACE_BYTES
    assert document["bytes_freed"] > 0
    assert all(row["removed"] for row in document["namespaces"])
    after = cli_json(store, "stats")
    assert after["bytes_used"] == before - document["bytes"]
    assert {ns["id"] for ns in after["namespaces"]} == {
        stores.fresh.namespace,
        stores.elsewhere.namespace,
    }
    assert not (store.root / stores.old.namespace).exists()
    assert not (store.root / stores.changed.namespace).exists()
    assert (store.root / stores.fresh.namespace / "rank-0000.pages").is_file()
    assert (store.root / stores.elsewhere.namespace).is_dir()
    entries = cli_json(store, "ls", "--limit", "1000")["entries"]
    assert {e["namespace"] for e in entries} == {stores.fresh.namespace}
    client = connect(store.config())
    try:
        assert client.lookup(stores.fresh.namespace, stores.fresh_keys) == 4
    finally:
        client.close()
    assert cli_json(store, "evict", "--stale", "-y")["removed"] == 0


def test_stale_table_reports_the_disk_returned(stores: Stores) -> None:
    result = cli(stores.fresh, "evict", "--stale", "--yes", env=WIDE)
    assert result.exit_code == 0, result.stderr
    assert "removed 2 stale namespaces" in result.stdout
    assert "of disk returned" in result.stdout


def test_stale_refuses_without_yes_when_stdin_is_not_a_tty(stores: Stores) -> None:
    result = cli(stores.fresh, "evict", "--stale")
    assert result.exit_code == 2
    assert "--yes" in result.stderr
    assert namespace_ids(stores.fresh) == all_ids(stores)


def test_a_lookup_makes_a_namespace_fresh_again(stores: Stores) -> None:
    client = connect(stores.old.config())
    try:
        client.lookup(stores.old.namespace, make_keys(1, salt="old"))
    finally:
        client.close()
    document = cli_json(stores.fresh, "evict", "--stale", "--dry-run")
    assert {row["id"] for row in document["namespaces"]} == {stores.changed.namespace}


def test_a_stale_namespace_holding_pins_is_kept_unless_include_pinned(stores: Stores) -> None:
    (pinned,) = make_keys(1, salt="old")
    cli_json(stores.old, "pin", stores.old.namespace, "--key", pinned)
    document = cli_json(stores.fresh, "evict", "--stale", "-y")
    rows = {row["id"]: row for row in document["namespaces"]}
    assert "--include-pinned" in rows[stores.old.namespace]["skipped"]
    assert not rows[stores.old.namespace]["removed"]
    assert rows[stores.changed.namespace]["removed"]
    assert stores.old.namespace in namespace_ids(stores.fresh)
    document = cli_json(stores.fresh, "evict", "--stale", "--include-pinned", "-y")
    assert [row["id"] for row in document["namespaces"] if row["removed"]] == [stores.old.namespace]
    assert cli_json(stores.fresh, "ls", "--pins")["pins"] == []


def test_stale_imports_no_heavy_module(stores: Stores) -> None:
    assert heavy_imports(stores.fresh, "evict", "--stale", "--dry-run") == []


@pytest.mark.parametrize(
    "args",
    [["--stale", "--all"], ["--stale", "--older-than", "1h"], ["--stale", "--max-entries", "1"]],
    ids=["all", "older-than", "max-entries"],
)
def test_stale_cannot_be_combined_with_entry_criteria(stores: Stores, args: list[str]) -> None:
    result = cli(stores.fresh, "evict", *args, "--dry-run")
    assert result.exit_code == 2
    assert "--stale" in result.stderr


def test_unused_for_needs_stale(stores: Stores) -> None:
    result = cli(stores.fresh, "evict", "--unused-for", "1d", "--all", "--dry-run")
    assert result.exit_code == 2
    assert "--unused-for applies to --stale only" in result.stderr
