"""Page geometry: vLLM's KV cache tensors as byte segments, checked against reality.

Contract: `KVCacheGeometry.from_vllm(kv_cache_config)` copies what the worker side needs
of vLLM's `KVCacheConfig` into plain data (so the worker side imports no vLLM and can be
driven without it), and `kv_segments(kv_caches, geometry)` turns its tensor placements
(offset, layer_stride, block_stride, layers; `KVCacheConfig.kv_cache_tensors`) into
`hf3fsctl.staging.KVSegment`s over the real backing allocations handed to
`register_kv_caches`, and verifies every claim against the tensors: each layer's view
starts at `offset + l*layer_stride` of its allocation, steps `block_stride` bytes per
block, spans no more than `page_size_bytes` inside a block, and every layer of the
stored group appears exactly once. Any mismatch is a `ConfigError` at start-up — pages
are never read back through a geometry we only assumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf3fsctl.errors import ConfigError
from hf3fsctl.kv_groups import FULL
from hf3fsctl.staging import KVSegment

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class TensorPlacement:
    """Where a set of same-shaped layers sits in one backing allocation (`KVCacheTensor`)."""

    layers: tuple[str, ...]  # layer names, in layer order
    offset: int  # byte offset of layers[0]'s block 0
    layer_stride: int  # bytes between the same block of consecutive layers
    block_stride: int  # bytes between consecutive blocks of one layer


@dataclass(frozen=True)
class KVCacheGeometry:
    """The stored KV cache group as plain data: what the worker side reads of vLLM's config."""

    num_blocks: int  # blocks per layer
    page_size_bytes: int  # stored bytes of one block of one layer (a Mamba state: unpadded)
    layer_names: tuple[str, ...]  # the layers of the stored group
    tensors: tuple[TensorPlacement, ...]  # the group's layers of each allocation, in order
    # FULL, SLIDING or MAMBA (`hf3fsctl.kv_groups`): whether a block vLLM still holds for a
    # request keeps its bytes (full attention) or may be freed or rewritten in place
    kind: str = FULL

    @classmethod
    def from_vllm(cls, kv_cache_config: KVCacheConfig, group: int | None = None) -> KVCacheGeometry:
        """The geometry of one stored group (`group`: its index; None: the only one).

        Layers of other groups may share a backing allocation with this group's (vLLM's
        hybrid manager gives every group its own block ids in one pool): only this
        group's layers are kept of each tensor.

        Raises:
            ConfigError: the groups cannot be stored (`namespace.kv_groups`), or `group`
                is None for a model with several stored groups.
        """
        from .namespace import kv_group, kv_groups

        if group is None:
            stored = kv_group(kv_cache_config)
        else:
            stored = next(g for g in kv_groups(kv_cache_config) if g.index == group)
        wanted = set(stored.layer_names)
        tensors = []
        for t in kv_cache_config.kv_cache_tensors:
            layers = [name for name in t.layers if name in wanted]
            if not layers:
                continue
            first = list(t.layers).index(layers[0])
            if layers != list(t.layers)[first : first + len(layers)]:
                raise ConfigError(
                    f"a KV cache tensor interleaves layers of group {stored.index} with "
                    f"others: {list(t.layers)}; non-uniform layouts are not supported"
                )
            tensors.append(
                TensorPlacement(
                    tuple(layers),
                    int(t.offset) + first * int(t.layer_stride),
                    int(t.layer_stride),
                    int(t.block_stride),
                )
            )
        return cls(
            num_blocks=int(kv_cache_config.num_blocks),
            page_size_bytes=stored.page_size_bytes,
            layer_names=stored.layer_names,
            tensors=tuple(tensors),
            kind=stored.kind,
        )


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage behind `tensor` (no copy)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _block_extent_bytes(view: torch.Tensor) -> int:
    """Bytes spanned by one block of a `[num_blocks, ...]` view (strides may be anything)."""
    span = 1 + sum(
        (size - 1) * stride for size, stride in zip(view.shape[1:], view.stride()[1:], strict=True)
    )
    return span * view.element_size()


def kv_segments(kv_caches: dict[str, torch.Tensor], geometry: KVCacheGeometry) -> list[KVSegment]:
    """The KV cache as byte segments, in the order their ranges make up a stored page.

    Args:
        kv_caches: `register_kv_caches`'s argument, `{layer_name: view}`.
        geometry: the engine's KV cache geometry (`KVCacheGeometry.from_vllm`).

    Raises:
        ConfigError: the tensors do not match the configured geometry, or the layout is
            one this connector cannot describe as byte ranges.
    """
    page = geometry.page_size_bytes
    wanted = set(geometry.layer_names)
    seen: list[str] = []
    segments: list[KVSegment] = []
    for tensor_spec in geometry.tensors:
        layers = [name for name in tensor_spec.layers if name in wanted]
        if not layers:
            continue
        if layers != list(tensor_spec.layers):
            raise ConfigError(
                "a KV cache tensor mixes stored and unstored layers: "
                f"{list(tensor_spec.layers)}; non-uniform layouts are not supported"
            )
        missing = [name for name in layers if name not in kv_caches]
        if missing:
            raise ConfigError(f"register_kv_caches got no tensor for layers {missing}")
        first = kv_caches[layers[0]]
        base = _byte_view(first)
        base_ptr = first.untyped_storage().data_ptr()
        num_blocks = int(first.shape[0])
        if num_blocks != geometry.num_blocks:
            raise ConfigError(
                f"KV tensor of {layers[0]} has {num_blocks} blocks, the config "
                f"{geometry.num_blocks}"
            )
        for index, name in enumerate(layers):
            view = kv_caches[name]
            where = view.data_ptr() - base_ptr
            expected = tensor_spec.offset + index * tensor_spec.layer_stride
            if view.untyped_storage().data_ptr() != base_ptr or where != expected:
                raise ConfigError(
                    f"layer {name} starts at byte {where} of its allocation, but "
                    f"kv_cache_tensors says {expected}: unknown KV cache layout"
                )
            block_stride = view.stride(0) * view.element_size()
            if int(view.shape[0]) != num_blocks or block_stride != tensor_spec.block_stride:
                raise ConfigError(
                    f"layer {name}: {view.shape[0]} blocks every {block_stride} bytes, "
                    f"config says {num_blocks} every {tensor_spec.block_stride}"
                )
            if _block_extent_bytes(view) > page:
                raise ConfigError(
                    f"layer {name}: one block spans {_block_extent_bytes(view)} bytes, more "
                    f"than page_size_bytes={page}: unknown KV cache layout"
                )
        segment = KVSegment(
            buffer=base,
            offset=int(tensor_spec.offset),
            layer_stride=int(tensor_spec.layer_stride),
            block_stride=int(tensor_spec.block_stride),
            num_layers=len(layers),
            num_blocks=num_blocks,
            page_size=page,
        )
        try:
            segment.check()
        except ValueError as exc:
            raise ConfigError(f"KV cache geometry is not usable: {exc}") from None
        segments.append(segment)
        seen.extend(layers)
    if sorted(seen) != sorted(wanted):
        raise ConfigError(
            f"kv_cache_tensors cover layers {sorted(seen)}, the KV group has {sorted(wanted)}"
        )
    return segments
