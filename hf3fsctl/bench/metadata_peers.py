"""The processes `bench metadata` measures beside its own: vLLM's in-tree server, Redis.

- `InTreeServer` runs the metadata server that ships in vLLM
  (`vllm/distributed/kv_transfer/kv_connector/v1/hf3fs/hf3fs_metadata_server.py`) on
  loopback, and `InTreeClient` drives it with vLLM's own client class
  (`Hf3fsGlobalMetadataClient`, requests keep-alive) behind the few calls the cells make
  (`lookup`, `locate`, `allocate`, `commit`), so the same cells measure both servers in
  one run. Its store is in memory and unbounded, namespaces do not exist in it, and a key
  is "stored" once every initialised rank confirmed it: the cells use one rank.
- `RedisServer` runs a private `redis-server` (Debian's package) on a free loopback port
  with persistence off (a benchmark measures the store's scripts, not disk fsyncs), for
  the `redis` and `serve-redis` modes.

Both are loopback-only, start in a work directory and stop (SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf3fsctl.errors import MetadataUnavailable

IN_TREE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.hf3fs.hf3fs_metadata_server"
IN_TREE_SCHEME = "in-tree+http://"


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop(process: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_for_port(process: subprocess.Popen[bytes], port: int, what: str, log: Path) -> None:
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise MetadataUnavailable(f"{what} exited with {process.returncode}: {tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    _stop(process)
    raise MetadataUnavailable(f"{what} did not listen on 127.0.0.1:{port} within 60 s")


class InTreeServer:
    """vLLM's in-tree hf3fs metadata server on loopback, one rank initialised."""

    def __init__(self, directory: Path, num_pages: int) -> None:
        self.port = free_port()
        self.num_pages = num_pages
        self.log_path = directory / "in-tree-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """How `StoreSpec.client` reaches it (`InTreeClient`)."""
        return f"{IN_TREE_SCHEME}127.0.0.1:{self.port}"

    def start(self) -> InTreeServer:
        """Start it and initialise rank 0 with `num_pages` pages.

        Raises:
            MetadataUnavailable: vLLM (and its in-tree server) is not installed here, or
                the server did not start.
        """
        try:
            import importlib.util

            found = importlib.util.find_spec(IN_TREE_MODULE) is not None
        except ImportError:
            found = False
        if not found:
            raise MetadataUnavailable(
                "vLLM's in-tree hf3fs metadata server is not installed here",
                hint="install vLLM (make setup does), or leave out --mode in-tree",
            )
        command = [sys.executable, "-m", IN_TREE_MODULE, "--host", "127.0.0.1"]
        command += ["--port", str(self.port)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _wait_for_port(self.process, self.port, "the in-tree metadata server", self.log_path)
        client = InTreeClient(self.url)
        try:
            client.initialize(self.num_pages)
        finally:
            client.close()
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        _stop(self.process)

    def __enter__(self) -> InTreeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class _Granted:
    key: str
    page: int


@dataclass(frozen=True)
class _AllocateAnswer:
    allocated: list[_Granted]
    existing: list[str]
    no_space: list[str]


class InTreeClient:
    """The calls the cells make, on vLLM's own client of its in-tree server (rank 0)."""

    RANK = 0

    def __init__(self, url: str) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.hf3fs.hf3fs_metadata_server import (
            Hf3fsGlobalMetadataClient,
        )

        base = "http://" + url.removeprefix(IN_TREE_SCHEME)
        self._client: Any = Hf3fsGlobalMetadataClient(base)

    def initialize(self, num_pages: int) -> None:
        """Initialise rank 0 with `num_pages` pages (once per server)."""
        self._client.initialize(self.RANK, num_pages)

    def lookup(self, namespace: str, keys: list[str]) -> int:
        """Leading keys stored (the in-tree server answers one flag per key)."""
        exists = self._client.batch_key_exists(keys)
        count = 0
        for flag in exists:
            if not flag:
                break
            count += 1
        return count

    def locate(self, namespace: str, rank: int, keys: list[str]) -> list[int | None]:
        """Pages of the keys on rank 0 (None where absent)."""
        found: list[int | None] = self._client.get_key_locations(self.RANK, keys)
        return found

    def allocate(
        self, namespace: str, rank: int, keys: list[str], first_depth: int = 0
    ) -> _AllocateAnswer:
        """Pages for the keys (its server answers -1 where none is left)."""
        answer = self._client.allocate_pages_for_keys(self.RANK, [(k, "") for k in keys])
        pages = {str(k): int(page) for k, page in answer}  # [key, page] pairs
        granted = [_Granted(k, pages[k]) for k in keys if pages.get(k, -1) >= 0]
        return _AllocateAnswer(granted, [], [k for k in keys if pages.get(k, -1) < 0])

    def commit(self, namespace: str, rank: int, items: list[Any]) -> int:
        """Confirm the writes (its server answers nothing: every item counts)."""
        self._client.confirm_write_for_keys(self.RANK, [(i.key, i.page) for i in items])
        return len(items)

    def health(self) -> dict[str, Any]:
        """A 1-key lookup (it has no health route)."""
        self._client.batch_key_exists(["0" * 64])
        return {"status": "ok"}

    def close(self) -> None:
        """Close its HTTP session."""
        self._client._session.close()


class RedisServer:
    """A private `redis-server` on a free loopback port, persistence off."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.log_path = directory / "redis-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        """`redis://127.0.0.1:PORT/DB`."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        """Start it and wait for it to listen.

        Raises:
            MetadataUnavailable: no `redis-server` on PATH, or it did not start.
        """
        binary = shutil.which("redis-server")
        if binary is None:
            raise MetadataUnavailable(
                "redis-server is not installed here",
                hint="apt-get install redis-server (make test does), or leave out the redis modes",
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        command += ["--logfile", str(self.log_path)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        _wait_for_port(self.process, self.port, "redis-server", self.log_path)
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        _stop(self.process)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
