"""CUDA staging kernels on vLLM-shaped KV caches: against the loop oracle, untouched
blocks, narrow-copy geometries, host-transfer modes, the 1-block path past the dispatcher
against the op, and a round trip through a page file."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers.staging_builders import GEOMETRY_FIELDS, fast_path_only, make_segment, page_mask, twin

from hf3fsctl.staging import (
    KVSegment,
    StagingPool,
    _CompiledOps,
    _ops,
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
)

pytestmark = pytest.mark.gpu

LAYOUTS = ["LBNHC", "BLNHC"]
ID_DTYPES = [torch.int64, torch.int32]
ID_DTYPE_IDS = ["int64", "int32"]


def flash_cache(layout: str, num_layers: int = 4, num_blocks: int = 24, seed: int = 0) -> KVSegment:
    """All layers in one flat bf16 buffer, each layer's blocks `[2, block_size, heads, dim]`.

    "LBNHC" is vLLM's CUDA FlashAttention default (layer-outermost: one region per layer,
    `layer_stride = num_blocks * page`); "BLNHC" is block-outermost (one range per block).
    """
    block_size, heads, head_dim = 16, 2, 64
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shape = (2, block_size, heads, head_dim)
    outer = (num_layers, num_blocks) if layout == "LBNHC" else (num_blocks, num_layers)
    kv = torch.randn(*outer, *shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    raw = kv.view(-1).view(torch.uint8)
    page = 2 * block_size * heads * head_dim * kv.element_size()
    if layout == "LBNHC":
        layer_stride, block_stride = num_blocks * page, page
    else:
        layer_stride, block_stride = page, num_layers * page
    segment = KVSegment(raw, 0, layer_stride, block_stride, num_layers, num_blocks, page)
    segment.check()
    return segment


BLOCKS = [17, 3, 9, 22, 0]


@pytest.mark.parametrize("dtype", ID_DTYPES, ids=ID_DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_to_pinned_host_writes_every_byte_of_the_oracle(
    cuda_ops: _CompiledOps, layout: str, dtype: torch.dtype
) -> None:
    seg = flash_cache(layout)
    expected = torch.empty(len(BLOCKS), seg.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([twin(seg)], BLOCKS, expected)
    ids = torch.tensor(BLOCKS, dtype=dtype, device="cuda")  # ids already on the device
    for poison in (0x00, 0xFF):
        out = torch.full_like(expected, poison).pin_memory()
        cuda_ops.gather([seg], ids, out)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_into_a_device_table_matches_the_oracle(cuda_ops: _CompiledOps, layout: str) -> None:
    seg = flash_cache(layout, seed=1)
    expected = torch.empty(len(BLOCKS), seg.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([twin(seg)], BLOCKS, expected)
    out = torch.full(expected.shape, 0x5A, dtype=torch.uint8, device="cuda")
    cuda_ops.gather([seg], torch.tensor(BLOCKS), out)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("dtype", ID_DTYPES, ids=ID_DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_from_pinned_host_matches_the_oracle(
    cuda_ops: _CompiledOps, layout: str, dtype: torch.dtype
) -> None:
    seg = flash_cache(layout, seed=2)
    expected = twin(seg)
    src = torch.randint(0, 256, (len(BLOCKS), seg.page_bytes), dtype=torch.uint8)
    cuda_ops.scatter([seg], torch.tensor(BLOCKS, dtype=dtype), src.pin_memory())
    scatter_blocks_reference([expected], BLOCKS, src)
    assert torch.equal(seg.buffer.cpu(), expected.buffer)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_leaves_untouched_blocks_untouched(cuda_ops: _CompiledOps, layout: str) -> None:
    seg = flash_cache(layout, seed=3)
    before = seg.buffer.cpu()
    src = torch.randint(0, 256, (len(BLOCKS), seg.page_bytes), dtype=torch.uint8).pin_memory()
    cuda_ops.scatter([seg], torch.tensor(BLOCKS), src)
    outside = ~page_mask(twin(seg), BLOCKS)
    assert torch.equal(seg.buffer.cpu()[outside], before[outside])


# Geometries that rule out 16-byte copies (page sizes off 16, odd offsets).
NARROW = [(2, 10, 50, "block_outer", 3), (3, 8, 36, "padded", 8), (2, 6, 4104, "layer_outer", 1)]
NARROW_IDS = [f"{g[3]}-P{g[2]}-O{g[4]}" for g in NARROW]


@pytest.mark.parametrize("geometry", NARROW, ids=NARROW_IDS)
def test_narrow_copies_round_trip_like_the_oracle(
    cuda_ops: _CompiledOps, geometry: tuple[int, int, int, str, int]
) -> None:
    *shape, layout, offset = geometry
    seg = make_segment(*shape, layout, offset=offset, device="cuda")
    blocks = [4, 0, 5]
    expected_pages = torch.empty(len(blocks), seg.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([twin(seg)], blocks, expected_pages)
    pages = torch.zeros_like(expected_pages).pin_memory()
    cuda_ops.gather([seg], torch.tensor(blocks), pages)
    torch.cuda.synchronize()
    expected_cache = twin(seg)
    scatter_blocks_reference([expected_cache], [1, 3, 2], expected_pages)
    cuda_ops.scatter([seg], torch.tensor([1, 3, 2]), pages)
    assert torch.equal(pages, expected_pages)
    assert torch.equal(seg.buffer.cpu(), expected_cache.buffer)


def test_bounce_transfer_gives_the_zero_copy_bytes(cuda_ops: _CompiledOps) -> None:
    bounce = _CompiledOps(cuda_ops.devices, "bounce")
    seg = flash_cache("LBNHC", seed=4)
    direct = torch.zeros(len(BLOCKS), seg.page_bytes, dtype=torch.uint8).pin_memory()
    bounced = torch.full_like(direct, 0xFF).pin_memory()
    cuda_ops.gather([seg], torch.tensor(BLOCKS), direct)
    bounce.gather([seg], torch.tensor(BLOCKS), bounced)
    torch.cuda.synchronize()
    assert torch.equal(direct, bounced)


def test_pageable_host_staging_still_gathers_the_right_bytes(cuda_ops: _CompiledOps) -> None:
    seg = flash_cache("LBNHC", seed=5)
    expected = torch.empty(len(BLOCKS), seg.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([twin(seg)], BLOCKS, expected)
    out = torch.zeros_like(expected)  # not pinned: the kernel cannot map it
    cuda_ops.gather([seg], torch.tensor(BLOCKS), out)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("blocks", [[BLOCKS[1]], BLOCKS], ids=["one-block-copy", "kernel-fallback"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pageable_host_staging_round_trips_through_gather_blocks(
    cuda_ops: _CompiledOps, layout: str, blocks: list[int]
) -> None:
    """One block goes to pageable memory by the copy engine itself, several by the torch
    path (the kernel refuses unpinned memory before it copies): right bytes both ways."""
    seg = flash_cache(layout, seed=6)
    expected = twin(seg)
    src = torch.randint(0, 256, (len(blocks), seg.page_bytes), dtype=torch.uint8)
    cuda_ops.scatter([seg], blocks, src)
    scatter_blocks_reference([expected], blocks, src)
    back = torch.zeros_like(src)
    cuda_ops.gather([seg], blocks, back)
    torch.cuda.synchronize()
    assert torch.equal(seg.buffer.cpu(), expected.buffer) and torch.equal(back, src)


# One block, as the connector's 1-block saves and loads move it: layer-outermost pages of
# 16 KiB (the fp8 TP 2 row) and 9 KiB (MLA fp8), 64 KiB (bf16), a narrow page off 16 bytes,
# and block-outermost (one flat range).
ONE_BLOCK = [(32, 16384, "layer_outer", 0), (61, 9216, "layer_outer", 0),
             (8, 65536, "layer_outer", 0), (6, 4104, "layer_outer", 1),
             (32, 16384, "block_outer", 0)]  # fmt: skip
ONE_BLOCK_IDS = [f"{g[2]}-{g[0]}x{g[1]}-O{g[3]}" for g in ONE_BLOCK]


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("geometry", ONE_BLOCK, ids=ONE_BLOCK_IDS)
def test_one_block_round_trips_exactly_its_pages(
    cuda_ops: _CompiledOps, geometry: tuple[int, int, str, int], pinned: bool
) -> None:
    layers, page, layout, offset = geometry
    seg = make_segment(layers, 6, page, layout, offset=offset, device="cuda", seed=8)
    expected_page = torch.empty(1, seg.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([twin(seg)], [4], expected_page)
    out = torch.full_like(expected_page, 0xA5)
    out = out.pin_memory() if pinned else out
    cuda_ops.gather([seg], [4], out)
    torch.cuda.synchronize()
    src = torch.randint(0, 256, expected_page.shape, dtype=torch.uint8)
    src = src.pin_memory() if pinned else src
    expected_cache = twin(seg)
    scatter_blocks_reference([expected_cache], [1], src)
    cuda_ops.scatter([seg], [1], src)
    torch.cuda.synchronize()
    assert torch.equal(out, expected_page)
    assert torch.equal(seg.buffer.cpu(), expected_cache.buffer)  # block 1 only, every byte


def test_the_dispatch_point_uses_the_compiled_cuda_ops(cuda_ops: _CompiledOps) -> None:
    active = _ops()
    assert isinstance(active, _CompiledOps) and "cuda" in active.devices


def test_cache_round_trip_through_a_page_file_restores_every_byte(
    cuda_ops: _CompiledOps, tmp_path: Path
) -> None:
    from hf3fsctl.storage.factory import open_engine
    from hf3fsctl.storage.layout import PageFile, slot_bytes

    source = flash_cache("LBNHC", seed=6)
    target = flash_cache("LBNHC", seed=7)
    assert isinstance(_ops(), _CompiledOps)
    targets = [2, 11, 23, 5, 14]
    pool = StagingPool(4 << 20)
    engine = open_engine("posix", io_threads=4)
    file = PageFile.create(
        tmp_path, "0123456789abcdef", 0, source.page_bytes, 8 * slot_bytes(source.page_bytes)
    )
    pages = list(range(len(BLOCKS)))
    with pool.acquire(len(BLOCKS), source.page_bytes) as saved:  # type: ignore[union-attr]
        gather_blocks([source], BLOCKS, saved.tensor)
        torch.cuda.synchronize()
        written = engine.write_pages(file, pages, saved.rows())
    with pool.acquire(len(BLOCKS), source.page_bytes) as loaded:  # type: ignore[union-attr]
        loaded.tensor.fill_(0xEE)
        read = engine.read_pages(file, pages, loaded.rows(), expected=[w.checksum for w in written])
        scatter_blocks([target], targets, loaded.tensor)
        torch.cuda.synchronize()
    file.close()
    engine.close()
    assert all(r.ok and r.checksum is not None for r in written + read)
    ids_src, ids_dst = torch.tensor(BLOCKS, device="cuda"), torch.tensor(targets, device="cuda")
    assert torch.equal(source.blocks_view()[ids_src], target.blocks_view()[ids_dst])


# The 1-block path past the dispatcher (issue 23): every geometry above, one block, through
# `_CompiledOps` with the op callables replaced by a refusal (so only the fast path can
# have moved the bytes), against the op itself on the same bytes.
def _fast_cases() -> dict[str, Callable[[], KVSegment]]:
    cases: dict[str, Callable[[], KVSegment]] = {
        f"flash-{layout}": partial(flash_cache, layout, seed=9) for layout in LAYOUTS
    }
    for (layers, blocks, page, layout, offset), name in zip(NARROW, NARROW_IDS, strict=True):
        cases[f"narrow-{name}"] = partial(
            make_segment, layers, blocks, page, layout, offset=offset, device="cuda", seed=9
        )
    for (layers, page, layout, offset), name in zip(ONE_BLOCK, ONE_BLOCK_IDS, strict=True):
        cases[f"one-block-{name}"] = partial(
            make_segment, layers, 6, page, layout, offset=offset, device="cuda", seed=9
        )
    return cases


FAST_CASES = _fast_cases()


def _op_geometry(seg: KVSegment) -> list[int]:
    return [seg.offset, seg.layer_stride, seg.block_stride, seg.num_layers, seg.num_blocks,
            seg.page_size, 0]  # fmt: skip


@pytest.mark.parametrize("side_stream", [False, True], ids=["current-stream", "side-stream"])
@pytest.mark.parametrize("case", list(FAST_CASES), ids=list(FAST_CASES))
def test_one_block_fast_path_moves_the_ops_bytes(
    cuda_ops: _CompiledOps, case: str, side_stream: bool
) -> None:
    """Gather and scatter of one block past the dispatcher write exactly what the op writes,
    ordered on the current stream: the stream first sleeps, then changes the cache, so a
    copy issued anywhere else would read (gather) or be overwritten by (scatter) stale bytes."""
    seg = FAST_CASES[case]()
    by_op = KVSegment(seg.buffer.clone(), *[getattr(seg, f) for f in GEOMETRY_FIELDS])
    ops = fast_path_only(cuda_ops)
    assert ops._plan([seg]).one_block is not None  # the fast path serves this geometry
    block, geometry = seg.num_blocks - 2, _op_geometry(seg)
    gathered_by_op = torch.full((1, seg.page_bytes), 0xA5, dtype=torch.uint8).pin_memory()
    gathered = torch.full_like(gathered_by_op, 0x5A).pin_memory()
    src = torch.randint(0, 256, gathered.shape, dtype=torch.uint8).pin_memory()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for cache in (seg, by_op):
            torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
            cache.buffer.add_(1)
        torch.ops.hf3fsctl.gather_pages(by_op.buffer, gathered_by_op, [block], geometry)
        ops.gather([seg], [block], gathered)
        torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]
        for cache in (seg, by_op):
            cache.buffer.add_(3)
        torch.ops.hf3fsctl.scatter_pages(by_op.buffer, src, [block], geometry)
        ops.scatter([seg], [block], src)
    stream.synchronize()
    expected = torch.empty_like(gathered)
    gather_blocks_reference([twin(by_op)], [block], expected)  # scattered: src's bytes
    assert torch.equal(gathered, gathered_by_op)
    assert torch.equal(seg.buffer, by_op.buffer)
    assert torch.equal(expected, src)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_a_bad_block_id_raises_the_ops_exception_past_the_dispatcher(
    cuda_ops: _CompiledOps, direction: str
) -> None:
    seg = make_segment(32, 6, 16384, "layer_outer", device="cuda")
    before = seg.buffer.clone()
    ops = _CompiledOps(cuda_ops.devices)
    table = torch.zeros(1, seg.page_bytes, dtype=torch.uint8).pin_memory()
    op = getattr(torch.ops.hf3fsctl, f"{direction}_pages")
    for bad in (seg.num_blocks, -1, 1 << 40):
        with pytest.raises(IndexError) as by_op:
            op(seg.buffer, table, [bad], _op_geometry(seg))
        with pytest.raises(IndexError) as fast:
            getattr(ops, direction)([seg], [bad], table)
        assert str(fast.value) == str(by_op.value)
    torch.cuda.synchronize()
    assert ops._plan([seg]).one_block is not None and torch.equal(seg.buffer, before)
