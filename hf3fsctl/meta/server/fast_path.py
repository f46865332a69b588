"""The server's fast path, behind one seam: `route_class(fast)` and `install(app, routes)`.

Fast (the default): `ModelBodyRoute` parses a JSON body straight into the route's
request model with pydantic's Rust parser, strictly (what it accepts is what the schema
says); the key lists are checked in one pass (`BlockKeys`), and the store does not check
them again. A body that parsed is answered by the route's own dependencies and endpoint
called directly (`DirectRoutes`, before the router: the token check first, then the
batch limit), which for a 1,000-key lookup costs ~50 µs less server CPU than FastAPI's
solver and router did; a body that does not parse goes through FastAPI, which reports it.

This path reads FastAPI internals (`Dependant`, `APIRoute.get_route_handler`,
`body_field`): pyproject bounds FastAPI's version. Stock (`create_app(fast_path=False)`,
or `HF3FSCTL_SERVER_FAST_PATH=0`): plain `APIRoute`s and no `DirectRoutes`, FastAPI's
own parsing and dispatch for every request — the fallback should a FastAPI release
change what this path relies on.

Writer first (`install(app, writer_first=True)`: a store whose lookup runs on the event
loop, SQLite): a lookup that arrives while a write (allocate, commit, release,
invalidate, locate) is in flight waits — before its body is even parsed — until the
oldest such write has answered, or `WRITER_FIRST_WAIT_S` at most. A lookup on the loop
holds the GIL for its whole call, while the writer thread gives the GIL up around every
SQLite call of its transaction and waits for it each time; beside 4 clients in tight
lookup loops allocate + commit kept 16–34% of its solo rate (issue 21's bar: 30%), and
~70% with this (the same run, rounds interleaved with a serve without it:
benchmarks/bench_serve_starvation.py --baseline-tree), while those lookups fell to
35–45% of their rate beside that tight writer — the price of the priority. The wait is
bounded both ways: a lookup waits for one write (the oldest, not the ones queued
behind it) and never longer than the cap, so lookups cannot starve either. The cap:
with 20 ms the writer kept 0.66 / 0.69 beside 2 / 4 lookers (0.32 / 0.34 without, in
the same run), with 5 ms 0.50 / 0.47 in another (0.35 / 0.34 without), the lookups'
loss alike; a write beside lookups takes 5–20 ms on this loaded 2-core VM.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from hf3fsctl.errors import Hf3fsctlError
from hf3fsctl.meta.server.errors import JSON, error_response
from hf3fsctl.meta.server.middleware import ASGIApp, Message, Receive, Scope, Send

FAST_PATH_ENV = "HF3FSCTL_SERVER_FAST_PATH"  # "0": stock FastAPI routing and parsing

# Writer first: the routes (by endpoint name) whose calls write through the writer
# thread, the ones answered on the loop that yield to them, and the longest a yielding
# call waits for the oldest write in flight (a write waiting on another process's
# writer lock may take up to the store's busy timeout: lookups go on after this; it
# bounds what the priority adds to a lookup's latency).
WRITE_ROUTES = frozenset({"allocate", "commit", "release", "invalidate", "locate"})
YIELDING_ROUTES = frozenset({"lookup"})
WRITER_FIRST_WAIT_S = 0.02


def fast_path_default() -> bool:
    """Whether the fast path is on unless the caller says (`HF3FSCTL_SERVER_FAST_PATH`)."""
    return os.environ.get(FAST_PATH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def route_class(fast: bool) -> type[APIRoute]:
    """The route class of the body routes: `ModelBodyRoute`, or FastAPI's own."""
    return ModelBodyRoute if fast else APIRoute


def install(app: FastAPI, *, writer_first: bool = False) -> None:
    """Answer the body routes' well-formed requests before the router (`DirectRoutes`),
    for the `ModelBodyRoute`s that have a direct call and a fixed path; with
    `writer_first`, lookups yield to the write in flight (module docstring)."""
    direct_routes = {
        (method, route.path): route
        for route in app.routes
        if isinstance(route, ModelBodyRoute)
        and route.direct is not None
        and not route.dependant.path_params
        for method in route.methods
    }
    if direct_routes:
        app.add_middleware(DirectRoutes, routes=direct_routes, writer_first=writer_first)


class _ModelBodyRequest(Request):
    """A request whose JSON body is parsed straight into its route's model (`parse`)."""

    parsed: BaseModel | None = None  # the body, as the route's model
    errors: list[Any] | None = None  # why it is not one: the validation errors, located

    async def parse(self, model: type[BaseModel]) -> None:
        """Parse and validate a JSON body into `model` in one pass, strictly.

        Pydantic's Rust parser validates while it parses (one pass where `json.loads`
        then validation took two: ~0.05 ms less for 1,000 keys), and strictly, so that
        what it accepts is what the schema says (no `"1"` for 1, no `1` for true). A body
        that is not valid JSON, or not a valid `model`, leaves its reasons in `errors`.
        """
        media_type = self.headers.get("content-type", "").partition(";")[0].strip().lower()
        json_body = media_type == JSON or (
            media_type.startswith("application/") and media_type.endswith("+json")
        )
        body = await self.body()
        if not (body and json_body):
            return  # FastAPI answers a missing or non-JSON body as it always does
        try:
            self.parsed = model.model_validate_json(body, strict=True)
        except ValidationError as exc:
            self.errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]

    async def json(self) -> Any:
        if self.parsed is None and self.errors is None:
            return await super().json()
        return self.parsed  # None for an invalid body: FastAPI reports it after auth


DirectCall = Callable[[Request, BaseModel], Awaitable[Response]]


def _direct_call(dependant: Dependant) -> DirectCall | None:
    """The route's own dependencies and endpoint called in order, without FastAPI's solver.

    For a route whose dependencies each take only the request (the token check) or only
    the body model (the batch limit, which returns the body the endpoint receives), and
    whose endpoint takes only those: the same functions FastAPI would call, in the same
    order, for ~40 µs less per call (FastAPI's solver, its second look at the body, its
    field validation of the parsed model). None for any other route shape.
    """
    if any(_params(dependant)) or dependant.request_param_name:
        return None
    steps: list[tuple[Callable[..., Awaitable[Any]], str, str | None]] = []
    for sub in dependant.dependencies:
        call = sub.call
        if call is None or sub.dependencies or any(_params(sub)[:4]):
            return None
        if not _is_async(call):
            return None
        if sub.request_param_name is not None and not sub.body_params:
            steps.append((call, sub.request_param_name, None))
        elif len(sub.body_params) == 1 and sub.request_param_name is None and sub.name:
            steps.append((call, sub.body_params[0].name, sub.name))
        else:
            return None
    endpoint = dependant.call
    if endpoint is None or not _is_async(endpoint):
        return None

    async def direct(request: Request, body: BaseModel) -> Response:
        values: dict[str, Any] = {}
        for call, argument, name in steps:
            result = await call(**{argument: request if name is None else body})
            if name is not None:
                values[name] = result
        response = await endpoint(**values)
        if not isinstance(response, Response):
            raise TypeError(f"{endpoint.__name__} must return a Response")
        return response

    return direct


def _is_async(call: Callable[..., Any]) -> bool:
    """Whether `call` (a function, or an object such as `BearerToken`) is awaited."""
    return inspect.iscoroutinefunction(call) or inspect.iscoroutinefunction(type(call).__call__)


def _params(dependant: Dependant) -> tuple[list[Any], ...]:
    return (
        dependant.path_params,
        dependant.query_params,
        dependant.header_params,
        dependant.cookie_params,
        dependant.body_params,
    )


class ModelBodyRoute(APIRoute):
    """An `APIRoute` whose body `_ModelBodyRequest` parses into the route's model.

    Nothing else changes: FastAPI takes the model from the route, documents it, checks
    the token before it looks at the body (a request without the token is a 401 whatever
    its body), and passes the parsed model on; an invalid body's 422 reports the errors
    of the strict parse. A body that parsed goes straight to the route's dependencies and
    endpoint (`_direct_call`) where the route's shape allows; anything else (no body, not
    JSON, invalid) takes FastAPI's own path, so every error is answered as FastAPI does.
    """

    body_model: type[BaseModel] | None = None  # the body's model, once the handler is built
    direct: DirectCall | None = None  # its dependencies and endpoint, called directly

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler
        self.body_model = model
        self.direct = direct = _direct_call(self.dependant)

        async def parse_into_model(request: Request) -> Response:
            parsed = _ModelBodyRequest(request.scope, request.receive)
            await parsed.parse(model)
            if direct is not None and parsed.parsed is not None:
                return await direct(parsed, parsed.parsed)
            try:
                return await handler(parsed)
            except RequestValidationError:
                if parsed.errors is None:
                    raise
                raise RequestValidationError(parsed.errors) from None

        return parse_into_model


class DirectRoutes:
    """ASGI middleware: the body routes' well-formed requests answered without the router.

    For `ModelBodyRoute`s with a direct call (`_direct_call`) and a fixed path: the body is
    parsed into the route's model and handed to the route's own dependencies (the token
    check, the batch limit) and endpoint, and a typed error becomes its `error_response`
    — what the app's handlers answer. A body that is missing, not JSON or invalid goes on
    to the app (replayed), which answers it as FastAPI does. This skips Starlette's
    exception middleware, FastAPI's exit stack, the route table and the request wrappers:
    ~30 µs of a ~200 µs lookup of 1,000 keys (measured in-process, CPU time). Being
    called directly, these routes ignore `app.dependency_overrides` (this app sets none).
    """

    def __init__(
        self,
        app: ASGIApp,
        routes: dict[tuple[str, str], ModelBodyRoute],
        writer_first: bool = False,
    ) -> None:
        self.app = app
        self.routes = routes
        self.writer_first = writer_first
        self.writes: deque[asyncio.Event] = deque()  # the writes in flight, oldest first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self.routes.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        )
        if route is None or route.direct is None or route.body_model is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route  # what FastAPI's router sets (the metrics read its path)
        if self.writer_first:
            if route.name in WRITE_ROUTES:
                await self._write(route, scope, receive, send)
                return
            if route.name in YIELDING_ROUTES and self.writes:
                await _wait_for(self.writes[0], WRITER_FIRST_WAIT_S)
        await self._answer(route, scope, receive, send)

    async def _write(
        self, route: ModelBodyRoute, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A write route's request, noted in flight (lookups yield to it) until answered."""
        done = asyncio.Event()
        self.writes.append(done)
        try:
            await self._answer(route, scope, receive, send)
        finally:
            self.writes.remove(done)
            done.set()

    async def _answer(
        self, route: ModelBodyRoute, scope: Scope, receive: Receive, send: Send
    ) -> None:
        assert route.direct is not None and route.body_model is not None
        request = _ModelBodyRequest(scope, receive)
        await request.parse(route.body_model)
        if request.parsed is None:
            await self.app(scope, _replay(await request.body(), receive), send)
            return
        try:
            response = await route.direct(request, request.parsed)
        except Hf3fsctlError as exc:
            response = error_response(exc)
        await response(scope, receive, send)


async def _wait_for(event: asyncio.Event, timeout_s: float) -> None:
    """Until `event` is set, or `timeout_s` has passed."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        pass


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` (already read) once, then the connection's messages."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
