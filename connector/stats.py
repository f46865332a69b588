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
    * Fixed costs (docs/design.md "Fixed costs"): `step(side, ns)` records one engine
      step's CPU time inside the connector's calls on one side (`STEP_SIDES`), as µs in
      the `step_us_<side>` sample list (shipped with other counts, or every
      `STEP_SHIP_SAMPLES` steps / `STEP_SHIP_S` seconds, so an idle engine's steps ship
      no stats object each; `steps` records a batch the facade kept), and in the process totals as `steps_<side>`,
      `step_us_<side>_sum` and a cumulative histogram `step_us_<side>_le_<edge>` (µs
      edges `STEP_EDGES_US`, only buckets that were hit: a difference of two totals is
      the histogram of the steps between them). `step_percentiles` reads p50/p99 back.
    * `take()` on an interval with nothing recorded returns None without building a
      dict (it runs every engine step); `due()` is the same check alone (the scheduler
      facade times `take()` only when it is due).
    * No vLLM here: the vLLM-facing classes (stats type, Prometheus metrics) are in
      `connector.vllm_stats`.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
import weakref
from collections.abc import Mapping
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
    "preempted",  # requests vLLM preempted (their saves still reading blocks: `reused`)
    # connector.store_after_hits: prompt blocks its admission decision kept from being
    # saved (the first one not admitted and every one after it; the store's
    # `admission_skipped` counts the keys it answered False, store-wide)
    "admission_skipped_blocks",
)
FAILURE_KINDS = (
    "not_found",
    "io",
    "checksum",
    "timeout",
    "pool_exhausted",
    "reused",  # a save's blocks were given to other data (preempted) before it was written
    "metadata_down",
    "no_space",
    "disabled",  # the connector is disabled (storage unusable since start-up)
    "paused",  # saves skipped while waiting out a storage failure's back-off
    "error",
)
LATENCIES = ("lookup_s", "load_s", "save_s")
STATE = "state_level"  # health: 0 ok, 1 degraded, 2 disabled (not a counter)
MAX_SAMPLES = 512
STEP_SIDES = ("scheduler", "worker")
STEP_TIMES = tuple(f"step_us_{side}" for side in STEP_SIDES)  # µs per step, sampled
STEP_SHIP_SAMPLES = 64  # step samples waiting before they are shipped on their own
STEP_SHIP_S = 1.0  # ... or this long since the last shipment
# Histogram edges (µs) of the process totals: 1 µs to ~100 s, 2^(1/8) apart (9%).
STEP_EDGES_US = tuple(float(f"{2 ** (i / 8):.4g}") for i in range(8 * 27))

_TOTALS_LOCK = threading.Lock()
_TOTALS: dict[str, float] = {}
# Holders of step samples not recorded yet (the facades): `process_totals` flushes them.
_STEP_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()


def hold_steps(holder: Any) -> None:
    """Have `process_totals` call `holder.flush_steps()` first (kept weakly)."""
    _STEP_HOLDERS.add(holder)


def empty_counts() -> dict[str, Any]:
    """Every counter at 0, every latency list empty."""
    data: dict[str, Any] = {name: 0 for name in COUNTERS}
    data.update({f"failed_{kind}": 0 for kind in FAILURE_KINDS})
    data.update({name: [] for name in LATENCIES})
    data.update({name: [] for name in STEP_TIMES})
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
    for holder in list(_STEP_HOLDERS):  # step samples a facade still keeps
        holder.flush_steps()
    with _TOTALS_LOCK:
        totals: dict[str, float] = {name: 0 for name in COUNTERS}
        totals.update({f"failed_{kind}": 0 for kind in FAILURE_KINDS})
        totals.update(_TOTALS)
    totals["load_gbps"] = gbps(totals["bytes_loaded"], totals["load_seconds"])
    totals["save_gbps"] = gbps(totals["bytes_saved"], totals["save_seconds"])
    totals["failed_blocks"] = sum(totals[f"failed_{kind}"] for kind in FAILURE_KINDS)
    return totals


def step_bucket_key(side: str, edge_us: float) -> str:
    """The process-totals key of one step-time histogram bucket (steps of <= edge µs)."""
    return f"step_us_{side}_le_{edge_us:g}"


# Per side: its sample list, step count and µs sum keys, and its bucket keys by edge.
_STEP_KEYS = {
    side: (
        f"step_us_{side}",
        f"steps_{side}",
        f"step_us_{side}_sum",
        [step_bucket_key(side, edge) for edge in STEP_EDGES_US],
    )
    for side in STEP_SIDES
}


def step_percentiles(totals: Mapping[str, Any], side: str) -> dict[str, float | None]:
    """p50 / p99 / mean µs per step of `side` from (a difference of) process totals.

    A percentile is its bucket's upper edge (at most 9% above the true value); None
    when no step was recorded.
    """
    prefix = f"step_us_{side}_le_"
    buckets = sorted(
        (float(key[len(prefix) :]), count)
        for key, count in totals.items()
        if key.startswith(prefix) and count
    )
    steps = sum(count for _, count in buckets)
    out: dict[str, float | None] = {"p50": None, "p99": None, "mean": None}
    if not steps:
        return out
    for name, q in (("p50", 0.50), ("p99", 0.99)):
        rank, seen = max(1, math.ceil(q * steps)), 0  # nearest rank
        for edge, count in buckets:
            seen += count
            if seen >= rank:
                out[name] = edge
                break
    out["mean"] = float(totals.get(f"step_us_{side}_sum", 0.0)) / steps
    return out


class StatsRecorder:
    """Thread-safe counters of one connector side."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty_counts()
        self._dirty = False  # something besides step samples was recorded since take()
        self._steps: dict[str, list[float]] = {name: [] for name in STEP_TIMES}
        self._steps_waiting = 0
        self._steps_shipped_at = time.monotonic()
        self._reported_level = 0

    def add(self, **counts: float) -> None:
        """Add to named counters (`COUNTERS` names or `failed_<kind>`)."""
        with self._lock:
            self._dirty = True
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
            self._dirty = True
            samples = self._data[name]
            if len(samples) < MAX_SAMPLES:
                samples.append(seconds)

    def step(self, side: str, ns: int) -> None:
        """Record one engine step's connector CPU time on `side` (`STEP_SIDES`)."""
        self.steps(side, [ns])

    def steps(self, side: str, ns: list[int]) -> None:
        """Record engine steps' connector CPU times (ns) on `side`, in one go."""
        if not ns:
            return
        name, steps, total, buckets = _STEP_KEYS[side]
        last = len(buckets) - 1
        us = [n / 1000.0 for n in ns]
        hit = [buckets[min(bisect.bisect_left(STEP_EDGES_US, u), last)] for u in us]
        with self._lock:
            samples = self._steps[name]
            samples.extend(us[: max(0, MAX_SAMPLES - len(samples))])
            self._steps_waiting += len(us)
        with _TOTALS_LOCK:
            _TOTALS[steps] = _TOTALS.get(steps, 0) + len(us)
            _TOTALS[total] = _TOTALS.get(total, 0.0) + sum(us)
            for bucket in hit:
                _TOTALS[bucket] = _TOTALS.get(bucket, 0) + 1

    def due(self, state_level: int = 0) -> bool:
        """Whether `take(state_level)` may have something to ship (False: it returns None;
        read unlocked, as take's own first check)."""
        return bool(self._dirty or self._steps_waiting or state_level or self._reported_level)

    def take(self, state_level: int = 0) -> dict[str, Any] | None:
        """The counts since the last call (None when there were none).

        Args:
            state_level: the connector's health now (0 ok, 1 degraded, 2 disabled,
                `hf3fsctl.health.LEVELS`); shipped while not ok and once when it changes,
                for the `hf3fsctl:connector_state` gauge.
        """
        if not (self._dirty or self._steps_waiting or state_level or self._reported_level):
            return None  # nothing recorded (read unlocked: what a thread adds is seen next)
        with self._lock:
            state_due = bool(state_level) or state_level != self._reported_level
            steps_due = self._steps_waiting >= STEP_SHIP_SAMPLES or bool(
                self._steps_waiting and time.monotonic() - self._steps_shipped_at >= STEP_SHIP_S
            )
            if not (self._dirty or state_due or steps_due):
                return None
            data, self._data, self._dirty = self._data, empty_counts(), False
            if self._steps_waiting:  # every shipment carries the steps so far
                for name, samples in self._steps.items():
                    data[name] = samples
                self._steps = {name: [] for name in STEP_TIMES}
                self._steps_waiting = 0
                self._steps_shipped_at = time.monotonic()
            if state_due:
                data[STATE] = state_level
            self._reported_level = state_level
        return None if is_empty(data) else data
