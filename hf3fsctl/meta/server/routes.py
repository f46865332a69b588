"""The service's routes, by room: the data path, namespaces, admin, and the service's own
(`/healthz`, `/metrics`). Each route takes its body as a `*Request` model of
`meta/models.py` and answers JSON; its store call runs where `Service` says (the lookup
on the loop for a store whose lookup does no I/O, reads on reader threads, writes on the
writer thread), so the event loop never waits on the store.

| route | call |
| --- | --- |
| `GET /healthz` | liveness (never needs the token) |
| `GET /metrics` | Prometheus text: requests and latency by route, store gauges |
| `POST /v1/namespaces`, `GET /v1/namespaces`, `GET /v1/namespaces/{id}` | namespaces |
| `POST /v1/ranks` | register a rank file |
| `POST /v1/lookup`, `/v1/locate`, `/v1/allocate`, `/v1/commit`, `/v1/release` | data path |
| `POST /v1/invalidate` | drop keys whose pages a reader found corrupt |
| `POST /v1/admit` | record sightings of keys; which have been seen `after_hits` times |
| `POST /v1/evict`, `GET /v1/stats`, `GET /v1/entries` | admin |
| `GET /v1/capacity`, `PUT /v1/capacity` | the store's recorded capacity |
| `POST /v1/pins`, `POST /v1/unpin`, `GET /v1/pins` | pins (kept out of LRU eviction) |
| `POST /v1/namespaces/drop` | remove namespaces' metadata (`evict --stale`) |
| `POST /v1/changes` | the change log: keys that gained or lost a committed rank (KV events) |
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, FastAPI, Query
from fastapi import Path as PathParam
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, TypeAdapter

from hf3fsctl.meta.models import (
    INT_MAX,
    NAMESPACE_PATTERN,
    AdmitRequest,
    AdmitResponse,
    AllocateRequest,
    AllocateResult,
    CapacityInfo,
    ChangeLog,
    ChangesRequest,
    CommitRequest,
    CountResponse,
    DropNamespacesRequest,
    DropNamespacesResult,
    EntryInfo,
    EvictRequest,
    EvictResult,
    InvalidateRequest,
    LocateRequest,
    LocateResponse,
    LookupRequest,
    LookupResponse,
    NamespaceInfo,
    PinInfo,
    PinRequest,
    PinResult,
    RecordWriterRequest,
    RegisterNamespaceRequest,
    RegisterRankRequest,
    ReleaseRequest,
    SetCapacityRequest,
    StoreStats,
    UnpinRequest,
    WritersResponse,
)
from hf3fsctl.meta.server.errors import JSON
from hf3fsctl.meta.server.metrics import ServerMetrics
from hf3fsctl.meta.server.service import Service

_NAMESPACES = TypeAdapter(list[NamespaceInfo])
_ENTRIES = TypeAdapter(list[EntryInfo])
_PINS = TypeAdapter(list[PinInfo])

NamespacePath = Annotated[str, PathParam(pattern=NAMESPACE_PATTERN)]
NamespaceQuery = Annotated[str | None, Query(pattern=NAMESPACE_PATTERN)]
Offset = Annotated[int, Query(ge=0, le=INT_MAX)]


class Health(BaseModel):
    """The answer of `/healthz`."""

    model_config = ConfigDict(extra="allow")

    status: str  # "ok"
    store: str  # the store's kind, "sqlite"
    namespaces: int  # registered namespaces


def _json(content: bytes | str) -> Response:
    return Response(content, media_type=JSON)


def _reply(model: BaseModel) -> Response:
    return Response(model.__pydantic_serializer__.to_json(model), media_type=JSON)


def _count(count: int) -> Response:
    return Response(b'{"count":%d}' % count, media_type=JSON)


def add_data_path(v1: APIRouter, service: Service) -> None:
    """The connector's calls: lookup, locate, allocate, commit, release, invalidate, admit."""
    store, read, write = service.store, service.read, service.write
    limited, documented = service.limited, service.documented

    @v1.post("/lookup", response_model=LookupResponse, responses=documented(400, 404, 422))
    async def lookup(body: LookupRequest = limited(LookupRequest)) -> Response:
        """Number of leading keys committed on every rank of the namespace."""
        if service.lookup_on_loop:
            return _json(b'{"hits":%d}' % store.lookup(body.namespace, body.keys))
        return await read(lambda: _json(b'{"hits":%d}' % store.lookup(body.namespace, body.keys)))

    @v1.post("/locate", response_model=LocateResponse, responses=documented(400, 404, 422))
    async def locate(body: LocateRequest = limited(LocateRequest)) -> Response:
        """Where each key's page is on the rank (null if absent), with a read lease."""
        return await write(
            lambda: _reply(
                LocateResponse.model_construct(
                    locations=store.locate(body.namespace, body.rank, body.keys)
                )
            )
        )

    @v1.post("/allocate", response_model=AllocateResult, responses=documented(400, 404, 422))
    async def allocate(body: AllocateRequest = limited(AllocateRequest)) -> Response:
        """Pages for keys not yet stored on the rank (may evict LRU keys)."""
        return await write(
            lambda: _reply(store.allocate(body.namespace, body.rank, body.keys, body.first_depth))
        )

    @v1.post("/commit", response_model=CountResponse, responses=documented(400, 404, 422))
    async def commit(body: CommitRequest = limited(CommitRequest)) -> Response:
        """Pending → committed for the exact (key, page) pairs; answers how many."""
        return await write(lambda: _count(store.commit(body.namespace, body.rank, body.items)))

    @v1.post("/release", response_model=CountResponse, responses=documented(400, 404, 422))
    async def release(body: ReleaseRequest = limited(ReleaseRequest)) -> Response:
        """Give back pending allocations (exact (key, page) pairs); answers how many."""
        return await write(
            lambda: _count(store.release(body.namespace, body.rank, body.allocations))
        )

    @v1.post("/invalidate", response_model=CountResponse, responses=documented(400, 404, 422))
    async def invalidate(body: InvalidateRequest = limited(InvalidateRequest)) -> Response:
        """Drop keys whose committed page a reader found corrupt; answers how many."""
        return await write(lambda: _count(store.invalidate(body.namespace, body.rank, body.items)))

    @v1.post("/admit", response_model=AdmitResponse, responses=documented(400, 404, 422))
    async def admit(body: AdmitRequest = limited(AdmitRequest)) -> Response:
        """Record one sighting of each key; per key, whether it has now been seen at least
        `after_hits` times (counts shared by every engine of the store)."""
        return await write(
            lambda: _reply(
                AdmitResponse.model_construct(
                    admitted=store.admit(body.namespace, body.keys, body.after_hits)
                )
            )
        )


def add_namespaces(v1: APIRouter, service: Service) -> None:
    """Registering, reading and dropping namespaces and rank files."""
    store, read, write = service.store, service.read, service.write
    limited, documented = service.limited, service.documented

    @v1.post("/namespaces", response_model=NamespaceInfo, responses=documented(400, 409, 422))
    async def register_namespace(
        body: RegisterNamespaceRequest = limited(RegisterNamespaceRequest),
    ) -> Response:
        """Create a namespace, or return it if identical."""
        return await write(lambda: _reply(store.register_namespace(body.namespace, body.manifest)))

    @v1.get("/namespaces", response_model=list[NamespaceInfo], responses=documented())
    async def list_namespaces() -> Response:
        """Every registered namespace, oldest first."""
        return await read(lambda: _json(_NAMESPACES.dump_json(store.namespaces())))

    @v1.get("/namespaces/{namespace}", response_model=NamespaceInfo, responses=documented(404, 422))
    async def get_namespace(namespace: NamespacePath) -> Response:
        """One namespace and its registered rank files."""
        return await read(lambda: _reply(store.get_namespace(namespace)))

    @v1.post(
        "/namespaces/drop",
        response_model=DropNamespacesResult,
        responses=documented(400, 404, 422),
    )
    async def drop_namespaces(
        body: DropNamespacesRequest = limited(DropNamespacesRequest),
    ) -> Response:
        """Remove namespaces' metadata (the page files are the caller's to remove)."""
        return await write(
            lambda: _reply(store.drop_namespaces(body.namespaces, dry_run=body.dry_run))
        )

    @v1.post("/writers", response_model=CountResponse, responses=documented(400, 404, 422))
    async def record_writer(body: RecordWriterRequest = limited(RecordWriterRequest)) -> Response:
        """Record an engine that wrote to a namespace (the first record of an id is kept)."""

        def record() -> Response:
            store.record_writer(body.namespace, body.writer)
            return _count(1)

        return await write(record)

    @v1.get("/writers", response_model=WritersResponse, responses=documented(422))
    async def list_writers(namespace: NamespaceQuery = None) -> Response:
        """Recorded writers by namespace id, oldest first."""
        return await read(lambda: _reply(WritersResponse(writers=store.writers(namespace))))

    @v1.post("/ranks", response_model=NamespaceInfo, responses=documented(400, 404, 409, 422))
    async def register_rank(body: RegisterRankRequest = limited(RegisterRankRequest)) -> Response:
        """Record one rank's page file, or return the namespace if identical."""
        rank_file = body.rank_file.as_rank_file()
        return await write(lambda: _reply(store.register_rank(body.namespace, rank_file)))


def add_admin(v1: APIRouter, service: Service) -> None:
    """Eviction, stats, listings, capacity, pins and the change log."""
    store, read, write = service.store, service.read, service.write
    limited, documented = service.limited, service.documented
    only_query, listing_limit = service.only_query, service.listing_limit

    @v1.post("/evict", response_model=EvictResult, responses=documented(400, 404, 422))
    async def evict(body: EvictRequest = limited(EvictRequest)) -> Response:
        """Evict committed keys (all ranks at once) by the request's criteria."""
        return await write(lambda: _reply(store.evict(body)))

    @v1.get("/stats", response_model=StoreStats, responses=documented())
    async def stats() -> Response:
        """Usage and traffic of every namespace and of the whole store."""
        return await read(lambda: _reply(store.stats()))

    @v1.get(
        "/entries",
        response_model=list[EntryInfo],
        responses=documented(400, 422),
        dependencies=[only_query("namespace", "limit", "offset")],
    )
    async def entries(
        namespace: NamespaceQuery = None,
        limit: int = listing_limit(100),
        offset: Offset = 0,
    ) -> Response:
        """Entries (one per key and rank), most recently used first."""
        return await read(
            lambda: _json(_ENTRIES.dump_json(store.list_entries(namespace, limit, offset)))
        )

    @v1.get("/capacity", response_model=CapacityInfo, responses=documented())
    async def get_capacity() -> Response:
        """The recorded capacity and the bytes the page files hold."""
        return await read(lambda: _reply(store.capacity()))

    @v1.put("/capacity", response_model=CapacityInfo, responses=documented(400, 422))
    async def set_capacity(body: SetCapacityRequest = limited(SetCapacityRequest)) -> Response:
        """Record the store's capacity (every process enforces the recorded value)."""
        return await write(lambda: _reply(store.set_capacity(body.capacity_bytes)))

    @v1.post("/pins", response_model=PinResult, responses=documented(400, 404, 422))
    async def pin(body: PinRequest = limited(PinRequest)) -> Response:
        """Keep keys out of LRU eviction (for `ttl_s`, or until unpinned)."""
        return await write(lambda: _reply(store.pin(body.namespace, body.keys, body.ttl_s)))

    @v1.post("/unpin", response_model=CountResponse, responses=documented(400, 422))
    async def unpin(body: UnpinRequest = limited(UnpinRequest)) -> Response:
        """Drop pins of the keys (all of the namespace's when `keys` is null)."""
        return await write(lambda: _count(store.unpin(body.namespace, body.keys)))

    @v1.get(
        "/pins",
        response_model=list[PinInfo],
        responses=documented(400, 422),
        dependencies=[only_query("namespace", "limit")],
    )
    async def list_pins(
        namespace: NamespaceQuery = None, limit: int = listing_limit(1000)
    ) -> Response:
        """Live pins, newest first."""
        return await read(lambda: _json(_PINS.dump_json(store.list_pins(namespace, limit))))

    @v1.post("/changes", response_model=ChangeLog, responses=documented(400, 422))
    async def changes(body: ChangesRequest = limited(ChangesRequest)) -> Response:
        """The store's change log after `since`: keys that gained or lost a committed rank."""
        return await read(lambda: _reply(store.changes(body.since, body.namespace, body.limit)))


def add_service_routes(app: FastAPI, service: Service, metrics: ServerMetrics) -> None:
    """`/healthz` (no token) and `/metrics`."""
    store, read, documented = service.store, service.read, service.documented

    @app.get("/healthz", response_model=Health, responses=documented(authed=False))
    async def healthz() -> Response:
        """Liveness: the database answers a query (never needs the token)."""
        return await read(lambda: _json(json.dumps(store.health(), separators=(",", ":"))))

    @app.get(
        "/metrics",
        dependencies=service.auth,
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus exposition text",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **documented(store_call=False),
        },
    )
    async def prometheus() -> Response:
        """Requests and latency by route, store gauges (read from the store per scrape)."""

        def render() -> Response:
            body, content_type = metrics.render()
            return Response(body, media_type=content_type)

        return await read(render)
