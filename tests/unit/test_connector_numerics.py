"""An engine's numerics (the writer record) and `connector.strict_numerics`: the hash
goes into every manifest, so engines with other numerics get other namespaces, and
the scheduler and the workers compute the same one (a pure function of the config)."""

from __future__ import annotations

from pathlib import Path

from helpers.connector_harness import make_kv_cache_config, make_vllm_config
from hf3fsctl_connector.namespace import build_manifests

from hf3fsctl.vllm_tools.numerics import (
    NUMERICS_FIELDS,
    engine_numerics,
    numerics_hash,
    strict_hash,
)


def test_numerics_name_every_setting_as_text(tiny_model_dir: Path, tmp_path: Path) -> None:
    numerics = engine_numerics(make_vllm_config(tiny_model_dir, tmp_path))
    assert tuple(numerics) == NUMERICS_FIELDS
    assert all(isinstance(v, str) for v in numerics.values())
    assert numerics["platform"] == "cpu" and numerics["dtype"] == "float32"


def test_a_changed_setting_is_another_writer(tiny_model_dir: Path, tmp_path: Path) -> None:
    numerics = engine_numerics(make_vllm_config(tiny_model_dir, tmp_path))
    eager = numerics | {"compilation_mode": "NONE", "enforce_eager": "true"}
    compiled = numerics | {"compilation_mode": "DYNAMO_TRACE_ONCE", "enforce_eager": "false"}
    assert numerics_hash(eager) != numerics_hash(compiled)
    assert strict_hash(eager) != strict_hash(compiled)
    # the attention backend is not in the strict hash: the scheduler cannot see it
    assert strict_hash(eager) == strict_hash(eager | {"attention_backend": "OTHER"})


def test_strict_numerics_give_another_namespace(tiny_model_dir: Path, tmp_path: Path) -> None:
    config, kv = make_vllm_config(tiny_model_dir, tmp_path), make_kv_cache_config()
    plain = build_manifests(config, kv)[0][1]
    strict = build_manifests(config, kv, numerics=strict_hash(engine_numerics(config)))[0][1]
    again = build_manifests(config, kv, numerics=strict_hash(engine_numerics(config)))[0][1]
    assert plain.namespace_id != strict.namespace_id == again.namespace_id
    assert "numerics" not in plain.extra
