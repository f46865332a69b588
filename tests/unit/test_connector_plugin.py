"""Registration through the vLLM plugin entry point, and the stats vLLM aggregates."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from hf3fsctl_connector.plugin import CONNECTOR_NAME, register
from hf3fsctl_connector.vllm_stats import Hf3fsctlConnectorStats, Hf3fsctlPromMetrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory


def test_plugin_registration_is_idempotent() -> None:
    register()
    register()  # vLLM runs plugins in every process; a second call must not raise
    config = KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config).__name__ == CONNECTOR_NAME


def test_stats_from_two_workers_add_up() -> None:
    first = Hf3fsctlConnectorStats()
    first.data.update(blocks_loaded=3, bytes_loaded=3000, load_seconds=1.0, load_s=[0.5])
    second = Hf3fsctlConnectorStats()
    second.data.update(blocks_loaded=2, bytes_loaded=2000, load_seconds=1.0, failed_io=1)
    total = first.aggregate(second)
    reduced = total.reduce()
    assert (reduced["blocks_loaded"], reduced["failed_blocks"], total.data["load_s"]) == (
        5,
        1,
        [0.5],
    )


def test_fresh_stats_are_empty() -> None:
    assert Hf3fsctlConnectorStats().is_empty()


def test_prometheus_metrics_export_counters_failures_and_latency() -> None:
    registry = CollectorRegistry()
    types = {
        Counter: functools.partial(Counter, registry=registry),
        Gauge: functools.partial(Gauge, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = Hf3fsctlPromMetrics(config, types, ["engine"], {0: ["0"]})
    metrics.observe(
        {
            "hit_tokens": 64,
            "invalidated": 3,
            "preempted": 2,
            "failed_checksum": 2,
            "failed_reused": 5,
            "lookup_s": [0.002],
        },
        0,
    )
    value = registry.get_sample_value
    assert value("hf3fsctl:connector_hit_tokens_total", {"engine": "0"}) == 64
    assert value("hf3fsctl:connector_invalidated_total", {"engine": "0"}) == 3
    assert value("hf3fsctl:connector_preempted_total", {"engine": "0"}) == 2
    assert value("hf3fsctl:connector_failed_blocks_total", {"engine": "0", "kind": "reused"}) == 5
    assert value("hf3fsctl:connector_failed_blocks_total", {"engine": "0", "kind": "checksum"}) == 2
    assert value("hf3fsctl:connector_latency_seconds_count", {"engine": "0", "op": "lookup"}) == 1
