"""`hf3fsctl warm` runs its engine with the serving engines' args from the config's
`vllm:` section (real CLI, real vLLM, bf16 tiny Llama): its output names the args and
their source and the numerics it used, and a serving engine with those args then loads
the warmed pages and produces the greedy tokens of a no-connector run of the same args.
`vllm-config --serve-args` prints the same args for `vllm serve --config`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import BLOCK, RUN_TIMEOUT_S
from numerics_scenario import (
    DTYPE,
    NumericsStore,
    cli,
    cli_json,
    make_numerics_store,
    prompt_file,
)

from hf3fsctl.vllm_tools.runner import EngineResult, EngineRun, run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _serve(model: Path, prompts: list[str], kv: dict[str, Any] | None) -> EngineResult:
    """A serving engine with the config's args (eager, bf16, block 32: the runner's
    defaults are eager)."""
    return run_engine(
        EngineRun(
            model=str(model),
            prompts=prompts,
            max_tokens=8,
            block_size=BLOCK,
            dtype=DTYPE,
            kv_transfer_config=kv,
            kv_cache_memory_bytes=64 << 20,
            max_model_len=4096,
            warmup_tokens=0,
            timeout_s=RUN_TIMEOUT_S,
            engine_args={"enforce_eager": True},
        )
    )


@pytest.fixture(scope="module")
def warmed(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[NumericsStore, list[str], dict[str, Any]]:
    work = tmp_path_factory.mktemp("warm-serving-args")
    store = make_numerics_store(work)
    prompts = prompt_file(work / "prompts.txt", seed=3)
    _, document = cli_json(
        "warm",
        "--config",
        str(store.config_file),
        "--model",
        str(tiny_model),
        "--prompts",
        str(prompts),
    )
    return store, prompts.read_text().splitlines(), document


def test_warm_takes_the_config_vllm_section_and_says_so(
    warmed: tuple[NumericsStore, list[str], dict[str, Any]],
) -> None:
    _, _, document = warmed
    args = document["engine_args"]
    assert args["enforce_eager"] == {"value": True, "source": "config vllm:"}
    assert args["dtype"]["value"] == DTYPE
    numerics = document["result"]["numerics"]
    assert (numerics["enforce_eager"], numerics["compilation_mode"]) == ("true", "NONE")
    assert numerics["dtype"] == DTYPE and numerics["vllm"] and numerics["torch"]
    assert document["result"]["blocks_saved"] > 0


def test_a_serving_engine_with_those_args_loads_and_matches_no_connector(
    warmed: tuple[NumericsStore, list[str], dict[str, Any]], tiny_model: Path
) -> None:
    store, prompts, _ = warmed
    kv = json.loads(cli("vllm-config", "--config", str(store.config_file)).stdout)
    served = _serve(tiny_model, prompts, kv)
    baseline = _serve(tiny_model, prompts, None)
    assert served.outputs == baseline.outputs
    assert served.connector is not None and served.connector["blocks_loaded"] > 0


def test_vllm_config_serve_args_prints_the_same_args_with_the_connector(
    warmed: tuple[NumericsStore, list[str], dict[str, Any]],
) -> None:
    store, _, _ = warmed
    document = json.loads(
        cli("vllm-config", "--config", str(store.config_file), "--serve-args").stdout
    )
    assert (document["enforce-eager"], document["dtype"]) == (True, DTYPE)
    assert document["kv-transfer-config"]["kv_connector"] == "Hf3fsctlConnector"


def test_lookup_takes_the_same_config_args_and_finds_what_warm_wrote(
    warmed: tuple[NumericsStore, list[str], dict[str, Any]], tiny_model: Path
) -> None:
    store, prompts, _ = warmed
    prompts_file = store.config_file.parent / "lookup-prompts.txt"
    prompts_file.write_text("\n".join(prompts) + "\n")
    _, found = cli_json(
        "lookup",
        "--config",
        str(store.config_file),
        "--model",
        str(tiny_model),
        "--prompts",
        str(prompts_file),
    )
    assert found["namespace"] is not None
    # The config's vllm: section picks the namespace as it picked warm's (a store holding
    # namespaces of several dtypes is not tested here: one more engine run).
    assert found["totals"]["cached_tokens"] > 0
