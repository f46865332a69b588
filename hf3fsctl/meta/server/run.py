"""Running the service: `run_server` (uvicorn, one or more worker processes), the store
it fronts (`store_path`, opened through the factory `meta.client.open_store`), and a clean
shutdown (drain, close the store, exit 0 after SIGTERM).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.meta.server.app import create_app

if TYPE_CHECKING:
    from hf3fsctl.meta.policy import StorePolicy
    from hf3fsctl.meta.protocol import Store
    from hf3fsctl.meta.server.logs import LogFormat

logger = logging.getLogger(__name__)


def store_path(store_path_or_url: str) -> str:
    """The store `serve` fronts, as `meta.client.open_store` takes it: a plain path, or a
    URL checked now by the one parser (`MetadataUrl`): SQLite or Redis, never a server.

    Raises:
        ConfigError: a malformed URL.
        InvalidRequest: an `http(s)://` URL (a server cannot front another server).
    """
    if "://" not in store_path_or_url:
        return str(Path(store_path_or_url).expanduser())
    from hf3fsctl.config.urls import MetadataUrl

    target = MetadataUrl.parse(store_path_or_url)
    if not (target.embedded or target.redis):
        raise InvalidRequest(
            f"serve needs a sqlite:///PATH, a file path or a redis:// URL, not {target.url!r}"
        )
    return store_path_or_url  # not target.url: that one has the password redacted


_SETTINGS_ENV = "HF3FSCTL_SERVE_SETTINGS"
DRAIN_TIMEOUT_S = 30  # longest wait for requests in flight at shutdown (systemd waits 45)
# The GIL's switch interval in a server process. A lookup runs on the event loop holding
# the GIL; the writer thread gives the GIL up around every SQLite call of a write
# transaction and, to get it back, waits for the loop thread's next forced switch (5 ms
# by default): a convoy that starved allocate + commit beside saturating lookups (issue
# 21). Measured in one process, a write thread beside a pure-Python lookup loop kept
# 14% of its solo rate at 5 ms and 33% at 1 ms; beside SQLite lookups, 30% and 46%
# (benchmarks/bench_serve_starvation.py measures a real serve).
SWITCH_INTERVAL_S = 0.001


def run_server(
    store_path_or_url: str,
    host: str,
    port: int,
    *,
    token: str | None,
    max_body_bytes: int,
    max_batch: int,
    lease_s: float = 30.0,
    high_watermark: float = 0.95,
    low_watermark: float = 0.85,
    log_level: str = "info",
    workers: int = 1,
    policy: StorePolicy | None = None,
    store_options: dict[str, Any] | None = None,
    log_format: LogFormat = "text",
    drain_timeout_s: int = DRAIN_TIMEOUT_S,
) -> None:
    """Serve the store at `store_path_or_url` on `host:port` until interrupted.

    `store_path_or_url` is a SQLite path (or `sqlite:///PATH`) or a Redis URL; for Redis,
    `store_options` holds `timeout_s`, `token` (its password) and `ca_file`
    (`meta.client.open_store`).

    Runs uvicorn (its own signal handlers stop it cleanly on SIGINT / SIGTERM); access
    logs are off (they cost more than a lookup), errors are logged. With `workers > 1`
    uvicorn starts that many worker processes on one socket, each building its app with
    `app_from_environment` from settings this process puts in its environment (the
    token included: only the same user can read another process's environment); the
    store is safe across processes (`WriterLock`, WAL).

    Shutdown (SIGTERM from systemd, or SIGINT): uvicorn stops accepting connections
    and lets the requests in flight finish (up to `drain_timeout_s`; idle keep-alive
    connections are closed, so a client sees a full answer or a refused/closed
    connection, never half of one); then the app's lifespan ends: the reader and writer
    threads finish their calls, lookup counters are flushed, the WAL is checkpointed
    and truncated and the store is closed. After a SIGTERM the process exits 0 (uvicorn
    re-raises the signal once it is done; by then there is nothing left to stop).
    `log_format` picks uvicorn's text lines or one JSON object per line
    (`meta/server/logs.py`; the token is masked).
    """
    import uvicorn

    from hf3fsctl.meta.server.logs import logging_config

    settings = {
        "db": store_path(store_path_or_url),
        "token": token,
        "max_body_bytes": max_body_bytes,
        "max_batch": max_batch,
        "lease_s": lease_s,
        "high_watermark": high_watermark,
        "low_watermark": low_watermark,
        "policy": dataclasses.asdict(policy) if policy is not None else None,
        "store_options": store_options or {},
    }
    logger.info(
        "serving metadata store %s on http://%s:%d (%d worker%s)",
        _shown(str(settings["db"])),
        host,
        port,
        workers,
        "s" if workers > 1 else "",
    )
    started = time.monotonic()
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": log_level,
        "access_log": False,
        "timeout_graceful_shutdown": drain_timeout_s,
    }
    config = logging_config(log_format, log_level, [token] if token else [])
    if config is not None:
        options["log_config"] = config
    # uvicorn restores this handler after its graceful shutdown and raises SIGTERM into
    # it: the drain is done by then, so it only notes it and the process exits 0
    previous = signal.signal(signal.SIGTERM, _after_drain)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        if workers > 1:
            # Opened once here first: a store that cannot be opened is its typed error
            # now, not workers that die at start and are started again, for good.
            _open_store(settings).close()
            os.environ[_SETTINGS_ENV] = json.dumps(settings)
            uvicorn.run(
                f"{__name__}:app_from_environment", factory=True, workers=workers, **options
            )
        else:
            uvicorn.run(_app_from_settings(settings), **options)
    finally:
        signal.signal(signal.SIGTERM, previous)
        logger.info("metadata server stopped after %.0fs", time.monotonic() - started)


def _after_drain(signum: int, frame: object) -> None:
    """SIGTERM after uvicorn's graceful shutdown: everything is drained; exit normally."""
    logger.info("SIGTERM: requests drained, store closed")


def _shown(db: str) -> str:
    """A store's path or URL, fit to log (a Redis password shows as ***)."""
    if "://" in db:
        from hf3fsctl.config.urls import MetadataUrl

        return MetadataUrl.parse(db).url
    return db


def app_from_environment() -> FastAPI:
    """The app of one worker process of `run_server(workers > 1)` (a uvicorn factory)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return _app_from_settings(json.loads(os.environ[_SETTINGS_ENV]))


def _close_store(store: Store) -> None:
    """Close a server's store at shutdown: counters flushed, and for SQLite the WAL
    checkpointed into the database and truncated (the file alone is then complete)."""
    store.shutdown()
    logger.info("metadata store closed")


def _open_store(settings: dict[str, Any]) -> Store:
    """The store of `run_server`'s settings, opened.

    Raises:
        StorageError: a SQLite store's directory cannot be made or written (a missing
            mount, a read-only one); MetadataUnavailable: a damaged database.
    """
    from hf3fsctl.meta.client import open_store
    from hf3fsctl.meta.policy import StorePolicy

    policy = settings.get("policy")
    return open_store(
        settings["db"],
        lease_s=settings["lease_s"],
        high_watermark=settings["high_watermark"],
        low_watermark=settings["low_watermark"],
        background_checkpoint=True,
        policy=StorePolicy(**policy) if policy else None,
        **settings.get("store_options", {}),
    )


def _app_from_settings(settings: dict[str, Any]) -> FastAPI:
    """A store and its app; the store is closed (counters flushed) at shutdown."""
    store = _open_store(settings)
    app = create_app(
        store,
        token=settings["token"],
        max_body_bytes=settings["max_body_bytes"],
        max_batch=settings["max_batch"],
    )
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        async with inner(app) as state:  # its exit waits for the store threads' calls
            yield state
        _close_store(store)

    app.router.lifespan_context = lifespan
    return app
