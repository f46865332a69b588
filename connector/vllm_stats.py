"""The connector's statistics as vLLM wants them: its stats type and Prometheus metrics.

The only stats module that imports vLLM (the counters themselves are `connector.stats`,
which the worker side uses without vLLM).

Contract:
    * `Hf3fsctlConnectorStats` wraps one interval's counts (`StatsRecorder.take()`);
      vLLM aggregates it across workers (sums, the worst health state, bounded latency
      samples) and reduces it for its log line.
    * `Hf3fsctlPromMetrics` turns the aggregated counts into `hf3fsctl:connector_*`
      counters (`..._admission_skipped_blocks`: saves admission skipped, per engine), a
      failure counter by kind, the health gauge, a latency histogram and
      `hf3fsctl:connector_step_cpu_seconds{side}`, the histogram of the connector's CPU
      time per engine step on each side (docs/design.md "Fixed costs").
    * `reduce()` (vLLM's log line) adds `<side>_step_p50_us` / `_p99_us`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from .stats import (
    FAILURE_KINDS,
    LATENCIES,
    MAX_SAMPLES,
    STATE,
    STEP_SIDES,
    empty_counts,
    gbps,
    is_empty,
)


def _nearest_rank(ordered: list[float], q: float) -> float:
    """The nearest-rank `q` quantile of an ascending non-empty list."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Hf3fsctlConnectorStats(KVConnectorStats):
    """Counts of one interval, aggregated across workers by vLLM."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = empty_counts()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name == STATE:  # the worst state of any worker
                self.data[STATE] = max(self.data.get(STATE, 0), value)
            elif isinstance(value, list):
                self.data.setdefault(name, []).extend(value[:MAX_SAMPLES])
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        data = self.data
        out: dict[str, int | float] = {
            name: data.get(name, 0)
            for name in ("hit_tokens", "blocks_loaded", "blocks_saved", "misses")
        }
        if data.get("admission_skipped_blocks"):  # only where admission is on
            out["admission_skipped_blocks"] = data["admission_skipped_blocks"]
        out["load_GBps"] = round(gbps(data.get("bytes_loaded", 0), data.get("load_seconds", 0)), 3)
        out["save_GBps"] = round(gbps(data.get("bytes_saved", 0), data.get("save_seconds", 0)), 3)
        out["failed_blocks"] = sum(data.get(f"failed_{kind}", 0) for kind in FAILURE_KINDS)
        for name in LATENCIES:
            samples = data.get(name) or []
            if samples:
                out[f"avg_{name.removesuffix('_s')}_ms"] = round(
                    1000 * sum(samples) / len(samples), 2
                )
        for side in STEP_SIDES:
            steps = sorted(data.get(f"step_us_{side}") or [])
            if steps:
                out[f"{side}_step_p50_us"] = round(_nearest_rank(steps, 0.50), 1)
                out[f"{side}_step_p99_us"] = round(_nearest_rank(steps, 0.99), 1)
        return out

    def is_empty(self) -> bool:
        return is_empty(self.data)


_COUNTER_HELP = {
    "hit_tokens": "Tokens loaded from hf3fsctl instead of prefilled",
    "blocks_loaded": "KV blocks loaded from hf3fsctl",
    "bytes_loaded": "Bytes loaded from hf3fsctl",
    "blocks_saved": "KV blocks saved to hf3fsctl",
    "bytes_saved": "Bytes saved to hf3fsctl",
    "misses": "Requests served as a miss because the metadata service failed",
    "invalidated": "Keys dropped from the store because a load found them corrupt",
    "preempted": "Requests vLLM preempted (saves still reading their blocks are not "
    "committed: failed_blocks{kind=reused})",
    "admission_skipped_blocks": "Prompt blocks not saved because admission "
    "(connector.store_after_hits) had not seen them often enough",
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
        self._step_cpu: Any = self._histogram_cls_any(
            name="hf3fsctl:connector_step_cpu_seconds",
            documentation="CPU time of the connector's calls on the engine thread per engine "
            "step, by side (scheduler, worker)",
            labelnames=[*labelnames, "side"],
            buckets=[1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.25],
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
        for side in STEP_SIDES:
            samples = transfer_stats_data.get(f"step_us_{side}")
            if samples:
                histogram = self._step_cpu.labels(*labels, side)
                for us in samples:
                    histogram.observe(us / 1e6)
