"""The metadata HTTP service: `create_app(store)` (FastAPI, no globals).

Rooms of `meta/server/`: this module builds the app; `routes.py` holds the routes (the
route table is there), `service.py` the store's threads, the limits and auth
(`auth.py`), `errors.py` how every error is answered, `middleware.py` the body limit,
`fast_path.py` the hand-tuned body parsing and dispatch (behind one seam, with FastAPI's
own as the fallback), `metrics.py` `/metrics`, `logs.py` the log format, `run.py`
uvicorn and process control.

Auth: when a token is configured, every `/v1` route and `/metrics` need
`Authorization: Bearer <token>`; `/healthz` stays open for load balancers. Errors are
`ErrorResponse` JSON with the error class and a one-line reason; each route documents
the statuses it can answer (`responses=`), and bad input never produces a 500.
`/openapi.json` documents every route with its request, answer and error statuses.

The app reaches its store only through the `Store` protocol (`meta/protocol.py`);
`run.py` opens one through the factory (`meta.client.open_store`). This module imports
FastAPI at the top: import it only where the service runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from hf3fsctl.errors import Hf3fsctlError
from hf3fsctl.meta.protocol import Store
from hf3fsctl.meta.server import fast_path, routes
from hf3fsctl.meta.server.errors import STATUS_OF_ERROR, error_response
from hf3fsctl.meta.server.middleware import BodyLimit
from hf3fsctl.meta.server.service import Service, declare_batch_limit

__all__ = ["STATUS_OF_ERROR", "create_app", "error_response"]


def create_app(
    store: Store,
    *,
    token: str | None = None,
    max_body_bytes: int = 16 * 1024**2,
    max_batch: int = 8192,
    fast_path_on: bool | None = None,
) -> FastAPI:
    """The metadata service over `store`.

    Args:
        store: the metadata store (the app closes nothing; the caller owns it).
        token: bearer token required on `/v1` routes and `/metrics`; None = open.
        max_body_bytes: larger request bodies get 413.
        max_batch: most keys/items in one request; more gets 413.
        fast_path_on: the hand-tuned body parsing and dispatch (`fast_path.py`); None:
            on unless `HF3FSCTL_SERVER_FAST_PATH=0`; False: FastAPI's own for every route.
    """
    from hf3fsctl.meta.server.metrics import ServerMetrics

    fast = fast_path.fast_path_default() if fast_path_on is None else fast_path_on
    metrics = ServerMetrics(store)
    service = Service(store, token=token, max_batch=max_batch)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        service.shutdown()  # the store is closed after this

    app = FastAPI(
        title="hf3fsctl metadata",
        version="1",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )

    @app.exception_handler(Hf3fsctlError)
    async def typed_error(request: Request, exc: Hf3fsctlError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(exc)

    v1 = APIRouter(prefix="/v1", dependencies=service.auth, route_class=fast_path.route_class(fast))
    routes.add_data_path(v1, service)
    routes.add_namespaces(v1, service)
    routes.add_admin(v1, service)
    app.include_router(v1)  # first: the data path is matched before the rest
    routes.add_service_routes(app, service, metrics)

    body_models = {
        model.__name__
        for route in app.routes
        if isinstance(route, APIRoute) and route.body_field is not None
        for model in [route.body_field.field_info.annotation]
        if isinstance(model, type)
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            declare_batch_limit(FastAPI.openapi(app), body_models, max_batch)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    if fast:
        fast_path.install(app, writer_first=service.lookup_on_loop)
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    app.add_middleware(metrics.middleware)
    return app
