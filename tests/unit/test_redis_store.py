"""What only the Redis store has: URLs, auth, a server that is down, connections lost,
leases against Redis's clock, atomic scripts under concurrent clients, Sentinel master
discovery and failover, the change-log stream.

The store contract itself (same answers as SQLite) is `tests/contract/`. Every test here
talks to real `redis-server` / `redis-sentinel` processes (`helpers.redis_servers`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.lease_window import leasing
from helpers.redis_servers import (
    RedisServer,
    flush,
    redis_server,
    redis_session_server,
    redis_url,
    sentinel_cluster,
)
from helpers.servers import free_port

from hf3fsctl.config import MetadataUrl, build_config
from hf3fsctl.errors import AuthError, ConfigError, MetadataUnavailable
from hf3fsctl.keys import namespace_id
from hf3fsctl.meta.client import connect, open_metadata_client
from hf3fsctl.meta.models import CommitItem, EvictRequest, RankFile
from hf3fsctl.meta.policy import StorePolicy
from hf3fsctl.meta.redis import RedisMetadataStore
from hf3fsctl.meta.redis.codec import decode_run

__all__ = ["redis_session_server", "redis_url", "sentinel_cluster"]  # fixtures used here

PAGE = 4096
LUA_CALLS = (
    "evalsha",
    "fcall",
)  # how a store's Lua is called (functions where the server has them)


def _namespace(store: Any, ranks: int = 1, num_pages: int = 1 << 20, model: str = "m") -> str:
    manifest = {"model": model, "tp_size": ranks, "pp_size": 1, "page_bytes": PAGE}
    ns = namespace_id(manifest)
    store.register_namespace(ns, manifest)
    for rank in range(ranks):
        store.register_rank(
            ns,
            RankFile(
                rank=rank,
                path=f"{ns}/rank-{rank:04d}.pages",
                page_bytes=PAGE,
                slot_bytes=PAGE,
                num_pages=num_pages,
            ),
        )
    return ns


def _keys(n: int, start: int = 0, tag: int = 0) -> list[str]:
    return [f"{tag:08x}{i:08x}" for i in range(start, start + n)]


def _save(store: Any, ns: str, keys: list[str], rank: int = 0) -> dict[str, int]:
    result = store.allocate(ns, rank, keys)
    store.commit(
        ns,
        rank,
        [
            CommitItem(key=a.key, page=a.page, checksum="xxh3:00", size=PAGE)
            for a in result.allocated
        ],
    )
    return {a.key: a.page for a in result.allocated}


# --- URLs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "hosts", "db", "service", "username", "password", "shown"),
    [
        ("redis://127.0.0.1:6379/2", ((("127.0.0.1", 6379),)), 2, None, None, None, None),
        (
            "rediss://app:p%40ss@h:6380",
            (("h", 6380),),
            0,
            None,
            "app",
            "p@ss",
            "rediss://app:***@h:6380",
        ),
        ("redis://s3cret@h:1/0", (("h", 1),), 0, None, None, "s3cret", "redis://***@h:1/0"),
        (
            "redis+sentinel://:pw@a:26379,b:26380/cache/3",
            (("a", 26379), ("b", 26380)),
            3,
            "cache",
            None,
            "pw",
            "redis+sentinel://:***@a:26379,b:26380/cache/3",
        ),
    ],
    ids=["redis-db", "rediss-user-password", "password-alone", "sentinel-hosts-db"],
)
def test_redis_urls_parse_and_never_show_the_password(
    url: str,
    hosts: tuple[tuple[str, int], ...],
    db: int,
    service: str | None,
    username: str | None,
    password: str | None,
    shown: str | None,
) -> None:
    target = MetadataUrl.parse(url)
    assert (target.hosts, target.db, target.service) == (hosts, db, service)
    assert (target.username, target.password) == (username, password)
    assert target.url == (shown or url)
    if password:
        assert password not in repr(target) and password not in target.url


@pytest.mark.parametrize(
    "url",
    ["redis://h", "redis://h:1,g:2/0", "redis://h:1/zero", "redis+sentinel://h:1", "redis://h:0"],
    ids=["no-port", "two-hosts", "bad-db", "no-service", "port-0"],
)
def test_malformed_redis_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError, match=r"metadata\.url"):
        MetadataUrl.parse(url)


# --- auth and availability --------------------------------------------------------------


@pytest.fixture
def password_server(tmp_path: Path) -> Any:
    server = redis_server(tmp_path / "auth")
    conn = server.client()
    conn.config_set("requirepass", "hunter2-secret")  # after start: its PING check has no password
    conn.close()
    try:
        yield server
    finally:
        server.stop()


def test_a_wrong_password_is_an_auth_error_that_names_no_password(
    password_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://:wrong-guess@127.0.0.1:{password_server.port}/0"
    with pytest.raises(AuthError) as raised:  # at open: a configuration error fails fast
        open_metadata_client(url, timeout_s=5)
    assert "wrong-guess" not in str(raised.value) and "wrong-guess" not in caplog.text


def test_the_token_file_is_the_password_of_a_url_without_one(
    password_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token = tmp_path / "token"
    token.write_text("hunter2-secret\n")
    config = build_config(
        [
            (
                "test",
                {
                    "storage.path": str(tmp_path / "no-root"),
                    "metadata.url": f"redis://127.0.0.1:{password_server.port}/0",
                    "metadata.token_file": str(token),
                },
            )
        ]
    )
    store = connect(config)
    try:
        ns = _namespace(store)
        assert store.get_namespace(ns).id == ns
    finally:
        store.close()
    assert "hunter2-secret" not in caplog.text


def test_a_redis_that_is_not_there_is_unavailable_within_the_deadline() -> None:
    store = open_metadata_client(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    started = time.monotonic()
    for call in (lambda: store.lookup("0" * 16, ["ab" * 8]), store.health):
        with pytest.raises(MetadataUnavailable, match=r"Redis at redis://127\.0\.0\.1"):
            call()
    assert time.monotonic() - started < 10  # no retry loop, no hang
    store.close()


def test_a_killed_server_is_unavailable_and_a_restarted_one_serves_again(tmp_path: Path) -> None:
    server = redis_server(tmp_path / "r")
    store = RedisMetadataStore(MetadataUrl.parse(server.url), timeout_s=2)
    try:
        ns = _namespace(store)
        server.kill()
        with pytest.raises(MetadataUnavailable):
            store.lookup(ns, _keys(4))
        server.start()  # empty (no persistence): the store answers, it does not hang
        assert store.namespaces() == []
    finally:
        store.close()
        server.stop()


def test_a_connection_the_server_dropped_is_replaced_before_use(redis_url: str) -> None:
    store = RedisMetadataStore(MetadataUrl.parse(redis_url), timeout_s=5)
    admin = RedisMetadataStore(MetadataUrl.parse(redis_url), timeout_s=5)
    try:
        ns = _namespace(store)
        _save(store, ns, _keys(8))

        def drop_store_connections() -> None:
            raw = admin._redis
            for client in raw.client_list():
                if client["name"] == "hf3fsctl" and int(client["id"]) != raw.client_id():
                    raw.client_kill_filter(_id=client["id"])

        drop_store_connections()
        assert store.lookup(ns, _keys(8)) == 8
        drop_store_connections()
        assert len(store.allocate(ns, 0, _keys(4, start=100)).allocated) == 4
        assert store.check_invariants() == []
    finally:
        store.close()
        admin.close()


def test_a_call_that_times_out_is_unavailable_and_sent_once(redis_url: str) -> None:
    store = RedisMetadataStore(MetadataUrl.parse(redis_url), timeout_s=0.3)
    admin = RedisMetadataStore(MetadataUrl.parse(redis_url), timeout_s=5)
    try:
        ns = _namespace(store)
        raw = admin._redis
        raw.config_resetstat()
        raw.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # answers nobody for 1.5 s
        started = time.monotonic()
        with pytest.raises(MetadataUnavailable, match="did not answer in time"):
            store.allocate(ns, 0, _keys(4))
        assert time.monotonic() - started < 1.5  # the deadline, not the pause, ended it
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                raw.ping()
                break
            except Exception:
                time.sleep(0.1)
        time.sleep(0.2)
        stats = raw.info("commandstats")
        sent = sum(stats.get(f"cmdstat_{lua}", {"calls": 0})["calls"] for lua in LUA_CALLS)
        assert sent <= 1  # never sent a second time
    finally:
        store.close()
        admin.close()


# --- leases, scripts, concurrency -------------------------------------------------------


def test_a_read_lease_keeps_an_evicted_page_until_it_expires(redis_url: str) -> None:
    lease_s = 0.6  # the locate is timed: the lease ends between its sent and returned + this
    store = RedisMetadataStore(MetadataUrl.parse(redis_url), lease_s=lease_s)
    try:
        ns = _namespace(store)
        page = _save(store, ns, _keys(1))[_keys(1)[0]]
        located, lease = leasing(lambda: store.locate(ns, 0, _keys(1))[0], lease_s)
        assert located is not None
        assert store.evict(EvictRequest(all=True)).keys == 1
        during = store.allocate(ns, 0, _keys(1, start=1)).allocated[0].page
        if lease.still_held():  # asked well within the lease (a slow machine skips this)
            assert during != page  # leased: not handed out again
        deadline = time.monotonic() + 30
        reused = False
        start = 2
        while not reused and time.monotonic() < deadline:
            time.sleep(0.05)
            got = store.allocate(ns, 0, _keys(1, start=start)).allocated
            reused, start = got[0].page == page, start + 1
        assert reused and time.time() >= lease.earliest  # reusable once it ended, not before
        assert store.check_invariants() == []
    finally:
        store.close()


def _run_threads(count: int, work: Any) -> list[Any]:
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    return results


def test_concurrent_writers_get_each_key_and_each_page_once(redis_url: str) -> None:
    setup = RedisMetadataStore(MetadataUrl.parse(redis_url))
    ns = _namespace(setup, ranks=2)
    keys = _keys(400)

    def writer(i: int) -> list[tuple[str, int]]:
        store = RedisMetadataStore(MetadataUrl.parse(redis_url))
        granted = []
        try:
            for round_ in range(20):  # overlapping windows of the same keys
                window = keys[(round_ * 17 + i * 29) % 380 :][:20]
                result = store.allocate(ns, i % 2, window)
                granted += [(f"{i % 2}:{a.key}", a.page) for a in result.allocated]
        finally:
            store.close()
        return granted

    granted = [g for part in _run_threads(6, writer) for g in part]
    per_key = Counter(key for key, _ in granted)
    pages = [(key.split(":")[0], page) for key, page in granted]
    assert max(per_key.values()) == 1  # each (rank, key) went to one writer
    assert len(set(pages)) == len(pages)  # each (rank, page) to one key
    assert setup.check_invariants() == []
    setup.close()


def test_concurrent_writers_on_a_full_store_stay_within_capacity(redis_url: str) -> None:
    capacity = 64 * PAGE
    setup = RedisMetadataStore(MetadataUrl.parse(redis_url))
    setup.set_capacity(capacity)
    namespaces = [_namespace(setup, model=f"m{i}") for i in range(3)]

    def writer(i: int) -> int:
        store = RedisMetadataStore(MetadataUrl.parse(redis_url))
        saved = 0
        try:
            for round_ in range(30):
                saved += len(_save(store, namespaces[i % 3], _keys(8, start=round_ * 8, tag=i)))
                assert store.capacity().bytes_used <= capacity
        finally:
            store.close()
        return saved

    saved = _run_threads(6, writer)
    assert sum(saved) > 64  # eviction made room again and again
    assert setup.capacity().bytes_used <= capacity
    assert setup.check_invariants() == []
    evicted = sum(counts[0] for n in setup.stats().namespaces for counts in n.evicted.values())
    assert evicted > 0
    setup.close()


def test_two_prefixes_are_two_stores_in_one_database(redis_url: str) -> None:
    first = RedisMetadataStore(MetadataUrl.parse(redis_url), prefix="{a}:")
    second = RedisMetadataStore(MetadataUrl.parse(redis_url), prefix="{b}:")
    try:
        ns = _namespace(first)
        assert [info.id for info in first.namespaces()] == [ns]
        assert second.namespaces() == []
    finally:
        first.close()
        second.close()


def test_the_change_log_is_a_stream_written_by_commits_and_removals(redis_url: str) -> None:
    store = RedisMetadataStore(MetadataUrl.parse(redis_url))
    try:
        ns = _namespace(store)
        _save(store, ns, _keys(3))
        store.evict(EvictRequest(max_entries=1))
        raw = store._redis.xrange("{hf3fsctl}:changes")
        # one entry per run of one namespace and sign, its id the run's last seq
        assert [
            (entry_id, fields["delta"], len(decode_run(fields["keys"]))) for entry_id, fields in raw
        ] == [
            ("0-3", "1", 3),
            ("0-4", "-1", 1),
        ]
        log = store.changes(2)
        assert [(c.seq, c.delta) for c in log.changes] == [(3, 1), (4, -1)]
        assert (log.next_seq, log.missed) == (4, False)
    finally:
        store.close()


# --- Sentinel ---------------------------------------------------------------------------


def test_sentinel_finds_the_master_and_follows_a_failover(sentinel_cluster: Any) -> None:
    sentinel_cluster.sentinel_servers[0].stop()  # the first sentinel named is down: the next
    store = open_metadata_client(sentinel_cluster.url, timeout_s=1.0, policy=StorePolicy())
    try:
        ns = _namespace(store)
        _save(store, ns, _keys(16))
        old = sentinel_cluster.master_port()
        master = sentinel_cluster.master.client()
        try:
            assert master.wait(1, 5000) == 1  # the replica has every write
        finally:
            master.close()
        sentinel_cluster.master.kill()
        new = sentinel_cluster.wait_for_new_master(old)
        assert new != old
        deadline = time.monotonic() + 30
        while True:  # a call on a dead connection is a miss; the next finds the new master
            try:
                hits = store.lookup(ns, _keys(16))
                break
            except MetadataUnavailable:
                assert time.monotonic() < deadline, "the store never found the new master"
                time.sleep(0.1)
        assert hits == 16
        assert len(_save(store, ns, _keys(4, start=16))) == 4  # and writes to it
    finally:
        store.close()


# --- serve in front of Redis; TLS -------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(
    redis_session_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Any]]:
    """Two `hf3fsctl serve` processes over the session's Redis (store calls may wait 20 s)."""
    from helpers.servers import ServerProcess

    directory = tmp_path_factory.mktemp("replicas")
    config = directory / "hf3fs.yaml"
    config.write_text(
        f"storage:\n  path: {directory / 'no-root'}\nmetadata:\n"
        f"  url: {redis_session_server.url}\n  timeout_s: 20\n"
    )
    started = [
        ServerProcess(
            config=config,
            db_path=directory / "unused.db",
            port=free_port(),
            token=None,
            log_path=directory / f"serve-{i}.log",
        ).start()
        for i in range(2)
    ]
    try:
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.mark.integration
def test_serve_replicas_on_one_redis_are_one_store(
    redis_session_server: RedisServer, replicas: list[Any]
) -> None:
    flush(redis_session_server)
    clients = [open_metadata_client(replica.url, timeout_s=10) for replica in replicas]
    try:
        ns = _namespace(clients[0])
        _save(clients[0], ns, _keys(12))
        assert clients[1].lookup(ns, _keys(12)) == 12  # the other replica sees it at once
        assert clients[1].allocate(ns, 0, _keys(12)).existing == _keys(12)
        direct = RedisMetadataStore(MetadataUrl.parse(redis_session_server.url))
        assert direct.stats().namespaces[0].lookups == 1  # counted in Redis, not a process
        direct.close()
    finally:
        for client in clients:
            client.close()


@pytest.mark.integration
def test_serve_answers_while_a_lookup_waits_on_redis(
    redis_session_server: RedisServer, replicas: list[Any]
) -> None:
    """A Redis lookup is a network round trip: serve runs it off its event loop, so a
    slow Redis delays that lookup, not every other request."""
    import urllib.request

    serve = replicas[1]
    client = open_metadata_client(serve.url, timeout_s=20)
    admin = RedisMetadataStore(MetadataUrl.parse(redis_session_server.url))
    try:
        ns = _namespace(client)
        admin._redis.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        waiting = threading.Thread(target=client.lookup, args=(ns, _keys(8)))
        waiting.start()
        time.sleep(0.3)  # the lookup is now waiting on Redis inside serve
        started = time.monotonic()
        with urllib.request.urlopen(f"{serve.url}/openapi.json", timeout=10) as response:
            assert response.status == 200
        assert time.monotonic() - started < 1.5  # not held for the 3 s pause
        waiting.join(30)
        assert not waiting.is_alive()
    finally:
        client.close()
        admin.close()


def _tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl, ~0.2 s)."""
    import subprocess

    ca_key, ca, key, csr, cert = (
        directory / name for name in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem")
    )
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName = IP:127.0.0.1\n")
    commands = [
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key,
         "-out", ca, "-days", "1", "-subj", "/CN=hf3fsctl test CA"],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
         "-CAcreateserial", "-out", cert, "-days", "1", "-extfile", ext],
    ]  # fmt: skip
    for command in commands:
        subprocess.run([str(c) for c in command], check=True, capture_output=True)
    return ca, cert, key


def test_rediss_verifies_the_server_against_the_ca_file(tmp_path: Path) -> None:
    ca, cert, key = _tls_files(tmp_path)
    tls_port = free_port()
    server = redis_server(
        tmp_path / "tls",
        settings=[
            f"tls-port {tls_port}",
            f"tls-cert-file {cert}",
            f"tls-key-file {key}",
            f"tls-ca-cert-file {ca}",
            "tls-auth-clients no",
        ],
    )
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        store = open_metadata_client(url, timeout_s=5, ca_file=str(ca))
        ns = _namespace(store)
        assert store.get_namespace(ns).id == ns
        store.close()
        untrusted = open_metadata_client(url, timeout_s=5)  # the system's CAs: not ours
        with pytest.raises(MetadataUnavailable, match="certificate"):
            untrusted.namespaces()
        untrusted.close()
    finally:
        server.stop()


def test_a_process_that_only_looks_up_has_its_hits_counted_at_exit(redis_url: str) -> None:
    import subprocess
    import sys

    store = RedisMetadataStore(MetadataUrl.parse(redis_url))
    try:
        ns = _namespace(store)
        _save(store, ns, _keys(5))
        code = (
            "from hf3fsctl.meta.client import open_metadata_client as o\n"
            f"c = o({redis_url!r})\n"
            f"assert c.lookup({ns!r}, {_keys(8)!r}) == 5\n"  # exits without close()
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        counted = store.namespace_stats(ns)
        assert (counted.lookups, counted.lookup_keys, counted.hit_keys) == (1, 8, 5)
    finally:
        store.close()


@pytest.mark.parametrize(
    "request_",
    [
        EvictRequest(max_entries=23),
        EvictRequest(all=True),
        EvictRequest(all=True, dry_run=True),
        EvictRequest(target_usage=0.5),
        EvictRequest(all=True, include_pinned=True),
    ],
    ids=["max-entries", "all", "dry-run", "target-usage", "include-pinned"],
)
def test_admin_eviction_in_small_batches_evicts_what_sqlite_evicts(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request_: EvictRequest
) -> None:
    """The SQLite store (one transaction) is the oracle for the batched Redis eviction."""
    import hf3fsctl.meta.redis.store as redis_store
    from hf3fsctl.meta.sqlite.store import MetadataStore

    monkeypatch.setattr(redis_store, "EVICT_BATCH", 4)
    sqlite = MetadataStore(tmp_path / "oracle.db")
    store = RedisMetadataStore(MetadataUrl.parse(redis_url))
    remaining = []
    try:
        for target in (sqlite, store):
            target.set_capacity(200 * PAGE)
            spaces = [_namespace(target, ranks=2, model=f"m{i}") for i in range(3)]
            for round_ in range(4):  # interleaved saves: LRU order crosses namespaces
                for i, ns in enumerate(spaces):
                    for rank in (0, 1):
                        _save(target, ns, _keys(5, start=round_ * 5, tag=i), rank=rank)
            target.pin(spaces[1], _keys(3, tag=1))  # pinned: only with include_pinned
            target.allocate(spaces[2], 0, _keys(2, start=100, tag=2))  # pending: never
            target.locate(spaces[0], 0, _keys(2, tag=0))  # touched: newest now
            result = target.evict(request_)
            left = {(e.namespace, e.key, e.rank) for e in target.list_entries(limit=10_000)}
            remaining.append((result.keys, result.pages, result.bytes, result.by_namespace, left))
        assert remaining[1] == remaining[0]
        assert store.check_invariants() == []
    finally:
        sqlite.close()
        store.close()


def test_marks_a_crashed_process_left_are_finished_by_the_next_store_only_when_stale(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hf3fsctl.meta.redis.store as redis_store

    root = tmp_path / "root"
    root.mkdir()
    policy = StorePolicy(storage_root=str(root))
    store = RedisMetadataStore(MetadataUrl.parse(redis_url), policy=policy)
    raw = store._redis
    try:
        ns = _namespace(store)
        _save(store, ns, _keys(10))

        def crash(marked: Any) -> Any:
            raise RuntimeError("the process died between marking and punching")

        monkeypatch.setattr(store._puncher, "punch", crash)
        with pytest.raises(RuntimeError):
            store.evict(EvictRequest(all=True))
        marked_key = f"{{hf3fsctl}}:give:{ns}:0"
        assert raw.zcard(marked_key) == 10
        assert int(raw.hget("{hf3fsctl}:giving", ns)) == 10 * PAGE

        RedisMetadataStore(MetadataUrl.parse(redis_url), policy=policy).close()
        assert raw.zcard(marked_key) == 10  # fresh marks may be a live writer's: left alone

        monkeypatch.setattr(redis_store, "STALE_MARK_S", 0.0)
        RedisMetadataStore(MetadataUrl.parse(redis_url), policy=policy).close()
        assert raw.zcard(marked_key) == 0  # stale: punched and settled
        assert int(raw.hget(f"{{hf3fsctl}}:rf:{ns}:0", "holes")) == 10
        assert store.capacity().bytes_used == 0
        assert store.check_invariants() == []
    finally:
        store.close()


def test_cli_commands_on_a_redis_url_never_print_its_password(
    password_server: RedisServer, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from hf3fsctl.cli.main import app

    url = f"redis://:hunter2-secret@127.0.0.1:{password_server.port}/0"
    root = tmp_path / "root"
    config = tmp_path / "hf3fs.yaml"
    runner = CliRunner()
    flags = ["--storage-path", str(root), "--create-path", "--metadata-url", url]
    flags += ["--capacity", "1GiB"]
    init = runner.invoke(app, ["init", *flags, "--write-config", str(config), "--json"])
    assert init.exit_code == 0, init.output
    for command in (["stats", "--json"], ["ls"], ["evict", "--all", "-y"]):
        result = runner.invoke(app, ["--config", str(config), *command])
        assert result.exit_code == 0, result.output
        assert "hunter2-secret" not in result.output
    assert "hunter2-secret" not in init.output
    assert "redis://:***@127.0.0.1" in init.output


def test_doctor_checks_a_redis_stores_role_and_invariants(redis_url: str, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from hf3fsctl.cli.main import app

    config = tmp_path / "hf3fs.yaml"
    config.write_text(f"storage:\n  path: {tmp_path / 'root'}\nmetadata:\n  url: {redis_url}\n")
    store = RedisMetadataStore(MetadataUrl.parse(redis_url))
    ns = _namespace(store)
    _save(store, ns, _keys(4))

    def invariants() -> dict[str, Any]:
        result = CliRunner().invoke(app, ["--config", str(config), "doctor", "--json"])
        checks = json.loads(result.stdout)["checks"]
        return next(c for c in checks if c["name"] == "metadata.invariants")

    assert invariants()["status"] == "ok"
    result = CliRunner().invoke(app, ["--config", str(config), "doctor", "--json"])
    redis_check = next(
        c for c in json.loads(result.stdout)["checks"] if c["name"] == "metadata.redis"
    )
    # a lone server: the master, no replica to fail over to, the layout's format
    assert redis_check["status"] == "warn" and "no replica" in redis_check["detail"]
    assert "role master" in redis_check["detail"] and "store format 5" in redis_check["detail"]
    assert "its Lua as functions (library hf3fsctl_" in redis_check["detail"]  # loaded: saved
    store._redis.hincrby(f"{{hf3fsctl}}:rf:{ns}:0", "used", 1)  # a count gone wrong
    found = invariants()
    assert found["status"] == "fail" and "used pages" in found["detail"]
    store.close()


def test_one_allocation_evicts_a_bounded_number_of_keys(redis_url: str) -> None:
    """A watermark swing of thousands of keys is spread over allocations (each script
    evicts at most 2,048 keys beyond its own need), so none holds Redis for long."""
    store = RedisMetadataStore(MetadataUrl.parse(redis_url), high_watermark=0.95, low_watermark=0.5)
    try:
        store.set_capacity(6000 * PAGE)  # a swing of 2,700 pages
        ns = _namespace(store)
        for start in range(0, 5700, 1000):
            _save(store, ns, _keys(min(1000, 5700 - start), start=start))
        assert store.capacity().bytes_used == 5700 * PAGE  # at the high watermark

        def evicted() -> int:
            return store.namespace_stats(ns).evicted.get("capacity", [0, 0])[0]

        granted = store.allocate(ns, 0, _keys(1, start=10_000)).allocated
        assert len(granted) == 1
        first = evicted()
        assert 1 <= first <= 1 + 2048  # bounded, not the whole swing
        store.allocate(ns, 0, _keys(1, start=10_001))
        assert store.check_invariants() == []
    finally:
        store.close()


def test_a_redis_that_evicts_by_itself_is_warned_about(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    admin = RedisMetadataStore(MetadataUrl.parse(redis_url))
    try:
        admin._redis.config_set("maxmemory-policy", "allkeys-lru")
        with caplog.at_level(logging.WARNING):
            RedisMetadataStore(MetadataUrl.parse(redis_url)).close()
        assert "maxmemory-policy allkeys-lru" in caplog.text
        admin._redis.config_set("maxmemory-policy", "noeviction")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            RedisMetadataStore(MetadataUrl.parse(redis_url)).close()
        assert "maxmemory-policy" not in caplog.text
    finally:
        admin._redis.config_set("maxmemory-policy", "noeviction")
        admin.close()
