"""The engine's own count of saves admission skipped: `admission_skipped_blocks`.

`connector.store_after_hits` turns blocks away in the store (its `admission_skipped`
counts keys, store-wide); each engine also counts the prompt blocks its admission
decision kept from being saved (the first block not admitted and every one after it,
the prefix rule), in its stats and in Prometheus. Driven through vLLM's real Scheduler
with a real store (`tests.helpers.connector_harness`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hf3fsctl_connector
from helpers.connector_harness import BLOCK_SIZE, Harness, make_harness, make_request, prompt_tokens
from hf3fsctl_connector.stats import process_totals

ADMIT_2 = {"connector.store_after_hits": 2}


def skipped_while(harness: Harness, *requests: Any) -> float:
    """Blocks admission skipped while `harness` ran `requests` (the process totals' delta)."""
    before = process_totals().get("admission_skipped_blocks", 0)
    harness.run(*requests)
    assert hf3fsctl_connector.wait_for_saves(10)
    return process_totals().get("admission_skipped_blocks", 0) - before


def test_a_prompt_seen_once_counts_every_block_and_seen_twice_none(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    prompt = prompt_tokens(3 * BLOCK_SIZE + 5)
    first = make_harness(tiny_model_dir, tmp_path / "store", extra=ADMIT_2)
    harnesses.append(first)
    assert skipped_while(first, make_request("once", prompt)) == 3
    assert first.saved_keys() == []
    second = make_harness(tiny_model_dir, tmp_path / "store", extra=ADMIT_2)  # another engine
    harnesses.append(second)
    assert skipped_while(second, make_request("twice", prompt)) == 0
    assert len(second.saved_keys()) == 3


def test_the_blocks_after_the_admitted_run_are_counted(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    shared = prompt_tokens(2 * BLOCK_SIZE)
    harness = make_harness(tiny_model_dir, tmp_path / "store", extra=ADMIT_2)
    harnesses.append(harness)
    a = make_request("a", shared + prompt_tokens(2 * BLOCK_SIZE + 3, salt=1))
    assert skipped_while(harness, a) == 4
    b = make_request("b", shared + prompt_tokens(2 * BLOCK_SIZE + 3, salt=2))
    assert skipped_while(harness, b) == 2  # its two shared blocks admitted, its own two not


def test_without_admission_nothing_is_counted(
    harnesses: list[Harness], tiny_model_dir: Path, tmp_path: Path
) -> None:
    harness = make_harness(tiny_model_dir, tmp_path / "store")
    harnesses.append(harness)
    assert skipped_while(harness, make_request("r", prompt_tokens(3 * BLOCK_SIZE + 5))) == 0
    assert len(harness.saved_keys()) == 3


def test_prometheus_counts_admission_skipped_blocks_per_engine() -> None:
    from hf3fsctl_connector.vllm_stats import Hf3fsctlConnectorStats, Hf3fsctlPromMetrics
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    types: Any = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    metrics = Hf3fsctlPromMetrics(
        SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"], 1: ["1"]}
    )
    stats = Hf3fsctlConnectorStats()
    stats.aggregate(Hf3fsctlConnectorStats(data={"admission_skipped_blocks": 3}))
    stats.aggregate(Hf3fsctlConnectorStats(data={"admission_skipped_blocks": 4}))
    metrics.observe(stats.data, 1)
    name = "hf3fsctl:connector_admission_skipped_blocks_total"
    assert registry.get_sample_value(name, {"engine": "1"}) == 7
    assert registry.get_sample_value(name, {"engine": "0"}) in (None, 0)
    assert stats.reduce()["admission_skipped_blocks"] == 7
