"""`HttpMetadataClient` against a real `hf3fsctl serve` process: the contract and errors."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.meta_builders import commit_items, keys, manifest, rank_file, register, store_keys
from helpers.servers import TOKEN, ServerProcess, start_server

from hf3fsctl.errors import AuthError, InvalidRequest, NamespaceConflict, NotFound
from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.http.client import HttpMetadataClient
from hf3fsctl.meta.models import EvictRequest

pytestmark = pytest.mark.integration

WORKERS_2 = "server:\n  workers: 2\n"


@pytest.fixture
def client(metadata_server: ServerProcess) -> HttpMetadataClient:
    return HttpMetadataClient(metadata_server.url, token=TOKEN, timeout_s=5)


def test_data_path_round_trip(client: HttpMetadataClient) -> None:
    ns = register(client, num_pages=20)
    store_keys(client, ns, keys(4))
    located = client.locate(ns, 0, keys(5))
    assert client.lookup(ns, keys(5)) == 4
    assert [loc is not None for loc in located] == [True] * 4 + [False]
    pending = client.allocate(ns, 0, keys(2, start=10)).allocated
    assert client.release(ns, 0, pending) == 2
    assert client.allocate(ns, 0, keys(4)).existing == keys(4)


def test_invalidate_drops_the_key_and_is_safe_to_repeat(client: HttpMetadataClient) -> None:
    ns = register(client, num_pages=20)
    store_keys(client, ns, keys(2))
    located = [loc for loc in client.locate(ns, 0, keys(1)) if loc is not None]
    counts = [client.invalidate(ns, 0, located), client.invalidate(ns, 0, located)]
    assert (counts, client.lookup(ns, keys(2))) == ([1, 0], 0)


def test_admin_calls(client: HttpMetadataClient) -> None:
    ns = register(client, num_pages=20)
    store_keys(client, ns, keys(3))
    assert client.stats().namespaces[0].keys == 3
    assert len(client.list_entries(ns, limit=2)) == 2
    assert client.get_namespace(ns).id == ns
    assert [n.id for n in client.namespaces()] == [ns]
    assert client.evict(EvictRequest(all=True)).keys == 3
    assert client.health()["status"] == "ok"


def test_wrong_token_is_auth_error(metadata_server: ServerProcess) -> None:
    client = HttpMetadataClient(metadata_server.url, token="wrong", timeout_s=5)
    with pytest.raises(AuthError):
        client.namespaces()


def test_conflict_and_not_found_are_typed(client: HttpMetadataClient) -> None:
    ns = register(client, num_pages=20)
    with pytest.raises(NamespaceConflict):
        client.register_rank(ns, rank_file(ns, 0, 21))
    with pytest.raises(NotFound):
        client.get_namespace("0123456789abcdef")


def test_malformed_key_is_invalid_request_with_reason(client: HttpMetadataClient) -> None:
    data = manifest()
    client.register_namespace(namespace_id(data), data)
    with pytest.raises(InvalidRequest, match="pattern"):
        client.lookup(namespace_id(data), ["nothex"])


def test_commit_of_unknown_pair_counts_zero(client: HttpMetadataClient) -> None:
    ns = register(client, num_pages=20)
    allocated = client.allocate(ns, 0, keys(1)).allocated
    items = commit_items(allocated)
    assert client.commit(ns, 0, items) == 1
    assert client.commit(ns, 0, items) == 0


def test_connection_closed_by_a_server_restart_does_not_fail_an_allocate(
    metadata_server: ServerProcess, client: HttpMetadataClient
) -> None:
    ns = register(client, num_pages=20)
    client.allocate(ns, 0, keys(1))
    metadata_server.restart()
    assert [a.key for a in client.allocate(ns, 0, keys(1, start=1)).allocated] == keys(1, start=1)


def test_key_needing_json_escapes_reaches_the_server_intact(client: HttpMetadataClient) -> None:
    data = manifest()
    client.register_namespace(namespace_id(data), data)
    with pytest.raises(InvalidRequest, match="pattern"):
        client.lookup(namespace_id(data), ['ab"c\\d'])


def test_two_worker_processes_serve_one_store(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", token=TOKEN, extra_config=WORKERS_2)
    try:
        clients = [HttpMetadataClient(server.url, token=TOKEN, timeout_s=5) for _ in range(4)]
        ns = register(clients[0], num_pages=100)
        for i, each in enumerate(clients):  # new connections: spread over the workers
            store_keys(each, ns, keys(4, start=4 * i))
        assert [each.lookup(ns, keys(16)) for each in clients] == [16] * 4
    finally:
        server.stop()


def test_threads_share_one_client(client: HttpMetadataClient) -> None:
    # Hot calls go over one http.client connection per thread, the others over one
    # httpx pool that every thread shares: both must hold up under concurrent use.
    ns = register(client, num_pages=400)

    def work(t: int) -> tuple[int, int]:
        chain = keys(40, salt=f"thread{t}")
        for i in range(0, 40, 4):
            store_keys(client, ns, chain[i : i + 4])
            assert client.get_namespace(ns).id == ns
        return client.lookup(ns, chain), client.stats().namespaces[0].keys

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, range(8)))
    assert [hits for hits, _ in results] == [40] * 8
    assert client.stats().namespaces[0].keys == 320
    client.close()
    assert client.lookup(ns, keys(40, salt="thread0")) == 40  # reconnects after close
