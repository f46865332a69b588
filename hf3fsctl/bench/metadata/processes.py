"""The processes a cell runs: forked children, `hf3fsctl serve` servers, and their RSS.

Contract: a child runs one function and reports its result (or its error) back; a
`Server` is a real `hf3fsctl serve` on a free loopback port with a token, stopped
(SIGTERM, then SIGKILL of its process tree) on exit; `rss_bytes` and `cpu_seconds` read /proc.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from hf3fsctl.bench.loopback import free_port
from hf3fsctl.bench.metadata.stores import StoreSpec
from hf3fsctl.errors import MetadataUnavailable


def rss_bytes(pid: int) -> int:
    """Resident set of a process and all its descendants (bytes; 0 when gone)."""
    total = 0
    for current in (pid, *_descendants(pid)):
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and all its descendants (0 when gone)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for current in (pid, *_descendants(pid)):
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name (may hold spaces)
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / ticks


def probe_embedded(spec: StoreSpec) -> dict[str, int]:
    """RSS of a fresh embedded store process before and after its first lookup."""
    code = (
        "import json, os, sys\n"
        "from hf3fsctl.bench.metadata import StoreSpec, key, rss_bytes\n"
        "spec = StoreSpec(**json.loads(sys.argv[1]))\n"
        "client = spec.client()\n"
        "client.health()\n"
        "before = rss_bytes(os.getpid())\n"
        "hits = client.lookup(spec.namespaces[0], [key(spec.stored_tag, 0)])\n"
        "after = rss_bytes(os.getpid())\n"
        "client.close()\n"
        "print(json.dumps({'before': before, 'after': after, 'hits': hits}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(dataclasses.asdict(spec))],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
        check=False,
    )
    if done.returncode != 0:
        raise MetadataUnavailable(f"memory probe failed: {done.stderr.strip()[-2000:]}")
    out: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def child_env() -> dict[str, str]:
    """This environment without hf3fsctl configuration overrides (the bench sets its own)."""
    drop = ("HF3FSCTL_STORAGE_", "HF3FSCTL_METADATA_", "HF3FSCTL_SERVER_", "HF3FSCTL_CONNECTOR_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.pop("HF3FSCTL_CONFIG", None)
    return env


class Server:
    """A real `hf3fsctl serve` on loopback over one store, with a token."""

    def __init__(
        self,
        directory: Path,
        spec: StoreSpec,
        db: Path | None,
        workers: int,
        metadata_url: str | None = None,
        name: str | None = None,
    ) -> None:
        self.directory = directory
        self.spec = spec
        self.db = db
        self.workers = workers
        self.metadata_url = metadata_url or f"sqlite:///{db}"
        self.name = name or spec.name
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.log_path = directory / f"serve-{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Server:
        """Write its config and token, start it, and wait for `/healthz`."""
        token_file = self.directory / f"token-{self.name}"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        root = self.spec.root or str(self.directory / f"storage-{self.spec.name}")
        config = self.directory / f"serve-{self.name}.yaml"
        config.write_text(
            f"storage:\n  path: {json.dumps(root)}\n"
            f"metadata:\n  url: {json.dumps(self.metadata_url)}\n"
            f"  high_watermark: {self.spec.high!r}\n  low_watermark: {self.spec.low!r}\n"
            f"server:\n  workers: {self.workers}\n"
        )
        command = [sys.executable, "-m", "hf3fsctl", "serve", "--config", str(config)]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        command += ["--token-file", str(token_file)]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=child_env()
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise MetadataUnavailable(
                    f"hf3fsctl serve exited with {self.process.returncode}: {self.log()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        self.stop()
        raise MetadataUnavailable(f"hf3fsctl serve did not answer in {timeout_s:g}s: {self.log()}")

    def store_spec(self) -> StoreSpec:
        """How clients reach this store through the server."""
        return dataclasses.replace(
            self.spec, url=self.url, token=self.token, root=None, replicas=()
        )

    def rss(self) -> int:
        """Resident set of the server's process tree."""
        return rss_bytes(self.process.pid) if self.process is not None else 0

    def cpu(self) -> float:
        """CPU seconds the server's process tree has used so far."""
        return cpu_seconds(self.process.pid) if self.process is not None else 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL (its worker processes too) if it does not exit in time."""
        if self.process is None or self.process.poll() is not None:
            return
        tree = _descendants(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for pid in tree:  # uvicorn workers left behind by a killed supervisor
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc; empty where it is not readable)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                children = [int(c) for c in (task / "children").read_text().split()]
                found.extend(children)
                pending.extend(children)
    return found


@contextlib.contextmanager
def serving(directory: Path, spec: StoreSpec, db: Path, workers: int) -> Iterator[Server]:
    server = Server(directory, spec, db, workers).start()
    try:
        yield server
    finally:
        server.stop()
