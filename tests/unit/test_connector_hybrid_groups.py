"""Hybrid KV cache groups: the hit every group can serve, and which groups start up.

`hf3fsctl.kv_groups.longest_hit` is driven against an in-memory store (a set of keys per
namespace); `connector.namespace.kv_groups` against vLLM's own spec classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hf3fsctl.errors import ConfigError
from hf3fsctl.kv_groups import CHUNKED, FULL, MAMBA, SLIDING, GroupPlan, longest_hit

BLOCK = 32
KEYS = [f"k{i:02d}" for i in range(20)]


class Store:
    """Committed keys per namespace; `lookup` counts leading keys present."""

    def __init__(self, **namespaces: set[int]) -> None:
        self.keys = {ns: {KEYS[i] for i in blocks} for ns, blocks in namespaces.items()}
        self.calls = 0

    def lookup(self, namespace: str, keys: Sequence[str]) -> int:
        self.calls += 1
        count = 0
        for key in keys:
            if key not in self.keys.get(namespace, set()):
                break
            count += 1
        return count


FULL_G = GroupPlan(0, FULL, "full")
SLIDING_G = GroupPlan(1, SLIDING, "swa", window_tokens=64)  # two blocks of 32
MAMBA_G = GroupPlan(2, MAMBA, "mamba")
CHUNKED_G = GroupPlan(3, CHUNKED, "local", window_tokens=128)  # chunks of four blocks


def test_full_attention_alone_is_the_stored_prefix_up_to_the_limit() -> None:
    store = Store(full=set(range(12)))
    assert longest_hit([FULL_G], KEYS, 20, BLOCK, store.lookup) == 12
    assert longest_hit([FULL_G], KEYS, 7, BLOCK, store.lookup) == 7


@pytest.mark.parametrize(
    ("plan", "hit", "expected"),
    [
        (FULL_G, 5, range(0, 5)),
        (SLIDING_G, 5, range(3, 5)),  # tokens 97..159 are in the window of token 160
        (SLIDING_G, 1, range(0, 1)),
        (MAMBA_G, 5, range(4, 5)),
        (MAMBA_G, 0, range(0)),
        (CHUNKED_G, 6, range(4, 6)),  # token 192 attends to tokens 128..191: blocks 4, 5
        (CHUNKED_G, 3, range(0, 3)),
        (CHUNKED_G, 8, range(8, 8)),  # token 256 starts a chunk: nothing before it
    ],
    ids=[
        "full",
        "sliding",
        "sliding-short",
        "mamba",
        "none",
        "chunked",
        "chunked-first",
        "chunked-boundary",
    ],
)
def test_each_kind_needs_what_vllm_keeps_for_the_next_token(
    plan: GroupPlan, hit: int, expected: range
) -> None:
    assert plan.needed(hit, BLOCK) == expected


def test_sliding_window_ignores_blocks_before_the_window() -> None:
    store = Store(full=set(range(10)), swa={6, 7, 8, 9})
    assert longest_hit([FULL_G, SLIDING_G], KEYS, 10, BLOCK, store.lookup) == 10


def test_a_missing_window_page_shortens_the_hit_for_every_group() -> None:
    store = Store(full=set(range(10)), swa=set(range(10)) - {8})
    # Hits 10 and 9 need block 8; hit 8 needs blocks 6 and 7.
    assert longest_hit([FULL_G, SLIDING_G], KEYS, 10, BLOCK, store.lookup) == 8


def test_mamba_needs_the_state_at_the_boundary_itself() -> None:
    store = Store(full=set(range(12)), mamba={3, 7})  # states after 4 and 8 blocks
    assert longest_hit([FULL_G, MAMBA_G], KEYS, 12, BLOCK, store.lookup) == 8


def test_no_common_boundary_is_a_miss() -> None:
    store = Store(full=set(range(12)), mamba={15})
    assert longest_hit([FULL_G, MAMBA_G], KEYS, 12, BLOCK, store.lookup) == 0


def test_a_missing_full_attention_page_bounds_the_other_groups() -> None:
    store = Store(full=set(range(5)), mamba={3, 7})
    assert longest_hit([FULL_G, MAMBA_G], KEYS, 12, BLOCK, store.lookup) == 4


def test_chunked_local_attention_needs_only_the_boundary_chunk() -> None:
    # Blocks 0..3 (the first chunk) were never stored; a hit of 6 needs blocks 4 and 5.
    store = Store(full=set(range(7)), local={4, 5, 6})
    assert longest_hit([FULL_G, CHUNKED_G], KEYS, 7, BLOCK, store.lookup) == 7
    store = Store(full=set(range(7)), local={5, 6})  # block 4 missing: hits 5..7 need it
    assert longest_hit([FULL_G, CHUNKED_G], KEYS, 7, BLOCK, store.lookup) == 4


def test_a_chunk_boundary_asks_the_chunked_group_nothing() -> None:
    store = Store(full=set(range(8)), local=set())
    assert longest_hit([FULL_G, CHUNKED_G], KEYS, 8, BLOCK, store.lookup) == 8
    assert store.calls == 1  # the full group's lookup only


def test_probes_bound_the_store_calls() -> None:
    store = Store(full=set(range(20)), mamba=set())
    assert longest_hit([FULL_G, MAMBA_G], KEYS, 20, BLOCK, store.lookup, probes=3) == 0
    assert store.calls == 1 + 3


def test_plan_comes_back_from_a_group_manifest() -> None:
    manifest = {"extra": {"group": "1", "group_kind": "sliding", "sliding_window": "64"}}
    assert GroupPlan.from_manifest(1, "swa", manifest) == SLIDING_G
    assert GroupPlan.from_manifest(0, "full", {"extra": {}}) == FULL_G
    chunked = {"extra": {"group_kind": "chunked", "sliding_window": "0", "attention_chunk": "128"}}
    assert GroupPlan.from_manifest(3, "local", chunked) == CHUNKED_G


# --- start-up: which groups the connector stores ---------------------------------------


def _config(*specs: object, eagle: bool = False) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [
        KVCacheGroupSpec([f"layer.{i}"], spec, is_eagle_group=eagle and i == len(specs) - 1)  # type: ignore[arg-type]
        for i, spec in enumerate(specs)
    ]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def _attention(kind: str, **extra: object) -> object:
    import torch
    from vllm.v1 import kv_cache_interface as kv

    cls = getattr(kv, kind)
    return cls(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32, **extra)


def test_full_sliding_and_chunked_groups_are_stored() -> None:
    from hf3fsctl_connector.namespace import kv_groups

    config = _config(
        _attention("SlidingWindowSpec", sliding_window=64),
        _attention("FullAttentionSpec"),
        _attention("ChunkedLocalAttentionSpec", attention_chunk_size=256),
    )
    groups = kv_groups(config)  # type: ignore[arg-type]
    assert [(g.index, g.kind, g.window_tokens) for g in groups] == [
        (0, SLIDING, 64),
        (1, FULL, 0),
        (2, CHUNKED, 256),
    ]


@pytest.mark.parametrize(
    ("spec", "eagle", "named"),
    [
        (("SinkFullAttentionSpec", {"sink_len": 4}), False, "SinkFullAttention"),
        (("FullAttentionSpec", {}), True, "EAGLE/MTP"),
    ],
    ids=["sink", "eagle"],
)
def test_unsupported_groups_fail_at_start_up_naming_what(
    spec: tuple[str, dict[str, object]], eagle: bool, named: str
) -> None:
    from hf3fsctl_connector.namespace import kv_groups

    config = _config(_attention("FullAttentionSpec"), _attention(spec[0], **spec[1]), eagle=eagle)
    with pytest.raises(ConfigError) as raised:
        kv_groups(config)  # type: ignore[arg-type]
    assert named in raised.value.message
    assert "\n" not in raised.value.message
