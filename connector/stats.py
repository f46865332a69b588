"""Connector statistics: vLLM's KV connector stats, Prometheus metrics, process totals.

Contract:
    * `StatsRecorder` is a thread-safe counter set owned by one scheduler or worker
      side. Every count also goes into this process's cumulative totals.
    * `take()` returns the counts since the last call as `Hf3fsctlConnectorStats` (what
      vLLM ships from workers to the logger and Prometheus), or None when nothing
      happened.
    * `process_totals()` returns the cumulative counters of every connector side in this
      process (in-process vLLM: scheduler and worker both), with derived GB/s. It is the
      hook tests and benchmarks read; it never resets.
    * Counter names: see `COUNTERS`; failures are `failed_<kind>` with kinds in
      `FAILURE_KINDS`; latencies are sampled (bounded lists) per interval.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

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
_MAX_SAMPLES = 512

_TOTALS_LOCK = threading.Lock()
_TOTALS: dict[str, float] = {}


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {name: 0 for name in COUNTERS}
    data.update({f"failed_{kind}": 0 for kind in FAILURE_KINDS})
    data.update({name: [] for name in LATENCIES})
    return data


def _gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def process_totals() -> dict[str, float]:
    """Cumulative counters of every connector side in this process, with GB/s."""
    with _TOTALS_LOCK:
        totals: dict[str, float] = {name: 0 for name in COUNTERS}
        totals.update({f"failed_{kind}": 0 for kind in FAILURE_KINDS})
        totals.update(_TOTALS)
    totals["load_gbps"] = _gbps(totals["bytes_loaded"], totals["load_seconds"])
    totals["save_gbps"] = _gbps(totals["bytes_saved"], totals["save_seconds"])
    totals["failed_blocks"] = sum(totals[f"failed_{kind}"] for kind in FAILURE_KINDS)
    return totals


class StatsRecorder:
    """Thread-safe counters of one connector side."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()
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
            if len(samples) < _MAX_SAMPLES:
                samples.append(seconds)

    def take(self, state_level: int = 0) -> Hf3fsctlConnectorStats | None:
        """The counts since the last call (None when there were none).

        Args:
            state_level: the connector's health now (0 ok, 1 degraded, 2 disabled,
                `hf3fsctl.health.LEVELS`); shipped while not ok and once when it changes,
                for the `hf3fsctl:connector_state` gauge.
        """
        with self._lock:
            data, self._data = self._data, _empty()
            if state_level or state_level != self._reported_level:
                data[STATE] = state_level
            self._reported_level = state_level
        stats = Hf3fsctlConnectorStats(data=data)
        return None if stats.is_empty() else stats


@dataclass
class Hf3fsctlConnectorStats(KVConnectorStats):
    """Counts of one interval, aggregated across workers by vLLM."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name == STATE:  # the worst state of any worker
                self.data[STATE] = max(self.data.get(STATE, 0), value)
            elif isinstance(value, list):
                self.data.setdefault(name, []).extend(value[:_MAX_SAMPLES])
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        data = self.data
        out: dict[str, int | float] = {
            name: data.get(name, 0)
            for name in ("hit_tokens", "blocks_loaded", "blocks_saved", "misses")
        }
        out["load_GBps"] = round(_gbps(data.get("bytes_loaded", 0), data.get("load_seconds", 0)), 3)
        out["save_GBps"] = round(_gbps(data.get("bytes_saved", 0), data.get("save_seconds", 0)), 3)
        out["failed_blocks"] = sum(data.get(f"failed_{kind}", 0) for kind in FAILURE_KINDS)
        for name in LATENCIES:
            samples = data.get(name) or []
            if samples:
                out[f"avg_{name.removesuffix('_s')}_ms"] = round(
                    1000 * sum(samples) / len(samples), 2
                )
        return out

    def is_empty(self) -> bool:
        if STATE in self.data:
            return False
        return not any(
            (len(value) if isinstance(value, list) else value) for value in self.data.values()
        )


_COUNTER_HELP = {
    "hit_tokens": "Tokens loaded from hf3fsctl instead of prefilled",
    "blocks_loaded": "KV blocks loaded from hf3fsctl",
    "bytes_loaded": "Bytes loaded from hf3fsctl",
    "blocks_saved": "KV blocks saved to hf3fsctl",
    "bytes_saved": "Bytes saved to hf3fsctl",
    "misses": "Requests served as a miss because the metadata service failed",
    "invalidated": "Keys dropped from the store because a load found them corrupt",
}


class Hf3fsctlPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters and latency histograms of the connector, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counter_cls_any = cast(Any, self._counter_cls)
        self._histogram_cls_any = cast(Any, self._histogram_cls)
        self._counters: dict[str, Any] = {}
        for name, doc in _COUNTER_HELP.items():
            self._counters[name] = self._counter_cls_any(
                name=f"hf3fsctl:connector_{name}", documentation=doc, labelnames=labelnames
            )
        self._failures: Any = self._counter_cls_any(
            name="hf3fsctl:connector_failed_blocks",
            documentation="Blocks whose load or save failed, by kind",
            labelnames=[*labelnames, "kind"],
        )
        self._state: Any = cast(Any, self._gauge_cls)(
            name="hf3fsctl:connector_state",
            documentation="Connector health: 0 ok, 1 degraded (saves failing), "
            "2 disabled (storage unusable: every lookup a miss)",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._latency: Any = self._histogram_cls_any(
            name="hf3fsctl:connector_latency_seconds",
            documentation="Latency of connector operations (lookup, load, save)",
            labelnames=[*labelnames, "op"],
            buckets=[0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        if STATE in transfer_stats_data:
            self._state.labels(*labels).set(transfer_stats_data[STATE])
        for name, counter in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter.labels(*labels).inc(value)
        for kind in FAILURE_KINDS:
            value = transfer_stats_data.get(f"failed_{kind}", 0)
            if value:
                self._failures.labels(*labels, kind).inc(value)
        for name in LATENCIES:
            for seconds in transfer_stats_data.get(name) or []:
                self._latency.labels(*labels, name.removesuffix("_s")).observe(seconds)
