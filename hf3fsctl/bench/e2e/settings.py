"""What a `bench e2e` run measures: the workload, the configurations, the settings.

Contract: `validate` refuses settings that cannot run with an `InvalidRequest` naming
the flag; `quick_settings` is `--quick`; `prefix_repetition_prompts` is deterministic
for a seed.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hf3fsctl.errors import InvalidRequest

MIB = 1 << 20


PEERS = ("example", "lmcache")


# `warm-async`: the load runs off-step and the first lookup never answers in-step.
ASYNC_LOAD = {"connector.load_mode": "async", "connector.lookup_wait_ms": 0}


# Every engine run reserves the same cores, with or without a connector (docs/vllm.md).
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


TOKEN_ID_LIMIT = 4096  # prompt ids stay below every model's vocabulary (the tiny one: 4096)


GOAL_COLD_PREFILL = 0.90  # cold prefill throughput at least 90% of no connector
# Issue 23's fixed-cost targets: cold prefill at least 95% of no connector, warm TTFT at
# most 1.10x the floor (and at most ExampleConnector's), and an engine step costs at most
# 50 µs of connector CPU time (p50 of the scheduler's plus the worker's).
GOAL_COLD_PREFILL_FIXED = 0.95
GOAL_WARM_OVER_FLOOR = 1.10
GOAL_STEP_US = 50.0


LABELS = {
    "none": "no connector",
    "floor": "floor: vLLM prefix cache, same process",
    "cold": "ours, cold store",
    "warm": "ours, warm: a fresh process",
    "warm-dropped": "ours, warm, page cache dropped",
    "warm-async": "ours, warm, async load",
    "example-cold": "ExampleConnector, cold",
    "example-warm": "ExampleConnector, warm",
    "none-mp": "no connector, multiprocess engine",
    "floor-mp": "floor, multiprocess engine",
    "lmcache-cold": "LMCache MP server, cold",
    "lmcache-warm": "LMCache MP server, warm: its DRAM tier",
    "server": "server, first pass",
    "server-repeat": "server, same prompts again",
}


# Which runs each configuration is measured against: (no-connector baseline, floor).
REFERENCES = {
    "lmcache-cold": ("none-mp", "floor-mp"),
    "lmcache-warm": ("none-mp", "floor-mp"),
    "floor-mp": ("none-mp", "floor-mp"),
    "server": ("server", "server-repeat"),
    "server-repeat": ("server", "server-repeat"),
}


@dataclass(frozen=True)
class Workload:
    """vLLM's prefix-repetition shape: `prefixes` × `suffixes` prompts."""

    prefixes: int = 4
    suffixes: int = 4
    prefix_tokens: int = 1024
    suffix_tokens: int = 128
    output_tokens: int = 16

    @property
    def requests(self) -> int:
        """Prompts per pass."""
        return self.prefixes * self.suffixes

    @property
    def prompt_tokens(self) -> int:
        """Tokens of one prompt."""
        return self.prefix_tokens + self.suffix_tokens


@dataclass(frozen=True)
class E2ESettings:
    """Everything `run` needs; `resolve` fills what was left unset."""

    workload: Workload = field(default_factory=Workload)
    model: str | None = None  # model directory (None: build SIZES["bench"] under work_dir)
    model_size: str = "bench"  # the tiny model built when `model` is None
    dtype: str = "float32"
    block_size: int = 128
    max_model_len: int | None = None  # None: the prompt, the output and a block of slack
    kv_cache_memory_bytes: int | None = None  # None: room for every prompt of a pass
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    warmup_tokens: int = 512
    peers: tuple[str, ...] = ()
    drop_page_cache: bool = False  # also run `warm-dropped`
    warm_async: bool = False  # also run `warm-async`
    admission: int = 0  # also compare store_after_hits N with storing all (`admission.py`)
    repeats: int = 1  # the whole set again on new prompts and new stores; samples pooled
    sequential: bool = False  # one request at a time (else one batch per pass)
    seed: int = 0
    timeout_s: float = 1800.0  # the whole benchmark
    url: str | None = None  # drive this running server instead of offline engines
    work_dir: Path | None = None  # model cache and the run's private stores
    keep: bool = False  # keep the run's stores
    quick: bool = False


def quick_settings(**overrides: Any) -> E2ESettings:
    """Settings of `--quick` (tiny model, 2×2 prompts of 512+64 tokens), then `overrides`."""
    quick = E2ESettings(
        workload=Workload(
            prefixes=2, suffixes=2, prefix_tokens=512, suffix_tokens=64, output_tokens=8
        ),
        model_size="tiny",
        block_size=32,
        warmup_tokens=64,
        quick=True,
    )
    return replace(quick, **overrides)


def default_work_dir() -> Path:
    """`$XDG_CACHE_HOME/hf3fsctl/bench-e2e` (else `~/.cache/...`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hf3fsctl" / "bench-e2e"


def prefix_repetition_prompts(
    workload: Workload, *, seed: int, vocab: int = TOKEN_ID_LIMIT
) -> list[list[int]]:
    """Token-id prompts: each of `prefixes` random prefixes with `suffixes` random suffixes.

    Shuffled (as vLLM's dataset does); ids avoid 0-2 (bos/eos/pad of the tiny model).
    """
    rng = random.Random(seed)
    top = max(4, min(vocab, TOKEN_ID_LIMIT))
    prompts = []
    for _ in range(workload.prefixes):
        prefix = [rng.randrange(3, top) for _ in range(workload.prefix_tokens)]
        for _ in range(workload.suffixes):
            prompts.append(prefix + [rng.randrange(3, top) for _ in range(workload.suffix_tokens)])
    rng.shuffle(prompts)
    return prompts


def validate(settings: E2ESettings) -> None:
    w = settings.workload
    if min(w.prefixes, w.suffixes, w.output_tokens) < 1:
        raise InvalidRequest("--prefixes, --suffixes and --output-tokens must be at least 1")
    if w.prefix_tokens < 1 or w.suffix_tokens < 0:
        raise InvalidRequest("--prefix-tokens must be at least 1, --suffix-tokens at least 0")
    if settings.block_size < 1 or settings.block_size % 32:
        raise InvalidRequest(
            f"--block-size {settings.block_size} is not a multiple of 32",
            hint="vLLM's CPU attention needs block sizes that are multiples of 32",
        )
    if settings.repeats < 1:
        raise InvalidRequest("--repeats must be at least 1")
    if settings.admission < 0 or settings.admission == 1:
        raise InvalidRequest(
            f"--admission {settings.admission}: must be 0 (not run) or at least 2",
            hint="store_after_hits 1 stores every block, as 0 does: compare with 2 or more",
        )
    if settings.timeout_s <= 0:
        raise InvalidRequest("--timeout must be positive")
    unknown = sorted(set(settings.peers) - set(PEERS))
    if unknown:
        raise InvalidRequest(f"unknown --peer {', '.join(unknown)}; choose from {PEERS}")
    offline_only = {
        "--peer": bool(settings.peers),
        "--warm-dropped": settings.drop_page_cache,
        "--warm-async": settings.warm_async,
        "--repeats": settings.repeats > 1,
        "--admission": settings.admission > 0,
    }
    given = [flag for flag, used in offline_only.items() if used]
    if settings.url and given:
        raise InvalidRequest(
            f"{', '.join(given)}: only with offline engines, not with --url",
            hint="a running server has its own connector; drop --url to compare configurations",
        )
