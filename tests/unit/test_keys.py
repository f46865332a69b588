"""Keys: namespace ids separate what must not mix; block hashes match vLLM's own."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.meta_builders import make_manifest

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.keys import (
    NamespaceManifest,
    block_hashes,
    block_keys,
    check_key,
    check_namespace_id,
    model_revision,
    none_hash,
)


def _manifest(**changes: object) -> NamespaceManifest:
    defaults: dict[str, object] = {
        "model": "tiny",
        "revision": "r1",
        "kv_dtype": "float32",
        "block_size": 32,
        "page_bytes": 65536,
        "none_hash": none_hash().hex(),
    }
    return make_manifest(**(defaults | changes))


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"revision": "r2"},
        {"kv_dtype": "bfloat16"},
        {"block_size": 64},
        {"layout": "LBNHC"},
        {"tp_size": 2},
        {"page_bytes": 131072},
        {"hash_algorithm": "sha256_cbor"},
        {"none_hash": "00"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_namespace_id_changes_with_every_field(change: dict[str, object]) -> None:
    assert _manifest().namespace_id != _manifest(**change).namespace_id


def test_namespace_id_is_stable_and_valid() -> None:
    manifest = _manifest()
    assert manifest.namespace_id == _manifest().namespace_id
    assert check_namespace_id(manifest.namespace_id) == manifest.namespace_id
    assert NamespaceManifest.from_dict(manifest.to_dict()) == manifest


def test_manifest_with_unknown_field_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="unknown"):
        NamespaceManifest.from_dict({**_manifest().to_dict(), "surprise": 1})


@pytest.mark.parametrize("bad", ["", "XYZ", "ab" * 100, "g" * 32, "../etc"], ids=str)
def test_malformed_keys_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        check_key(bad)


def test_block_hashes_cover_only_full_blocks() -> None:
    assert len(block_hashes(list(range(100)), 32)) == 3
    assert block_hashes(list(range(31)), 32) == []


def test_block_hashes_are_a_chain() -> None:
    tokens = list(range(96))
    changed = [*tokens[:40], 999, *tokens[41:]]
    a, b = block_hashes(tokens, 32), block_hashes(changed, 32)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_extra_keys_change_the_hash() -> None:
    tokens = list(range(64))
    salted = block_hashes(tokens, 32, extra_keys=[("salt",), None])
    assert salted[0] != block_hashes(tokens, 32)[0]


def test_block_hashes_match_installed_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256

    kv_cache_utils.init_none_hash(sha256)
    tokens = [(i * 7919) % 4096 for i in range(1000)]
    expected, parent = [], None
    for i in range(len(tokens) // 64):
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, tokens[i * 64 : (i + 1) * 64])
        expected.append(bytes(parent))
    assert block_hashes(tokens, 64) == expected
    assert block_keys(expected) == [h.hex() for h in expected]


def test_model_revision_of_local_dir_tracks_weight_bytes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(3 << 20))
    first = model_revision(tmp_path)
    assert model_revision(tmp_path) == first
    data = bytearray(weights.read_bytes())
    data[-10] = 1  # same size, last chunk changed
    weights.write_bytes(bytes(data))
    assert model_revision(tmp_path) != first


def test_model_revision_of_hub_id_is_the_given_revision() -> None:
    assert model_revision("org/model-that-is-not-a-dir", "abc123") == "abc123"
