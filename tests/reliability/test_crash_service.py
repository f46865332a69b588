"""Crash the metadata service: kill -9 of `hf3fsctl serve` under a storm of clients.

Four spawned client processes run `metadata_storm.storm` against one real serve
(allocate / commit / locate / invalidate in a durable namespace; allocate / commit /
abandon / evict in a small churn namespace under eviction pressure). Mid-storm the
server is SIGKILLed, left down for a second, and restarted on the same database. Then:

- every commit a client saw acknowledged is still there (less the keys it invalidated);
- the database is sound (`check_invariants`: no page owned twice, no leak);
- every client saw the outage and carried on by itself (never restarted);
- allocations abandoned by dead writers (and those the crash cut) are handed out again
  once their deadline (`metadata.pending_timeout_s`, 2 s here) has passed.

Parametrised over the metadata store behind serve: SQLite, and Redis (a real
`redis-server`, which is not killed: serve is a stateless front for it there; skipped
where the Redis store or `redis-server` is missing).
"""

from __future__ import annotations

import multiprocessing
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fault_scenario import invariants
from helpers.meta_builders import keys, register
from helpers.servers import TOKEN, ServerProcess, start_server
from metadata_storm import logged, storm

import hf3fsctl
from hf3fsctl.meta.http.client import HttpMetadataClient

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENTS = 4
PENDING_S = 2.0  # metadata.pending_timeout_s of the server: an allocation's deadline
CHURN_PAGES = 64  # the churn namespace: small, so allocations evict and reclaim
STORM_S = 1.0  # storm at full rate before the kill, and the outage after it
WAIT_S = 60.0  # bound on waiting for clients to start or to come back


@dataclass
class Storm:
    """What one storm with a crash left behind."""

    server: ServerProcess
    client: HttpMetadataClient
    durable: str
    churn: str
    directory: Path
    summaries: list[dict[str, Any]]
    restarted_at: float
    stopped_at: float
    invariants: Callable[[], list[str]]

    def pending(self, namespace: str) -> set[tuple[str, int]]:
        """(key, page) of the namespace's pending entries, through the service."""
        found: set[tuple[str, int]] = set()
        offset = 0
        while batch := self.client.list_entries(namespace, limit=8192, offset=offset):
            found.update((e.key, e.page) for e in batch if e.state == "pending")
            offset += len(batch)
        return found


# The Redis store's files, as tests/contract looks for them.
_REDIS_STORE_FILES = ("meta/redis_store.py", "meta/redis/__init__.py")


def _backend(
    name: str, directory: Path, request: pytest.FixtureRequest
) -> tuple[str, Callable[[Path], list[str]]]:
    """The serve config lines for a store kind, and its invariant check (by db path)."""
    if name == "sqlite":
        return "", invariants
    package = Path(hf3fsctl.__file__).parent
    if not any((package / f).is_file() for f in _REDIS_STORE_FILES):
        pytest.skip("no Redis metadata store in the tree yet (hf3fsctl/meta/redis_store.py)")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (`make redis` installs it)")
    from helpers.redis_servers import redis_server

    redis = redis_server(directory / "redis")
    request.addfinalizer(redis.stop)
    url = redis.url

    def redis_invariants(_: Path) -> list[str]:
        from hf3fsctl.config import load_config
        from hf3fsctl.meta.client import connect

        config = directory / "redis-client.yaml"
        config.write_text(f"storage:\n  path: {directory}\nmetadata:\n  url: {url}\n")
        client = connect(load_config(config, environ={}))
        try:
            return list(getattr(client, "store", client).check_invariants())
        finally:
            client.close()

    return f"  url: {url}\n", redis_invariants


def _acks(directory: Path, worker: int) -> int:
    path = directory / f"w{worker}.acks"
    return path.read_text().count("\n") if path.exists() else 0


def _wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def crashed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Storm]:
    """A storm of `CLIENTS` processes with one kill -9 and restart of the server."""
    directory = tmp_path_factory.mktemp(f"storm-{request.param}")
    store_lines, invariants = _backend(request.param, directory, request)
    # Lines appended to the `metadata:` section (a later `url:` wins over the sqlite one).
    server = start_server(
        directory / "server",
        token=TOKEN,
        extra_config=f"{store_lines}  pending_timeout_s: {PENDING_S}\n",
    )
    client = HttpMetadataClient(server.url, token=TOKEN, timeout_s=10)
    durable = register(client, num_pages=100_000, model="durable")
    churn = register(client, num_pages=CHURN_PAGES, model="churn")
    logs = directory / "logs"
    logs.mkdir()
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(CLIENTS)
    try:
        args = [(server.url, TOKEN, durable, churn, w, str(logs)) for w in range(CLIENTS)]
        running = pool.starmap_async(storm, args)
        _wait_for(lambda: all(_acks(logs, w) > 0 for w in range(CLIENTS)), "the storm")
        time.sleep(STORM_S)
        server.kill()
        time.sleep(STORM_S)
        before = [_acks(logs, w) for w in range(CLIENTS)]
        restarted_at = time.time()  # clients may succeed before start() returns
        server.start()
        _wait_for(
            lambda: all(_acks(logs, w) > before[w] for w in range(CLIENTS)),
            "every client to commit again after the restart",
        )
        (logs / "stop").touch()
        summaries = running.get(WAIT_S)
        yield Storm(
            server,
            client,
            durable,
            churn,
            logs,
            summaries,
            restarted_at,
            time.time(),
            lambda: invariants(server.db_path),
        )
    finally:
        (logs / "stop").touch()
        pool.terminate()
        pool.join()
        client.close()
        server.stop()


def test_every_acknowledged_commit_survives_kill_9(crashed: Storm) -> None:
    expected = sorted(logged(crashed.directory, "acks") - logged(crashed.directory, "invalidated"))
    assert len(expected) > 0
    missing = 0
    for start in range(0, len(expected), 4096):
        located = crashed.client.locate(crashed.durable, 0, expected[start : start + 4096])
        missing += sum(loc is None for loc in located)
    assert missing == 0


def test_store_is_sound_after_kill_9(crashed: Storm) -> None:
    assert crashed.invariants() == []


def test_every_client_saw_the_outage(crashed: Storm) -> None:
    assert all(s["failures"] > 0 for s in crashed.summaries)


def test_clients_recover_without_a_restart(crashed: Storm) -> None:
    assert all(s["first_ok_after_failure"] >= crashed.restarted_at for s in crashed.summaries)


def test_dead_writers_allocations_are_granted_again_after_their_deadline(crashed: Storm) -> None:
    assert sum(s["abandoned"] for s in crashed.summaries) > 0
    abandoned_churn, abandoned_durable = (
        crashed.pending(crashed.churn),
        crashed.pending(crashed.durable),
    )
    assert abandoned_churn
    # Every storm allocation was made before the stop: past this, every deadline is.
    time.sleep(max(0.0, crashed.stopped_at + PENDING_S + 0.2 - time.time()))
    # The durable namespace has room: a dead writer's keys go to the next writer.
    if abandoned_durable:
        regranted = crashed.client.allocate(crashed.durable, 0, [k for k, _ in abandoned_durable])
        assert {(a.key, a.page) for a in regranted.allocated} == abandoned_durable
        crashed.client.release(crashed.durable, 0, regranted.allocated)
    # The churn namespace is full: the next allocation reclaims the abandoned pages.
    granted = crashed.client.allocate(
        crashed.churn, 0, keys(CHURN_PAGES, salt="after-deadline")
    ).allocated
    assert crashed.pending(crashed.churn) == {(a.key, a.page) for a in granted}
    crashed.client.release(crashed.churn, 0, granted)
    assert crashed.invariants() == []
