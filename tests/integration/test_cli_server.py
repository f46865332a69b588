"""The CLI against a real `hf3fsctl serve` process over HTTP, with a bearer token:
init → stats → ls → doctor → evict, and what a wrong or missing token does.

One server serves the module; each test makes its own namespace (its own model name)
and looks only at that namespace."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.cli_store import PAGE_BYTES, Store, corrupt_page, fill, make_store
from helpers.meta_builders import keys as make_keys
from helpers.servers import TOKEN, ServerProcess, start_server
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.errors import AuthError

pytestmark = pytest.mark.integration

runner = CliRunner()
NUM_KEYS = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(tmp_path_factory.mktemp("server"), token=TOKEN)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One storage root for the module, as every node of a deployment shares one."""
    return tmp_path_factory.mktemp("client")


@pytest.fixture
def store(server: ServerProcess, client_dir: Path, request: pytest.FixtureRequest) -> Store:
    assert server.token_file is not None
    made = make_store(
        client_dir,
        metadata_url=server.url,
        token_file=server.token_file,
        model=request.node.name,
    )
    fill(made, make_keys(NUM_KEYS, salt=request.node.name))
    return made


def cli(store: Store, *args: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, ["--config", str(store.config_file), *args], env=env)


def cli_json(store: Store, *args: str) -> Any:
    result = cli(store, *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def namespace_stats(store: Store) -> dict[str, Any]:
    document = cli_json(store, "stats")
    return next(ns for ns in document["namespaces"] if ns["id"] == store.namespace)


def statuses(document: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in document["checks"]}


def test_init_registers_the_namespace_on_the_server(store: Store) -> None:
    assert namespace_stats(store)["bytes_used"] == 2 * 64 * PAGE_BYTES  # preallocated files


def test_stats_over_http_counts_committed_keys(store: Store) -> None:
    assert namespace_stats(store)["keys"] == NUM_KEYS


def test_ls_over_http_lists_every_entry(store: Store) -> None:
    entries = cli_json(store, "ls", "--namespace", store.namespace)["entries"]
    assert len(entries) == 2 * NUM_KEYS


def test_doctor_over_http_accepts_the_right_token(store: Store) -> None:
    result = cli(store, "doctor", "--json")
    assert statuses(json.loads(result.stdout))["metadata.auth"] == "ok"


def test_doctor_over_http_verifies_the_namespace_pages(store: Store) -> None:
    result = cli(store, "doctor", "--checksums", "--json")
    found = statuses(json.loads(result.stdout))
    mine = [found[f"{check} {store.namespace}"] for check in ("manifest", "pages", "checksums")]
    assert mine == ["ok", "ok", "ok"]


def test_doctor_over_http_finds_a_corrupt_page(store: Store) -> None:
    entry = cli_json(store, "ls", "--namespace", store.namespace, "--limit", "1")["entries"][0]
    corrupt_page(store, rank=entry["rank"], key=entry["key"])
    result = cli(store, "doctor", "--checksums", "--all-pages", "--json")
    assert result.exit_code == 1
    assert statuses(json.loads(result.stdout))[f"checksums {store.namespace}"] == "fail"


def test_evict_over_http_frees_every_page(store: Store) -> None:
    result = cli_json(store, "evict", "--all", "-y", "--namespace", store.namespace)
    assert result["keys"] == NUM_KEYS
    assert namespace_stats(store)["pages_used"] == 0


def test_wrong_token_exits_with_the_auth_code_and_hint(store: Store, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    result = cli(store, "stats", env={"HF3FSCTL_METADATA_TOKEN_FILE": str(wrong)})
    assert result.exit_code == AuthError.exit_code == 7
    assert "Hint:" in result.stderr
    assert "token_file" in result.stderr


def test_missing_token_exits_with_the_auth_code(store: Store) -> None:
    result = cli(store, "ls", env={"HF3FSCTL_METADATA_TOKEN_FILE": ""})
    assert result.exit_code == AuthError.exit_code


def test_doctor_reports_a_wrong_token_as_a_failed_auth_check(store: Store, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    result = cli(store, "doctor", "--json", env={"HF3FSCTL_METADATA_TOKEN_FILE": str(wrong)})
    assert result.exit_code == 1
    found = statuses(json.loads(result.stdout))
    assert (found["metadata.reachable"], found["metadata.auth"]) == ("ok", "fail")
