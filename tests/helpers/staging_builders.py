"""Builders for the staging-kernel tests: KV segments of chosen geometry, the compiled ops.

`build_compiled_ops` compiles hf3fsctl/ops/csrc/ into a test directory (or reuses a library already
loaded in this process, or already built there) and returns the devices it supports;
`session_ops_dir` is the directory every module of a session shares, so the CPU op is
compiled once per session.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf3fsctl.staging import KVSegment, _CompiledOps, load_compiled_ops

REPO = Path(__file__).resolve().parents[2]

GEOMETRY_FIELDS = (
    "offset",
    "layer_stride",
    "block_stride",
    "num_layers",
    "num_blocks",
    "page_size",
)


def make_segment(
    num_layers: int,
    num_blocks: int,
    page: int,
    layout: str,
    *,
    offset: int = 0,
    device: str = "cpu",
    seed: int = 0,
) -> KVSegment:
    """A segment over random bytes.

    Args:
        num_layers: layers in the segment.
        num_blocks: blocks per layer.
        page: bytes of one (block, layer) page.
        layout: "layer_outer" (vLLM's default), "block_outer" (one range per block) or
            "padded" (gaps between blocks and layers).
        offset: byte offset of layer 0, block 0.
        device: where the buffer lives.
        seed: random seed of the bytes.
    """
    if layout == "layer_outer":
        block_stride, layer_stride = page, page * num_blocks
    elif layout == "block_outer":
        layer_stride, block_stride = page, page * num_layers
    elif layout == "padded":
        block_stride = page + 16
        layer_stride = block_stride * num_blocks + 64
    else:
        raise ValueError(layout)
    size = offset + (num_layers - 1) * layer_stride + (num_blocks - 1) * block_stride + page
    generator = torch.Generator().manual_seed(seed * 7919 + num_layers * 1000 + page)
    data = torch.randint(0, 256, (size + 32,), dtype=torch.uint8, generator=generator)
    segment = KVSegment(
        data.to(device), offset, layer_stride, block_stride, num_layers, num_blocks, page
    )
    segment.check()
    return segment


def twin(segment: KVSegment, device: str = "cpu") -> KVSegment:
    """A copy of `segment` with its own buffer (on `device`) and the same geometry."""
    fields = [getattr(segment, f) for f in GEOMETRY_FIELDS]
    return KVSegment(segment.buffer.to(device, copy=True), *fields)


def page_mask(segment: KVSegment, blocks: list[int]) -> torch.Tensor:
    """Bool mask over the segment's buffer: True on the pages of `blocks`."""
    mask = torch.zeros(segment.buffer.numel(), dtype=torch.bool)
    for block in blocks:
        for layer in range(segment.num_layers):
            start = segment.offset + layer * segment.layer_stride + block * segment.block_stride
            mask[start : start + segment.page_size] = True
    return mask


def session_ops_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one directory a test session builds the CPU ops into (every module reuses it)."""
    return tmp_path_factory.getbasetemp() / "ops-cpu"


def build_compiled_ops(out_dir: Path, *, cuda: bool) -> frozenset[str]:
    """Load the compiled ops, building them into `out_dir` first when none is loaded.

    The builder reuses a library already in `out_dir` (nothing is compiled then).

    Returns:
        The devices the loaded library supports.
    """
    devices = load_compiled_ops()
    if devices and ("cuda" in devices or not cuda):
        return devices
    flag = "--cuda" if cuda else "--cpu"
    subprocess.run(
        [sys.executable, "-m", "hf3fsctl.ops.build", flag, "--out", str(out_dir)],
        check=True,
    )
    return load_compiled_ops(out_dir / "_ops.so")


def fast_path_only(compiled: _CompiledOps) -> _CompiledOps:
    """Compiled ops of their own (fresh plans) whose op calls fail the test: what a 1-block
    call moves, the path past the dispatcher (csrc/one_block.cpp) moved."""

    def refused(*_args: object) -> None:
        raise AssertionError("a 1-block call reached the op")

    ops = _CompiledOps(compiled.devices)
    ops._gather_op = ops._scatter_op = refused
    return ops
