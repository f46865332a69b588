"""Admission's effect (`--admission N`): storing every block vs the Nth sighting, one run.

The workload is two waves of traffic. Each wave is the repeated prompts — the run's
`prefixes` shared prefixes, each with `suffixes` distinct suffixes (the prefix-repetition
shape) — mixed with as many one-off prompts (random, of the same length, seen once),
shuffled. Wave 2 keeps the prefixes and draws new suffixes and new one-offs: what repeats
across waves is the prefixes, as system prompts do.

Each setting — `connector.store_after_hits` 0 (store all, the default) and N — gets its
own private store and two fresh engine processes: `cold` runs wave 1 on the empty store,
`warm` runs wave 2 on what wave 1 left. A no-connector engine runs each wave once, the
outputs every connector run must equal.

Figures per setting and wave: vLLM's hit rate and the store's (the connector's loaded
tokens over prompt tokens), TTFT p50, blocks and bytes the connector wrote, the blocks its
admission kept from being saved (`admission_skipped_blocks`), and what the
store holds after the wave (`hf3fsctl stats --json`: keys, live bytes, admission_skipped;
these include each engine's untimed warm-up request, the connector's counts do not).
Ratios: N over store-all in the same run, for bytes written and the warm wave's hit rate.
Store-all is the hit-rate ceiling: wave 2's suffixes and one-offs are in no store, so
no admission can load more of wave 2 than storing everything does.

Contract: `admission_waves` is deterministic for a seed; `admission_document` is pure
(figures from the runs' samples; None where a run failed or gave no figure); a failed
run is recorded by `OfflineRuns` and the others still run. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hf3fsctl.bench.e2e.engines import clean_env, make_store
from hf3fsctl.bench.e2e.samples import Samples, ratio_of
from hf3fsctl.bench.e2e.settings import TOKEN_ID_LIMIT, E2ESettings, Workload

if TYPE_CHECKING:
    from hf3fsctl.vllm_tools.runner import EngineResult


class Runs(Protocol):
    """What this module needs of `offline.OfflineRuns` (which calls it: no import back)."""

    s: E2ESettings
    log: Callable[[str], None]
    samples: dict[str, Samples]
    failures: dict[str, str]
    admission_stores: dict[str, dict[str, int] | None]

    def engine(
        self, names: list[str], model: str, prompts: list[list[int]], kv: dict[str, Any] | None
    ) -> EngineResult | None: ...


STORE_ALL = 0  # connector.store_after_hits' default: every block is saved
WAVES = ("cold", "warm")  # wave 1 on an empty store, wave 2 on what wave 1 left


def run_name(after_hits: int, wave: str) -> str:
    """The samples' name of one setting's wave: `admission-0-cold`, `admission-2-warm`."""
    return f"admission-{after_hits}-{wave}"


def reference_name(wave: int) -> str:
    """The no-connector run of wave `wave` (1 or 2)."""
    return f"admission-none-{wave}"


def settings_compared(after_hits: int) -> tuple[int, int]:
    """The two `store_after_hits` of the comparison: store all, then N."""
    return (STORE_ALL, after_hits)


def admission_waves(
    workload: Workload, *, seed: int, vocab: int = TOKEN_ID_LIMIT
) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves of token-id prompts: repeated prefixes (new suffixes per wave) and one-offs.

    Each wave holds `workload.requests` repeated prompts and as many one-off prompts of
    `workload.prompt_tokens` tokens, shuffled; ids avoid 0-2 (bos/eos/pad of the tiny model).
    """
    rng = random.Random(f"admission-{seed}")
    top = max(4, min(vocab, TOKEN_ID_LIMIT))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, top) for _ in range(n)]

    prefixes = [tokens(workload.prefix_tokens) for _ in range(workload.prefixes)]
    waves = []
    for _ in range(2):
        prompts = [
            p + tokens(workload.suffix_tokens) for p in prefixes for _ in range(workload.suffixes)
        ]
        prompts += [tokens(workload.prompt_tokens) for _ in range(workload.requests)]
        rng.shuffle(prompts)
        waves.append(prompts)
    return waves[0], waves[1]


def store_figures(config_file: str) -> dict[str, int] | None:
    """What the store holds (`hf3fsctl stats --json`, summed over namespaces); None if it
    could not be read."""
    argv = [sys.executable, "-m", "hf3fsctl", "--config", config_file, "stats", "--json"]
    try:
        proc = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
        namespaces = json.loads(proc.stdout)["namespaces"] if proc.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return None
    if namespaces is None:
        return None
    return {
        key: sum(int(ns.get(key) or 0) for ns in namespaces)
        for key in ("keys", "bytes_live", "admission_skipped")
    }


def run_admission(runner: Runs, repeat: int, model: str, vocab: int, scratch: Path) -> None:
    """One repeat of the comparison: the references, then each setting's two waves.

    Samples go to `runner.samples` under `run_name` / `reference_name`; what each store
    holds after a wave to `runner.admission_stores[run_name]` (the last repeat's).
    """
    s = runner.s
    waves = admission_waves(s.workload, seed=s.seed + repeat, vocab=vocab)
    runner.log(
        f"admission: 2 waves of {len(waves[0])} prompts ({s.workload.requests} repeated, "
        f"{s.workload.requests} one-off), store_after_hits {STORE_ALL} vs {s.admission}"
    )
    for number, prompts in enumerate(waves, start=1):
        runner.engine([reference_name(number)], model, prompts, None)
    for after_hits in settings_compared(s.admission):
        store = make_store(scratch / f"admission-{after_hits}-{repeat}")
        kv = store["kv_transfer_config"]
        if after_hits != STORE_ALL:
            extra = {**kv["kv_connector_extra_config"], "connector.store_after_hits": after_hits}
            kv = {**kv, "kv_connector_extra_config": extra}
        for wave, prompts in zip(WAVES, waves, strict=True):
            name = run_name(after_hits, wave)
            if runner.engine([name], model, prompts, kv) is not None:
                runner.admission_stores[name] = store_figures(store["config_file"])


def _wave_figures(
    samples: Samples | None, reference: Samples | None, store: dict[str, int] | None
) -> dict[str, Any]:
    if samples is None:
        return {"status": "not run"}
    figures = samples.figures()
    conn = figures.get("connector", {})
    return {
        "status": "ok",
        "requests": figures["requests"],
        "prompt_tokens": figures["prompt_tokens"],
        "hit_rate": figures["hit_rate"],
        "store_hit_rate": figures["connector_hit_rate"],
        "ttft_p50_s": figures["ttft_p50_s"],
        "blocks_written": conn.get("blocks_saved", 0),
        "bytes_written": conn.get("bytes_saved", 0),
        "bytes_loaded": conn.get("bytes_loaded", 0),
        "blocks_skipped": conn.get("admission_skipped_blocks", 0),  # the engine's own count
        "store_after": store,
        "outputs_match_none": (
            None
            if reference is None
            else figures["outputs_sha256"] == reference.figures()["outputs_sha256"]
        ),
    }


def admission_document(settings: E2ESettings, runner: Runs) -> dict[str, Any]:
    """The JSON section `admission`: each setting's waves, totals and ratios to store-all."""
    references = [runner.samples.get(reference_name(n)) for n in (1, 2)]
    runs = []
    for after_hits in settings_compared(settings.admission):
        row: dict[str, Any] = {
            "store_after_hits": after_hits,
            "label": "store all"
            if after_hits == STORE_ALL
            else f"store when seen {after_hits} times",
        }
        for wave, reference in zip(WAVES, references, strict=True):
            name = run_name(after_hits, wave)
            if name in runner.failures:
                row[wave] = {"status": "failed", "error": runner.failures[name]}
            else:
                row[wave] = _wave_figures(
                    runner.samples.get(name), reference, runner.admission_stores.get(name)
                )
        row.update(admission_totals(row))
        runs.append(row)
    return summarize(settings.admission, settings.workload, runs)


def admission_totals(row: dict[str, Any]) -> dict[str, Any]:
    """Blocks and bytes written over both waves (None unless both waves ran)."""
    waves = [row.get(wave, {}) for wave in WAVES]
    if any(w.get("status") != "ok" for w in waves):
        return {"blocks_written": None, "bytes_written": None}
    return {
        "blocks_written": sum(w["blocks_written"] for w in waves),
        "bytes_written": sum(w["bytes_written"] for w in waves),
    }


def summarize(after_hits: int, workload: Workload, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The section: the workload, the runs, N's ratios to store-all, whether outputs held."""
    base, admitted = runs[0], runs[1]

    def warm(row: dict[str, Any], key: str) -> Any:
        return row["warm"].get(key) if row["warm"].get("status") == "ok" else None

    matches = [
        row[wave].get("outputs_match_none")
        for row in runs
        for wave in WAVES
        if row[wave].get("status") == "ok"
    ]
    return {
        "store_after_hits": after_hits,
        "workload": {
            "waves": len(WAVES),
            "repeated_prompts_per_wave": workload.requests,
            "one_off_prompts_per_wave": workload.requests,
            "prompt_tokens": workload.prompt_tokens,
            "shared_prefix_tokens": workload.prefix_tokens,
            "what_repeats": "the prefixes: wave 2 draws new suffixes and new one-off prompts",
        },
        "ceiling": "store all (store_after_hits 0) in the same run: wave 2's new suffixes "
        "and one-offs are in no store, so it loads the most of wave 2 any admission can",
        "runs": runs,
        "ratios": {
            "bytes_written_over_store_all": ratio_of(
                admitted["bytes_written"], base["bytes_written"]
            ),
            "cold_bytes_written_over_store_all": ratio_of(
                admitted["cold"].get("bytes_written"), base["cold"].get("bytes_written")
            ),
            "warm_hit_rate_over_store_all": ratio_of(
                warm(admitted, "hit_rate"), warm(base, "hit_rate")
            ),
            "warm_store_hit_rate_over_store_all": ratio_of(
                warm(admitted, "store_hit_rate"), warm(base, "store_hit_rate")
            ),
        },
        "outputs_identical": bool(matches) and all(m is True for m in matches),
    }
