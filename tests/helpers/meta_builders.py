"""Builders for metadata tests: manifests, namespaces, rank files, keys and checksums."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from hf3fsctl.keys import NamespaceManifest
from hf3fsctl.meta.models import CommitItem, RankFile

PAGE_BYTES = 4096


def make_manifest(**changes: Any) -> NamespaceManifest:
    """A valid namespace manifest (tiny Llama, one rank); `changes` override fields."""
    base = NamespaceManifest(
        model="tiny-llama",
        revision="main",
        kv_dtype="float16",
        block_size=16,
        layout="LBHNC",
        backend="CPU_ATTN",
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        tp_size=1,
        pp_size=1,
        page_bytes=PAGE_BYTES,
        hash_algorithm="sha256",
        none_hash="00" * 32,
    )
    return dataclasses.replace(base, **changes)


def manifest(model: str = "tiny-llama", tp_size: int = 1, pp_size: int = 1) -> dict[str, Any]:
    """A valid namespace manifest dict."""
    return make_manifest(model=model, tp_size=tp_size, pp_size=pp_size).to_dict()


def rank_file(namespace: str, rank: int, num_pages: int) -> RankFile:
    """A rank file of `num_pages` pages."""
    return RankFile(
        rank=rank,
        path=f"{namespace}/rank-{rank:04d}.pages",
        page_bytes=PAGE_BYTES,
        slot_bytes=PAGE_BYTES,
        num_pages=num_pages,
    )


def key(i: int, salt: str = "") -> str:
    """A 64-hex-digit block key."""
    return hashlib.sha256(f"{salt}{i}".encode()).hexdigest()


def keys(n: int, start: int = 0, salt: str = "") -> list[str]:
    """`n` distinct keys."""
    return [key(i, salt) for i in range(start, start + n)]


def checksum(k: str, page: int) -> str:
    """A deterministic checksum for a (key, page)."""
    return hashlib.blake2b(f"{k}:{page}".encode(), digest_size=8).hexdigest()


def commit_items(
    allocations: list[Any], retention_s: float | None = None, renew_on_read: bool = False
) -> list[CommitItem]:
    """Commit items for allocations (anything with `key` and `page`), with a retention."""
    return [
        CommitItem(
            key=a.key,
            page=a.page,
            checksum=checksum(a.key, a.page),
            size=PAGE_BYTES,
            retention_s=retention_s,
            renew_on_read=renew_on_read,
        )
        for a in allocations
    ]


def register(client: Any, num_pages: int = 100, tp_size: int = 1, model: str = "tiny") -> str:
    """Register a namespace and all its rank files on a store or client; returns its id."""
    from hf3fsctl.keys import namespace_id

    data = manifest(model=model, tp_size=tp_size)
    ns = namespace_id(data)
    client.register_namespace(ns, data)
    for rank in range(tp_size):
        client.register_rank(ns, rank_file(ns, rank, num_pages))
    return ns


def store_keys(
    client: Any, ns: str, chain: list[str], ranks: int = 1, first_depth: int = 0
) -> None:
    """Allocate and commit `chain` on every rank (asserting every key got a page)."""
    for rank in range(ranks):
        result = client.allocate(ns, rank, chain, first_depth)
        assert not result.no_space, f"no space for {len(result.no_space)} keys"
        client.commit(ns, rank, commit_items(result.allocated))


_LOOKUP_AND_EXIT = """
import sys
from hf3fsctl.meta.client import open_metadata_client
client = open_metadata_client(sys.argv[1])
client.lookup(sys.argv[2], sys.argv[3:])
"""


def lookup_in_a_process_that_exits(url: str, ns: str, chain: list[str]) -> None:
    """One embedded `lookup` in a fresh Python process that exits without `close`
    (as a vLLM scheduler process may)."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-c", _LOOKUP_AND_EXIT, url, ns, *chain], check=True, timeout=60
    )


# --- growing page files on a real disk (store capacity tests) ---------------------


def register_growable(
    client: Any,
    root: Any,
    *,
    model: str = "tiny",
    page_bytes: int = PAGE_BYTES,
    tp_size: int = 1,
    **changes: Any,
) -> tuple[str, list[Any]]:
    """Register a namespace whose rank files grow on demand, created empty under `root`.

    Returns the namespace id and its open `PageFile`s (one per rank; close them).
    """
    from hf3fsctl.keys import namespace_id
    from hf3fsctl.storage.layout import PageFile

    data = make_manifest(model=model, page_bytes=page_bytes, tp_size=tp_size, **changes).to_dict()
    ns = namespace_id(data)
    client.register_namespace(ns, data)
    files = []
    for rank in range(tp_size):
        file = PageFile.create_growable(root, ns, rank, page_bytes)
        client.register_rank(
            ns,
            RankFile(
                rank=rank,
                path=file.relpath,
                page_bytes=page_bytes,
                slot_bytes=file.slot_bytes,
                num_pages=file.num_pages,
                preallocated=False,
            ),
        )
        files.append(file)
    return ns, files


def write_pages(file: Any, pages: Any) -> None:
    """Fill whole slots of `pages` of an open page file, as a writer does (takes disk)."""
    data = b"\xa5" * file.slot_bytes
    for page in pages:
        os.pwrite(file.fd, data, page * file.slot_bytes)


def store_written(
    client: Any, ns: str, files: list[Any], chain: list[str], first_depth: int = 0
) -> int:
    """Allocate `chain` on every rank, write the granted pages, commit them.

    Returns how many keys got pages on rank 0 (the rest were `no_space`).
    """
    granted = 0
    for rank, file in enumerate(files):
        result = client.allocate(ns, rank, chain, first_depth)
        write_pages(file, [a.page for a in result.allocated])
        client.commit(
            ns,
            rank,
            [
                CommitItem(
                    key=a.key, page=a.page, checksum=checksum(a.key, a.page), size=file.page_bytes
                )
                for a in result.allocated
            ],
        )
        if rank == 0:
            granted = len(result.allocated)
    return granted


def sqlite_compiles(store: Any) -> list[tuple[int, str | None]]:
    """What SQLite compiles on this thread's connection of a `MetadataStore` from now on:
    one (action, table) per authorizer call (a statement found in the connection's
    cache is not compiled again, so it adds none)."""
    import sqlite3

    seen: list[tuple[int, str | None]] = []

    def authorize(action: int, arg1: str | None, *_: Any) -> int:
        seen.append((action, arg1))
        return sqlite3.SQLITE_OK

    store._conn().set_authorizer(authorize)
    return seen
