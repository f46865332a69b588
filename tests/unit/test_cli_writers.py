"""Writers shown by `stats`, `ls --writers` and `doctor`: a namespace written by engines
with other numerics is warned about, one with a single writer is not."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli_store import Store, cli, cli_json, make_store

from hf3fsctl.meta.client import connect
from hf3fsctl.meta.models import WriterInfo

EAGER = WriterInfo(
    id="a" * 12, numerics={"compilation_mode": "NONE", "enforce_eager": "true", "dtype": "bf16"}
)
COMPILED = WriterInfo(
    id="b" * 12,
    numerics={"compilation_mode": "DYNAMO_TRACE_ONCE", "enforce_eager": "false", "dtype": "bf16"},
)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return make_store(tmp_path)


def _record(store: Store, *writers: WriterInfo) -> None:
    client = connect(store.config())
    try:
        for writer in writers:
            client.record_writer(store.namespace, writer)
    finally:
        client.close()


def test_stats_json_lists_one_writer_without_a_warning(store: Store) -> None:
    _record(store, EAGER)
    document = cli_json(store, "stats")
    assert [w["id"] for w in document["namespaces"][0]["writers"]] == [EAGER.id]
    assert document["warnings"] == []


def test_stats_warns_about_two_writers_naming_what_differs(store: Store) -> None:
    _record(store, EAGER, COMPILED)
    document = cli_json(store, "stats")
    (warning,) = document["warnings"]
    assert store.namespace in warning
    assert "compilation_mode, enforce_eager" in warning
    table = cli(store, "stats", env={"COLUMNS": "300"})
    assert "2 (numerics differ)" in table.stdout


def test_ls_writers_lists_each_writer(store: Store) -> None:
    _record(store, EAGER, COMPILED)
    document = cli_json(store, "ls", "--writers")
    assert [w["id"] for w in document["writers"][store.namespace]] == [EAGER.id, COMPILED.id]


def test_doctor_warns_about_a_namespace_with_two_writers(store: Store) -> None:
    _record(store, EAGER, COMPILED)
    checks = {c["name"]: c for c in cli_json(store, "doctor")["checks"]}
    assert checks["store.writers"]["status"] == "warn"
    assert checks[f"namespace.{store.namespace}.writers"]["status"] == "warn"
    assert "strict_numerics" in checks[f"namespace.{store.namespace}.writers"]["fix"]
