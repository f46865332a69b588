"""LMCache's multiprocess server on loopback with a file-system L2 (docs/vllm.md's recipe).

Contract: `lmcache_available()` says whether the `lmcache` package imports here (it is
never a dependency: `bench e2e --peer lmcache` is skipped without it); `LMCacheServer`
starts `lmcache.cli.main server` on two free loopback ports, `wait_ready` raises with
its log's tail when it exits or does not listen in time, and `kv_config` is the
`--kv-transfer-config` of vLLM's `LMCacheMPConnector` pointed at it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hf3fsctl.bench.loopback import free_port
from hf3fsctl.bench.peers.process import stop_process


def lmcache_available() -> bool:
    """Whether the `lmcache` package is importable here (it is never a dependency)."""
    try:
        return importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        return False


class LMCacheServer:
    """LMCache's multiprocess server on loopback, with a file-system L2 (docs/vllm.md)."""

    def __init__(self, base_path: Path, chunk_size: int, log_path: Path) -> None:
        self.port, self.http_port = free_port(), free_port()
        base_path.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(chunk_size),
            "--l1-size-gb",
            "2",
            "--eviction-policy",
            "LRU",
            "--disable-observability",  # its exporter needs packages we do not install
            "--l2-adapter",
            json.dumps({"type": "fs", "base_path": str(base_path)}),
        ]
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.log_path = log_path

    def wait_ready(self, timeout_s: float) -> None:
        """Return once it listens; raise `RuntimeError` with its log's tail otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited {self.proc.returncode}: {self.tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"LMCache server not listening after {timeout_s:.0f} s: {self.tail()}")

    def tail(self) -> str:
        """The last lines of its log."""
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-8:])

    def kv_config(self) -> dict[str, Any]:
        """vLLM's `--kv-transfer-config` for `LMCacheMPConnector` against this server."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.port,
                "lmcache.mp.mp_transfer_mode": "lmcache_driven",
            },
        }

    def stop(self) -> None:
        """SIGTERM, then SIGKILL; close its log."""
        stop_process(self.proc, timeout_s=15.0)
        self._log.close()
