"""Real `hf3fsctl serve` processes for tests and benchmarks.

`start_server` writes a config, starts `python -m hf3fsctl serve --config CFG --host
127.0.0.1 --port PORT [--token-file F]` on a free loopback port and waits for
`/healthz`; `ServerProcess` stops it (SIGTERM), kills it (SIGKILL) and restarts it on
the same database. The `metadata_server` fixture yields one and always stops it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TOKEN = "test-token-0123456789abcdef"


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_config(directory: Path, db_path: Path, extra: str = "") -> Path:
    """A config whose metadata store is `db_path`; `extra` is appended YAML."""
    config = directory / "hf3fs.yaml"
    config.write_text(
        f"storage:\n  path: {directory / 'storage'}\nmetadata:\n  url: sqlite:///{db_path}\n{extra}"
    )
    return config


@dataclass
class ServerProcess:
    """A running `hf3fsctl serve` and how to reach it."""

    config: Path
    db_path: Path
    port: int
    token: str | None
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    token_file: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "hf3fsctl", "serve", "--config", str(self.config)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        if self.token_file is not None:
            cmd += ["--token-file", str(self.token_file)]
        return cmd

    def start(self, timeout_s: float = 30.0) -> ServerProcess:
        """Start the process and wait until `/healthz` answers."""
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"hf3fsctl serve exited with {self.process.returncode}:\n{self.log()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"hf3fsctl serve did not answer /healthz in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self) -> ServerProcess:
        """Start again on the same database and port."""
        self.stop()
        return self.start()


def start_server(
    directory: Path,
    *,
    token: str | None = None,
    db_path: Path | None = None,
    extra_config: str = "",
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start a real `hf3fsctl serve` on a free loopback port and wait for `/healthz`."""
    directory.mkdir(parents=True, exist_ok=True)
    db_path = db_path or directory / "metadata.db"
    server = ServerProcess(
        config=write_config(directory, db_path, extra_config),
        db_path=db_path,
        port=free_port(),
        token=token,
        log_path=directory / "serve.log",
        env=env or {},
    )
    if token is not None:
        server.token_file = directory / "token"
        server.token_file.write_text(token + "\n")
    return server.start()


@pytest.fixture
def metadata_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A real `hf3fsctl serve` (token `TOKEN`) on a free port; stopped afterwards."""
    server = start_server(tmp_path / "server", token=TOKEN)
    try:
        yield server
    finally:
        server.stop()
