"""How the contract suite reaches each store implementation (see `conftest.py`).

`Backend.open(...)` writes a config (metadata URL, watermarks, lease, capacity policy),
loads it and returns a client made by `connect`, the way the connector and the CLI open
theirs; `Backend.invariants()` asks the store behind the client for its own consistency
check. `InProcessServer` serves the service app over a store on a loopback port.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.servers import free_port

from hf3fsctl.config import Config, load_config
from hf3fsctl.meta.client import connect
from hf3fsctl.meta.protocol import MetadataClient, SelfChecking

DEFAULT_BACKENDS = ("sqlite", "redis", "redis-cluster", "redis-sharded")
# http-stock: the same service with both hand-tuned paths off — every call over stock
# httpx (HF3FSCTL_HTTP_FAST_PATH=0), every route through FastAPI's own parsing and
# dispatch (HF3FSCTL_SERVER_FAST_PATH=0): the fallbacks behave as the fast paths do.
# redis-cluster: the Redis store on a local 3-master Redis Cluster (`redis+cluster://`).
# redis-sharded: that cluster with the store split into 4 one-slot shards (`?shards=4`,
# `meta/redis/sharded.py`). Its eviction is LRU per shard and its change log one per
# shard, so tests of one slot's exact global order, or of files and capacities of a few
# pages (a quarter each per shard), are marked `one_slot` and not run on it; the modules
# of capacity and eviction order (ONE_SLOT_BACKENDS) leave it out whole.
ALL_BACKENDS = ("sqlite", "redis", "redis-cluster", "redis-sharded", "http", "http-stock")
ONE_SLOT_BACKENDS = ("sqlite", "redis", "redis-cluster")
SHARDS = 4
# Where the Redis store lives (a module or a package); the `redis` parameter skips only
# while neither is in the tree.


class InProcessServer:
    """The metadata service app over `store`, served by uvicorn on a thread."""

    def __init__(self, store: Any) -> None:
        import uvicorn

        from hf3fsctl.meta.server.app import create_app

        self.port = free_port()
        config = uvicorn.Config(
            create_app(store),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="contract-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process metadata service did not start")
            time.sleep(0.005)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Ask the server to exit; it does within uvicorn's 0.1 s tick, on its own thread
        (a join would cost every test that tick)."""
        self.server.should_exit = True


class Backend:
    """One implementation of the store contract, and how a test reaches it.

    `open(...)` writes the config (metadata URL, watermarks, lease, capacity policy) and
    returns a client made by `connect`; later `connect()` calls open more clients on the
    same store (another process's view, or the same process after a restart).
    """

    def __init__(self, kind: str, directory: Path, redis: str | None) -> None:
        self.kind = kind
        self.directory = directory
        self.redis = redis
        self.root = directory / "root"
        self.config: Config | None = None
        self.clients: list[MetadataClient] = []
        self.server: InProcessServer | None = None
        self.server_store: Any = None

    def open(
        self,
        *,
        lease_s: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        with_root: bool = False,
        capacity: str = "100%",
        max_pinned: str = "25%",
        quotas: dict[str, str] | None = None,
    ) -> MetadataClient:
        """The store for this test, with these settings; returns its first client.

        Args:
            with_root: the storage root exists here (growing files, holes punched back);
                without it the store has no capacity until one is set, as a server
                without the mount.
        """
        assert self.config is None, "open() once per test; connect() for more clients"
        if with_root:
            self.root.mkdir(exist_ok=True)
        url = {
            "sqlite": f"sqlite:///{self.directory / 'meta.db'}",
            "redis": self.redis,
            "redis-cluster": self.redis,
            "redis-sharded": f"{self.redis}?shards={SHARDS}",
            "http": "http://127.0.0.1:1",  # replaced below by the server's address
            "http-stock": "http://127.0.0.1:1",
        }[self.kind]
        lines = [
            "storage:",
            f"  path: {self.root if with_root else self.directory / 'no-root'}",
            f"  capacity: '{capacity}'",
            f"  max_pinned: '{max_pinned}'",
            "metadata:",
            f"  url: {url}",
            "  timeout_s: 10",
            f"  lease_s: {lease_s}",
            f"  high_watermark: {high_watermark}",
            f"  low_watermark: {low_watermark}",
        ]
        if quotas:
            lines += ["quotas:", *(f"  {name}: '{value}'" for name, value in quotas.items())]
        config_file = self.directory / "hf3fs.yaml"
        config_file.write_text("\n".join(lines) + "\n")
        config = load_config(config_file, environ={})
        if self.kind.startswith("http"):
            config = self._serve(config)
        self.config = config
        return self.connect()

    def _serve(self, config: Config) -> Config:
        """Start the service over a fresh SQLite store with `config`'s store settings."""
        from hf3fsctl.meta.policy import StorePolicy
        from hf3fsctl.meta.sqlite.store import MetadataStore

        md = config.metadata
        self.server_store = MetadataStore(
            self.directory / "meta.db",
            lease_s=md.lease_s,
            high_watermark=md.high_watermark,
            low_watermark=md.low_watermark,
            policy=StorePolicy.from_config(config),
        )
        self.server = InProcessServer(self.server_store)
        return config.model_copy(
            update={"metadata": md.model_copy(update={"url": self.server.url})}
        )

    def connect(self) -> MetadataClient:
        """Another client on this test's store."""
        assert self.config is not None, "open() first"
        client = connect(self.config)
        self.clients.append(client)
        return client

    def invariants(self) -> list[str]:
        """The store's own consistency check: every violated invariant, one line each."""
        if self.server_store is not None:
            return list(self.server_store.check_invariants())
        assert self.clients, "open() first"
        client = self.clients[-1]  # a test may have closed the first
        if not isinstance(client, SelfChecking):
            pytest.fail(f"{type(client).__name__} ({self.kind}) has no check_invariants()")
        return list(client.check_invariants())

    def close(self) -> None:
        for client in self.clients:
            try:
                client.close()
            except Exception:  # a test may have closed it already
                pass
        if self.server is not None:
            self.server.stop()
        if self.server_store is not None:
            self.server_store.close()
