"""Figures of one configuration: TTFT percentiles, throughput, hit rates, output hash.

Contract: `Samples` pools the requests of every repeat of a configuration; `figures()`
is its entry of the document (None where a figure cannot be computed, never 0 for
"unknown"). Our connector's CPU time per engine step comes from its process totals'
step histograms (`hf3fsctl_connector.stats`: `steps_<side>`, `step_us_<side>_sum`,
`step_us_<side>_le_<edge µs>`), pooled by adding bucket counts; `step_figures` reads
p50/p99 back (a percentile is its bucket's upper edge, at most 9% high).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hf3fsctl.bench import report

if TYPE_CHECKING:
    from hf3fsctl.vllm_tools.runner import RequestResult


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (0-100) of `values` (0.0 when empty)."""
    return report.percentile(sorted(values), q / 100.0) if values else 0.0


def ratio_of(a: float | None, b: float | None) -> float | None:
    return report.ratio(None if a is None else float(a), None if b is None else float(b))


STEP_SIDES = ("scheduler", "worker")


def step_figures(connector: dict[str, float], side: str) -> dict[str, float | None]:
    """Steps, p50, p99 and mean µs per step of one connector side (None: none recorded)."""
    prefix = f"step_us_{side}_le_"
    buckets = sorted(
        (float(key[len(prefix) :]), count)
        for key, count in connector.items()
        if key.startswith(prefix) and count > 0
    )
    steps = float(sum(count for _, count in buckets))
    out: dict[str, float | None] = {"steps": steps, "p50_us": None, "p99_us": None}
    out["mean_us"] = connector.get(f"step_us_{side}_sum", 0.0) / steps if steps else None
    for name, q in (("p50_us", 0.50), ("p99_us", 0.99)):
        rank, seen = max(1, math.ceil(q * steps)), 0.0
        for edge, count in buckets:
            seen += count
            if steps and seen >= rank:
                out[name] = edge
                break
    return out


def outputs_hash(outputs: list[Any]) -> str:
    return hashlib.sha256(json.dumps(outputs, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Samples:
    """One configuration's samples, pooled over repeats."""

    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    generate_s: float = 0.0
    prefill_window_s: float = 0.0
    engine_start_s: float = 0.0
    process_s: float = 0.0
    outputs: list[Any] = field(default_factory=list)
    connector: dict[str, float] = field(default_factory=dict)
    runs: int = 0

    def add_pass(
        self, requests: list[RequestResult], generate_s: float, *, sequential: bool
    ) -> None:
        ttfts = [r.ttft_s for r in requests]
        self.ttft += ttfts
        self.prompt_tokens += sum(r.prompt_tokens for r in requests)
        self.output_tokens += sum(len(r.output_token_ids) for r in requests)
        self.cached_tokens += sum(r.num_cached_tokens for r in requests)
        self.generate_s += generate_s
        self.prefill_window_s += sum(ttfts) if sequential else max(ttfts, default=0.0)
        self.outputs.append([r.output_token_ids for r in requests])
        self.runs += 1

    def add_connector(self, counters: dict[str, Any] | None) -> None:
        for key in (
            "hit_tokens",
            "blocks_loaded",
            "bytes_loaded",
            "load_seconds",
            "blocks_saved",
            "bytes_saved",
            "save_seconds",
            "failed_blocks",
            "save_dropped",
            "admission_skipped_blocks",
        ):
            value = (counters or {}).get(key)
            if isinstance(value, (int, float)):
                self.connector[key] = self.connector.get(key, 0) + value
        for key, value in (counters or {}).items():  # the per-step CPU histograms
            if key.startswith(("step_us_", "steps_")) and isinstance(value, (int, float)):
                self.connector[key] = self.connector.get(key, 0) + value

    def figures(self) -> dict[str, Any]:
        gen = self.generate_s
        conn = self.connector
        figures: dict[str, Any] = {
            "status": "ok",
            "requests": len(self.ttft),
            "ttft_p50_s": percentile(self.ttft, 50),
            "ttft_p99_s": percentile(self.ttft, 99),
            "ttft_mean_s": sum(self.ttft) / len(self.ttft) if self.ttft else 0.0,
            "ttft_max_s": max(self.ttft, default=0.0),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": ratio_of(self.cached_tokens, self.prompt_tokens),
            "connector_hit_rate": (
                ratio_of(conn["hit_tokens"], self.prompt_tokens) if "hit_tokens" in conn else None
            ),
            "generate_s": gen,
            "requests_per_s": ratio_of(len(self.ttft), gen),
            "output_tokens_per_s": ratio_of(self.output_tokens, gen),
            "total_tokens_per_s": ratio_of(self.prompt_tokens + self.output_tokens, gen),
            "prefill_window_s": self.prefill_window_s,
            "prefill_tokens_per_s": ratio_of(self.prompt_tokens, self.prefill_window_s),
            "engine_start_s": self.engine_start_s / max(1, self.runs),
            "process_s": self.process_s,
            "outputs_sha256": outputs_hash(self.outputs),
        }
        if conn:
            loaded, saved = conn.get("bytes_loaded", 0), conn.get("bytes_saved", 0)
            figures["connector"] = {
                **{k: v for k, v in conn.items() if not k.startswith(("step_us_", "steps_"))},
                "load_gbps": ratio_of(loaded / 1e9, conn.get("load_seconds")),
                "save_gbps": ratio_of(saved / 1e9, conn.get("save_seconds")),
            }
            # The connector's own CPU time per engine step (engine thread), by side.
            figures["connector_step_cpu"] = {side: step_figures(conn, side) for side in STEP_SIDES}
        return figures
