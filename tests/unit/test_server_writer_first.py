"""Writer first (`fast_path.DirectRoutes`): a lookup on the loop yields to the write in flight.

Through the app itself (httpx's ASGI transport, the real SQLite store, its writer thread);
the store's allocate is held on an event so that a write is in flight for as long as a
test wants.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.meta_builders import commit_items, keys, manifest, rank_file

from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.server import fast_path
from hf3fsctl.meta.server.app import create_app
from hf3fsctl.meta.sqlite.store import MetadataStore


class HeldStore(MetadataStore):
    """A SQLite store whose allocate waits for `release` once `hold` is set."""

    hold = False

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.entered = threading.Event()
        self.release = threading.Event()

    def allocate(self, *args: Any, **kwargs: Any) -> Any:
        if self.hold:
            self.entered.set()
            self.release.wait(10)
        return super().allocate(*args, **kwargs)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HeldStore]:
    store = HeldStore(tmp_path / "meta.db")
    data = manifest()
    ns = namespace_id(data)
    store.register_namespace(ns, data)
    store.register_rank(ns, rank_file(ns, 0, 64))
    stored = keys(4)
    granted = store.allocate(ns, 0, stored).allocated
    store.commit(ns, 0, commit_items(granted))
    store.namespace = ns  # type: ignore[attr-defined]
    store.stored = stored  # type: ignore[attr-defined]
    store.hold = True
    yield store
    store.release.set()
    store.close()


async def _lookup_and_allocate(store: HeldStore, wait_s: float) -> tuple[list[str], int]:
    """An allocate held in the writer thread, a lookup sent meanwhile: (the order they
    answered in, the lookup's hits)."""
    app = create_app(store)
    order: list[str] = []
    ns = store.namespace  # type: ignore[attr-defined]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

        async def call(name: str, path: str, body: dict[str, Any]) -> httpx.Response:
            response = await client.post(path, json=body)
            order.append(name)
            return response

        body = {"namespace": ns, "rank": 0, "keys": keys(2, start=100)}
        write = asyncio.create_task(call("allocate", "/v1/allocate", body))
        await asyncio.to_thread(store.entered.wait, 10)
        lookup = asyncio.create_task(
            call("lookup", "/v1/lookup", {"namespace": ns, "keys": store.stored})  # type: ignore[attr-defined]
        )
        await asyncio.sleep(wait_s)
        store.release.set()
        answered = await lookup
        assert (await write).status_code == 200
    return order, answered.json()["hits"]


def test_lookup_waits_for_the_write_in_flight(
    store: HeldStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fast_path, "WRITER_FIRST_WAIT_S", 10.0)
    order, hits = asyncio.run(_lookup_and_allocate(store, wait_s=0.3))
    assert order == ["allocate", "lookup"]
    assert hits == 4


def test_lookup_waits_no_longer_than_the_cap(
    store: HeldStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fast_path, "WRITER_FIRST_WAIT_S", 0.05)
    order, hits = asyncio.run(_lookup_and_allocate(store, wait_s=1.0))
    assert order == ["lookup", "allocate"]
    assert hits == 4
