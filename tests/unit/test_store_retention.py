"""Retention and admission on SQLite (issue 22), beyond the contract: a store written
before them gains them on a writable open and is still read by a read-only one; `stats`,
`ls` and `/metrics` show what they count."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from helpers.cli_store import Store, fill, make_store
from helpers.meta_builders import commit_items, keys, register, store_keys
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.meta.client import connect
from hf3fsctl.meta.server.metrics import ServerMetrics
from hf3fsctl.meta.sqlite import schema
from hf3fsctl.meta.sqlite.store import MetadataStore

runner = CliRunner()
WIDE = {"COLUMNS": "220"}

# What a store written before issue 22 lacks: dropped to make one.
_ISSUE_22_SQL = """
BEGIN;
DROP TRIGGER key_lru_on_expiry; DROP TRIGGER key_lru_expiry_on_delete;
DROP TRIGGER admission_on_insert; DROP TRIGGER admission_on_delete;
DROP INDEX key_lru_by_expiry; DROP TABLE admission; DROP TABLE admission_size;
DROP TRIGGER key_lru_on_pin; DROP TRIGGER key_lru_on_unpin; DROP TRIGGER key_lru_pinned_on_insert;
DROP INDEX key_lru_unpinned; DROP INDEX pins_by_expiry; DROP INDEX key_lru_pinned;
ALTER TABLE key_lru DROP COLUMN pinned;
CREATE INDEX key_lru_by_age ON key_lru (namespace, last_access, depth DESC);
ALTER TABLE entries DROP COLUMN expires_at; ALTER TABLE entries DROP COLUMN renew_s;
ALTER TABLE key_lru DROP COLUMN expires_at; ALTER TABLE namespaces DROP COLUMN admission_skipped;
COMMIT;
"""


def commit_expiring(store: MetadataStore, ns: str, chain: list[str], retention_s: float) -> None:
    result = store.allocate(ns, 0, chain)
    store.commit(
        ns,
        0,
        commit_items(result.allocated, retention_s),
    )


def older_store(tmp_path: Path) -> tuple[Path, str, list[str]]:
    """A store with 4 committed keys (one pinned), as written before issue 22."""
    db = tmp_path / "m.db"
    store = MetadataStore(db)
    ns = register(store)
    chain = keys(4)
    store_keys(store, ns, chain)
    store.pin(ns, chain[:1])  # its pinned flag is filled in on the writable open
    store.close()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.executescript(_ISSUE_22_SQL)
    conn.close()
    return db, ns, chain


def test_a_store_written_before_expiry_gains_it_on_a_writable_open(tmp_path: Path) -> None:
    db, ns, chain = older_store(tmp_path)
    store = MetadataStore(db)
    assert store.check_invariants() == []
    assert store.lookup(ns, chain) == 4
    commit_expiring(store, ns, keys(2, salt="new"), 3600)
    assert store.admit(ns, chain[:1], 2) == [False]
    assert store.check_invariants() == []
    store.close()
    conn = sqlite3.connect(db)
    for table, column, _ in schema.OPEN_COLUMNS:
        assert schema.has_column(conn, table, column), (table, column)
    conn.close()


def test_a_read_only_reader_of_an_older_store_reads_it_as_never_expiring(tmp_path: Path) -> None:
    db, ns, chain = older_store(tmp_path)
    reader = MetadataStore(db, read_only=True)
    assert reader.lookup(ns, chain) == 4
    assert {e.expires_at for e in reader.list_entries(ns)} == {None}
    stats = reader.stats().namespaces[0]
    assert (stats.admission_skipped, stats.expiring_keys) == (0, 0)
    assert reader.check_invariants() == []
    reader.close()


def test_metrics_export_admission_skipped_and_expiring_keys(tmp_path: Path) -> None:
    store = MetadataStore(tmp_path / "m.db")
    ns = register(store)
    store.admit(ns, keys(3, salt="seen"), 2)
    commit_expiring(store, ns, keys(2), 0.05)
    time.sleep(0.1)
    text = ServerMetrics(store).render()[0].decode()
    assert f'hf3fsctl_admission_skipped_keys_total{{namespace="{ns}"}} 3.0' in text
    assert f'hf3fsctl_expiring_keys{{namespace="{ns}"}} 2.0' in text
    assert f'hf3fsctl_expired_keys{{namespace="{ns}"}} 2.0' in text
    store.close()


def _admit_and_expire(store: Store, chain: list[str]) -> None:
    client = connect(store.config())
    try:
        client.admit(store.namespace, keys(5, salt="once"), 3)
        for rank in (0, 1):
            result = client.allocate(store.namespace, rank, keys(2, salt="r"))
            client.commit(store.namespace, rank, commit_items(result.allocated, 3600))
    finally:
        client.close()


def test_stats_show_admission_skipped_and_expiring_keys(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    fill(store, keys(3))
    _admit_and_expire(store, keys(3))
    args = ["--config", str(store.config_file), "stats"]
    table = runner.invoke(app, args, env=WIDE)
    assert table.exit_code == 0, table.stderr
    assert "admission skipped" in table.stdout and "5 keys" in table.stdout
    assert "2 keys (0 expired" in table.stdout
    (ns,) = json.loads(runner.invoke(app, [*args, "--json"]).stdout)["namespaces"]
    assert (ns["admission_skipped"], ns["expiring_keys"], ns["expired_keys"]) == (5, 2, 0)


def test_ls_shows_when_entries_expire(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    fill(store, keys(3))
    _admit_and_expire(store, keys(3))
    args = ["--config", str(store.config_file), "ls"]
    table = runner.invoke(app, args, env=WIDE)
    assert table.exit_code == 0, table.stderr
    assert "expires in" in table.stdout and "60m" in table.stdout
    entries = json.loads(runner.invoke(app, [*args, "--json"]).stdout)["entries"]
    assert sum(e["expires_at"] is not None for e in entries) == 4  # 2 keys x 2 ranks
