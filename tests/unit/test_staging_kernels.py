"""The compiled CPU staging ops (csrc/) against the loop oracle, their dispatch, and the
1-block path past the dispatcher against the op.

The session builds the CPU op once (~12 s on 2 cores) unless a library is already loaded.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers.staging_builders import (
    build_compiled_ops,
    fast_path_only,
    make_segment,
    page_mask,
    session_ops_dir,
    twin,
)

from hf3fsctl.staging import (
    KVSegment,
    _CompiledOps,
    _one_block_entry_points,
    gather_blocks_reference,
    scatter_blocks_reference,
    total_page_bytes,
)

# Every test here runs the compiled CPU op, built once per session (about 40 s on 2
# cores): `slow`, so the quick tier (`make test-quick`) leaves them to `make test`.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> _CompiledOps:
    devices = build_compiled_ops(session_ops_dir(tmp_path_factory), cuda=False)
    assert "cpu" in devices
    return _CompiledOps(devices)


# (num_layers, num_blocks, page_size, layout, offset): page sizes off multiples of 16 and
# odd offsets on purpose.
GEOMETRIES = [
    (2, 16, 64, "layer_outer", 0),
    (3, 8, 50, "block_outer", 3),
    (2, 10, 36, "padded", 8),
    (4, 6, 4104, "layer_outer", 1),
    (1, 5, 7, "block_outer", 0),
]
GEOMETRY_IDS = [f"{g[3]}-L{g[0]}-B{g[1]}-P{g[2]}-O{g[4]}" for g in GEOMETRIES]
ID_DTYPES = [torch.int64, torch.int32]
ID_DTYPE_IDS = ["int64", "int32"]
BLOCKS = [4, 0, 2]  # unsorted, non-contiguous


def _gather_op(seg: KVSegment, ids: list[int], out: torch.Tensor, column: int = 0) -> None:
    geometry = [seg.offset, seg.layer_stride, seg.block_stride, seg.num_layers,
                seg.num_blocks, seg.page_size, column]  # fmt: skip
    torch.ops.hf3fsctl.gather_pages(seg.buffer, out, ids, geometry)


@pytest.mark.parametrize("dtype", ID_DTYPES, ids=ID_DTYPE_IDS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_gather_op_writes_every_byte_of_the_oracle(
    compiled: _CompiledOps, geometry: tuple[int, int, int, str, int], dtype: torch.dtype
) -> None:
    *shape, layout, offset = geometry
    seg = make_segment(*shape, layout, offset=offset)
    blocks = [b for b in BLOCKS if b < seg.num_blocks]
    expected = torch.empty(len(blocks), seg.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([seg], blocks, expected)
    for poison in (0x00, 0xFF):  # a byte left unwritten cannot match under both poisons
        out = torch.full_like(expected, poison)
        compiled.gather([seg], torch.tensor(blocks, dtype=dtype), out)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", ID_DTYPES, ids=ID_DTYPE_IDS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_scatter_op_matches_loop_oracle(
    compiled: _CompiledOps, geometry: tuple[int, int, int, str, int], dtype: torch.dtype
) -> None:
    *shape, layout, offset = geometry
    seg = make_segment(*shape, layout, offset=offset)
    expected = twin(seg)
    blocks = [b for b in BLOCKS if b < seg.num_blocks]
    src = torch.randint(0, 256, (len(blocks), seg.page_bytes), dtype=torch.uint8)
    compiled.scatter([seg], torch.tensor(blocks, dtype=dtype), src)
    scatter_blocks_reference([expected], blocks, src)
    assert torch.equal(seg.buffer, expected.buffer)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_scatter_op_leaves_untouched_blocks_untouched(
    compiled: _CompiledOps, geometry: tuple[int, int, int, str, int]
) -> None:
    *shape, layout, offset = geometry
    seg = make_segment(*shape, layout, offset=offset, seed=1)
    before = seg.buffer.clone()
    blocks = [1, 3] if seg.num_blocks > 3 else [1]
    compiled.scatter(
        [seg], torch.tensor(blocks), torch.zeros(len(blocks), seg.page_bytes, dtype=torch.uint8)
    )
    outside = ~page_mask(seg, blocks)
    assert torch.equal(seg.buffer[outside], before[outside])


def test_two_segments_fill_their_columns_in_segment_order(compiled: _CompiledOps) -> None:
    first = make_segment(2, 8, 40, "layer_outer", offset=5)
    second = make_segment(3, 8, 24, "padded", seed=2)
    blocks = [6, 3, 7]
    expected = torch.empty(len(blocks), total_page_bytes([first, second]), dtype=torch.uint8)
    gather_blocks_reference([first, second], blocks, expected)
    out = torch.full_like(expected, 0xAB)
    compiled.gather([first, second], torch.tensor(blocks), out)
    assert torch.equal(out, expected)


def test_two_segment_round_trip_restores_pages(compiled: _CompiledOps) -> None:
    segments = [make_segment(2, 8, 40, "layer_outer"), make_segment(1, 8, 72, "block_outer")]
    targets = [make_segment(2, 8, 40, "padded", seed=3), make_segment(1, 8, 72, "padded")]
    pages = torch.empty(3, total_page_bytes(segments), dtype=torch.uint8)
    compiled.gather(segments, torch.tensor([1, 5, 2]), pages)
    compiled.scatter(targets, torch.tensor([7, 0, 4]), pages)
    back = torch.zeros_like(pages)
    compiled.gather(targets, torch.tensor([7, 0, 4]), back)
    assert torch.equal(back, pages)


def test_gather_op_rejects_out_of_range_block_ids(compiled: _CompiledOps) -> None:
    seg = make_segment(2, 8, 32, "layer_outer")
    out = torch.empty(2, seg.page_bytes, dtype=torch.uint8)
    with pytest.raises(IndexError, match="out of range"):
        _gather_op(seg, [1, 8], out)


def test_dispatch_rejects_negative_block_ids_before_the_op(compiled: _CompiledOps) -> None:
    seg = make_segment(2, 8, 32, "layer_outer")
    out = torch.empty(2, seg.page_bytes, dtype=torch.uint8)
    with pytest.raises(IndexError, match="out of range"):
        compiled.gather([seg], torch.tensor([-1, 2]), out)


def test_gather_op_rejects_a_row_too_short_for_the_pages(compiled: _CompiledOps) -> None:
    seg = make_segment(2, 8, 32, "layer_outer")
    out = torch.empty(2, seg.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overrun"):
        _gather_op(seg, [1, 2], out, column=1)


def test_gather_op_rejects_a_segment_past_the_buffer(compiled: _CompiledOps) -> None:
    seg = make_segment(2, 8, 32, "layer_outer")
    short = KVSegment(seg.buffer[:100], 0, 256, 32, 2, 8, 32)
    out = torch.empty(1, seg.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="reaches byte"):
        _gather_op(short, [0], out)


def test_build_script_output_loads_with_a_cpu_kernel(compiled: _CompiledOps) -> None:
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has_kernel("hf3fsctl::gather_pages", "CPU")
    assert has_kernel("hf3fsctl::scatter_pages", "CPU")


def test_devices_without_a_compiled_kernel_take_the_torch_path() -> None:
    ops = _CompiledOps(frozenset({"cuda"}))  # a library built for CUDA only
    seg = make_segment(2, 8, 32, "layer_outer")
    out = torch.zeros(2, seg.page_bytes, dtype=torch.uint8)
    expected = torch.zeros_like(out)
    ops.gather([seg], torch.tensor([5, 1]), out)
    gather_blocks_reference([seg], [5, 1], expected)
    assert torch.equal(out, expected) and "cpu tensors" in ops._warned


def test_a_call_plan_keeps_no_cache_alive_and_follows_a_new_segment(
    compiled: _CompiledOps,
) -> None:
    """The per-segment-list plan holds its segments weakly and is rebuilt for new ones."""
    seg = make_segment(2, 8, 32, "layer_outer")
    compiled.gather([seg], [1], torch.empty(1, seg.page_bytes, dtype=torch.uint8))
    gone = weakref.ref(seg.buffer)
    del seg
    gc.collect()
    other = make_segment(3, 8, 24, "padded", seed=4)  # may reuse the dead segment's id
    expected = torch.empty(2, other.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([other], [5, 2], expected)
    out = torch.zeros_like(expected)
    compiled.gather([other], [5, 2], out)
    assert gone() is None and torch.equal(out, expected)


# The 1-block path past the dispatcher (csrc/one_block.cpp, through ctypes): on a CPU cache
# too, where the CPU op would copy a block serially anyway.
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_one_block_past_the_dispatcher_moves_the_ops_bytes(
    compiled: _CompiledOps, geometry: tuple[int, int, int, str, int]
) -> None:
    *shape, layout, offset = geometry
    seg = make_segment(*shape, layout, offset=offset, seed=5)
    by_op, ops = twin(seg), fast_path_only(compiled)
    assert ops._plan([seg]).one_block is not None
    block = seg.num_blocks - 1
    gathered, gathered_by_op = (
        torch.full((1, seg.page_bytes), v, dtype=torch.uint8) for v in (0, 255)
    )
    ops.gather([seg], [block], gathered)
    _gather_op(by_op, [block], gathered_by_op)
    src = torch.randint(0, 256, gathered.shape, dtype=torch.uint8)
    ops.scatter([seg], [block], src)
    geometry_arg = [seg.offset, seg.layer_stride, seg.block_stride, seg.num_layers,
                    seg.num_blocks, seg.page_size, 0]  # fmt: skip
    torch.ops.hf3fsctl.scatter_pages(by_op.buffer, src, [block], geometry_arg)
    assert torch.equal(gathered, gathered_by_op) and torch.equal(seg.buffer, by_op.buffer)


def test_one_block_of_two_segments_fills_their_columns(compiled: _CompiledOps) -> None:
    segments = [make_segment(2, 8, 40, "layer_outer", offset=5), make_segment(3, 8, 24, "padded")]
    ops = fast_path_only(compiled)
    expected = torch.empty(1, total_page_bytes(segments), dtype=torch.uint8)
    gather_blocks_reference(segments, [6], expected)
    out = torch.full_like(expected, 0xAB)
    ops.gather(segments, [6], out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_a_bad_block_id_raises_the_ops_exception_past_the_dispatcher(
    compiled: _CompiledOps, direction: str
) -> None:
    seg = make_segment(2, 8, 32, "layer_outer")
    before, ops = seg.buffer.clone(), _CompiledOps(compiled.devices)
    table = torch.zeros(1, seg.page_bytes, dtype=torch.uint8)
    op = getattr(torch.ops.hf3fsctl, f"{direction}_pages")
    geometry = [0, seg.layer_stride, seg.block_stride, 2, 8, 32, 0]
    for bad in (8, -1, 1 << 40):
        with pytest.raises(IndexError) as by_op:
            op(seg.buffer, table, [bad], geometry)
        with pytest.raises(IndexError) as fast:
            getattr(ops, direction)([seg], [bad], table)
        assert str(fast.value) == str(by_op.value)
    assert ops._plan([seg]).one_block is not None and torch.equal(seg.buffer, before)


def test_a_plan_releases_its_handles_when_it_goes(compiled: _CompiledOps) -> None:
    entry = _one_block_entry_points()
    assert entry is not None
    ops = _CompiledOps(compiled.devices)
    gc.collect()  # earlier tests' plans, still to be collected, release theirs first
    in_use = entry.handles_in_use()
    segments = [make_segment(2, 8, 32, "layer_outer"), make_segment(1, 8, 16, "block_outer")]
    ops.gather(segments, [3], torch.empty(1, total_page_bytes(segments), dtype=torch.uint8))
    assert entry.handles_in_use() == in_use + 2
    del ops
    gc.collect()
    assert entry.handles_in_use() == in_use


def test_blocks_the_cpu_op_would_share_out_and_bounce_transfer_keep_the_op(
    compiled: _CompiledOps,
) -> None:
    large = make_segment(32, 2, 65536, "layer_outer")  # 2 MiB a block: two CPU op tasks
    small = make_segment(2, 8, 32, "layer_outer")
    assert _CompiledOps(compiled.devices)._plan([large]).one_block is None
    assert _CompiledOps(compiled.devices, "bounce")._plan([small]).one_block is None
    expected = torch.empty(1, large.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([large], [1], expected)
    out = torch.zeros_like(expected)
    compiled.gather([large], [1], out)
    assert torch.equal(out, expected)
