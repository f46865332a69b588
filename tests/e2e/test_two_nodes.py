"""Two nodes on one machine: two vLLM processes, one storage root, one Redis.

Node A's connector talks to Redis directly (`redis://`) and fills the store. Two
stateless `hf3fsctl serve` replicas then front the same Redis; node B's connector talks
to replica 2 only. While node B is being served, replica 1 is killed with SIGKILL — a
client of replica 1 (the other node) gets the typed `MetadataUnavailable` (a miss),
while node B and a client of replica 2 are not interrupted: node B hits every block
node A wrote and its tokens are those of a run without any connector.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from e2e_scenario import BLOCK, LONG, PREFIX, SUFFIX, E2EStore, make_store
from helpers.redis_servers import RedisServer, redis_server
from helpers.servers import ServerProcess, free_port

from hf3fsctl.errors import MetadataUnavailable
from hf3fsctl.meta.client import open_metadata_client
from hf3fsctl.vllm_tools.runner import EngineResult

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.integration]

FULL_BLOCKS = (PREFIX + SUFFIX) // BLOCK
KILL_WAIT_S = 120.0  # node B's first lookup reaches replica 2 well within this
# metadata.timeout_s of node B: a loaded machine never turns a slow answer into a miss
NODE_B_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, RedisServer]]:
    """The storage root both nodes mount, and the Redis both share."""
    directory = tmp_path_factory.mktemp("two-nodes")
    server = redis_server(directory / "redis")
    try:
        yield directory / "storage", server
    finally:
        server.stop()


def start_replica(directory: Path, root: Path, redis_url: str) -> ServerProcess:
    """A `hf3fsctl serve` whose store is the shared Redis (it keeps nothing itself)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "hf3fs.yaml"
    config.write_text(f"storage:\n  path: {root}\nmetadata:\n  url: {redis_url}\n")
    return ServerProcess(
        config=config,
        db_path=directory / "unused.db",
        port=free_port(),
        token=None,
        log_path=directory / "serve.log",
    ).start()


@pytest.fixture(scope="module")
def replicas(
    shared: tuple[Path, RedisServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    root, redis = shared
    directory = tmp_path_factory.mktemp("replicas")
    started = [start_replica(directory / f"replica-{i}", root, redis.url) for i in (1, 2)]
    try:
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture(scope="module")
def node_a(
    engine: Callable[..., EngineResult],
    shared: tuple[Path, RedisServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> EngineResult:
    """Node A, straight on Redis, on the empty store: prefill and save."""
    root, redis = shared
    store = make_store(tmp_path_factory.mktemp("node-a"), root=root, metadata={"url": redis.url})
    return engine(store.kv_config())


@dataclass
class Prober:
    """Lookups in a loop through one replica, counting answers and typed failures."""

    url: str
    answered: int = 0
    unavailable: int = 0
    other_errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        client = open_metadata_client(self.url, timeout_s=1.0)
        try:
            while not self.stop.is_set():
                try:
                    client.namespaces()
                    self.answered += 1
                except MetadataUnavailable:
                    self.unavailable += 1
                except Exception as exc:  # anything untyped is the finding
                    self.other_errors.append(repr(exc))
                time.sleep(0.05)
        finally:
            client.close()


@dataclass
class NodeB:
    """Node B's run, with what happened around it."""

    result: EngineResult
    kill_after_lookups: bool
    other_node: Prober
    same_replica: Prober


def _namespace_lookups(url: str) -> int:
    client = open_metadata_client(url, timeout_s=2.0)
    try:
        return sum(ns.lookups for ns in client.stats().namespaces)
    finally:
        client.close()


@pytest.fixture(scope="module")
def node_b(
    engine: Callable[..., EngineResult],
    shared: tuple[Path, RedisServer],
    replicas: list[ServerProcess],
    node_a: EngineResult,
    tmp_path_factory: pytest.TempPathFactory,
) -> NodeB:
    """Node B on replica 2; replica 1 is killed once node B's lookups reach replica 2."""
    root, _ = shared
    first, second = replicas
    store: E2EStore = make_store(
        tmp_path_factory.mktemp("node-b"),
        root=root,
        metadata={"url": second.url, "timeout_s": NODE_B_TIMEOUT_S, "retry_backoff_s": 1.0},
    )
    other, same = Prober(first.url), Prober(second.url)
    probes = [threading.Thread(target=p.run, daemon=True) for p in (other, same)]
    for probe in probes:
        probe.start()
    before = _namespace_lookups(second.url)
    with ThreadPoolExecutor(1) as pool:
        run: Future[EngineResult] = pool.submit(engine, store.kv_config())
        deadline = time.monotonic() + KILL_WAIT_S
        while not run.done() and _namespace_lookups(second.url) == before:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        killed_mid_run = not run.done()
        first.kill()
        result = run.result()
    time.sleep(1.5)  # the probers see the dead replica for at least one 1 s timeout
    for prober in (other, same):
        prober.stop.set()
    for probe in probes:
        probe.join(10)
    return NodeB(result, killed_mid_run, other, same)


def test_node_a_outputs_match_no_connector(node_a: EngineResult, baseline: EngineResult) -> None:
    assert node_a.outputs == baseline.outputs


def test_node_a_saves_through_redis(node_a: EngineResult) -> None:
    assert node_a.connector is not None and node_a.connector["blocks_saved"] > 0


def test_replica_1_was_killed_while_node_b_was_served(node_b: NodeB) -> None:
    assert node_b.kill_after_lookups


def test_node_b_hits_what_node_a_wrote(node_b: NodeB) -> None:
    assert node_b.result.requests[LONG[0]].num_cached_tokens == FULL_BLOCKS * BLOCK


def test_node_b_outputs_match_no_connector(node_b: NodeB, baseline: EngineResult) -> None:
    assert node_b.result.outputs == baseline.outputs


def test_node_b_ends_no_request_in_error(node_b: NodeB) -> None:
    assert all(r.finish_reason == "length" for r in node_b.result.requests)


def test_node_b_counts_no_metadata_failure(node_b: NodeB) -> None:
    counts = node_b.result.connector
    assert counts is not None
    assert (counts["failed_metadata_down"], counts["failed_timeout"], counts["misses"]) == (0, 0, 0)


def test_the_surviving_replica_answers_every_call(node_b: NodeB) -> None:
    same = node_b.same_replica
    assert (same.answered > 0, same.unavailable, same.other_errors) == (True, 0, [])


def test_the_killed_replicas_client_gets_the_typed_unavailable_error(node_b: NodeB) -> None:
    other = node_b.other_node
    assert (other.unavailable > 0, other.other_errors) == (True, [])
