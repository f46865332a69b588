"""`hf3fsctl warm` and `hf3fsctl lookup` through the real CLI and real vLLM.

`warm` fills a store made by `init` from a text file and from a JSONL chat file; the
entries show in `stats`; a second `warm` starts no engine and says so; a later vLLM run
with the connector hits and reproduces the tokens of a run without it. `--dry-run`
predicts the blocks and bytes the real run writes. `lookup` reports, per prompt, exactly
the `num_cached_tokens` the next vLLM run shows — for fully cached, partly shared,
uncached and shorter-than-a-block prompts. A `warm` interrupted with SIGINT leaves only
valid entries (`doctor --checksums`) and a re-run completes the rest.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import BLOCK, DTYPE, RUN_TIMEOUT_S
from helpers.cli_runner import CLI_ZYGOTE_ENV, cli_env, run_hf3fsctl, zygote_can_run
from helpers.forked_child import ForkedChild

from hf3fsctl.config import load_config
from hf3fsctl.meta.client import connect
from hf3fsctl.vllm_tools.runner import EngineResult, EngineRun, run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Eager, like every engine `run_engine` starts: a store made by `init` has no `vllm:` args,
# so `warm` would run vLLM's default, a torch.compile'd engine, whose start costs 25-40 s
# on 2 cores (eager: ~7 s). test_verify's mixed store warms a compiled engine.
ENGINE_FLAGS = ["--dtype", DTYPE, "--block-size", str(BLOCK), "--kv-cache-memory", "64MiB"]
ENGINE_FLAGS += ["--engine-arg", "enforce_eager=true"]
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "sigma",
    "omega",
]


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(count))


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_hf3fsctl(*args, timeout=RUN_TIMEOUT_S, check=check)


def _start_cli(directory: Path, *args: str) -> subprocess.Popen[str] | ForkedChild:
    """`hf3fsctl ARGS` started, not waited for (a test signals it), with the environment
    `helpers.cli_runner` gives it: forked from the session's CLI zygote when it can take
    the command (vLLM imported already: ~10-15 s less on 2 cores), else `python -m`.
    Its output goes to `directory/stdout.txt` and `directory/stderr.log`."""
    directory.mkdir()
    env = cli_env(None, args)
    path = os.environ.get(CLI_ZYGOTE_ENV)
    if path and zygote_can_run(args, env):
        forked = ForkedChild.start(path, "hf3fsctl", list(args), env, directory)
        if forked is not None:
            return forked
    with (directory / "stdout.txt").open("w") as out, (directory / "stderr.log").open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "hf3fsctl", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            text=True,
        )


def cli_json(*args: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(cli(*args, "--json").stdout)
    return document


def engine(model: Path, prompts: list[str], kv: dict[str, Any] | None) -> EngineResult:
    return run_engine(
        EngineRun(
            model=str(model),
            prompts=prompts,
            max_tokens=4,
            block_size=BLOCK,
            dtype=DTYPE,
            kv_transfer_config=kv,
            kv_cache_memory_bytes=64 << 20,
            max_model_len=4096,
            warmup_tokens=0,
            timeout_s=RUN_TIMEOUT_S,
        )
    )


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    rng = random.Random(5)
    shared = words(rng, 150)
    return {
        "system": shared,
        "a": shared + " " + words(rng, 40),
        "b": shared + " " + words(rng, 30),
        "other": words(rng, 120),
        "short": "hello",
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("warm")
    config = root / "hf3fs.yaml"
    cli(
        "init",
        "--storage-path",
        str(root / "store"),
        "--create-path",
        "--write-config",
        str(config),
    )
    kv = json.loads(cli("vllm-config", "--config", str(config)).stdout)
    return config, kv


@pytest.fixture(scope="module")
def warmed(
    tiny_model: Path,
    store: tuple[Path, dict[str, Any]],
    texts: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """Dry run, then warm of a text file, a second warm, and a warm of a JSONL chat file."""
    config, _ = store
    work = tmp_path_factory.mktemp("warm-inputs")
    prompts = work / "prompts.txt"
    prompts.write_text(f"{texts['a']}\n\n{texts['b']}\n{texts['short']}\n")
    chats = work / "chats.jsonl"
    chats.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": texts["system"]},
                    {"role": "user", "content": "hi"},
                ]
            }
        )
        + "\n{not json\n"
        + json.dumps({"prompt": texts["other"]})
        + "\n"
    )
    common = ["--config", str(config), "--model", str(tiny_model), *ENGINE_FLAGS]
    dry = cli_json("warm", *common, "--prompts", str(prompts), "--dry-run")
    first = cli_json("warm", *common, "--prompts", str(prompts))
    stats = cli_json("stats", "--config", str(config))
    again = cli("warm", *common, "--prompts", str(prompts))
    chat = cli_json("warm", *common, "--prompts", str(chats))
    return {"dry": dry, "first": first, "stats": stats, "again": again, "chat": chat}


def test_warm_writes_entries_that_stats_shows(warmed: dict[str, Any]) -> None:
    (namespace,) = warmed["stats"]["namespaces"]
    assert namespace["keys"] == warmed["first"]["result"]["blocks_saved"] > 0


def test_dry_run_predicts_the_blocks_and_bytes_the_warm_writes(warmed: dict[str, Any]) -> None:
    plan, result = warmed["dry"]["plan"], warmed["first"]["result"]
    assert (plan["new_blocks"], plan["new_bytes"]) == (
        result["blocks_saved"],
        result["bytes_saved"],
    )
    assert warmed["dry"]["plan"]["fits"] is True and warmed["dry"].get("result") is None


def test_a_prompt_shorter_than_a_block_is_skipped(warmed: dict[str, Any]) -> None:
    assert warmed["first"]["plan"]["shorter_than_a_block"] == 1
    assert warmed["first"]["result"]["prompts"] == 2


def test_a_second_warm_starts_no_engine_and_says_so(warmed: dict[str, Any]) -> None:
    out = warmed["again"].stdout
    assert "nothing to do" in out and "no engine started" in out


def test_a_malformed_jsonl_line_is_reported_with_file_and_line(warmed: dict[str, Any]) -> None:
    (problem,) = warmed["chat"]["plan"]["malformed"]
    assert problem["origin"].endswith("chats.jsonl:2")
    assert warmed["chat"]["result"]["prompts"] == 2


def test_vllm_after_warm_hits_and_reproduces_the_tokens(
    tiny_model: Path, store: tuple[Path, dict[str, Any]], texts: dict[str, str], warmed: Any
) -> None:
    _, kv = store
    prompts = [texts["a"], texts["b"]]
    baseline = engine(tiny_model, prompts, None)
    warm = engine(tiny_model, prompts, kv)
    assert warm.outputs == baseline.outputs
    assert warm.connector is not None and warm.connector["hit_tokens"] > 0


def test_lookup_reports_what_the_next_vllm_run_loads(
    tiny_model: Path, store: tuple[Path, dict[str, Any]], texts: dict[str, str], warmed: Any
) -> None:
    config, kv = store
    rng = random.Random(9)
    prompts = [
        texts["a"],  # fully cached
        texts["system"] + " " + words(rng, 25),  # shares the cached prefix
        words(rng, 90),  # uncached
        texts["short"],  # shorter than a block
    ]
    args = ["lookup", "--config", str(config), "--model", str(tiny_model), "--dtype", DTYPE]
    for prompt in prompts:
        args += ["--prompt", prompt]
    looked = cli_json(*args)
    run = engine(tiny_model, prompts, kv)
    reported = [p["cached_tokens"] for p in looked["prompts"]]
    assert reported == [r.num_cached_tokens for r in run.requests]
    assert reported[0] > reported[1] > 0 and reported[2:] == [0, 0]


def test_warm_interrupted_leaves_valid_entries_and_a_rerun_completes(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "hf3fs.yaml"
    cli(
        "init",
        "--storage-path",
        str(tmp_path / "store"),
        "--create-path",
        "--write-config",
        str(config),
    )
    rng = random.Random(3)
    prompts = tmp_path / "many.txt"
    # 20 prompts: the interrupt lands after 1-2 of them (2 of 60 measured), and the re-run
    # prefills every prompt left, the bulk of this test's time.
    prompts.write_text("\n".join(words(rng, 700) for _ in range(20)) + "\n")
    common = ["--config", str(config), "--model", str(tiny_model), *ENGINE_FLAGS]
    child = _start_cli(tmp_path / "warm", "warm", *common, "--prompts", str(prompts), "--json")
    # The store is polled in this process (a read-only SQLite store, no CLI start-up per
    # poll), so the interrupt lands within ~0.1 s of the first committed key, well before
    # the warm ends even on a loaded machine.
    store = connect(load_config(config), read_only=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and child.poll() is None:
            if any(ns.keys > 0 for ns in store.stats().namespaces):
                break
            time.sleep(0.1)
        assert child.poll() is None, "warm ended before it could be interrupted"
        child.send_signal(signal.SIGINT)
        child.wait(timeout=RUN_TIMEOUT_S)
    finally:
        store.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    out = (tmp_path / "warm" / "stdout.txt").read_text()
    err = (tmp_path / "warm" / "stderr.log").read_text(errors="replace")
    assert child.returncode == 130, err[-3000:]
    interrupted = json.loads(out)
    assert interrupted["interrupted"] is True
    doctor = cli_json("doctor", "--config", str(config), "--checksums", "--all-pages")
    assert [c for c in doctor["checks"] if c["status"] == "fail"] == []
    rerun = cli_json("warm", *common, "--prompts", str(prompts))
    done = interrupted["plan"]["to_warm"] - rerun["plan"]["to_warm"]
    result = rerun["result"]
    assert (
        done > 0 and result["prompts"] + result["skipped_after_start"] == rerun["plan"]["to_warm"]
    )
    final = cli_json("warm", *common, "--prompts", str(prompts))
    assert final["result"] is None and final["plan"]["to_warm"] == 0
    assert os.path.exists(config)
