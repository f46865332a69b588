"""The store contract, run against every implementation of it.

Each test here takes `backend` (or a fixture built on it) and runs once per store:

- `sqlite`: `sqlite:///…`, the embedded `MetadataStore` (a fresh database per test);
- `redis`: `redis://…`, the Redis store on a real `redis-server` (one per session,
  flushed before each test);
- `redis-cluster`: `redis+cluster://…`, the same store on a local 3-master Redis Cluster
  (one per session, every master flushed before each test);
- `redis-sharded`: `redis+cluster://…?shards=4`, the store split into 4 one-slot shards
  on that cluster (`ShardedRedisStore`); tests marked `one_slot` skip it (not collected);
- `http`: `HttpMetadataClient` against the service app (`create_app`) over a fresh
  SQLite store, served by uvicorn on a loopback port in this process — real HTTP and
  the real routes, without the second or so a `hf3fsctl serve` process costs to start
  (that process is tested in `tests/integration/`). Only modules that set
  `BACKENDS = ALL_BACKENDS` run it.

Every client is opened the way the connector and the CLI open theirs: a config file →
`load_config` → `connect`. `Backend.invariants()` asks the store behind the client for
its own consistency check (`check_invariants`); the fixture runs it after every test
(a violation is an error of that test), and scenarios also check it where it matters.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from contract_backends import DEFAULT_BACKENDS, Backend
from helpers.redis_servers import (
    redis_cluster_servers,
    redis_cluster_url,
    redis_session_server,
    redis_url,
)

__all__ = ["redis_cluster_servers", "redis_cluster_url", "redis_session_server", "redis_url"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise `backend` over the module's `BACKENDS` (default sqlite and redis)."""
    if "backend" in metafunc.fixturenames:
        kinds = getattr(metafunc.module, "BACKENDS", DEFAULT_BACKENDS)
        if metafunc.definition.get_closest_marker("one_slot") is not None:
            kinds = tuple(kind for kind in kinds if kind != "redis-sharded")
        metafunc.parametrize("backend", kinds, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """The store implementation this test runs against (see `pytest_generate_tests`)."""
    kind: str = request.param
    redis: str | None = None
    if kind == "redis":
        redis = request.getfixturevalue("redis_url")
    if kind in ("redis-cluster", "redis-sharded"):
        redis = request.getfixturevalue("redis_cluster_url")
    if kind == "http-stock":
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setenv("HF3FSCTL_HTTP_FAST_PATH", "0")
        monkeypatch.setenv("HF3FSCTL_SERVER_FAST_PATH", "0")
    made = Backend(kind, tmp_path, redis)
    try:
        yield made
        if made.clients:  # every scenario ends with a sound store
            assert made.invariants() == [], f"{kind} store unsound after the test"
    finally:
        made.close()
