"""Connector statistics: the counters of each connector side and the process totals.

Contract:
    * `StatsRecorder` is a thread-safe counter set owned by one scheduler or worker
      side. Every count also goes into this process's cumulative totals.
    * `take()` returns the counts since the last call as a plain dict (the facade wraps
      it in `connector.vllm_stats.Hf3fsctlConnectorStats`, what vLLM ships from workers
      to the logger and Prometheus), or None when nothing happened.
    * `process_totals()` returns the cumulative counters of every connector side in this
      process (in-process vLLM: scheduler and worker both), with derived GB/s. It is the
      hook tests and benchmarks read; it never resets.
    * Counter names: see `COUNTERS`; failures are `failed_<kind>` with kinds in
      `FAILURE_KINDS`; latencies are sampled (bounded lists) per interval.
    * No vLLM here: the vLLM-facing classes (stats type, Prometheus metrics) are in
      `connector.vllm_stats`.
"""

from __future__ import annotations

import threading
from typing import Any

COUNTERS = (
    "lookups",  # metadata lookups answered
    "lookup_blocks",  # prompt blocks asked about
    "hit_blocks",  # blocks promised to vLLM for loading
    "hit_tokens",  # tokens promised to vLLM for loading
    "misses",  # requests served as a miss because of a failure (down, timeout)
    "load_jobs",
    "blocks_loaded",
    "bytes_loaded",
    "load_seconds",  # wall time of load jobs (for GB/s)
    "save_jobs",
    "blocks_saved",
    "bytes_saved",
    "save_seconds",
    "save_existing",  # blocks another writer had already stored
    "save_dropped",  # blocks not saved (pool full, service down, no space, I/O)
    "invalidated",  # keys dropped from the store because a load found them corrupt
)
FAILURE_KINDS = (
    "not_found",
    "io",
    "checksum",
    "timeout",
    "pool_exhausted",
    "metadata_down",
    "no_space",
    "disabled",  # the connector is disabled (storage unusable since start-up)
    "paused",  # saves skipped while waiting out a storage failure's back-off
    "error",
)
LATENCIES = ("lookup_s", "load_s", "save_s")
STATE = "state_level"  # health: 0 ok, 1 degraded, 2 disabled (not a counter)
MAX_SAMPLES = 512

_TOTALS_LOCK = threading.Lock()
_TOTALS: dict[str, float] = {}


def empty_counts() -> dict[str, Any]:
    """Every counter at 0, every latency list empty."""
    data: dict[str, Any] = {name: 0 for name in COUNTERS}
    data.update({f"failed_{kind}": 0 for kind in FAILURE_KINDS})
    data.update({name: [] for name in LATENCIES})
    return data


def is_empty(data: dict[str, Any]) -> bool:
    """Whether one interval's counts hold nothing to report."""
    if STATE in data:
        return False
    return not any((len(value) if isinstance(value, list) else value) for value in data.values())


def gbps(num_bytes: float, seconds: float) -> float:
    """Bytes over seconds in GB/s (0 when no time passed)."""
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def process_totals() -> dict[str, float]:
    """Cumulative counters of every connector side in this process, with GB/s."""
    with _TOTALS_LOCK:
        totals: dict[str, float] = {name: 0 for name in COUNTERS}
        totals.update({f"failed_{kind}": 0 for kind in FAILURE_KINDS})
        totals.update(_TOTALS)
    totals["load_gbps"] = gbps(totals["bytes_loaded"], totals["load_seconds"])
    totals["save_gbps"] = gbps(totals["bytes_saved"], totals["save_seconds"])
    totals["failed_blocks"] = sum(totals[f"failed_{kind}"] for kind in FAILURE_KINDS)
    return totals


class StatsRecorder:
    """Thread-safe counters of one connector side."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_counts()
        self._reported_level = 0

    def add(self, **counts: float) -> None:
        """Add to named counters (`COUNTERS` names or `failed_<kind>`)."""
        with self._lock:
            for name, value in counts.items():
                self._data[name] += value
        with _TOTALS_LOCK:
            for name, value in counts.items():
                _TOTALS[name] = _TOTALS.get(name, 0) + value

    def fail(self, kind: str, blocks: int = 1) -> None:
        """Count `blocks` failed blocks of `kind` (one of `FAILURE_KINDS`)."""
        self.add(**{f"failed_{kind if kind in FAILURE_KINDS else 'error'}": blocks})

    def observe(self, name: str, seconds: float) -> None:
        """Record one latency sample (`LATENCIES` names)."""
        with self._lock:
            samples = self._data[name]
            if len(samples) < MAX_SAMPLES:
                samples.append(seconds)

    def take(self, state_level: int = 0) -> dict[str, Any] | None:
        """The counts since the last call (None when there were none).

        Args:
            state_level: the connector's health now (0 ok, 1 degraded, 2 disabled,
                `hf3fsctl.health.LEVELS`); shipped while not ok and once when it changes,
                for the `hf3fsctl:connector_state` gauge.
        """
        with self._lock:
            data, self._data = self._data, empty_counts()
            if state_level or state_level != self._reported_level:
                data[STATE] = state_level
            self._reported_level = state_level
        return None if is_empty(data) else data
