"""Client selection by URL, the embedded client, and HTTP client failure modes (no server).

What every client does with the store (the contract) is in `tests/contract/`."""

from __future__ import annotations

import gc
import multiprocessing
import sqlite3
import time
from pathlib import Path

import pytest
from helpers.meta_builders import keys, lookup_in_a_process_that_exits, register, store_keys
from helpers.servers import free_port

from hf3fsctl.config import load_config
from hf3fsctl.errors import ConfigError, MetadataUnavailable
from hf3fsctl.meta.client import connect, open_metadata_client
from hf3fsctl.meta.http.client import HttpMetadataClient
from hf3fsctl.meta.protocol import MetadataClient
from hf3fsctl.meta.sqlite.store import MetadataStore


@pytest.mark.parametrize(
    ("url", "cls"),
    [("sqlite:///{tmp}/m.db", MetadataStore), ("http://127.0.0.1:1", HttpMetadataClient)],
    ids=["sqlite", "http"],
)
def test_url_scheme_selects_client(tmp_path: Path, url: str, cls: type) -> None:
    client = open_metadata_client(url.format(tmp=tmp_path))
    assert isinstance(client, cls) and isinstance(client, MetadataClient)
    client.close()


def test_unknown_scheme_is_config_error() -> None:
    with pytest.raises(ConfigError):
        open_metadata_client("redis://x")


def test_connect_honours_configured_url(tmp_path: Path) -> None:
    config = load_config(overrides={"metadata.url": f"sqlite:///{tmp_path}/x.db"}, environ={})
    client = connect(config)
    assert client.url.endswith("/x.db")
    client.close()


def test_embedded_four_slash_url_is_absolute(tmp_path: Path) -> None:
    client = open_metadata_client(f"sqlite:///{tmp_path}/a/m.db".replace(":///", ":////"))
    assert isinstance(client, MetadataStore)
    assert Path(client.path).resolve() == (tmp_path / "a" / "m.db").resolve()


def test_embedded_busy_database_is_unavailable_after_timeout(tmp_path: Path) -> None:
    client = open_metadata_client(f"sqlite:///{tmp_path}/m.db", timeout_s=0.2)
    ns = register(client)
    blocker = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    started = time.monotonic()
    with pytest.raises(MetadataUnavailable):
        client.allocate(ns, 0, keys(1))
    assert time.monotonic() - started < 2
    blocker.execute("ROLLBACK")


def _store_with_three_keys(tmp_path: Path) -> tuple[str, str]:
    """An embedded store holding the first 3 of `keys(5)`; returns (url, namespace)."""
    url = f"sqlite:///{tmp_path}/m.db"
    client = open_metadata_client(url)
    ns = register(client)
    store_keys(client, ns, keys(3))
    client.close()
    return url, ns


def _lookup_counters(tmp_path: Path) -> tuple[int, int, int]:
    """(lookups, lookup_keys, hit_keys) of the only namespace, read by a fresh store."""
    store = MetadataStore(tmp_path / "m.db")
    try:
        got = store.stats().namespaces[0]
    finally:
        store.close()
    return got.lookups, got.lookup_keys, got.hit_keys


def test_embedded_lookups_count_when_the_process_exits_without_close(tmp_path: Path) -> None:
    url, ns = _store_with_three_keys(tmp_path)
    lookup_in_a_process_that_exits(url, ns, keys(5))
    assert _lookup_counters(tmp_path) == (1, 5, 3)


_HELD: list[MetadataClient] = []  # alive until the process ends, like a connector's


def _lookup_and_hold(url: str, ns: str, chain: list[str]) -> None:
    client = open_metadata_client(url)
    client.lookup(ns, chain)
    _HELD.append(client)  # no `close`


def test_embedded_lookups_count_when_a_forked_process_exits_without_close(
    tmp_path: Path,
) -> None:
    # vLLM's EngineCore, where the scheduler side looks up, is such a process by default;
    # it ends with os._exit, so atexit handlers do not run there.
    url, ns = _store_with_three_keys(tmp_path)
    child = multiprocessing.get_context("fork").Process(
        target=_lookup_and_hold, args=(url, ns, keys(5))
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert _lookup_counters(tmp_path) == (1, 5, 3)


def test_embedded_lookups_count_when_the_client_is_dropped_without_close(
    tmp_path: Path,
) -> None:
    url, ns = _store_with_three_keys(tmp_path)
    client = open_metadata_client(url)
    client.lookup(ns, keys(5))
    del client
    gc.collect()
    assert _lookup_counters(tmp_path) == (1, 5, 3)


def test_http_client_dead_server_is_unavailable_within_timeout() -> None:
    client = HttpMetadataClient(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(MetadataUnavailable):
        client.lookup("0123456789abcdef", keys(1))
    assert time.monotonic() - started < 3.0  # bounded by the 0.5 s timeout, with margin
