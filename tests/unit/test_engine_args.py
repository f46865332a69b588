"""The serving engines' args for `warm`: config `vllm:` < `--engine-args-file` < flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf3fsctl.config import load_config
from hf3fsctl.errors import ConfigError
from hf3fsctl.offline.engine_args import (
    CONFIG_SOURCE,
    FLAG_SOURCE,
    engine_options,
    parse_engine_arg_pairs,
    resolve_engine_args,
)


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hf3fs.yaml"
    path.write_text(f"storage: {{path: {tmp_path}}}\n{text}")
    return path


def test_config_section_keeps_nested_args_and_takes_vllm_serve_spelling(tmp_path: Path) -> None:
    cfg = load_config(
        _config(tmp_path, "vllm:\n  enforce-eager: true\n  compilation_config: {mode: 3}\n")
    )
    assert cfg.vllm == {"enforce_eager": True, "compilation_config": {"mode": 3}}
    assert cfg.to_dict()["vllm"] == cfg.vllm


def test_config_section_that_is_not_a_mapping_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="vllm"):
        load_config(_config(tmp_path, "vllm: [enforce_eager]\n"))


def test_file_overrides_config_and_flags_override_both(tmp_path: Path) -> None:
    file = tmp_path / "serve.json"
    file.write_text(json.dumps({"dtype": "float16", "block-size": 64, "port": 8000}))
    args = resolve_engine_args(
        {"dtype": "bfloat16", "enforce_eager": True, "block_size": 32},
        file,
        {"dtype": None, "block_size": 128, **parse_engine_arg_pairs(["max-num-seqs=4"])},
    )
    assert args.values == {
        "dtype": "float16",
        "enforce_eager": True,
        "block_size": 128,
        "port": 8000,
        "max_num_seqs": 4,
    }
    assert args.sources["enforce_eager"] == CONFIG_SOURCE
    assert args.sources["dtype"] == "file serve.json"
    assert args.sources["block_size"] == FLAG_SOURCE
    assert list(args.shown())[:3] == ["dtype", "enforce_eager", "block_size"]


def test_engine_options_take_the_typed_args_and_pass_the_rest() -> None:
    args = resolve_engine_args(
        {"dtype": "bfloat16", "kv_cache_memory_bytes": "64MiB", "enforce_eager": True},
        None,
        {"tensor_parallel_size": 1, "model": "ignored"},
    )
    options = engine_options("m", args)
    assert (options.dtype, options.kv_cache_memory_bytes) == ("bfloat16", 64 << 20)
    assert options.engine_args == {"enforce_eager": True}
    assert options.llm_kwargs()["enforce_eager"] is True


def test_a_typed_arg_of_the_wrong_type_names_its_source() -> None:
    args = resolve_engine_args({"block_size": "big"}, None, {})
    with pytest.raises(ConfigError, match="config vllm:"):
        engine_options("m", args)


def test_an_unreadable_engine_args_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="engine-args-file"):
        resolve_engine_args({}, tmp_path / "missing.yaml", {})
