"""vLLM's in-tree hf3fs metadata server, and its own client behind the cells' calls.

Contract: `InTreeServer.start` raises `MetadataUnavailable` with a hint when vLLM (and
so the server) is not installed here; `InTreeClient` answers `lookup`, `locate`,
`allocate`, `commit` and `health` the way `bench metadata`'s cells call hf3fsctl's
clients, through vLLM's `Hf3fsGlobalMetadataClient` (rank 0).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf3fsctl.bench.loopback import free_port
from hf3fsctl.bench.peers.process import stop_process, wait_for_port
from hf3fsctl.errors import MetadataUnavailable

IN_TREE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.hf3fs.hf3fs_metadata_server"


IN_TREE_SCHEME = "in-tree+http://"


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
        wait_for_port(self.process, self.port, "the in-tree metadata server", self.log_path)
        client = InTreeClient(self.url)
        try:
            client.initialize(self.num_pages)
        finally:
            client.close()
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        stop_process(self.process)

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
