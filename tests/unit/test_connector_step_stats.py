"""The connector's own CPU time per engine step: recorded, shipped, exported, read back."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
from hf3fsctl_connector.stats import (
    STEP_SHIP_SAMPLES,
    StatsRecorder,
    process_totals,
    step_percentiles,
)

from hf3fsctl.bench.e2e.samples import Samples, step_figures


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0) for key, value in after.items()}


def test_an_idle_interval_ships_nothing_until_enough_steps_wait() -> None:
    recorder = StatsRecorder()
    for _ in range(STEP_SHIP_SAMPLES - 1):
        recorder.step("worker", 12_000)
        assert recorder.take() is None  # no stats object per idle step
    recorder.step("worker", 12_000)
    data = recorder.take()
    assert data is not None and data["step_us_worker"] == [12.0] * STEP_SHIP_SAMPLES
    assert recorder.take() is None


def test_steps_ride_along_with_other_counts() -> None:
    recorder = StatsRecorder()
    recorder.step("scheduler", 30_000)
    recorder.add(lookups=1)
    data = recorder.take()
    assert data is not None and data["step_us_scheduler"] == [30.0] and data["lookups"] == 1


def test_process_totals_give_the_steps_percentiles_to_the_connector_and_the_bench() -> None:
    before = process_totals()
    recorder = StatsRecorder()
    for us in [10] * 90 + [1000] * 10:
        recorder.step("scheduler", us * 1000)
    delta = _delta(process_totals(), before)
    ours = step_percentiles(delta, "scheduler")
    assert ours["p50"] is not None and 10 <= ours["p50"] <= 10 * 1.1
    assert ours["p99"] is not None and 1000 <= ours["p99"] <= 1000 * 1.1
    # totals are process-wide floats: earlier steps in this process leave rounding in the delta
    assert ours["mean"] == pytest.approx(109.0)
    samples = Samples()
    samples.add_connector(delta)
    bench = step_figures(samples.connector, "scheduler")
    assert (bench["steps"], bench["p50_us"], bench["p99_us"]) == (100, ours["p50"], ours["p99"])


def test_prometheus_exports_the_step_histogram_by_side() -> None:
    from hf3fsctl_connector.vllm_stats import Hf3fsctlConnectorStats, Hf3fsctlPromMetrics
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    types: Any = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    metrics = Hf3fsctlPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]}
    )
    stats = Hf3fsctlConnectorStats(data={"step_us_worker": [15.0, 30.0, 2000.0]})
    metrics.observe(stats.data, 0)
    count = registry.get_sample_value(
        "hf3fsctl:connector_step_cpu_seconds_count", {"engine": "0", "side": "worker"}
    )
    assert count == 3
    reduced = stats.reduce()
    assert (reduced["worker_step_p50_us"], reduced["worker_step_p99_us"]) == (30.0, 2000.0)
