"""gather_blocks / scatter_blocks against the loop oracle, and the StagingPool's bounds."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.staging_builders import GEOMETRY_FIELDS, make_segment, twin

from hf3fsctl.staging import (
    KVSegment,
    StagingPool,
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
    total_page_bytes,
)

# (num_layers, num_blocks, page_size, layout): layer-outermost (vLLM's default: one
# region per layer), block-outermost (one contiguous page per block), and padded strides.
GEOMETRIES = [
    (2, 16, 64, "layer_outer"),
    (3, 8, 48, "block_outer"),
    (2, 10, 32, "padded"),
    (1, 5, 128, "layer_outer"),
]
GEOMETRY_IDS = [f"{g[3]}-L{g[0]}-B{g[1]}-P{g[2]}" for g in GEOMETRIES]


BLOCK_LISTS = [[0], [3, 1, 4], [5, 0, 2, 7], []]
BLOCK_IDS = ["one", "unsorted", "non_contiguous", "empty"]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
@pytest.mark.parametrize("blocks", BLOCK_LISTS, ids=BLOCK_IDS)
def test_gather_matches_loop_oracle(geometry: tuple[int, int, int, str], blocks: list[int]) -> None:
    seg = make_segment(*geometry, offset=8)
    blocks = [b for b in blocks if b < seg.num_blocks]
    out = torch.zeros(len(blocks), seg.page_bytes, dtype=torch.uint8)
    expected = torch.zeros_like(out)
    gather_blocks([seg], blocks, out)
    gather_blocks_reference([seg], blocks, expected)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_scatter_matches_loop_oracle(geometry: tuple[int, int, int, str]) -> None:
    seg = make_segment(*geometry)
    copy = twin(seg)
    blocks = [b for b in (4, 0, 2) if b < seg.num_blocks]
    src = torch.randint(0, 256, (len(blocks), seg.page_bytes), dtype=torch.uint8)
    scatter_blocks([seg], blocks, src)
    scatter_blocks_reference([copy], blocks, src)
    assert torch.equal(seg.buffer, copy.buffer)


def _page_mask(seg: KVSegment, blocks: list[int]) -> torch.Tensor:
    mask = torch.zeros(seg.buffer.numel(), dtype=torch.bool)
    for block in blocks:
        for layer in range(seg.num_layers):
            start = seg.offset + layer * seg.layer_stride + block * seg.block_stride
            mask[start : start + seg.page_size] = True
    return mask


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_scatter_leaves_untouched_blocks_untouched(geometry: tuple[int, int, int, str]) -> None:
    seg = make_segment(*geometry)
    before = seg.buffer.clone()
    blocks = [1, 3] if seg.num_blocks > 3 else [1]
    scatter_blocks([seg], blocks, torch.zeros(len(blocks), seg.page_bytes, dtype=torch.uint8))
    outside = ~_page_mask(seg, blocks)
    assert torch.equal(seg.buffer[outside], before[outside])


def test_round_trip_between_two_caches_restores_pages() -> None:
    source, target = make_segment(2, 12, 64, "layer_outer"), make_segment(2, 12, 64, "padded")
    pages = torch.empty(3, source.page_bytes, dtype=torch.uint8)
    gather_blocks([source], [9, 2, 5], pages)
    scatter_blocks([target], [0, 1, 11], pages)
    back = torch.empty_like(pages)
    gather_blocks([target], [0, 1, 11], back)
    assert torch.equal(back, pages)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_gather_over_typed_kv_tensor_copies_its_bytes(dtype: torch.dtype) -> None:
    # A vLLM-like KV tensor [blocks, heads, block_size, 2*head] viewed as raw bytes.
    kv = torch.randn(6, 2, 4, 16).to(dtype)
    raw = torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())
    page = kv[0].numel() * kv.element_size()
    seg = KVSegment(raw, 0, page * 6, page, 1, 6, page)
    out = torch.empty(2, page, dtype=torch.uint8)
    gather_blocks([seg], [4, 1], out)
    assert torch.equal(out[0].view(dtype).view(kv[4].shape), kv[4])


def test_two_segments_concatenate_in_segment_order() -> None:
    first, second = make_segment(2, 8, 32, "layer_outer"), make_segment(1, 8, 64, "block_outer")
    out = torch.empty(2, total_page_bytes([first, second]), dtype=torch.uint8)
    expected = torch.empty_like(out)
    gather_blocks([first, second], [6, 3], out)
    gather_blocks_reference([first, second], [6, 3], expected)
    assert torch.equal(out, expected)


def test_gather_rejects_wrongly_shaped_out() -> None:
    seg = make_segment(2, 8, 32, "layer_outer")
    with pytest.raises(ValueError, match="uint8"):
        gather_blocks([seg], [1, 2], torch.empty(2, seg.page_bytes + 1, dtype=torch.uint8))


def test_segment_check_rejects_overlapping_pages() -> None:
    buffer = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        KVSegment(buffer, 0, 64, 16, 2, 4, 32).check()


def test_pool_never_holds_more_than_its_capacity() -> None:
    pool = StagingPool(64 * 1024, pin=False)
    leases = [pool.acquire(1, 16 * 1024) for _ in range(5)]
    assert [lease is not None for lease in leases] == [True] * 4 + [False]
    assert pool.counters()["held_bytes"] <= 64 * 1024


def test_pool_reuses_released_buffers() -> None:
    pool = StagingPool(1 << 20, pin=False)
    for _ in range(3):
        lease = pool.acquire(4, 1000)
        assert lease is not None
        lease.release()
    assert pool.counters()["allocations"] == 1


def test_prewarmed_buffer_serves_a_smaller_acquire_without_allocating() -> None:
    pool = StagingPool(1 << 20, pin=False)
    assert pool.prewarm(256 * 1024)
    lease = pool.acquire(3, 10_000)
    assert lease is not None
    assert (pool.counters()["allocations"], lease.nbytes) == (1, 256 * 1024)


def test_in_use_counts_the_real_size_of_a_larger_cached_buffer() -> None:
    pool = StagingPool(1 << 20, pin=False)
    assert pool.prewarm(256 * 1024)
    lease = pool.acquire(1, 30_000)
    assert lease is not None
    assert pool.in_use_bytes == lease.nbytes == 256 * 1024


def test_in_use_returns_to_zero_after_a_larger_cached_buffer_is_released() -> None:
    pool = StagingPool(1 << 20, pin=False)
    assert pool.prewarm(256 * 1024)
    lease = pool.acquire(1, 30_000)
    assert lease is not None
    lease.release()
    assert pool.in_use_bytes == 0


def test_prewarm_never_exceeds_capacity() -> None:
    pool = StagingPool(64 * 1024, pin=False)
    lease = pool.acquire(1, 32 * 1024)
    assert lease is not None
    assert (pool.prewarm(64 * 1024), pool.counters()["held_bytes"]) == (False, 32 * 1024)


def test_pool_acquire_waits_for_a_release() -> None:
    pool = StagingPool(8192, pin=False)
    first = pool.acquire(1, 8192)
    assert first is not None
    threading.Timer(0.05, first.release).start()
    second = pool.acquire(1, 8192, timeout_s=5.0)
    assert second is not None


def test_pool_rows_are_views_of_the_buffer() -> None:
    pool = StagingPool(1 << 20, pin=False)
    lease = pool.acquire(3, 100)
    assert lease is not None
    lease.tensor.zero_()
    lease.rows()[1][:] = 7
    assert int(lease.tensor[1].sum()) == 700 and int(lease.tensor[0].sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_cuda_gather_to_host_matches_loop_oracle(geometry: tuple[int, int, int, str]) -> None:
    seg = make_segment(*geometry, device="cuda")
    cpu_seg = twin(seg)
    blocks = [b for b in (5, 0, 2) if b < seg.num_blocks]
    out = torch.zeros(len(blocks), seg.page_bytes, dtype=torch.uint8).pin_memory()
    expected = torch.zeros_like(out)
    gather_blocks([seg], blocks, out)
    torch.cuda.synchronize()
    gather_blocks_reference([cpu_seg], blocks, expected)
    assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=GEOMETRY_IDS)
def test_cuda_scatter_leaves_untouched_blocks_untouched(
    geometry: tuple[int, int, int, str],
) -> None:
    seg = make_segment(*geometry, device="cuda")
    before = seg.buffer.cpu()
    blocks = [1, 3] if seg.num_blocks > 3 else [1]
    src = torch.randint(0, 256, (len(blocks), seg.page_bytes), dtype=torch.uint8)
    scatter_blocks([seg], blocks, src.pin_memory())
    torch.cuda.synchronize()
    cpu_seg = KVSegment(before.clone(), *[getattr(seg, f) for f in GEOMETRY_FIELDS])
    scatter_blocks_reference([cpu_seg], blocks, src)
    assert torch.equal(seg.buffer.cpu(), cpu_seg.buffer)
