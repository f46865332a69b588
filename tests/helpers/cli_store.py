"""Builders for CLI tests: a store made by `hf3fsctl init`, filled with real pages.

`make_store` runs the real `init` command (config file, SQLite DB, preallocated page
files); `fill` writes random pages with the POSIX engine and allocates + commits them
through the `MetadataClient` API, exactly as the connector does; `corrupt_page`
overwrites a committed page's bytes on disk. `add_namespace` registers another
namespace in the same store; `cli` / `cli_json` run commands against a store;
`age_namespace` ages a namespace in SQLite directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from helpers.meta_builders import make_manifest
from hf3fsctl.cli.main import app
from hf3fsctl.config import Config, load_config
from hf3fsctl.keys import NamespaceManifest
from hf3fsctl.meta.client import connect
from hf3fsctl.meta.models import CommitItem
from hf3fsctl.meta.protocol import MetadataClient

PAGE_BYTES = 16384
FILE_SIZE = "1MiB"  # 64 pages of 16 KiB per rank


def manifest(model: str = "tiny-llama", tp_size: int = 2) -> NamespaceManifest:
    """A namespace manifest with small pages."""
    return make_manifest(model=model, tp_size=tp_size, block_size=32, page_bytes=PAGE_BYTES)


@dataclass
class Store:
    """A store made by `hf3fsctl init`."""

    root: Path
    config_file: Path
    namespace: str

    def config(self) -> Config:
        return load_config(self.config_file, environ={})


def make_store(
    tmp: Path,
    *,
    metadata_url: str | None = None,
    token_file: Path | None = None,
    model: str = "tiny-llama",
) -> Store:
    """Run `hf3fsctl init` with a namespace manifest and two preallocated ranks."""
    ns = manifest(model)
    tmp.mkdir(parents=True, exist_ok=True)
    manifest_file = tmp / f"manifest-{model}.json"
    manifest_file.write_text(json.dumps(ns.to_dict()))
    config_file = tmp / "hf3fs.yaml"
    args = [
        "init",
        "--storage-path",
        str(tmp / "store"),
        "--create-path",
        "--file-size",
        FILE_SIZE,
        "--preallocate",
        "--write-config",
        str(config_file),
        "--force",
        "--namespace-manifest",
        str(manifest_file),
        "--json",
    ]
    if metadata_url:
        args += ["--metadata-url", metadata_url]
    if token_file:
        args += ["--token-file", str(token_file)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    return Store(tmp / "store", config_file, ns.namespace_id)


def fill(store: Store, keys: list[str], client: MetadataClient | None = None) -> None:
    """Write a random page per key on every rank, then allocate + commit them."""
    from hf3fsctl.storage.factory import open_engine
    from hf3fsctl.storage.layout import PageFile

    own = client is None
    client = client or connect(store.config())
    engine = open_engine("posix", io_threads=2)
    try:
        for rank_file in client.get_namespace(store.namespace).rank_files:
            result = client.allocate(store.namespace, rank_file.rank, keys)
            pages = [a.page for a in result.allocated]
            buffers = [os.urandom(rank_file.page_bytes) for _ in pages]
            with PageFile.open(
                store.root, rank_file.path, rank_file.page_bytes, rank_file.num_pages
            ) as page_file:
                written = engine.write_pages(page_file, pages, buffers)
            items = [
                CommitItem(
                    key=a.key, page=a.page, checksum=str(w.checksum), size=rank_file.page_bytes
                )
                for a, w in zip(result.allocated, written, strict=True)
            ]
            assert client.commit(store.namespace, rank_file.rank, items) == len(items)
    finally:
        engine.close()
        if own:
            client.close()


def corrupt_page(store: Store, rank: int, key: str) -> int:
    """Flip bytes of `key`'s committed page on `rank`; returns the page index."""
    client = connect(store.config())
    try:
        entry = next(
            e
            for e in client.list_entries(store.namespace, limit=1000)
            if e.key == key and e.rank == rank
        )
        rank_file = next(
            r for r in client.get_namespace(store.namespace).rank_files if r.rank == rank
        )
    finally:
        client.close()
    with open(store.root / rank_file.path, "r+b") as handle:
        handle.seek(entry.page * rank_file.slot_bytes + 100)
        old = handle.read(16)
        handle.seek(entry.page * rank_file.slot_bytes + 100)
        handle.write(bytes(b ^ 0xFF for b in old))
    return entry.page


# Commands that open a store, each a way an operator meets a broken one (damaged, on a
# file system gone): every one must say so in one line.
STORE_COMMANDS = [
    ["stats"],
    ["ls"],
    ["vllm-config"],
    ["evict", "--all", "--yes"],
    ["pin", "0123456789abcdef", "--key", "k"],
]


def one_line_error(stderr: str) -> bool:
    """An error as the CLI prints known ones: `Error:` and `Hint:`, no traceback."""
    return "Traceback" not in stderr and stderr.startswith("Error: ")


def cli(store: Store, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run `hf3fsctl --config <store's config> ARGS` through Typer's CliRunner."""
    return CliRunner().invoke(app, ["--config", str(store.config_file), *args], env=env)


def cli_json(store: Store, *args: str, env: dict[str, str] | None = None) -> Any:
    """`cli(... --json)`, asserting success; the one JSON document it printed."""
    result = cli(store, *args, "--json", env=env)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def add_namespace(store: Store, ns: NamespaceManifest) -> Store:
    """Register another namespace in `store` (its manifest, preallocated page files) with
    `hf3fsctl init`; the returned `Store` names it."""
    manifest_file = store.root.parent / f"manifest-{ns.namespace_id}.json"
    manifest_file.write_text(json.dumps(ns.to_dict()))
    result = cli(
        store,
        "init",
        "--storage-path",
        str(store.root),
        "--file-size",
        FILE_SIZE,
        "--preallocate",
        "--namespace-manifest",
        str(manifest_file),
        "--json",
    )
    assert result.exit_code == 0, result.stderr
    return dataclasses.replace(store, namespace=ns.namespace_id)


def age_namespace(store: Store, when: float) -> None:
    """Make the namespace last used at `when`, in SQLite directly: its `last_used`
    (registration, lookups, loads) and its entries' last access (saves, loads)."""
    db = sqlite3.connect(store.root / "metadata.db")
    try:
        with db:
            db.execute("UPDATE namespaces SET last_used = ? WHERE id = ?", (when, store.namespace))
            db.execute(
                "UPDATE entries SET last_access = ?, created = MIN(created, ?) WHERE namespace = ?",
                (when, when, store.namespace),
            )
    finally:
        db.close()


HEAVY_MODULES = ("torch", "vllm", "transformers", "fastapi", "uvicorn", "httpx", "numpy")
_IMPORTS_PROBE = """
import json, sys
modules = json.loads(sys.argv[2])
sys.argv = ["hf3fsctl", *json.loads(sys.argv[1])]
from hf3fsctl.cli.main import main
try:
    main()
except SystemExit as exc:
    code = exc.code
heavy = [m for m in modules if m in sys.modules]
sys.stderr.write("HEAVY=" + json.dumps(heavy) + "\\n")
sys.exit(code or 0)
"""


def heavy_imports(store: Store, *args: str) -> list[str]:
    """Run `hf3fsctl --config <store's> ARGS` in a fresh interpreter (as the console script
    runs); the heavy modules (`HEAVY_MODULES`) it imported. Asserts it succeeded."""
    import subprocess
    import sys

    argv = json.dumps(["--config", str(store.config_file), *args])
    result = subprocess.run(
        [sys.executable, "-c", _IMPORTS_PROBE, argv, json.dumps(HEAVY_MODULES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("HEAVY="))
    return list(json.loads(line[len("HEAVY=") :]))
