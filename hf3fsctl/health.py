"""Connector health: is the cache serving, degraded, or disabled — and why.

The cache never stops inference (docs/design.md decision 14): a store problem turns the
connector into one that serves misses instead of raising into vLLM. This module is how
that state becomes visible:

- `ConnectorHealth` is the state of one connector side: ``ok``, ``degraded`` (saves are
  failing — no space, I/O errors — and are retried after a back-off) or ``disabled``
  (the store could not be opened at start-up: every lookup a miss, no saves). Each
  change is logged once, with the fix, and written to a status file.
- Status files live on the node's local disk (`state_dir()`: `$HF3FSCTL_STATE_DIR`, else
  `<tmp>/hf3fsctl-<uid>`), never on the store (which may be the thing that failed), one
  JSON document per process and rank. `hf3fsctl doctor` reads them (`read_status`).

Imports only the standard library.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

OK = "ok"
DEGRADED = "degraded"
DISABLED = "disabled"
LEVELS = {OK: 0, DEGRADED: 1, DISABLED: 2}


def state_dir() -> Path:
    """The local directory of connector status files."""
    configured = os.environ.get("HF3FSCTL_STATE_DIR")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"hf3fsctl-{os.getuid()}"


@dataclass
class HealthRecord:
    """What a status file holds."""

    state: str  # ok, degraded, disabled
    reason: str  # what went wrong ('' when ok)
    fix: str  # what to do about it
    since: float  # when this state began
    updated: float  # when the file was written
    pid: int
    host: str
    role: str  # "worker" or "scheduler"
    rank: int
    namespace: str
    storage_path: str
    counts: dict[str, int] = field(default_factory=dict)  # failures by kind while degraded


class ConnectorHealth:
    """The health of one connector side; thread-safe; logs and records each change."""

    def __init__(
        self, *, role: str, rank: int, namespace: str, storage_path: str, record: bool = True
    ) -> None:
        self._lock = threading.Lock()
        self._record = record
        self.state = OK
        self.reason = ""
        self.fix = ""
        self.since = time.time()
        self.counts: dict[str, int] = {}
        self._identity = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "role": role,
            "rank": rank,
            "namespace": namespace,
            "storage_path": storage_path,
        }
        self._path = state_dir() / f"connector-{os.getpid()}-{role}-rank{rank}.json"

    @property
    def level(self) -> int:
        """0 ok, 1 degraded, 2 disabled (the Prometheus gauge's value)."""
        return LEVELS[self.state]

    def disable(self, reason: str, fix: str) -> None:
        """Serve misses and skip saves from now on (logged once, at error level)."""
        self._change(DISABLED, reason, fix, logging.ERROR)

    def degrade(self, kind: str, reason: str, fix: str) -> None:
        """Saves are failing (`kind` counted); logged once per degraded spell."""
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
        self._change(DEGRADED, reason, fix, logging.WARNING)

    def recover(self) -> None:
        """Back to serving normally (logged once)."""
        self._change(OK, "", "", logging.INFO)

    def _change(self, state: str, reason: str, fix: str, level: int) -> None:
        with self._lock:
            if state == self.state and (state != DISABLED or reason == self.reason):
                if state == DEGRADED:
                    self._write()
                return
            previous, self.state, self.reason, self.fix = self.state, state, reason, fix
            self.since = time.time()
            if state == OK:
                self.counts = {}
            self._write()
        role, rank = self._identity["role"], self._identity["rank"]
        if state == OK:
            logger.log(level, "hf3fsctl connector %s rank %s: %s again", role, rank, OK)
        else:
            logger.log(
                level,
                "hf3fsctl connector %s rank %s %s (was %s): %s; fix: %s",
                role,
                rank,
                state,
                previous,
                reason,
                fix,
            )

    def publish(self) -> None:
        """Write the status file now (at start-up, so `doctor` sees a healthy connector)."""
        with self._lock:
            self._write()

    def retire(self) -> None:
        """At shutdown: a healthy connector's file goes; a troubled one's stays for `doctor`.

        A healthy one also removes the files its exited predecessors (same store,
        namespace, role and rank) left troubled: it ran well after them, so what they
        reported is over and `doctor` would otherwise warn of it for good.
        """
        if not (self._record and self.state == OK):
            return
        self._path.unlink(missing_ok=True)
        mine = {k: self._identity[k] for k in ("namespace", "role", "rank", "storage_path")}
        for record in read_status(self._path.parent):
            if not record["alive"] and all(record.get(k) == v for k, v in mine.items()):
                try:
                    Path(record["file"]).unlink(missing_ok=True)
                except OSError as exc:  # visibility only: never a reason to fail
                    logger.debug("cannot remove connector status %s: %s", record["file"], exc)

    def snapshot(self) -> HealthRecord:
        """The current state as a record."""
        return HealthRecord(
            state=self.state,
            reason=self.reason,
            fix=self.fix,
            since=self.since,
            updated=time.time(),
            counts=dict(self.counts),
            **self._identity,  # type: ignore[arg-type]
        )

    def _write(self) -> None:
        if not self._record:
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._path.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(self.snapshot()), sort_keys=True))
            os.replace(tmp, self._path)
        except OSError as exc:  # visibility only: never a reason to fail
            logger.debug("cannot write connector status %s: %s", self._path, exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_status(directory: Path | None = None) -> list[dict[str, Any]]:
    """Every connector status file of this node, newest first, each with `alive`."""
    directory = directory or state_dir()
    records: list[dict[str, Any]] = []
    for path in sorted(directory.glob("connector-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "state" in data:
            data["alive"] = _alive(int(data.get("pid", 0)))
            data["file"] = str(path)
            records.append(data)
    records.sort(key=lambda r: r.get("updated", 0), reverse=True)
    return records
