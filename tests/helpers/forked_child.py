"""A child of the session's engine zygote that a test drives as it drives a `Popen`.

`hf3fsctl.vllm_tools.zygote.run_forked` blocks until the child exits; a test that kills
an engine mid-run, or talks to it while it runs, needs its pid and a `poll`. The zygote's
protocol gives both: the child's pid on the first line of the connection, its exit
status on the second once the zygote reaped it. `fork_if_eligible` forks only a run the
zygote can take as a fresh `python -m` start would run it (`zygote.eligible`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from hf3fsctl.vllm_tools import zygote


class ForkedChild:
    """A child of the session's engine zygote, driven as `subprocess.Popen` is: `pid`,
    `poll`, `wait`, `kill`, `returncode` (the status as `subprocess` gives it, -N when
    killed by signal N). The zygote reaps it and sends its status on our connection."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock, self._reader = sock, sock.makefile("rb", buffering=0)  # no read-ahead
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(
        cls,
        path: str,
        module: str,
        argv: list[str],
        env: dict[str, str],
        directory: Path,
        cwd: Path | None = None,
    ) -> ForkedChild | None:
        """`python -m MODULE ARGV` forked by the zygote at `path` in `cwd` (default: ours;
        the module is looked up there first, as `python -m` does), its stdout and stderr
        in `directory` (`stdout.txt`, `stderr.log`); None when the zygote cannot take it."""
        request = {
            "module": module,
            "argv": argv,
            "env": env,
            "cwd": str(cwd or os.getcwd()),
            "stdout": str(directory / "stdout.txt"),
            "stderr": str(directory / "stderr.log"),
        }
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            child = cls(sock, 0)
            first = child._reader.readline()
        except OSError:
            sock.close()
            return None
        if not first:  # the zygote refused (a thread appeared) or is shutting down
            sock.close()
            return None
        child.pid = int(json.loads(first)["pid"])
        return child

    def _status(self, timeout_s: float | None) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._sock], [], [], timeout_s)
            if not ready:
                return None
            line = self._reader.readline()
            self._sock.close()
            if not line:
                raise ConnectionError(f"the engine zygote died while {self.pid} ran")
            self.returncode = int(json.loads(line)["status"])
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(zygote.RUNNER, timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_if_eligible(
    module: str,
    argv: list[str],
    env: dict[str, str],
    spec: dict[str, Any],
    directory: Path,
    cwd: Path | None = None,
) -> ForkedChild | None:
    """`python -m MODULE ARGV` with `env` forked from the session's engine zygote when
    `zygote.eligible(env, its env, spec)`; None (start it fresh) otherwise."""
    path = os.environ.get(zygote.ZYGOTE_ENV)
    started_with = zygote.zygote_env(path) if path else None
    if not path or started_with is None or not zygote.eligible(env, started_with, spec):
        return None
    return ForkedChild.start(path, module, argv, env, directory, cwd)
