"""The metadata API is true to its own `/openapi.json`: schemathesis fuzzes every route.

Every operation of the schema gets schema-valid (positive) and schema-violating
(negative) requests, with the token and without it, and every response goes through ALL
of schemathesis's checks: no 5xx, the status documented for the route, the content type
and the body documented for that status, schema-valid data accepted, invalid data
refused, auth enforced. In-process (ASGI) for breadth, then once over real HTTP against a
real `hf3fsctl serve`.

Generation is derandomized (hypothesis `derandomize=True`, no example database), so a
run makes the same requests every time, and bounded (`max_examples` per operation and
mode). What the schema cannot say is said here, each in one place:

- `positive_body`: half the positive requests are aimed at a registered namespace (so
  the store's paths run, not only its 404s), a namespace being registered gets the id
  its manifest hashes to, and a rank file the path of its own namespace and rank — rules
  across fields no JSON Schema can state.
- `STATE_REFUSALS`: the 400 answers a schema-valid body may still get because of what
  the store holds (a rank beyond the namespace's ranks, a page size that is not the
  manifest's) or a rule across fields; each is matched by its reason.
- a batch over `max_batch` (declared `maxItems`) is refused with 413, a rejection status
  schemathesis does not list by default.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from helpers.meta_builders import manifest, rank_file
from helpers.servers import ServerProcess, start_server
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup

from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.server.app import create_app
from hf3fsctl.meta.sqlite.store import MetadataStore

TOKEN = "fuzz-token-0123456789abcdef"
MAX_BATCH = 50
IN_PROCESS_EXAMPLES = 20  # per operation and mode, with the token
HTTP_EXAMPLES = 6  # over a real socket: every operation, a few each
OPEN_EXAMPLES = 6  # an app without a token

STATE_REFUSALS: dict[str, tuple[str, ...]] = {
    "POST /v1/namespaces": ("ranks (TP x PP)",),  # tp_size * pp_size over 4096
    "POST /v1/ranks": (
        "is out of range: namespace",  # rank >= the namespace's num_ranks
        "differs from the manifest",  # page_bytes is not the manifest's
        "slot_bytes is smaller than page_bytes",
    ),
    "POST /v1/pins": ("more than storage.max_pinned",),  # after PUT /v1/capacity shrank it
}
CONFIG = schemathesis.Config.from_dict(
    {
        "checks": {
            "negative_data_rejection": {
                "expected-statuses": [400, 401, 404, 405, 409, 413, 415, 422],
            }
        }
    }
)


@dataclass
class Tally:
    """What a fuzz run did: requests made, failures by (operation, check), by status."""

    requests: int = 0
    operations: set[str] = field(default_factory=set)
    refusals: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: dict[tuple[str, str], str] = field(default_factory=dict)
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)

    def report(self) -> str:
        lines = [f"{len(self.operations)} operations, {self.requests} requests"]
        lines += [f"status {s}: {n}" for s, n in sorted(self.statuses.items())]
        lines += [f"refused by state: {r} x{n}" for r, n in self.refusals.items()]
        lines += [f"FAILED {op} {check}: {why}" for (op, check), why in self.failures.items()]
        return "\n".join(lines)


def positive_body(case: Any, namespace: str) -> None:
    """Aim a positive case at what the store holds (see the module docstring)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.operation.label == "POST /v1/namespaces" and isinstance(body.get("manifest"), dict):
        data = body["manifest"]
        for name in ("tp_size", "pp_size"):  # whole-number floats count as the int
            if isinstance(data.get(name), float):
                data[name] = int(data[name])
        body["namespace"] = namespace_id(data)
        return
    if isinstance(body.get("namespace"), str) and len(repr(body)) % 2 == 0:
        body["namespace"] = namespace
    rank_file = body.get("rank_file")
    if isinstance(rank_file, dict) and isinstance(rank_file.get("rank"), (int, float)):
        rank_file["path"] = f"{body['namespace']}/rank-{int(rank_file['rank']):04d}.pages"


def refused_by_state(label: str, failures: FailureGroup, status: int, text: str) -> str | None:
    """The `STATE_REFUSALS` reason a 400 answer to schema-valid data gave, if it is one."""
    names = {type(failure).__name__ for failure in failures.exceptions}
    if status != 400 or names != {"RejectedPositiveData"}:
        return None
    return next((reason for reason in STATE_REFUSALS.get(label, ()) if reason in text), None)


def fuzz(
    schema: Any, namespace: str, examples: int, tally: Tally, token: str | None = TOKEN, **call: Any
) -> None:
    """Run every operation of `schema` in both modes, with the token and (a few) without."""
    runs = (
        [({"authorization": f"Bearer {token}"}, examples), ({}, 4)] if token else [({}, examples)]
    )
    for result in schema.get_all_operations():
        operation = result.ok()
        tally.operations.add(operation.label)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for headers, count in runs:
                run_operation(operation, mode, headers, namespace, count, tally, call)


def run_operation(
    operation: Any,
    mode: GenerationMode,
    headers: dict[str, str],
    namespace: str,
    examples: int,
    tally: Tally,
    call: dict[str, Any],
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    def one(case: Any) -> None:
        if mode.is_positive:
            positive_body(case, namespace)
        response = case.call(headers=headers, **call)
        tally.requests += 1
        tally.statuses[response.status_code] += 1
        try:
            case.validate_response(response, headers=headers, transport_kwargs=call or None)
        except FailureGroup as failures:
            label = operation.label
            reason = refused_by_state(label, failures, response.status_code, response.text)
            if reason is not None:
                tally.refusals[reason] += 1
                return
            for failure in failures.exceptions:
                key = (f"{label} [{mode.value}, token={bool(headers)}]", type(failure).__name__)
                tally.failures.setdefault(
                    key,
                    f"{response.status_code} {response.text[:200]} <- {response.request.url} {response.request.body!r:.300}",
                )

    try:
        one()
    except Unsatisfiable:
        # no negative request exists for an operation that takes no input at all
        assert mode is GenerationMode.NEGATIVE
        assert not operation.definition.raw.get("parameters")
        assert "requestBody" not in operation.definition.raw


def register(store: MetadataStore) -> str:
    data = manifest()
    ns = namespace_id(data)
    store.register_namespace(ns, data)
    store.register_rank(ns, rank_file(ns, 0, 1000))
    return ns


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MetadataStore]:
    store = MetadataStore(tmp_path / "meta.db")
    yield store
    store.close()


@pytest.fixture
def app(store: MetadataStore) -> FastAPI:
    return create_app(store, token=TOKEN, max_body_bytes=64 * 1024, max_batch=MAX_BATCH)


def test_every_route_answers_as_its_schema_says_in_process(
    app: FastAPI, store: MetadataStore
) -> None:
    namespace = register(store)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)
    tally = Tally()
    fuzz(schema, namespace, IN_PROCESS_EXAMPLES, tally)
    print(tally.report())
    assert not tally.failures, tally.report()
    assert tally.operations == {
        f"{method.upper()} {path}"
        for path, item in app.openapi()["paths"].items()
        for method in item
    }
    assert tally.statuses[401] > 0 and any(200 <= s < 300 for s in tally.statuses)
    assert not any(s >= 500 for s in tally.statuses)


def test_an_open_app_answers_as_its_schema_says(store: MetadataStore) -> None:
    # without a token the schema documents no 401, and no route may answer one
    app = create_app(store, max_body_bytes=64 * 1024, max_batch=MAX_BATCH)
    namespace = register(store)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)
    tally = Tally()
    fuzz(schema, namespace, OPEN_EXAMPLES, tally, token=None)
    print(tally.report())
    assert not tally.failures, tally.report()
    assert tally.statuses[401] == 0 and tally.statuses[200] > 0


@pytest.mark.integration
def test_every_route_answers_as_its_schema_says_over_http(tmp_path: Path) -> None:
    server: ServerProcess = start_server(
        tmp_path / "server", token=TOKEN, extra_config=f"server:\n  max_batch: {MAX_BATCH}\n"
    )
    try:
        store = MetadataStore(server.db_path)
        try:
            namespace = register(store)
        finally:
            store.close()
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=CONFIG)
        tally = Tally()
        fuzz(schema, namespace, HTTP_EXAMPLES, tally, base_url=server.url)
        print(tally.report())
        assert not tally.failures, tally.report()
        assert not re.search(r"Traceback|Exception in ASGI", server.log()), server.log()
    finally:
        server.stop()
