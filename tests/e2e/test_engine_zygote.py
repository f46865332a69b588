"""The engine zygote (`hf3fsctl.vllm_tools.zygote`): a run forked from it gives the same
greedy tokens as a fresh `python -m` process of the same spec, a run it must not take starts
fresh, and a session whose zygote is gone falls back to fresh starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hf3fsctl.vllm_tools import zygote
from hf3fsctl.vllm_tools.runner import EngineRun, child_env, run_engine, shared_prefix_prompts


def _spec(model: Path, **overrides: object) -> EngineRun:
    prompts = shared_prefix_prompts(2, 64, 16, seed=3)
    fields: dict[str, object] = {
        "model": str(model),
        "prompts": prompts,
        "max_tokens": 8,
        "kv_cache_memory_bytes": 64 << 20,
        "max_model_len": 1024,
        "warmup_tokens": 0,
    }
    return EngineRun(**(fields | overrides))  # type: ignore[arg-type]


@pytest.fixture()
def own_zygote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[zygote.Zygote]:
    """A zygote of this test only (the session's may be off or shared)."""
    started = zygote.Zygote.start(tmp_path / "zygote.sock", child_env())
    monkeypatch.setenv(zygote.ZYGOTE_ENV, str(started.path))
    yield started
    started.stop()


def test_forked_run_gives_the_fresh_run_tokens(
    tiny_model: Path, own_zygote: zygote.Zygote, monkeypatch: pytest.MonkeyPatch
) -> None:
    forked = run_engine(_spec(tiny_model))
    monkeypatch.delenv(zygote.ZYGOTE_ENV)
    fresh = run_engine(_spec(tiny_model))
    assert (forked.started, fresh.started) == ("forked", "fresh")
    assert forked.outputs == fresh.outputs
    assert all(len(out) == 8 for out in forked.outputs)
    assert [r.num_cached_tokens for r in forked.requests] == [
        r.num_cached_tokens for r in fresh.requests
    ]
    assert forked.engine_info == fresh.engine_info


def test_gone_zygote_falls_back_to_a_fresh_start(
    tiny_model: Path, own_zygote: zygote.Zygote
) -> None:
    own_zygote.stop()
    result = run_engine(_spec(tiny_model))
    assert result.started == "fresh"
    assert all(len(out) == 8 for out in result.outputs)


def test_runs_the_zygote_cannot_take_start_fresh() -> None:
    env = child_env()
    spec = {"tensor_parallel_size": 1, "engine_args": {}}
    assert zygote.eligible(env, env, spec)
    assert zygote.eligible(env | {"HF3FSCTL_NAMESPACE": "other"}, env, spec)  # read after fork
    assert not zygote.eligible(env, env, spec | {"tensor_parallel_size": 2})
    mp = {"distributed_executor_backend": "mp"}
    assert not zygote.eligible(env, env, spec | {"engine_args": mp})
    for name, value in [
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        ("PYTHONHASHSEED", "0"),
        ("OMP_NUM_THREADS", "1"),
        ("VLLM_CACHE_ROOT", "/elsewhere"),
    ]:
        assert not zygote.eligible(env | {name: value}, env, spec), name
