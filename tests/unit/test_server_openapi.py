"""`/openapi.json` is the service's contract: every route is in it, with its request, its
answer and its error statuses, and what it says is true (walked from `app.routes` and from
the schema itself, so that a new route cannot be forgotten)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from helpers.meta_builders import checksum, keys, manifest, rank_file
from pydantic import BaseModel, TypeAdapter

from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.server.app import create_app
from hf3fsctl.meta.sqlite.store import MetadataStore

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
NAMESPACE = "0123456789abcdef"  # well-formed, never registered


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    store = MetadataStore(tmp_path / "meta.db")
    yield store
    store.close()


@pytest.fixture
def app(store: MetadataStore) -> FastAPI:
    return create_app(store, token=TOKEN, max_body_bytes=64 * 1024, max_batch=50)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def spec(client: TestClient) -> dict[str, Any]:
    return dict(client.get("/openapi.json").json())


def api_routes(app: FastAPI) -> list[tuple[str, str, APIRoute]]:
    """(method, path, route) of every route of the app (the schema's own routes aside)."""
    return sorted(
        (method.lower(), route.path, route)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    )


def operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(method, path, operation) of every operation the schema documents."""
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            yield method, path, operation


def concrete(path: str) -> str:
    """`path` with every `{parameter}` filled in (the only kind there is: a namespace id)."""
    return re.sub(r"\{[^}]+\}", NAMESPACE, path)


def test_every_route_of_the_app_is_documented(app: FastAPI, spec: dict[str, Any]) -> None:
    documented = {(method, path) for method, path, _ in operations(spec)}
    routes = {(method, path) for method, path, _ in api_routes(app)}
    assert routes == documented
    assert {path for _, path in routes if path.startswith("/v1/")}  # the walk found routes


def test_every_v1_route_documents_its_request_and_answer(
    app: FastAPI, spec: dict[str, Any]
) -> None:
    v1 = [(m, p, r) for m, p, r in api_routes(app) if p.startswith("/v1/")]
    for method, path, route in v1:
        operation = spec["paths"][path][method]
        answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
        model = route.response_model
        if get_origin(model) is list:
            (model,) = get_args(model)
            assert answer["type"] == "array", (method, path)
            answer = answer["items"]
        assert isinstance(model, type) and issubclass(model, BaseModel), (method, path)
        assert answer == {"$ref": f"#/components/schemas/{model.__name__}"}, (method, path)
        for parameter in operation.get("parameters", []):
            assert parameter["schema"], (method, path, parameter["name"])
        if route.body_field is None:
            assert "requestBody" not in operation, (method, path)
            continue
        body = operation["requestBody"]
        model = route.body_field.field_info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        assert body["required"] is True, (method, path)
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model.__name__}"
        }, (method, path)
        assert model.__name__ in spec["components"]["schemas"], (method, path)


def test_every_error_status_is_an_error_response(spec: dict[str, Any]) -> None:
    for method, path, operation in operations(spec):
        responses = operation["responses"]
        errors = {status for status in responses if status != "200"}
        assert {"413"} <= errors, (method, path)
        for status in errors:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == ERROR_REF, (method, path, status)
        if operation.get("parameters") or "requestBody" in operation:
            assert "422" in errors, (method, path)
        needs_token = path.startswith("/v1/") or path == "/metrics"
        assert ("401" in errors) is needs_token, (method, path)
        if path.startswith("/v1/"):
            assert "503" in errors, (method, path)
    assert "HTTPValidationError" not in spec["components"]["schemas"]


def test_with_a_token_every_v1_route_answers_401_without_it(
    client: TestClient, spec: dict[str, Any]
) -> None:
    checked = []
    for method, path, operation in operations(spec):
        if not path.startswith("/v1/"):
            continue
        assert operation["security"] == [{"BearerToken": []}], (method, path)
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            for body in ({"json": {}}, {"content": b"{not json"}):
                response = client.request(method, concrete(path), headers=headers, **body)
                answer = (response.status_code, response.json()["error"])
                assert answer == (401, "AuthError"), (method, path, headers, body)
                assert response.headers["www-authenticate"] == "Bearer"
        checked.append((method, path))
    assert len(checked) == len({(m, p) for m, p, _ in operations(spec) if p.startswith("/v1/")})
    assert spec["components"]["securitySchemes"]["BearerToken"]["scheme"] == "bearer"


def test_healthz_needs_no_token_and_says_so(client: TestClient, spec: dict[str, Any]) -> None:
    assert "security" not in spec["paths"]["/healthz"]["get"]
    assert client.get("/healthz").status_code == 200


def test_an_open_app_documents_no_auth(tmp_path: Path) -> None:
    with TestClient(create_app(MetadataStore(tmp_path / "open.db"))) as open_client:
        spec = open_client.get("/openapi.json").json()
    assert "securitySchemes" not in spec.get("components", {})
    for method, path, operation in operations(spec):
        assert "401" not in operation["responses"], (method, path)
        assert "security" not in operation, (method, path)


# --- the answers are what the schema says -------------------------------------------------

Call = Callable[[dict[str, Any]], dict[str, Any]]  # state → request kwargs (path, json, params)


def _calls(ns: str) -> list[tuple[str, str, Call]]:
    """A valid request for every route, in an order where each finds what it needs."""
    chain, spare = keys(4), keys(2, start=10)

    def commit_items(state: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {**a, "checksum": checksum(a["key"], a["page"]), "size": 4096}
            | ({"retention_s": 3600, "renew_on_read": True} if index == 0 else {})
            for index, a in enumerate(state["allocated"])
        ]

    return [
        ("get", "/healthz", lambda s: {}),
        ("post", "/v1/namespaces", lambda s: {"json": {"namespace": ns, "manifest": manifest()}}),
        (
            "post",
            "/v1/ranks",
            lambda s: {"json": {"namespace": ns, "rank_file": rank_file(ns, 0, 64).model_dump()}},
        ),
        ("get", "/v1/namespaces", lambda s: {}),
        (
            "post",
            "/v1/writers",
            lambda s: {
                "json": {"namespace": ns, "writer": {"id": "a" * 12, "numerics": {"dtype": "bf16"}}}
            },
        ),
        ("get", "/v1/writers", lambda s: {"params": {"namespace": ns}}),
        ("get", "/v1/namespaces/{namespace}", lambda s: {"path": f"/v1/namespaces/{ns}"}),
        (
            "post",
            "/v1/allocate",
            lambda s: {"json": {"namespace": ns, "rank": 0, "keys": chain, "first_depth": 0}},
        ),
        (
            "post",
            "/v1/commit",
            lambda s: {"json": {"namespace": ns, "rank": 0, "items": commit_items(s)}},
        ),
        ("post", "/v1/lookup", lambda s: {"json": {"namespace": ns, "keys": chain + spare}}),
        (
            "post",
            "/v1/admit",
            lambda s: {"json": {"namespace": ns, "keys": spare, "after_hits": 2}},
        ),
        (
            "post",
            "/v1/locate",
            lambda s: {"json": {"namespace": ns, "rank": 0, "keys": chain + spare}},
        ),
        (
            "post",
            "/v1/release",
            lambda s: {"json": {"namespace": ns, "rank": 0, "allocations": s["allocated"]}},
        ),
        (
            "post",
            "/v1/invalidate",
            lambda s: {
                "json": {
                    "namespace": ns,
                    "rank": 0,
                    "items": [{k: commit_items(s)[0][k] for k in ("key", "page", "checksum")}],
                }
            },
        ),
        ("post", "/v1/pins", lambda s: {"json": {"namespace": ns, "keys": chain, "ttl_s": 60}}),
        ("get", "/v1/pins", lambda s: {"params": {"namespace": ns, "limit": 10}}),
        ("post", "/v1/unpin", lambda s: {"json": {"namespace": ns, "keys": chain[:1]}}),
        ("get", "/v1/entries", lambda s: {"params": {"namespace": ns, "limit": 10}}),
        ("post", "/v1/changes", lambda s: {"json": {"since": 0, "namespace": ns}}),
        ("get", "/v1/stats", lambda s: {}),
        ("get", "/v1/capacity", lambda s: {}),
        ("put", "/v1/capacity", lambda s: {"json": {"capacity_bytes": 1 << 30}}),
        ("post", "/v1/evict", lambda s: {"json": {"all": True, "dry_run": True}}),
        (
            "post",
            "/v1/namespaces/drop",
            lambda s: {"json": {"namespaces": [ns], "dry_run": True}},
        ),
        ("get", "/metrics", lambda s: {}),
    ]


def test_every_answer_is_its_documented_model(app: FastAPI, client: TestClient) -> None:
    calls = _calls(namespace_id(manifest()))
    routes = {(method, path): route for method, path, route in api_routes(app)}
    assert {(method, path) for method, path, _ in calls} == set(routes), "a route has no call"
    state: dict[str, Any] = {}
    for method, path, request in calls:
        kwargs = request(state)
        url = kwargs.pop("path", path)
        response = client.request(method, url, headers=AUTH, **kwargs)
        assert response.status_code == 200, (method, path, response.text)
        route = routes[(method, path)]
        if route.response_model is None:  # /metrics: Prometheus text
            assert response.headers["content-type"].startswith("text/plain")
            continue
        assert response.headers["content-type"] == "application/json"
        answer = TypeAdapter(route.response_model).validate_json(response.content, strict=True)
        if path == "/v1/allocate":
            state["allocated"] = [a.model_dump() for a in answer.allocated]
            assert len(state["allocated"]) == 4
    assert state["allocated"]
