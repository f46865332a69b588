"""One capacity for many models, and a store that fills — through real vLLM and the CLI.

A store created by `hf3fsctl init` with its defaults on a small tmpfs (a few MiB):
model A cold, A warm, model B, A again — each a fresh engine process — must complete
with the tokens of a run without the connector, the warm runs hit, and the store never
holds more than its capacity (neither by its own account nor on disk). A store whose
capacity is smaller than one run's pages serves the run with identical tokens and counted
save failures; after `hf3fsctl evict` saves succeed again. A capacity larger than the
file system (ENOSPC under the connector) costs saves, never a request.

Mounting a tmpfs needs root (CAP_SYS_ADMIN); where that is refused the tests skip with
the reason.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import BLOCK, DTYPE, RUN_TIMEOUT_S
from helpers.cli_runner import run_hf3fsctl

from hf3fsctl.storage.extents import disk_bytes
from hf3fsctl.vllm_tools.runner import EngineResult, EngineRun, run_engine, shared_prefix_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TMPFS_BYTES = 8 << 20  # the whole file system: page files, database, WAL
PAGE_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4  # tiny model: layers x K,V x heads x dim x block x fp32


def hf3fsctl(*args: str, as_json: bool = True) -> dict[str, Any]:
    """Run the real CLI as a fresh process (`helpers.cli_runner`: the CLI zygote's child);
    the JSON document it prints."""
    done = run_hf3fsctl(*args, *(["--json"] if as_json else []), timeout=120, check=True)
    document: dict[str, Any] = json.loads(done.stdout)
    return document


@contextmanager
def tmpfs(size: int) -> Iterator[Path]:
    """A fresh tmpfs of `size` bytes, unmounted afterwards (skips where not allowed)."""
    mountpoint = Path(tempfile.mkdtemp(prefix="hf3fsctl-tmpfs-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        mountpoint.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or 'not root'}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        mountpoint.rmdir()


@pytest.fixture(scope="module")
def models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny models of the same shape and different weights (different namespaces): A
    is the session's (seed 0, read-only here), B the same shape with seed 1."""
    from dataclasses import replace

    from hf3fsctl.vllm_tools.tiny_model import SIZES, build_tiny_model

    root = tmp_path_factory.mktemp("capacity-models")
    return {"A": tiny_model, "B": build_tiny_model(root / "b", replace(SIZES["tiny"], seed=1))}


PROMPTS = shared_prefix_prompts(2, 8 * BLOCK, 3 * BLOCK + 5, seed=11)  # 14 distinct blocks


@pytest.fixture(scope="module")
def run(models: dict[str, Path]) -> Callable[..., EngineResult]:
    def engine(model: str, kv_config: dict[str, Any] | None, **overrides: Any) -> EngineResult:
        spec: dict[str, Any] = {
            "model": str(models[model]),
            "prompts": PROMPTS,
            "max_tokens": 6,
            "block_size": BLOCK,
            "dtype": DTYPE,
            "kv_transfer_config": kv_config,
            "kv_cache_memory_bytes": 32 << 20,
            "max_model_len": 2048,
            "warmup_tokens": 0,
            "timeout_s": RUN_TIMEOUT_S,
        }
        return run_engine(EngineRun(**(spec | overrides)))

    return engine


@pytest.fixture(scope="module")
def baselines(run: Callable[..., EngineResult]) -> dict[str, list[list[int]]]:
    return {model: run(model, None).outputs for model in ("A", "B")}


def _init(root: Path, *args: str) -> tuple[Path, dict[str, Any]]:
    config = root.parent / f"{root.name}.yaml"
    hf3fsctl(
        "init", "--storage-path", str(root), "--create-path", "--write-config", str(config), *args
    )
    kv = hf3fsctl("vllm-config", "--config", str(config), as_json=False)
    return config, kv


def _held_on_disk(root: Path) -> int:
    return sum(disk_bytes(path) for path in root.glob("*/rank-*.pages"))


@pytest.fixture(scope="module")
def many_models(
    run: Callable[..., EngineResult], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[tuple[str, EngineResult, dict[str, Any], int]], dict[str, Any]]]:
    """A, A, B, A on one small store made by `init`'s defaults; stats after each run."""
    with tmpfs(TMPFS_BYTES) as mount:
        config, kv = _init(mount / "store")
        runs = []
        for model in ("A", "A", "B", "A"):
            result = run(model, kv)
            stats = hf3fsctl("stats", "--config", str(config))
            runs.append((model, result, stats, _held_on_disk(mount / "store")))
        yield runs, hf3fsctl("stats", "--config", str(config))


def test_every_run_on_a_shared_small_store_reproduces_the_baseline(
    many_models: tuple[list[Any], dict[str, Any]], baselines: dict[str, list[list[int]]]
) -> None:
    runs, _ = many_models
    assert [result.outputs == baselines[model] for model, result, _, _ in runs] == [True] * 4


def test_warm_runs_of_both_models_hit(many_models: tuple[list[Any], dict[str, Any]]) -> None:
    runs, _ = many_models
    hits = [result.connector["hit_tokens"] > 0 for _, result, _, _ in runs]
    assert hits == [False, True, False, True]


def test_the_store_never_holds_more_than_its_capacity(
    many_models: tuple[list[Any], dict[str, Any]],
) -> None:
    runs, final = many_models
    capacity = final["capacity_bytes"]
    assert 0 < capacity <= TMPFS_BYTES
    assert all(stats["bytes_used"] <= capacity for _, _, stats, _ in runs)
    assert all(disk <= capacity for _, _, _, disk in runs)


def test_the_default_capacity_keeps_both_models(
    many_models: tuple[list[Any], dict[str, Any]],
) -> None:
    _, final = many_models
    assert sorted(ns["keys"] > 0 for ns in final["namespaces"]) == [True, True]


# --- a store smaller than one run ------------------------------------------------------


@pytest.fixture(scope="module")
def overfull(
    run: Callable[..., EngineResult], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Capacity for 6 pages, a run needing 14; then `evict --all` and a run of B."""
    root = tmp_path_factory.mktemp("overfull") / "store"
    config, kv = _init(root, "--capacity", str(6 * 4096 * -(-PAGE_BYTES // 4096)))
    full = run("A", kv)
    after_full = hf3fsctl("stats", "--config", str(config))
    evicted = hf3fsctl("evict", "--all", "-y", "--config", str(config))
    again = run("B", kv)
    return {
        "full": full,
        "after_full": after_full,
        "evicted": evicted,
        "again": again,
        "final": hf3fsctl("stats", "--config", str(config)),
    }


def test_a_store_smaller_than_the_run_still_gives_the_baseline_tokens(
    overfull: dict[str, Any], baselines: dict[str, list[list[int]]]
) -> None:
    assert [overfull["full"].outputs, overfull["again"].outputs] == [
        baselines["A"],
        baselines["B"],
    ]


def test_saves_past_the_capacity_are_counted_as_no_space(overfull: dict[str, Any]) -> None:
    counters = overfull["full"].connector
    assert counters["failed_no_space"] > 0
    assert overfull["after_full"]["bytes_used"] <= overfull["after_full"]["capacity_bytes"]


def test_no_request_ends_in_error_when_the_store_is_full(overfull: dict[str, Any]) -> None:
    reasons = {r.finish_reason for r in overfull["full"].requests + overfull["again"].requests}
    assert "error" not in reasons


def test_saves_succeed_again_after_evict(overfull: dict[str, Any]) -> None:
    assert overfull["evicted"]["keys"] > 0
    assert overfull["again"].connector["blocks_saved"] > 0


# --- a capacity the file system cannot give (ENOSPC under the connector) --------------


@pytest.fixture(scope="module")
def enospc(
    run: Callable[..., EngineResult], baselines: dict[str, list[list[int]]]
) -> Iterator[tuple[EngineResult, dict[str, Any]]]:
    with tmpfs(1 << 20) as mount:  # 1 MiB: room for a few pages only
        config, kv = _init(mount / "store", "--capacity", "64MiB")
        result = run("A", kv)
        yield result, hf3fsctl("stats", "--config", str(config))


def test_a_full_file_system_costs_saves_not_requests(
    enospc: tuple[EngineResult, dict[str, Any]], baselines: dict[str, list[list[int]]]
) -> None:
    result, _ = enospc
    assert result.outputs == baselines["A"]
    assert result.connector["failed_no_space"] > 0
    assert "error" not in {r.finish_reason for r in result.requests}
