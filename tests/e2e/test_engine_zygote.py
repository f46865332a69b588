"""The engine zygote (`hf3fsctl.vllm_tools.zygote`): a run forked from it gives the same
greedy tokens as a fresh `python -m` process of the same spec, a run it must not take starts
fresh, and a session whose zygote is gone falls back to fresh starts. The CLI zygote
(`helpers.cli_runner`) gives a command the exit status, stdout and stderr of a fresh
`python -m hf3fsctl`, `warm` included (vLLM imported before the command configured it),
and a command it must not take runs fresh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import BLOCK, DTYPE, RUN_TIMEOUT_S
from helpers.cli_runner import CLI_ZYGOTE_ENV, cli_env, run_hf3fsctl, zygote_can_run

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


@pytest.fixture(scope="module")
def forked_then_gone(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One spec run twice: forked from a zygote (the session's, else one of this module),
    then with `ENGINE_ZYGOTE_SOCKET` naming a zygote that was started and stopped (gone),
    where `run_engine` must fall back to a fresh `python -m` start. The fresh run is both
    tests' (one `python -m` start costs ~10-15 s of vLLM import on 2 cores)."""
    tmp = tmp_path_factory.mktemp("zygote-runs")
    with pytest.MonkeyPatch.context() as patch:
        own = None
        if not os.environ.get(zygote.ZYGOTE_ENV):
            own = zygote.Zygote.start(tmp / "zygote.sock", child_env())
            patch.setenv(zygote.ZYGOTE_ENV, str(own.path))
        try:
            forked = run_engine(_spec(tiny_model))
        finally:
            if own is not None:
                own.stop()
        gone = zygote.Zygote.start(tmp / "gone.sock", child_env())
        gone.stop()
        assert gone.path.exists(), "a gone zygote leaves its socket behind"
        patch.setenv(zygote.ZYGOTE_ENV, str(gone.path))
        fresh = run_engine(_spec(tiny_model))
    return {"forked": forked, "fresh": fresh}


def test_forked_run_gives_the_fresh_run_tokens(forked_then_gone: dict[str, Any]) -> None:
    forked, fresh = forked_then_gone["forked"], forked_then_gone["fresh"]
    assert (forked.started, fresh.started) == ("forked", "fresh")
    assert forked.outputs == fresh.outputs
    assert all(len(out) == 8 for out in forked.outputs)
    assert [r.num_cached_tokens for r in forked.requests] == [
        r.num_cached_tokens for r in fresh.requests
    ]
    assert forked.engine_info == fresh.engine_info


def test_gone_zygote_falls_back_to_a_fresh_start(forked_then_gone: dict[str, Any]) -> None:
    result = forked_then_gone["fresh"]
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


# --- the CLI zygote --------------------------------------------------------------------


@pytest.fixture()
def own_cli_zygote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[zygote.Zygote]:
    """A CLI zygote of this test only."""
    started = zygote.Zygote.start(tmp_path / "cli.sock", cli_env())
    monkeypatch.setenv(CLI_ZYGOTE_ENV, str(started.path))
    yield started
    started.stop()


@pytest.fixture()
def cli_zygote(tmp_path: Path) -> Iterator[str]:
    """The session's CLI zygote (tests/conftest.py), or one of this test when it is off."""
    if os.environ.get(CLI_ZYGOTE_ENV):
        yield os.environ[CLI_ZYGOTE_ENV]
        return
    started = zygote.Zygote.start(tmp_path / "cli.sock", cli_env())
    yield str(started.path)
    started.stop()


def _both(
    path: str, args: list[str], tmp: Path
) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """`hf3fsctl ARGS` forked from the zygote at `path`, then in a fresh `python -m hf3fsctl`."""
    env = cli_env()
    (tmp / "forked").mkdir(exist_ok=True)
    forked = zygote.run_forked(path, args, env, tmp / "forked", RUN_TIMEOUT_S, module="hf3fsctl")
    assert forked is not None, "the CLI zygote did not take the command"
    fresh = subprocess.run(
        [sys.executable, "-m", "hf3fsctl", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    return forked, (fresh.returncode, fresh.stdout, fresh.stderr)


def test_a_forked_cli_command_exits_and_prints_as_a_fresh_one(
    cli_zygote: str, tmp_path: Path
) -> None:
    config = tmp_path / "hf3fs.yaml"
    for args in (
        ["--version"],
        ["stats", "--config", str(config), "--json"],  # no config yet: an error exit
        ["vllm-config", "--no-such-option"],  # a usage error from Typer
    ):
        forked, fresh = _both(cli_zygote, args, tmp_path)
        assert forked == fresh, args
    assert forked[0] == 2 and "--no-such-option" in forked[2]
    init = ["init", "--storage-path", str(tmp_path / "store"), "--create-path"]
    run_hf3fsctl(*init, "--write-config", str(config), check=True)
    for args in (["vllm-config", "--config", str(config)], ["ls", "--config", str(config)]):
        forked, fresh = _both(cli_zygote, args, tmp_path)
        assert forked == fresh and forked[0] == 0, args


def test_a_forked_warm_prints_one_json_document_and_saves_as_a_fresh_one(
    cli_zygote: str, tiny_model: Path, tmp_path: Path
) -> None:
    """vLLM was imported by the zygote before `warm` set its logging: it must still log to
    stderr, not into the JSON document on stdout."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(f"word{i}" for i in range(300)) + "\n")
    results: list[tuple[int, dict[str, Any]]] = []
    for name in ("forked", "fresh"):
        config = tmp_path / f"{name}.yaml"
        init = ["init", "--storage-path", str(tmp_path / name), "--create-path"]
        run_hf3fsctl(*init, "--write-config", str(config), check=True)
        args = ["warm", "--config", str(config), "--model", str(tiny_model)]
        args += ["--prompts", str(prompts), "--dtype", DTYPE, "--block-size", str(BLOCK)]
        args += ["--kv-cache-memory", "64MiB", "--json"]
        # Eager: a compiled engine start (vLLM's default) costs 25-40 s more per warm on 2
        # cores; test_verify's mixed store warms a compiled engine through the CLI zygote.
        args += ["--engine-arg", "enforce_eager=true"]
        if name == "forked":
            done = zygote.run_forked(
                cli_zygote, args, cli_env(), tmp_path, RUN_TIMEOUT_S, module="hf3fsctl"
            )
            assert done is not None
            code, stdout = done[0], done[1]
        else:
            proc = subprocess.run(
                [sys.executable, "-m", "hf3fsctl", *args],
                env=cli_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
            )
            code, stdout = proc.returncode, proc.stdout
        results.append((code, json.loads(stdout)))  # exactly one document
    (forked_code, forked), (fresh_code, fresh) = results
    assert (forked_code, fresh_code) == (0, 0)
    assert forked["plan"]["new_blocks"] == fresh["plan"]["new_blocks"] > 0
    for key in ("prompts", "blocks_saved", "bytes_saved"):
        assert forked["result"][key] == fresh["result"][key], key


def test_cli_commands_the_zygote_cannot_take_run_fresh(
    own_cli_zygote: zygote.Zygote, tmp_path: Path
) -> None:
    env = cli_env()
    assert zygote_can_run(("stats",), env)
    assert zygote_can_run(("stats",), env | {"HF3FSCTL_NAMESPACE": "other"})  # read later
    assert not zygote_can_run(("stats",), env | {"OMP_NUM_THREADS": "1"})
    assert not zygote_can_run(("stats",), env | {"VLLM_LOGGING_STREAM": "ext://sys.stdout"})
    for tp in (
        ("-tp", "2"),
        ("--tensor-parallel-size", "2"),
        ("--engine-arg", "tensor_parallel_size=2"),
    ):
        assert not zygote_can_run(("warm", *tp), env), tp
    assert zygote_can_run(("warm", "-tp", "1"), env)
    bench = ("bench", "e2e", "--quick")  # its engines: run_engine, the engine zygote's
    assert not zygote_can_run(bench, cli_env(args=bench))
    assert zygote.eligible(child_env(cli_env(args=bench)), child_env(), {})
    own_cli_zygote.stop()  # gone: the helper starts a fresh process
    done = run_hf3fsctl("--version", check=True)
    assert done.stdout.strip()
