"""A private `redis-server` on a free loopback port, persistence off.

Contract: `RedisServer.start` raises `MetadataUnavailable` with a hint when no
`redis-server` is on PATH; its data lives only in the work directory it is given.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from hf3fsctl.bench.loopback import free_port
from hf3fsctl.bench.peers.process import stop_process, wait_for_port
from hf3fsctl.errors import MetadataUnavailable


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
        wait_for_port(self.process, self.port, "redis-server", self.log_path)
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL."""
        stop_process(self.process)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
