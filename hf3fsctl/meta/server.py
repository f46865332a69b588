"""The metadata HTTP service: `create_app(store)` (FastAPI, no globals) and `run_server`.

Routes (bodies are the `*Request` models of `meta/models.py`; answers are JSON models):

| route | call |
| --- | --- |
| `GET /healthz` | liveness (never needs the token) |
| `GET /metrics` | Prometheus text: requests and latency by route, store gauges |
| `POST /v1/namespaces`, `GET /v1/namespaces`, `GET /v1/namespaces/{id}` | namespaces |
| `POST /v1/ranks` | register a rank file |
| `POST /v1/lookup`, `/v1/locate`, `/v1/allocate`, `/v1/commit`, `/v1/release` | data path |
| `POST /v1/invalidate` | drop keys whose pages a reader found corrupt |
| `POST /v1/evict`, `GET /v1/stats`, `GET /v1/entries` | admin |
| `GET /v1/capacity`, `PUT /v1/capacity` | the store's recorded capacity |
| `POST /v1/pins`, `POST /v1/unpin`, `GET /v1/pins` | pins (kept out of LRU eviction) |
| `POST /v1/namespaces/drop` | remove namespaces' metadata (`evict --stale`) |

Auth: when a token is configured, every `/v1` route and `/metrics` need
`Authorization: Bearer <token>` (the simplest rule that cannot leak a namespace's
contents); `/healthz` stays open for load balancers.

Errors are `ErrorResponse` JSON with the error class and a one-line reason:
`InvalidRequest` 400 (a malformed body is 422), `AuthError` 401, `NotFound` 404,
`NamespaceConflict` 409, body or batch too large 413, `MetadataUnavailable` 503 (the
store stayed busy). Bad input never produces a 500.

This module imports FastAPI at the top: import it only where the service runs.

Data path: lookup, locate, allocate, commit and release are answered by the lean ASGI
layer of `meta/data_routes.py` (same bodies, answers, auth and errors; no FastAPI
routing or encoding), on the event loop: each is a short SQLite transaction, the server
is normally the database's only writer, and a thread-pool hop cost more than the call.
Admin routes (stats, evict, entries, namespaces) are FastAPI `def`s in the thread pool,
as they may scan the whole database; so is `invalidate`, called only when a load found
corrupt pages.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from hf3fsctl.errors import (
    AuthError,
    Hf3fsctlError,
    InvalidRequest,
    MetadataUnavailable,
    NamespaceConflict,
    NotFound,
)
from hf3fsctl.meta.data_routes import BatchTooLarge, DataRoutes
from hf3fsctl.meta.models import (
    CountResponse,
    DropNamespacesRequest,
    ErrorResponse,
    EvictRequest,
    InvalidateRequest,
    PinRequest,
    RegisterNamespaceRequest,
    RegisterRankRequest,
    SetCapacityRequest,
    UnpinRequest,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from hf3fsctl.meta.policy import StorePolicy
    from hf3fsctl.meta.store import MetadataStore

logger = logging.getLogger(__name__)

STATUS_OF_ERROR: dict[type[Hf3fsctlError], int] = {
    InvalidRequest: 400,
    AuthError: 401,
    NotFound: 404,
    NamespaceConflict: 409,
    MetadataUnavailable: 503,
}

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


_JSON_HEADERS = [(b"content-type", b"application/json")]


def _error_body(error: str, detail: str) -> bytes:
    return ErrorResponse(error=error, detail=detail).model_dump_json().encode()


class BodyLimit:
    """ASGI middleware: 413 for bodies over `max_body_bytes` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await self._reject(send)
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = _error_body("InvalidRequest", f"request body exceeds {self.max_body_bytes} bytes")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass


def create_app(
    store: MetadataStore,
    *,
    token: str | None = None,
    max_body_bytes: int = 16 * 1024**2,
    max_batch: int = 8192,
) -> FastAPI:
    """The metadata service over `store`.

    Args:
        store: the metadata store (the app closes nothing; the caller owns it).
        token: bearer token required on `/v1` routes and `/metrics`; None = open.
        max_body_bytes: larger request bodies get 413.
        max_batch: most keys/items in one request; more gets 413.
    """
    from hf3fsctl.meta.metrics import ServerMetrics

    metrics = ServerMetrics(store)
    expected = f"Bearer {token}".encode() if token else None

    async def require_token(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise AuthError("missing or wrong bearer token")

    def check_batch(size: int) -> None:
        if size > max_batch:
            raise BatchTooLarge(f"batch of {size} exceeds the limit of {max_batch}")

    def reply(model: BaseModel) -> Response:
        return Response(model.model_dump_json(), media_type="application/json")

    def reply_dict(data: dict[str, Any]) -> Response:
        return Response(json.dumps(data, separators=(",", ":")), media_type="application/json")

    def reply_list(models: list[Any]) -> Response:
        body = "[" + ",".join(m.model_dump_json() for m in models) + "]"
        return Response(body, media_type="application/json")

    app = FastAPI(title="hf3fsctl metadata", version="1", docs_url=None, redoc_url=None)
    auth = [Depends(require_token)]

    @app.exception_handler(Hf3fsctlError)
    async def typed_error(request: Request, exc: Hf3fsctlError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(exc)

    @app.get("/healthz")
    def healthz() -> Response:
        return reply_dict(store.health())

    @app.get("/metrics", dependencies=auth)
    def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/namespaces", dependencies=auth)
    def register_namespace(body: RegisterNamespaceRequest) -> Response:
        return reply(store.register_namespace(body.namespace, body.manifest))

    @app.get("/v1/namespaces", dependencies=auth)
    def list_namespaces() -> Response:
        return reply_list(store.namespaces())

    @app.get("/v1/namespaces/{namespace}", dependencies=auth)
    def get_namespace(namespace: str) -> Response:
        return reply(store.get_namespace(namespace))

    @app.post("/v1/ranks", dependencies=auth)
    def register_rank(body: RegisterRankRequest) -> Response:
        return reply(store.register_rank(body.namespace, body.rank_file))

    @app.post("/v1/invalidate", dependencies=auth)
    def invalidate(body: InvalidateRequest) -> Response:
        check_batch(len(body.items))
        return reply(CountResponse(count=store.invalidate(body.namespace, body.rank, body.items)))

    @app.post("/v1/evict", dependencies=auth)
    def evict(body: EvictRequest) -> Response:
        return reply(store.evict(body))

    @app.get("/v1/stats", dependencies=auth)
    def stats() -> Response:
        return reply(store.stats())

    @app.get("/v1/capacity", dependencies=auth)
    def get_capacity() -> Response:
        return reply(store.capacity())

    @app.put("/v1/capacity", dependencies=auth)
    def set_capacity(body: SetCapacityRequest) -> Response:
        return reply(store.set_capacity(body.capacity_bytes))

    @app.post("/v1/pins", dependencies=auth)
    def pin(body: PinRequest) -> Response:
        check_batch(len(body.keys))
        return reply(store.pin(body.namespace, body.keys, body.ttl_s))

    @app.post("/v1/unpin", dependencies=auth)
    def unpin(body: UnpinRequest) -> Response:
        check_batch(len(body.keys or ()))
        return reply(CountResponse(count=store.unpin(body.namespace, body.keys)))

    @app.get("/v1/pins", dependencies=auth)
    def list_pins(namespace: str | None = None, limit: int = 1000) -> Response:
        check_batch(limit)
        return reply_list(store.list_pins(namespace, limit))

    @app.post("/v1/namespaces/drop", dependencies=auth)
    def drop_namespaces(body: DropNamespacesRequest) -> Response:
        return reply(store.drop_namespaces(body.namespaces, dry_run=body.dry_run))

    @app.get("/v1/entries", dependencies=auth)
    def entries(namespace: str | None = None, limit: int = 100, offset: int = 0) -> Response:
        check_batch(limit)
        return reply_list(store.list_entries(namespace, limit, offset))

    app.add_middleware(
        DataRoutes, store=store, token=token, max_batch=max_batch, error_reply=error_reply
    )
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    app.add_middleware(metrics.middleware)
    return app


def error_reply(exc: Exception) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """Status, `ErrorResponse` body and headers of a typed or validation error."""
    if isinstance(exc, (RequestValidationError, ValidationError)):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        detail = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        if first.get("type") == "json_invalid":
            detail = f"body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})"
        if len(errors) > 1:
            detail += f" (and {len(errors) - 1} more)"
        return 422, _error_body("InvalidRequest", detail), _JSON_HEADERS
    if not isinstance(exc, Hf3fsctlError):
        raise TypeError(f"no error reply for {type(exc).__name__}")
    status = next((s for t, s in STATUS_OF_ERROR.items() if isinstance(exc, t)), 400)
    name = type(exc).__name__
    if isinstance(exc, BatchTooLarge):
        status, name = 413, "InvalidRequest"
    headers = list(_JSON_HEADERS)
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return status, _error_body(name, exc.message), headers


def _error_response(exc: Exception) -> Response:
    status, body, headers = error_reply(exc)
    return Response(body, status, {k.decode(): v.decode() for k, v in headers})


def store_path(store_path_or_url: str) -> str:
    """The database path of `sqlite:///PATH` or a plain path."""
    if store_path_or_url.startswith("sqlite:///"):
        from hf3fsctl.meta.store import sqlite_path

        return sqlite_path(store_path_or_url)
    if "://" in store_path_or_url:
        raise InvalidRequest(
            f"serve needs a sqlite:///PATH or a file path, not {store_path_or_url!r}"
        )
    return str(Path(store_path_or_url).expanduser())


_SETTINGS_ENV = "HF3FSCTL_SERVE_SETTINGS"


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
) -> None:
    """Serve the store at `store_path_or_url` on `host:port` until interrupted.

    Runs uvicorn (its own signal handlers stop it cleanly on SIGINT / SIGTERM); access
    logs are off (they cost more than a lookup), errors are logged. With `workers > 1`
    uvicorn starts that many worker processes on one socket, each building its app with
    `app_from_environment` from settings this process puts in its environment (the
    token included: only the same user can read another process's environment); the
    store is safe across processes (`WriterLock`, WAL).
    """
    import uvicorn

    settings = {
        "db": store_path(store_path_or_url),
        "token": token,
        "max_body_bytes": max_body_bytes,
        "max_batch": max_batch,
        "lease_s": lease_s,
        "high_watermark": high_watermark,
        "low_watermark": low_watermark,
        "policy": dataclasses.asdict(policy) if policy is not None else None,
    }
    logger.info(
        "serving metadata store %s on http://%s:%d (%d worker%s)",
        settings["db"],
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
    }
    try:
        if workers > 1:
            os.environ[_SETTINGS_ENV] = json.dumps(settings)
            uvicorn.run(
                f"{__name__}:app_from_environment", factory=True, workers=workers, **options
            )
        else:
            uvicorn.run(_app_from_settings(settings), **options)
    finally:
        logger.info("metadata server stopped after %.0fs", time.monotonic() - started)


def app_from_environment() -> FastAPI:
    """The app of one worker process of `run_server(workers > 1)` (a uvicorn factory)."""
    return _app_from_settings(json.loads(os.environ[_SETTINGS_ENV]))


def _app_from_settings(settings: dict[str, Any]) -> FastAPI:
    """A store and its app; the store is closed (counters flushed) at shutdown."""
    from hf3fsctl.meta.policy import StorePolicy
    from hf3fsctl.meta.store import MetadataStore

    policy = settings.get("policy")
    store = MetadataStore(
        settings["db"],
        lease_s=settings["lease_s"],
        high_watermark=settings["high_watermark"],
        low_watermark=settings["low_watermark"],
        background_checkpoint=True,
        policy=StorePolicy(**policy) if policy else None,
    )
    app = create_app(
        store,
        token=settings["token"],
        max_body_bytes=settings["max_body_bytes"],
        max_batch=settings["max_batch"],
    )
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[Any]:
        async with inner(app) as state:
            yield state
        store.close()

    app.router.lifespan_context = lifespan
    return app
