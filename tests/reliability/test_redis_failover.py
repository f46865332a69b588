"""Redis failover under a metadata load: a master, its replica and three sentinels on
loopback; the master is killed with SIGKILL while writers allocate, commit and look up
through a `redis+sentinel://` URL.

What must hold:

- every call either succeeds or raises the typed `MetadataUnavailable` (the connector's
  miss) — never another exception, never a hang past the call's deadline;
- no entry is lost whose commit was acknowledged *and* replicated. "Replicated" is read
  from the replica itself: after each acknowledged commit the writer reads the master's
  replication offset, and a watcher polls the replica's own offset (`slave_repl_offset`);
  a commit whose master offset the replica had reached before the kill is in the
  replica's data. (A commit acknowledged but not yet replicated may be lost: Redis
  replication is asynchronous; that window is what `WAIT` would close, at a round trip
  per commit.)
- caching resumes on the promoted replica by itself: the same clients, no restart.

The failover window (kill → first commit acknowledged by the new master) is printed.

Then the same kill under real vLLM (one engine whose connector is on `redis+sentinel://`,
the master killed once the engine's first blocks are committed): its tokens are those of
the run without a connector, no request ends in error and the engine does not stall.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fault_scenario import Prompts, engine_run, make_store, spawn_engine
from helpers.meta_builders import commit_items, keys, register
from helpers.redis_servers import SentinelCluster, connect_port

from hf3fsctl.errors import MetadataUnavailable
from hf3fsctl.meta.client import open_metadata_client
from hf3fsctl.meta.protocol import MetadataClient
from hf3fsctl.vllm_tools.runner import EngineResult

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WRITERS = 3
CALL_TIMEOUT_S = 1.0  # metadata.timeout_s of every client
BEFORE_KILL_S = 1.0  # load on the healthy master first
AFTER_RECOVERY_COMMITS = 5  # per writer, acknowledged by the new master
SCENARIO_DEADLINE_S = 60.0  # the whole load, kill and recovery
ENGINE_SLACK_S = 30.0  # a run through a failover may be this much slower than the baseline
FIRST_COMMIT_WAIT_S = 240.0  # engine start-up and its first saves, on a loaded machine
CHAIN = 2


@dataclass
class Writer:
    """One thread's allocate → commit → lookup loop and everything it saw."""

    index: int
    client: MetadataClient
    namespace: str
    master_port: int
    ok: int = 0
    unavailable: int = 0
    other_errors: list[str] = field(default_factory=list)
    slowest_call_s: float = 0.0
    # (key, master replication offset read after the ack, or None once the master is gone)
    acknowledged: list[tuple[str, int | None]] = field(default_factory=list)
    commits_after: list[float] = field(default_factory=list)  # ack times (monotonic)
    master_gone: bool = False

    def call(self, fn: Any, *args: Any) -> Any:
        started = time.monotonic()
        try:
            result = fn(*args)
            self.ok += 1
            return result
        except MetadataUnavailable:
            self.unavailable += 1
            return None
        except Exception as exc:  # anything untyped is the finding
            self.other_errors.append(f"{fn.__name__}: {exc!r}")
            return None
        finally:
            self.slowest_call_s = max(self.slowest_call_s, time.monotonic() - started)

    def master_offset(self, conn: Any) -> int | None:
        """The old master's replication offset now; None once it is gone (an ack from
        then on is the new master's: not part of what the replica had to keep)."""
        if self.master_gone:
            return None
        try:
            return int(conn.info("replication")["master_repl_offset"])
        except Exception:
            self.master_gone = True
            return None

    def run(self, stop: threading.Event) -> None:
        master = connect_port(self.master_port, timeout_s=0.5)
        i = 0
        try:
            while not stop.is_set():
                chain = keys(CHAIN, start=i * CHAIN, salt=f"w{self.index}-")
                i += 1
                result = self.call(self.client.allocate, self.namespace, 0, chain)
                if result is not None and result.allocated:
                    items = commit_items(result.allocated)
                    committed = self.call(self.client.commit, self.namespace, 0, items)
                    if committed == len(items):
                        offset = self.master_offset(master)
                        self.acknowledged += [(item.key, offset) for item in items]
                        self.commits_after.append(time.monotonic())
                self.call(self.client.lookup, self.namespace, chain)
                time.sleep(0.01)
        finally:
            master.close()


@dataclass
class ReplicaWatch:
    """The replica's replication offset, polled until it is promoted."""

    port: int
    offset: int = 0

    def run(self, stop: threading.Event) -> None:
        conn = connect_port(self.port, timeout_s=0.5)
        try:
            while not stop.is_set():
                try:
                    info = conn.info("replication")
                except Exception:
                    time.sleep(0.01)
                    continue
                if info.get("role") != "slave":
                    return  # promoted: from here on its own writes move the offset
                self.offset = max(self.offset, int(info.get("slave_repl_offset", 0)))
                time.sleep(0.005)
        finally:
            conn.close()


@dataclass
class Failover:
    """What the scenario measured."""

    writers: list[Writer]
    replicated_before_kill: int  # the replica's offset when it stopped being a replica
    killed_at: float
    promoted_at: float
    first_commit_after: float
    lost: list[str]
    invariants: list[str]

    @property
    def window_s(self) -> float:
        return self.first_commit_after - self.killed_at


@pytest.fixture(scope="module")
def failover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Failover]:
    cluster = SentinelCluster(tmp_path_factory.mktemp("failover")).start()
    clients: list[MetadataClient] = []
    try:
        yield _run_scenario(cluster, clients)
    finally:
        for client in clients:
            client.close()
        cluster.stop()


def _run_scenario(cluster: SentinelCluster, clients: list[MetadataClient]) -> Failover:
    def client() -> MetadataClient:
        made = open_metadata_client(cluster.url, timeout_s=CALL_TIMEOUT_S)
        clients.append(made)
        return made

    admin = client()
    ns = register(admin, num_pages=100_000)
    old_master = cluster.master.port
    writers = [Writer(i, client(), ns, old_master) for i in range(WRITERS)]
    watch = ReplicaWatch(cluster.replica.port)
    stop, stop_watch = threading.Event(), threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,)) for w in writers]
    watcher = threading.Thread(target=watch.run, args=(stop_watch,))
    for thread in [*threads, watcher]:
        thread.start()
    deadline = time.monotonic() + SCENARIO_DEADLINE_S
    try:
        time.sleep(BEFORE_KILL_S)
        cluster.master.kill()
        killed_at = time.monotonic()
        cluster.wait_for_new_master(old_master, timeout_s=SCENARIO_DEADLINE_S)
        promoted_at = time.monotonic()
        while time.monotonic() < deadline and not all(
            sum(t > promoted_at for t in w.commits_after) >= AFTER_RECOVERY_COMMITS for w in writers
        ):
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        stop_watch.set()
        watcher.join(30)
    first_after = min(
        (t for w in writers for t in w.commits_after if t > killed_at), default=float("inf")
    )
    replicated = [
        key
        for w in writers
        for key, offset in w.acknowledged
        if offset is not None and offset <= watch.offset
    ]
    unreplicated = [
        key
        for w in writers
        for key, offset in w.acknowledged
        if offset is not None and offset > watch.offset
    ]
    reader = client()
    lost = [key for key in replicated if reader.lookup(ns, [key]) == 0]
    lost_unreplicated = sum(reader.lookup(ns, [key]) == 0 for key in unreplicated)
    check = getattr(reader, "check_invariants", None)
    invariants = list(check()) if check is not None else ["no check_invariants() on the client"]
    result = Failover(writers, watch.offset, killed_at, promoted_at, first_after, lost, invariants)
    print(
        f"\nredis failover: window {result.window_s:.2f}s (kill → first commit on the new "
        f"master), promotion {promoted_at - killed_at:.2f}s; "
        f"{sum(w.ok for w in writers)} calls ok, "
        f"{sum(w.unavailable for w in writers)} MetadataUnavailable; "
        f"{len(replicated)} acknowledged+replicated commits, {len(lost)} lost; "
        f"{len(unreplicated)} acknowledged before the replica had them, "
        f"{lost_unreplicated} of those lost"
    )
    return result


def test_every_call_succeeds_or_is_typed_unavailable(failover: Failover) -> None:
    assert [e for w in failover.writers for e in w.other_errors] == []


def test_the_kill_was_felt(failover: Failover) -> None:
    # the scenario proves nothing if no call ever met the dead master
    assert sum(w.unavailable for w in failover.writers) > 0


def test_no_call_outlives_its_deadline_by_much(failover: Failover) -> None:
    # one call: connect timeout + socket timeout at most, with a wide margin for load
    assert max(w.slowest_call_s for w in failover.writers) < 4 * CALL_TIMEOUT_S + 5


def test_no_acknowledged_and_replicated_commit_is_lost(failover: Failover) -> None:
    assert failover.lost == []


def test_replicated_commits_were_observed(failover: Failover) -> None:
    assert failover.replicated_before_kill > 0


def test_caching_resumes_on_the_new_master_by_itself(failover: Failover) -> None:
    resumed = [sum(t > failover.promoted_at for t in w.commits_after) for w in failover.writers]
    assert min(resumed) >= AFTER_RECOVERY_COMMITS


def test_failover_window_is_bounded(failover: Failover) -> None:
    # down-after 0.5 s + an election; a generous bound for a loaded 2-core machine
    assert failover.window_s < 30


def test_the_new_master_holds_a_sound_store(failover: Failover) -> None:
    assert failover.invariants == []


# --- the same kill under real vLLM ----------------------------------------------------


@dataclass
class EngineFailover:
    """One vLLM run whose metadata master was killed while it ran."""

    result: EngineResult
    killed_mid_run: bool
    keys_at_kill: int
    keys_after: int
    invariants: list[str]


def _stored_keys(client: MetadataClient) -> int:
    try:
        return sum(ns.keys for ns in client.stats().namespaces)
    except MetadataUnavailable:
        return 0


@pytest.fixture(scope="module")
def engine_failover(
    tmp_path_factory: pytest.TempPathFactory, fault_model: Path, fault_prompts: Prompts
) -> Iterator[EngineFailover]:
    directory = tmp_path_factory.mktemp("engine-failover")
    cluster = SentinelCluster(directory / "redis").start()
    watcher = open_metadata_client(cluster.url, timeout_s=CALL_TIMEOUT_S)
    try:
        store = make_store(
            directory / "store",
            metadata={"url": cluster.url, "timeout_s": CALL_TIMEOUT_S, "retry_backoff_s": 1.0},
        )
        engine = spawn_engine(
            engine_run(fault_model, fault_prompts, store.kv_config()), directory / "engine"
        )
        deadline = time.monotonic() + FIRST_COMMIT_WAIT_S
        while engine.process.poll() is None and time.monotonic() < deadline:
            if _stored_keys(watcher) > 0:
                break
            time.sleep(0.05)
        killed_mid_run = engine.process.poll() is None
        keys_at_kill = _stored_keys(watcher)
        old_master = cluster.master.port
        cluster.master.kill()
        result = engine.result()
        cluster.wait_for_new_master(old_master)
        keys_after = _stored_keys(watcher)
        check = getattr(watcher, "check_invariants", None)
        invariants = list(check()) if check is not None else ["no check_invariants()"]
        counts = result.connector or {}
        print(
            f"\nvLLM through a redis failover: {keys_at_kill} keys at the kill, {keys_after} "
            f"after; generate {result.generate_s:.1f}s; connector "
            f"failed_metadata_down={counts.get('failed_metadata_down')} "
            f"save_dropped={counts.get('save_dropped')} misses={counts.get('misses')}"
        )
        yield EngineFailover(result, killed_mid_run, keys_at_kill, keys_after, invariants)
    finally:
        watcher.close()
        cluster.stop()


@pytest.mark.e2e
def test_engine_master_was_killed_while_it_ran(engine_failover: EngineFailover) -> None:
    assert (engine_failover.killed_mid_run, engine_failover.keys_at_kill > 0) == (True, True)


@pytest.mark.e2e
def test_engine_tokens_through_a_failover_match_no_connector(
    engine_failover: EngineFailover, baseline: EngineResult
) -> None:
    assert engine_failover.result.outputs == baseline.outputs


@pytest.mark.e2e
def test_engine_ends_no_request_in_error_through_a_failover(
    engine_failover: EngineFailover,
) -> None:
    assert all(r.finish_reason == "length" for r in engine_failover.result.requests)


@pytest.mark.e2e
def test_engine_does_not_stall_through_a_failover(
    engine_failover: EngineFailover, baseline: EngineResult
) -> None:
    assert engine_failover.result.generate_s < baseline.generate_s + ENGINE_SLACK_S


@pytest.mark.e2e
def test_engine_store_is_sound_on_the_new_master(engine_failover: EngineFailover) -> None:
    # every key committed before the kill is still there or was evicted by the store,
    # never half-present: the store's own check on the promoted replica
    assert engine_failover.invariants == []
