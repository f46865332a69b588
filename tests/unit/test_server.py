"""The metadata app through `TestClient`: every route, auth, and 4xx with reasons."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from helpers.meta_builders import checksum, keys, manifest, rank_file

from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.server.app import create_app
from hf3fsctl.meta.sqlite.store import MetadataStore

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    store = MetadataStore(tmp_path / "meta.db")
    app = create_app(store, token=TOKEN, max_body_bytes=64 * 1024, max_batch=50)
    with TestClient(app) as test_client:
        yield test_client
    store.close()


def _register(client: TestClient, num_pages: int = 20) -> str:
    data = manifest()
    ns = namespace_id(data)
    client.post("/v1/namespaces", json={"namespace": ns, "manifest": data}, headers=AUTH)
    body = {"namespace": ns, "rank_file": rank_file(ns, 0, num_pages).model_dump()}
    client.post("/v1/ranks", json=body, headers=AUTH)
    return ns


def _store(client: TestClient, ns: str, chain: list[str]) -> list[dict[str, Any]]:
    body = {"namespace": ns, "rank": 0, "keys": chain}
    allocated = client.post("/v1/allocate", json=body, headers=AUTH).json()["allocated"]
    items = [{**a, "checksum": checksum(a["key"], a["page"]), "size": 4096} for a in allocated]
    client.post("/v1/commit", json={"namespace": ns, "rank": 0, "items": items}, headers=AUTH)
    return allocated


def test_healthz_needs_no_token(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"


ROUTES = [
    ("post", "/v1/namespaces"),
    ("get", "/v1/namespaces"),
    ("get", "/v1/namespaces/0123456789abcdef"),
    ("post", "/v1/ranks"),
    ("post", "/v1/lookup"),
    ("post", "/v1/locate"),
    ("post", "/v1/allocate"),
    ("post", "/v1/commit"),
    ("post", "/v1/release"),
    ("post", "/v1/invalidate"),
    ("post", "/v1/evict"),
    ("get", "/v1/stats"),
    ("get", "/v1/entries"),
    ("get", "/metrics"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m}-{p}" for m, p in ROUTES])
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}], ids=["none", "wrong"])
def test_route_refuses_missing_or_wrong_token(
    client: TestClient, method: str, path: str, headers: dict[str, str]
) -> None:
    response = client.request(method, path, json={}, headers=headers)
    assert (response.status_code, response.json()["error"]) == (401, "AuthError")


def test_register_namespace_returns_info(client: TestClient) -> None:
    data = manifest()
    ns = namespace_id(data)
    body = {"namespace": ns, "manifest": data}
    assert client.post("/v1/namespaces", json=body, headers=AUTH).json()["num_ranks"] == 1


def test_register_rank_conflict_is_409(client: TestClient) -> None:
    ns = _register(client)
    body = {"namespace": ns, "rank_file": rank_file(ns, 0, 21).model_dump()}
    response = client.post("/v1/ranks", json=body, headers=AUTH)
    assert (response.status_code, response.json()["error"]) == (409, "NamespaceConflict")


def test_get_namespace_and_list(client: TestClient) -> None:
    ns = _register(client)
    one = client.get(f"/v1/namespaces/{ns}", headers=AUTH).json()
    assert [n["id"] for n in client.get("/v1/namespaces", headers=AUTH).json()] == [one["id"]]


def test_unknown_namespace_is_404_with_reason(client: TestClient) -> None:
    response = client.get("/v1/namespaces/0123456789abcdef", headers=AUTH)
    assert response.status_code == 404
    assert "not registered" in response.json()["detail"]


def test_lookup_counts_committed_prefix(client: TestClient) -> None:
    ns = _register(client)
    _store(client, ns, keys(3))
    body = {"namespace": ns, "keys": keys(5)}
    assert client.post("/v1/lookup", json=body, headers=AUTH).json() == {"hits": 3}


def test_locate_returns_locations_and_nulls(client: TestClient) -> None:
    ns = _register(client)
    allocated = _store(client, ns, keys(1))
    body = {"namespace": ns, "rank": 0, "keys": keys(2)}
    locations = client.post("/v1/locate", json=body, headers=AUTH).json()["locations"]
    assert locations[1] is None
    assert locations[0]["page"] == allocated[0]["page"]


def test_release_returns_count(client: TestClient) -> None:
    ns = _register(client)
    body = {"namespace": ns, "rank": 0, "keys": keys(2)}
    allocated = client.post("/v1/allocate", json=body, headers=AUTH).json()["allocated"]
    body = {"namespace": ns, "rank": 0, "allocations": allocated}
    assert client.post("/v1/release", json=body, headers=AUTH).json() == {"count": 2}


def _invalidate(client: TestClient, ns: str, items: list[dict[str, Any]]) -> Any:
    body = {"namespace": ns, "rank": 0, "items": items}
    return client.post("/v1/invalidate", json=body, headers=AUTH)


def test_invalidate_drops_the_reported_key(client: TestClient) -> None:
    ns = _register(client)
    chain = keys(2)
    stored = _store(client, ns, chain)
    item = {**stored[0], "checksum": checksum(stored[0]["key"], stored[0]["page"])}
    count = _invalidate(client, ns, [item]).json()["count"]
    lookup = client.post("/v1/lookup", json={"namespace": ns, "keys": chain}, headers=AUTH)
    assert (count, lookup.json()["hits"]) == (1, 0)


BAD_INVALIDATE_ITEMS = {
    "missing-checksum": ({"key": keys(1)[0], "page": 0}, "checksum"),
    "negative-page": ({"key": keys(1)[0], "page": -1, "checksum": "ab"}, "page"),
    "bad-key": ({"key": "XYZ", "page": 0, "checksum": "ab"}, "key"),
}


@pytest.mark.parametrize(
    ("item", "reason"), list(BAD_INVALIDATE_ITEMS.values()), ids=list(BAD_INVALIDATE_ITEMS)
)
def test_bad_invalidate_body_is_422_with_reason(
    client: TestClient, item: dict[str, Any], reason: str
) -> None:
    response = _invalidate(client, _register(client), [item])
    assert (response.status_code, reason in response.json()["detail"]) == (422, True)


def test_evict_dry_run(client: TestClient) -> None:
    ns = _register(client)
    _store(client, ns, keys(2))
    result = client.post("/v1/evict", json={"all": True, "dry_run": True}, headers=AUTH).json()
    assert (result["keys"], result["dry_run"]) == (2, True)


def test_evict_without_criteria_is_400(client: TestClient) -> None:
    response = client.post("/v1/evict", json={}, headers=AUTH)
    assert (response.status_code, response.json()["error"]) == (400, "InvalidRequest")


def test_stats_and_entries(client: TestClient) -> None:
    ns = _register(client)
    _store(client, ns, keys(2))
    assert client.get("/v1/stats", headers=AUTH).json()["pages_used"] == 2
    entries = client.get("/v1/entries", params={"namespace": ns, "limit": 1}, headers=AUTH)
    assert len(entries.json()) == 1


def test_metrics_exposes_requests_and_store_gauges(client: TestClient) -> None:
    ns = _register(client)
    _store(client, ns, keys(2))
    text = client.get("/metrics", headers=AUTH).text
    assert 'hf3fsctl_pages_used{namespace="' + ns + '"} 2.0' in text
    assert 'hf3fsctl_requests_total{route="/v1/allocate",status="200"} 1.0' in text


BAD_BODIES = {
    "malformed-key": ({"keys": ["XYZ"]}, 422, "keys.0"),
    "missing-field": ({}, 422, "keys"),
    "batch-too-large": ({"keys": keys(51)}, 413, "exceeds the limit of 50"),
    "negative-rank": ({"keys": keys(1), "rank": -1}, 422, "rank"),
    "extra-field": ({"keys": keys(1), "bogus": 1}, 422, "bogus"),
}


@pytest.mark.parametrize(
    ("patch", "status", "reason"), list(BAD_BODIES.values()), ids=list(BAD_BODIES)
)
def test_bad_locate_body_gets_4xx_with_reason(
    client: TestClient, patch: dict[str, Any], status: int, reason: str
) -> None:
    ns = _register(client)
    body = {"namespace": ns, "rank": 0, **patch}
    if patch == {}:
        body.pop("keys", None)
    response = client.post("/v1/locate", json=body, headers=AUTH)
    assert response.status_code == status
    assert reason in response.json()["detail"]


def test_body_too_large_is_413(client: TestClient) -> None:
    response = client.post("/v1/lookup", content=b"x" * (65 * 1024), headers=AUTH)
    assert (response.status_code, response.json()["error"]) == (413, "InvalidRequest")


def test_invalid_json_is_422(client: TestClient) -> None:
    headers = {**AUTH, "content-type": "application/json"}
    response = client.post("/v1/lookup", content=b"{nope", headers=headers)
    assert (response.status_code, "not valid JSON" in response.json()["detail"]) == (422, True)


def test_open_app_needs_no_token(tmp_path: Path) -> None:
    with TestClient(create_app(MetadataStore(tmp_path / "m.db"))) as client:
        assert client.get("/v1/namespaces").status_code == 200


def test_body_is_parsed_strictly(client: TestClient) -> None:
    ns = _register(client)
    body = {"namespace": ns, "rank": "0", "keys": keys(1)}  # the schema says integer
    response = client.post("/v1/locate", json=body, headers=AUTH)
    assert (response.status_code, "rank" in response.json()["detail"]) == (422, True)


def test_commit_batch_too_large_is_413(client: TestClient) -> None:
    ns = _register(client)
    items = [{"key": k, "page": i, "checksum": "ab", "size": 1} for i, k in enumerate(keys(51))]
    response = client.post(
        "/v1/commit", json={"namespace": ns, "rank": 0, "items": items}, headers=AUTH
    )
    assert (response.status_code, response.json()["error"]) == (413, "InvalidRequest")


def test_listing_limit_over_max_batch_is_422_and_the_default_fits(client: TestClient) -> None:
    # the bound is declared (`maximum: max_batch`), so a larger limit is schema-invalid
    too_many = client.get("/v1/entries", params={"limit": 51}, headers=AUTH)
    assert (too_many.status_code, "50" in too_many.json()["detail"]) == (422, True)
    assert client.get("/v1/entries", headers=AUTH).status_code == 200


def test_listing_refuses_an_undeclared_query_parameter(client: TestClient) -> None:
    response = client.get("/v1/pins", params={"limti": 5}, headers=AUTH)
    assert (response.status_code, response.json()["detail"]) == (
        422,
        "query.limti: Extra inputs are not permitted",
    )


def test_malformed_namespace_in_the_path_is_422(client: TestClient) -> None:
    response = client.get("/v1/namespaces/NOT-A-NAMESPACE", headers=AUTH)
    assert (response.status_code, "namespace" in response.json()["detail"]) == (422, True)


def test_unknown_route_is_an_error_response(client: TestClient) -> None:
    response = client.post("/v1/nope", json={}, headers=AUTH)
    assert (response.status_code, response.json()["error"]) == (404, "NotFound")


def test_a_key_with_a_trailing_newline_is_refused(client: TestClient) -> None:
    ns = _register(client)
    body = {"namespace": ns, "keys": [keys(1)[0] + "\n"]}
    response = client.post("/v1/lookup", json=body, headers=AUTH)
    assert (response.status_code, response.json()["detail"].startswith("keys.0")) == (422, True)


def test_a_valid_body_without_the_token_is_401(client: TestClient) -> None:
    # a body that parses is answered by the route's direct call: the token is still checked
    ns = _register(client)
    response = client.post("/v1/lookup", json={"namespace": ns, "keys": keys(2)})
    assert (response.status_code, response.json()["error"]) == (401, "AuthError")
    assert response.headers["www-authenticate"] == "Bearer"


def test_every_body_route_is_answered_directly(client: TestClient) -> None:
    from hf3fsctl.meta.server.fast_path import ModelBodyRoute

    body_routes = [r for r in client.app.routes if isinstance(r, ModelBodyRoute) and r.body_model]
    assert len(body_routes) >= 14
    assert [r.path for r in body_routes if r.direct is None] == []


def test_direct_answers_are_counted_by_route(client: TestClient) -> None:
    ns = _register(client)
    for _ in range(3):
        client.post("/v1/lookup", json={"namespace": ns, "keys": keys(2)}, headers=AUTH)
    text = client.get("/metrics", headers=AUTH).text
    assert 'hf3fsctl_requests_total{route="/v1/lookup",status="200"} 3.0' in text


@pytest.mark.parametrize(
    "path",
    [
        "../../etc/passwd",
        "/abs/rank-0000.pages",
        "0123456789abcdef/../rank-0000.pages",
        "x",
        "fedcba9876543210/rank-0000.pages",
    ],
    ids=["dotdot", "absolute", "inner-dotdot", "not-a-rank-file", "another-namespace"],
)
def test_a_rank_file_path_outside_its_namespace_is_refused(client: TestClient, path: str) -> None:
    ns = _register(client)
    rank = {**rank_file(ns, 0, 20).model_dump(), "path": path}
    response = client.post("/v1/ranks", json={"namespace": ns, "rank_file": rank}, headers=AUTH)
    assert (response.status_code, "rank_file.path" in response.json()["detail"]) == (422, True)
