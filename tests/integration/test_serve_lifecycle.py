"""SIGTERM drains a real `hf3fsctl serve` under load, and its logs are JSON lines.

One server (`--log-format json`, a token) takes allocate → commit → lookup loops from
several client threads, each on its own keep-alive connection (stdlib `http.client`,
so every outcome is seen as it is: an answer, or which connection error). One more
commit is held in flight on purpose: the test takes the store's writer lock (the same
`flock` the server's writer waits on) before sending it, then sends SIGTERM.

What "drained" means, asserted precisely:

- while that commit is in flight the server stays up but refuses new connections (it
  stopped accepting first); once the lock is released, the commit gets its full answer;
- every answer any client got is a complete 200 (no 5xx, no truncated body), and per
  client, the answers come first: after its first connection error (refused, reset or
  closed without an answer) it never gets another answer, and it ends refused;
- the process exits 0, the WAL is empty or gone, and every acknowledged commit is in
  the store when it is opened again;
- every line the server wrote is one JSON object, and the token appears in none.
"""

from __future__ import annotations

import http.client
import json
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.meta_builders import PAGE_BYTES, checksum, keys, register
from helpers.servers import TOKEN, ServerProcess, free_port, start_server, write_config

from hf3fsctl.meta.http.client import HttpMetadataClient
from hf3fsctl.meta.sqlite.store import MetadataStore
from hf3fsctl.meta.sqlite.writer_lock import WriterLock

pytestmark = pytest.mark.integration

CLIENTS = 4
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
# what a client may see once the server is going away: never an answer cut short
CONNECTION_ERRORS = (ConnectionRefusedError, ConnectionResetError, BrokenPipeError)


class LoadClient(threading.Thread):
    """allocate → commit → lookup in a loop until the server refuses the connection.

    `trace` holds ("answer", op, status) and ("gone", op, error name) in order;
    `broken` anything else (a truncated body, a non-JSON answer, a timeout).
    """

    def __init__(self, port: int, namespace: str, index: int) -> None:
        super().__init__(name=f"load-{index}", daemon=True)
        self.port, self.namespace, self.index = port, namespace, index
        self.trace: list[tuple[str, str, Any]] = []
        self.acked: list[str] = []
        self.broken: list[str] = []

    def call(self, conn: http.client.HTTPConnection, op: str, body: dict[str, Any]) -> Any:
        conn.request("POST", f"/v1/{op}", json.dumps(body), HEADERS)
        response = conn.getresponse()
        payload = response.read()  # IncompleteRead here would be an answer cut short
        self.trace.append(("answer", op, response.status))
        return json.loads(payload)

    def run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        i = 0
        while True:
            op = "connect"
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                    conn.connect()
                batch = keys(4, start=i * 4, salt=f"client-{self.index}")
                i += 1
                op = "allocate"
                granted = self.call(
                    conn, op, {"namespace": self.namespace, "rank": 0, "keys": batch}
                )["allocated"]
                items = [
                    {"key": a["key"], "page": a["page"], "size": PAGE_BYTES,
                     "checksum": checksum(a["key"], a["page"])}
                    for a in granted
                ]  # fmt: skip
                op = "commit"
                count = self.call(
                    conn, op, {"namespace": self.namespace, "rank": 0, "items": items}
                )
                if count["count"] == len(items):
                    self.acked.extend(item["key"] for item in items)
                op = "lookup"
                self.call(conn, op, {"namespace": self.namespace, "keys": batch})
            except CONNECTION_ERRORS as exc:
                self.trace.append(("gone", op, type(exc).__name__))
                if conn is not None:
                    conn.close()
                conn = None
                if isinstance(exc, ConnectionRefusedError):
                    return
            except Exception as exc:  # recorded, asserted empty
                self.broken.append(f"{op}: {type(exc).__name__}: {exc}")
                return

    def answers(self) -> int:
        return sum(1 for kind, _, _ in self.trace if kind == "answer")


class InfoServer(ServerProcess):
    """The helper's server, logging at info level (the helper asks for warnings only)."""

    def command(self) -> list[str]:
        return [*super().command(), "--log-level", "info"]


def refused(port: int) -> bool:
    """Whether a new connection to `port` is refused now."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.connect()
    except ConnectionRefusedError:
        return True
    finally:
        conn.close()
    return False


def test_sigterm_drains_in_flight_requests_then_exits_0_with_every_ack_durable(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "server"
    directory.mkdir()
    (directory / "token").write_text(TOKEN + "\n")
    db_path = directory / "metadata.db"
    server = InfoServer(
        config=write_config(directory, db_path, "server:\n  log_format: json\n"),
        db_path=db_path,
        port=free_port(),
        token=TOKEN,
        log_path=directory / "serve.log",
        token_file=directory / "token",
    )
    server.start()
    assert server.process is not None
    client = HttpMetadataClient(server.url, token=TOKEN, timeout_s=10)
    namespace = register(client, num_pages=1_000_000)
    probe = client.allocate(namespace, 0, keys(16, salt="probe")).allocated
    client.close()

    clients = [LoadClient(server.port, namespace, i) for i in range(CLIENTS)]
    for load in clients:
        load.start()
    deadline = time.monotonic() + 60
    while min(c.answers() for c in clients) < 15 and time.monotonic() < deadline:
        time.sleep(0.05)

    items = [
        {"key": a.key, "page": a.page, "size": PAGE_BYTES, "checksum": checksum(a.key, a.page)}
        for a in probe
    ]
    in_flight = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    lock = WriterLock(f"{server.db_path}.lock")  # held ~1 s; the server's writes wait 5 s
    with lock.hold(5.0) as got:
        assert got  # the server's writes now wait for this process
        body = {"namespace": namespace, "rank": 0, "items": items}
        in_flight.request("POST", "/v1/commit", json.dumps(body), HEADERS)
        # a round trip on another connection: the loop has read the commit by then
        side = HttpMetadataClient(server.url, token=TOKEN, timeout_s=10)
        side.health()
        side.close()
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while not refused(server.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused(server.port), "still accepting connections after SIGTERM"
        assert server.process.poll() is None, "exited with a commit still in flight"
    lock.close()
    response = in_flight.getresponse()
    assert (response.status, json.loads(response.read())) == (200, {"count": len(probe)})
    in_flight.close()

    assert server.process.wait(60) == 0
    for load in clients:
        load.join(60)
    log = server.log()

    for load in clients:
        assert load.broken == [], load.broken
        statuses = {status for kind, _, status in load.trace if kind == "answer"}
        assert statuses == {200}, (load.name, statuses)
        kinds = [kind for kind, _, _ in load.trace]
        first_gone = kinds.index("gone")
        assert set(kinds[first_gone:]) == {"gone"}, (load.name, load.trace[first_gone:])
        assert load.trace[-1][2] == "ConnectionRefusedError", load.trace[-3:]

    wal = Path(f"{server.db_path}-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    acked = sorted({k for load in clients for k in load.acked} | {a.key for a in probe})
    store = MetadataStore(server.db_path)
    try:
        missing = [k for k in acked if store.lookup(namespace, [k]) != 1]
        assert (missing, store.check_invariants()) == ([], [])
    finally:
        store.close()

    lines = [line for line in log.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    messages = [r["message"] for r in records]
    assert "Shutting down" in messages and "metadata store closed" in messages
    assert TOKEN not in log


def test_shutdown_truncates_the_wal_even_while_another_process_has_the_store_open(
    tmp_path: Path,
) -> None:
    """After SIGTERM the database file alone holds every commit: the WAL is checkpointed
    and truncated, also when SQLite would not remove it (another connection is open)."""
    server = start_server(tmp_path / "server", token=TOKEN)
    client = HttpMetadataClient(server.url, token=TOKEN, timeout_s=10)
    namespace = register(client)
    chain = keys(32, salt="wal")
    granted = client.allocate(namespace, 0, chain).allocated
    from hf3fsctl.meta.models import CommitItem

    client.commit(
        namespace,
        0,
        [CommitItem(key=a.key, page=a.page, checksum=checksum(a.key, a.page), size=PAGE_BYTES) for a in granted],
    )  # fmt: skip
    client.close()
    reader = sqlite3.connect(server.db_path)  # e.g. `hf3fsctl doctor` on the same node
    try:
        reader.execute("SELECT COUNT(*) FROM entries").fetchone()
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        assert Path(f"{server.db_path}-wal").stat().st_size == 0
    finally:
        reader.close()
    alone = tmp_path / "copy.db"
    alone.write_bytes(server.db_path.read_bytes())  # the file without any -wal beside it
    conn = sqlite3.connect(alone)
    try:
        committed = conn.execute(
            "SELECT COUNT(*) FROM entries WHERE namespace = ? AND state = 1", (namespace,)
        ).fetchone()[0]
    finally:
        conn.close()
    assert committed == len(chain)
