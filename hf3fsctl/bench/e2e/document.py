"""The JSON document of a `bench e2e` run: settings, figures, and each figure's ratios.

Contract: every ratio is to a configuration measured in the same run (TTFT to `floor`,
throughput and hit rate to `none`, or the pair `REFERENCES` names); a configuration
whose outputs differ from `none`'s is flagged, never silently compared.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.bench.e2e.samples import ratio_of
from hf3fsctl.bench.e2e.settings import (
    GOAL_COLD_PREFILL,
    GOAL_COLD_PREFILL_FIXED,
    GOAL_STEP_US,
    GOAL_WARM_OVER_FLOOR,
    REFERENCES,
    E2ESettings,
)


def settings_dict(settings: E2ESettings) -> dict[str, Any]:
    data = asdict(settings)
    data["work_dir"] = str(settings.work_dir) if settings.work_dir else None
    data["peers"] = list(settings.peers)
    return data


def step_p50_us(entry: dict[str, Any]) -> float | None:
    """The connector's p50 CPU µs per step, scheduler's plus worker's (None: not ours)."""
    sides = entry.get("connector_step_cpu") or {}
    p50s = [side.get("p50_us") for side in sides.values()]
    return None if not p50s or None in p50s else float(sum(p50s))


def step_goal(configurations: dict[str, dict[str, Any]]) -> bool | None:
    """Whether every run of our connector costs at most `GOAL_STEP_US` per step (p50)."""
    ours = [step_p50_us(configurations.get(name, {})) for name in ("cold", "warm")]
    measured = [us for us in ours if us is not None]
    return None if not measured else max(measured) <= GOAL_STEP_US


def build_document(
    settings: E2ESettings,
    configurations: dict[str, dict[str, Any]],
    notes: list[str],
    engine_info: dict[str, Any],
) -> dict[str, Any]:
    """The JSON document: settings, figures, each figure's ratio to its ceiling, notes."""
    w = settings.workload
    base_hash = configurations.get("none", configurations.get("server", {})).get("outputs_sha256")
    for name, entry in configurations.items():
        if entry.get("status") != "ok":
            continue
        none_name, floor_name = REFERENCES.get(name, ("none", "floor"))
        none, floor = configurations.get(none_name, {}), configurations.get(floor_name, {})
        entry["reference"] = {"baseline": none_name, "floor": floor_name}
        entry["outputs_match_baseline"] = entry["outputs_sha256"] == none.get("outputs_sha256")
        entry["outputs_match_none"] = entry["outputs_sha256"] == base_hash
        entry["ratios"] = {
            "ttft_p50_over_floor": ratio_of(entry["ttft_p50_s"], floor.get("ttft_p50_s")),
            "ttft_p99_over_floor": ratio_of(entry["ttft_p99_s"], floor.get("ttft_p99_s")),
            "ttft_p50_over_baseline": ratio_of(entry["ttft_p50_s"], none.get("ttft_p50_s")),
            "prefill_tokens_per_s_over_baseline": ratio_of(
                entry["prefill_tokens_per_s"], none.get("prefill_tokens_per_s")
            ),
            "total_tokens_per_s_over_baseline": ratio_of(
                entry["total_tokens_per_s"], none.get("total_tokens_per_s")
            ),
            "hit_rate_over_floor": ratio_of(entry["hit_rate"], floor.get("hit_rate")),
        }

    def fig(name: str, key: str) -> Any:
        entry = configurations.get(name, {})
        return entry.get("ratios", {}).get(key) if entry.get("status") == "ok" else None

    def ttft(name: str) -> float | None:
        entry = configurations.get(name, {})
        return entry.get("ttft_p50_s") if entry.get("status") == "ok" else None

    if settings.url:
        ratios = {
            "first_ttft_p50_over_repeat": ratio_of(ttft("server"), ttft("server-repeat")),
        }
        goals: dict[str, bool | None] = {}
        ceiling = {
            "ttft": "server-repeat: the same prompts again, hitting the server's own prefix cache",
            "throughput": "server: the first pass",
            "ratio": "*_over_floor: divided by server-repeat's figure; *_over_baseline: by "
            "server's (the same run)",
        }
    else:
        cold_prefill = fig("cold", "prefill_tokens_per_s_over_baseline")
        ratios = {
            "warm_ttft_p50_over_floor": fig("warm", "ttft_p50_over_floor"),
            "warm_ttft_p99_over_floor": fig("warm", "ttft_p99_over_floor"),
            "warm_ttft_p50_over_none": fig("warm", "ttft_p50_over_baseline"),
            "warm_hit_rate_over_floor": fig("warm", "hit_rate_over_floor"),
            "cold_ttft_p50_over_none": fig("cold", "ttft_p50_over_baseline"),
            "cold_prefill_throughput_over_none": cold_prefill,
            "cold_total_throughput_over_none": fig("cold", "total_tokens_per_s_over_baseline"),
            "warm_dropped_ttft_p50_over_floor": fig("warm-dropped", "ttft_p50_over_floor"),
            "warm_async_ttft_p50_over_floor": fig("warm-async", "ttft_p50_over_floor"),
            "example_warm_ttft_p50_over_floor": fig("example-warm", "ttft_p50_over_floor"),
            "ours_warm_over_example_warm": ratio_of(ttft("warm"), ttft("example-warm")),
            "lmcache_warm_ttft_p50_over_floor_mp": fig("lmcache-warm", "ttft_p50_over_floor"),
            # Each against its own engine mode's floor: ours in-process, LMCache multiprocess.
            "ours_over_lmcache_warm_vs_floor": ratio_of(
                fig("warm", "ttft_p50_over_floor"), fig("lmcache-warm", "ttft_p50_over_floor")
            ),
        }
        warm_floor = fig("warm", "ttft_p50_over_floor")
        warm_example = ratios["ours_warm_over_example_warm"]
        goals = {
            "cold_prefill_within_10pct_of_none": (
                None if cold_prefill is None else cold_prefill >= GOAL_COLD_PREFILL
            ),
            "cold_prefill_at_least_95pct_of_none": (
                None if cold_prefill is None else cold_prefill >= GOAL_COLD_PREFILL_FIXED
            ),
            "warm_ttft_at_most_110pct_of_floor": (
                None if warm_floor is None else warm_floor <= GOAL_WARM_OVER_FLOOR
            ),
            "warm_ttft_at_most_example_warm": (
                None if warm_example is None else warm_example <= 1.0
            ),
            "connector_step_p50_at_most_50us": step_goal(configurations),
            "outputs_identical": all(
                e.get("outputs_match_none") for e in configurations.values() if "ratios" in e
            ),
        }
        ceiling = {
            "ttft": "floor: the same prompts hitting vLLM's own prefix cache in the same "
            "process (a second pass in one engine)",
            "throughput": "none: the same prompts with no connector",
            "hit_rate": "floor's hit rate (every full block but the one holding the last "
            "prompt token)",
            "ratio": "each configuration's *_over_floor is its figure divided by its floor's "
            "(floor, or floor-mp for LMCache), *_over_baseline by its no-connector run's "
            "(none, or none-mp), all measured in this run",
        }
    return {
        "benchmark": "e2e",
        "schema": report.SCHEMA,
        "machine": report.machine(),
        "mode": "url" if settings.url else "offline",
        "settings": settings_dict(settings),
        "workload": {
            "dataset": "prefix_repetition",
            **asdict(w),
            "requests_per_pass": w.requests,
            "arrival": "one at a time" if settings.sequential else "all at once (one batch)",
            "repeats": settings.repeats,
            "seed": settings.seed,
        },
        "engine": {
            "model": settings.model,
            "dtype": settings.dtype,
            "block_size": settings.block_size,
            "max_model_len": settings.max_model_len,
            "kv_cache_memory_bytes": settings.kv_cache_memory_bytes,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            **{f"reported_{k}": v for k, v in engine_info.items()},
        },
        "ceiling": ceiling,
        "configurations": configurations,
        "ratios": ratios,
        "goals": goals,
        "notes": notes,
    }
