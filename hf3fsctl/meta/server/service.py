"""`Service`: what the routes share — the store, the threads its calls run on, and the
limits and auth, each declared in one place.

Limits: a body over `max_body_bytes` is refused (413) by the `BodyLimit` middleware
before it is read; a batch over `max_batch` (the keys, items, allocations or namespaces
of a body: `limited`) by a dependency (413), and the schema declares it (`maxItems`,
`declare_batch_limit`); a listing's `limit` is declared at most `max_batch` (422
above), and a query parameter a listing does not declare is a 422.

Threads: the event loop never waits on the store. `lookup` — the hottest call — runs on
the loop itself when the store's lookup does no network I/O (SQLite: a WAL snapshot and
a primary-key probe of `key_lru` per key, pages the OS has cached; its once-a-second
counter flush is skipped when another
writer holds the lock), since the thread hop cost ~60–90 µs of a ~500 µs call; a store
whose lookup is a round trip (`lookup_does_io`: Redis) sends it to the reader threads.
Every other route hands its store call, and the encoding of its answer, to a thread:
reads (WAL snapshots: listings, `/healthz`) to a pool of reader threads, writes (which
may wait up to the store's `busy_timeout_s` for the writer lock, held by another
process) to the writer thread. An explicit executor (`run_in_executor`) costs ~15 µs
less CPU per call than FastAPI's thread pool for `def` routes (anyio). The server
process shortens the GIL's switch interval (`run.py: SWITCH_INTERVAL_S`) so the writer
thread is not starved by lookups holding the GIL on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel

from hf3fsctl.meta.models import ErrorResponse
from hf3fsctl.meta.protocol import Store
from hf3fsctl.meta.server.auth import BearerToken
from hf3fsctl.meta.server.errors import DESCRIPTIONS, BatchTooLarge

M = TypeVar("M", bound=BaseModel)

READ_THREADS = 8  # lookups, listings, /healthz: WAL reads, in parallel
# write transactions run one at a time anyway (the store's writer lock); one thread keeps
# one SQLite connection's page cache warm (4 threads taking turns: ~8% slower writes)
WRITE_THREADS = 1


def _batch_size(body: BaseModel) -> int:
    """The keys, items, allocations or namespaces a body carries (its longest list field)."""
    return max(
        (len(value) for value in body.__dict__.values() if isinstance(value, list)), default=0
    )


def declare_batch_limit(schema: dict[str, Any], models: set[str], max_batch: int) -> None:
    """Declare `maxItems: max_batch` on the list fields of the request models `models`.

    The limit is the app's (`create_app(max_batch=)`), not the models', so the schema that
    FastAPI derives from the models learns it here; a longer list is answered 413.
    """
    components = schema.get("components", {}).get("schemas", {})
    for name in models:
        for prop in components.get(name, {}).get("properties", {}).values():
            for branch in (prop, *prop.get("anyOf", ())):
                if branch.get("type") == "array":
                    branch["maxItems"] = max_batch


class Service:
    """The store behind the routes, its threads, its limits and its auth.

    Args:
        store: the metadata store (closed by whoever opened it, not here).
        token: bearer token required on `/v1` routes and `/metrics`; None = open.
        max_batch: most keys/items in one request; more gets 413.
    """

    def __init__(self, store: Store, *, token: str | None, max_batch: int) -> None:
        self.store = store
        self.token = token
        self.max_batch = max_batch
        self.auth: list[Any] = [Depends(BearerToken(token))] if token else []
        self.lookup_on_loop = not store.lookup_does_io
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="hf3fsctl-read")
        self._writers = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="hf3fsctl-write")

    async def read(self, answer: Callable[[], Response]) -> Response:
        """`answer()` (store reads: WAL snapshots, never the writer lock) in a reader thread."""
        return await asyncio.get_running_loop().run_in_executor(self._readers, answer)

    async def write(self, answer: Callable[[], Response]) -> Response:
        """`answer()` (a write transaction: may wait for the writer lock) in a writer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._writers, answer)

    def shutdown(self) -> None:
        """Stop the threads (the store is closed after this)."""
        self._readers.shutdown(cancel_futures=True)
        self._writers.shutdown(cancel_futures=True)

    def check_batch(self, size: int) -> None:
        if size > self.max_batch:
            raise BatchTooLarge(f"batch of {size} exceeds the limit of {self.max_batch}")

    def limited(self, model: type[M]) -> Any:
        """The validated `model` body, refused (413) when it carries more than `max_batch`."""

        async def body_of(body: BaseModel) -> BaseModel:
            self.check_batch(_batch_size(body))
            return body

        body_of.__annotations__["body"] = model  # FastAPI reads the body's model here
        return Depends(body_of)

    def only_query(self, *names: str) -> Any:
        """Refuse (422) query parameters a listing does not declare, as its body models do."""

        async def check(request: Request) -> None:
            unknown = [name for name in request.query_params if name not in names]
            if unknown:
                loc, message = ("query", unknown[0]), "Extra inputs are not permitted"
                raise RequestValidationError(
                    [{"type": "extra_forbidden", "loc": loc, "msg": message}]
                )

        return Depends(check)

    def listing_limit(self, default: int) -> Any:
        """A listing's `limit` query parameter: at most `max_batch` (422 above, as declared)."""

        most = self.max_batch

        async def limit_of(limit: int = Query(min(default, most), ge=0, le=most)) -> int:
            return limit

        return Depends(limit_of)

    def documented(
        self, *statuses: int, store_call: bool = True, authed: bool = True
    ) -> dict[int | str, Any]:
        """`responses=` of a route: its error statuses, each an `ErrorResponse`."""
        codes = {*statuses, 413}
        if store_call:
            codes.add(503)
        if self.token and authed:
            codes.add(401)
        return {
            code: {"model": ErrorResponse, "description": DESCRIPTIONS[code]}
            for code in sorted(codes)
        }
