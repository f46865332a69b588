"""Starting and stopping a peer's process: wait until it listens, stop it for sure.

Contract: `wait_for_port` returns once the port accepts a connection, or raises
`MetadataUnavailable` with the log's tail when the process exits first (or after 60 s,
having stopped it); `stop_process` sends SIGTERM, then SIGKILL after `timeout_s`.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

from hf3fsctl.errors import MetadataUnavailable


def stop_process(process: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s` (nothing when it is not running)."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_for_port(process: subprocess.Popen[bytes], port: int, what: str, log: Path) -> None:
    """Return once `port` on loopback accepts a connection; raise if `process` exits first."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise MetadataUnavailable(f"{what} exited with {process.returncode}: {tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    stop_process(process)
    raise MetadataUnavailable(f"{what} did not listen on 127.0.0.1:{port} within 60 s")
