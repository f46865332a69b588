"""How the Redis store runs its Lua (`meta/redis/connection.py`, `StoreLua`): as one
function library (`FUNCTION LOAD`, `FCALL`) where the server has functions, else as
scripts (`EVALSHA`); a library the server lost is loaded again and the call made once.

The store contract itself runs on functions in `tests/contract/` (Redis 7 here); these
tests pin down the choice and the recovery, on the session's local Redis and Cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import commit_items, keys, register
from helpers.redis_servers import (
    RedisClusterServers,
    RedisServer,
    redis_cluster_servers,
    redis_cluster_url,
    redis_session_server,
    redis_url,
)

from hf3fsctl.config import MetadataUrl, build_config
from hf3fsctl.meta.client import connect
from hf3fsctl.meta.protocol import SelfChecking
from hf3fsctl.meta.redis import RedisMetadataStore
from hf3fsctl.meta.redis.connection import LIBRARY

__all__ = [  # fixtures used here
    "redis_cluster_servers",
    "redis_cluster_url",
    "redis_session_server",
    "redis_url",
]


def _calls(server: RedisServer, command: str) -> int:
    """How many times `command` ran on `server` since its last CONFIG RESETSTAT."""
    conn = server.client()
    try:
        return int(conn.info("commandstats").get(f"cmdstat_{command}", {"calls": 0})["calls"])
    finally:
        conn.close()


def _libraries(server: RedisServer) -> list[str]:
    conn = server.client()
    try:
        listed = conn.function_list()
    finally:
        conn.close()
    names = []
    for entry in listed:  # RESP2: [name, value, …] per library
        fields = (
            dict(zip(entry[::2], entry[1::2], strict=True)) if isinstance(entry, list) else entry
        )
        names.append(bytes(fields[b"library_name"]).decode())
    return names


def _reset(server: RedisServer, *, flush_functions: bool = False) -> None:
    conn = server.client()
    try:
        if flush_functions:
            conn.execute_command("FUNCTION", "FLUSH")
        conn.config_resetstat()
    finally:
        conn.close()


def _round_trip(store: Any, n: int = 8, salt: str = "") -> None:
    """Register, save `n` keys, look them up and locate them: every kind of call."""
    ns = register(store)
    asked = keys(n, salt=salt)
    allocated = store.allocate(ns, 0, asked).allocated
    assert sorted(a.key for a in allocated) == sorted(asked)  # each allocated, once
    store.commit(ns, 0, commit_items(allocated))
    assert store.lookup(ns, asked) == n
    located = store.locate(ns, 0, asked)
    assert [loc.page if loc else None for loc in located] == [
        a.page for a in sorted(allocated, key=lambda a: asked.index(a.key))
    ]


@pytest.fixture
def server(redis_url: str, redis_session_server: RedisServer) -> Iterator[RedisServer]:
    _reset(redis_session_server)
    yield redis_session_server


def test_a_store_on_redis_7_runs_one_function_library(server: RedisServer) -> None:
    _reset(server, flush_functions=True)
    store = RedisMetadataStore(MetadataUrl.parse(server.url))
    try:
        assert "loaded by the first call" in store.replication()["lua"]  # what doctor says
        _round_trip(store)
        assert store.check_invariants() == []
        assert store.replication()["lua"] == f"functions (library {_libraries(server)[0]})"
    finally:
        store.close()
    assert _calls(server, "fcall") >= 5  # register ×2, allocate, commit, lookup's counter …
    assert _calls(server, "evalsha") == 0 and _calls(server, "eval") == 0
    assert _calls(server, "function|load") == 1  # loaded once, by the first call
    assert [name.startswith(f"{LIBRARY}_") for name in _libraries(server)] == [True]


def test_a_library_the_server_lost_is_loaded_again_and_no_call_runs_twice(
    server: RedisServer,
) -> None:
    store = RedisMetadataStore(MetadataUrl.parse(server.url))
    try:
        _round_trip(store, salt="before")
        _reset(server, flush_functions=True)  # as a fresh master after a failover
        ns = register(store, model="after")  # the first call after it loads the library
        asked = keys(16, salt="after")
        allocated = store.allocate(ns, 0, asked).allocated
        assert len(allocated) == 16 and not store.allocate(ns, 0, asked).allocated  # pending
        store.commit(ns, 0, commit_items(allocated))
        assert store.lookup(ns, asked) == 16
        assert store.check_invariants() == []
    finally:
        store.close()
    assert _calls(server, "function|load") == 1
    assert len(_libraries(server)) == 1


def test_a_user_refused_functions_runs_the_same_calls_as_scripts(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An ACL without FCALL and FUNCTION (as Redis 6, which has neither): scripts."""
    admin = server.client()
    admin.execute_command(
        "ACL", "SETUSER", "nofunctions", "on", ">secret", "~*", "&*", "+@all", "-fcall",
        "-fcall_ro", "-function",
    )  # fmt: skip
    url = f"redis://nofunctions:secret@127.0.0.1:{server.port}/0"
    try:
        with caplog.at_level(logging.INFO, logger="hf3fsctl.meta.redis.connection"):
            store = RedisMetadataStore(MetadataUrl.parse(url))
            try:
                _round_trip(store)
                assert store.check_invariants() == []
                assert store.replication()["lua"].startswith("scripts (EVALSHA")
            finally:
                store.close()
    finally:
        admin.execute_command("ACL", "DELUSER", "nofunctions")
        admin.close()
    assert _calls(server, "fcall") == 0  # refused calls are not counted as calls
    assert _calls(server, "evalsha") >= 5
    assert sum("runs no functions" in r.getMessage() for r in caplog.records) == 1  # said once


def test_a_sharded_store_loads_the_library_on_a_master_that_lost_it(
    redis_cluster_url: str, redis_cluster_servers: RedisClusterServers, tmp_path: Path
) -> None:
    masters = redis_cluster_servers.servers
    config = build_config(
        [
            (
                "test",
                {
                    "storage.path": str(tmp_path / "no-root"),
                    "metadata.url": redis_cluster_url + "?shards=3",
                    "metadata.timeout_s": 10,
                },
            )
        ]
    )
    store = connect(config)
    try:
        _round_trip(store, n=32, salt="before")
        lost = masters[1]
        _reset(lost, flush_functions=True)
        _round_trip(store, n=32, salt="after")  # 32 keys: every shard, every master, asked
        assert isinstance(store, SelfChecking) and store.check_invariants() == []
    finally:
        store.close()
    assert _calls(lost, "function|load") == 1
    assert all(len(_libraries(master)) == 1 for master in masters)
