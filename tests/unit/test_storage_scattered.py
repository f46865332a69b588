"""Scattered reads: a stored page read straight into several buffers (a KV block's layers)."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf3fsctl.staging import HostBlockPieces, KVSegment, gather_blocks_reference, page_pieces
from hf3fsctl.storage.checksum import checksum, checksum_pieces
from hf3fsctl.storage.engine import ERROR_BOUNDS, ERROR_CHECKSUM, ERROR_SHORT
from hf3fsctl.storage.layout import PageFile, slot_bytes
from hf3fsctl.storage.posix import PosixEngine

NS = "0123456789abcdef"
NUM_PAGES = 32


def _page_file(root: Path, page_bytes: int) -> PageFile:
    return PageFile.create(root, NS, 0, page_bytes, NUM_PAGES * slot_bytes(page_bytes))


@pytest.fixture
def engine() -> Iterator[PosixEngine]:
    with PosixEngine(io_threads=4) as eng:
        yield eng


def _split(page: int, cuts: list[int]) -> list[bytearray]:
    bounds = [0, *cuts, page]
    return [bytearray(b - a) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize(
    "algorithm", ["xxh3", "xxh64", "xxh128", "crc32"], ids=["xxh3", "xxh64", "xxh128", "crc32"]
)
def test_checksum_of_pieces_equals_checksum_of_their_concatenation(algorithm: str) -> None:
    data = os.urandom(70_000)
    pieces = [data[:1], data[1:4096], data[4096:65_537], data[65_537:]]
    assert checksum_pieces(pieces, algorithm) == checksum(data, algorithm)


@pytest.mark.parametrize(
    ("page_bytes", "cuts", "pages"),
    [
        (8192, [4096], list(range(8))),
        (5000, [1, 2500, 4999], [7, 3, 4, 5, 20]),
        (12288, [], [0]),
    ],
    ids=["two-aligned-pieces", "uneven-pieces-shuffled", "one-piece"],
)
def test_scattered_read_puts_each_byte_in_its_piece(
    tmp_path: Path, engine: PosixEngine, page_bytes: int, cuts: list[int], pages: list[int]
) -> None:
    rng = random.Random(page_bytes)
    data = [rng.randbytes(page_bytes) for _ in pages]
    with _page_file(tmp_path, page_bytes) as file:
        written = engine.write_pages(file, pages, data)
        pieces = [_split(page_bytes, cuts) for _ in pages]
        results = engine.read_pages_scattered(
            file, pages, pieces, expected=[w.checksum for w in written]
        )
    assert [r.ok for r in results] == [True] * len(pages)
    assert [b"".join(p) for p in pieces] == data


def test_scattered_read_detects_corruption(tmp_path: Path, engine: PosixEngine) -> None:
    with _page_file(tmp_path, 8192) as file:
        (written,) = engine.write_pages(file, [3], [os.urandom(8192)])
        os.pwrite(file.fd, b"\x00\x01", file.offset(3) + 5000)
        (result,) = engine.read_pages_scattered(
            file, [3], [_split(8192, [4096])], expected=[written.checksum]
        )
    assert (result.ok, result.error) == (False, ERROR_CHECKSUM)


def test_pieces_that_do_not_add_up_to_a_page_are_bounds_errors(
    tmp_path: Path, engine: PosixEngine
) -> None:
    with _page_file(tmp_path, 8192) as file:
        engine.write_pages(file, [1, 2], [os.urandom(8192)] * 2)
        results = engine.read_pages_scattered(
            file, [1, 2], [_split(8000, [4096]), _split(8192, [4096])]
        )
    assert [(r.ok, r.error) for r in results] == [(False, ERROR_BOUNDS), (True, None)]


def test_scattered_read_past_the_end_is_short(tmp_path: Path, engine: PosixEngine) -> None:
    with _page_file(tmp_path, 4096) as file:
        os.ftruncate(file.fd, file.offset(NUM_PAGES - 1) + 100)
        (result,) = engine.read_pages_scattered(file, [NUM_PAGES - 1], [_split(4096, [50])])
    assert (result.ok, result.error) == (False, ERROR_SHORT)


def test_more_pieces_than_iov_max_still_read(tmp_path: Path) -> None:
    page_bytes = 4096 * 2
    with _page_file(tmp_path, page_bytes) as file, PosixEngine(io_threads=1) as eng:
        eng._iov_max = 16  # a tiny IOV_MAX: one page needs several vectored calls
        data = [os.urandom(page_bytes) for _ in range(3)]
        written = eng.write_pages(file, [0, 1, 2], data)
        pieces = [_split(page_bytes, list(range(256, page_bytes, 256))) for _ in data]
        results = eng.read_pages_scattered(
            file, [0, 1, 2], pieces, expected=[w.checksum for w in written]
        )
    assert ([r.ok for r in results], [b"".join(p) for p in pieces]) == ([True] * 3, data)


@pytest.mark.parametrize(
    ("page_bytes", "cuts", "pages"),
    [
        (8192, [4096], list(range(8))),
        (5000, [1, 2500, 4999], [7, 3, 4, 5, 20]),
        (4 << 20, [1 << 20, 3 << 20], [0, 1, 5]),  # past a thread's share: split tasks
    ],
    ids=["two-aligned-pieces", "uneven-pieces-shuffled", "4mib-pages"],
)
def test_gathered_write_stores_the_pieces_as_one_page_with_its_checksum(
    tmp_path: Path, engine: PosixEngine, page_bytes: int, cuts: list[int], pages: list[int]
) -> None:
    rng = random.Random(page_bytes)
    data = [rng.randbytes(page_bytes) for _ in pages]
    bounds = [0, *cuts, page_bytes]
    pieces = [
        [memoryview(page)[a:b] for a, b in itertools.pairwise(bounds)] for page in data
    ]  # read-only views: a write may take them
    with _page_file(tmp_path, page_bytes) as file:
        written = engine.write_pages_gathered(file, pages, pieces)
        back = [bytearray(page_bytes) for _ in pages]
        read = engine.read_pages(file, pages, back, expected=[w.checksum for w in written])
    assert [w.ok for w in written] == [True] * len(pages)
    assert [w.checksum for w in written] == [checksum(page, "xxh3") for page in data]
    assert [r.ok for r in read] == [True] * len(pages) and back == data


def test_gathered_write_of_block_pieces_stores_what_a_gather_stages(
    tmp_path: Path, engine: PosixEngine
) -> None:
    """A KV block saved from its per-layer ranges is the page a gather would stage."""
    seg = KVSegment(
        buffer=torch.randint(0, 256, (2 * 3 * 5 * 4096 + 8,), dtype=torch.uint8),
        offset=8,
        layer_stride=5 * 8192,
        block_stride=8192,
        num_layers=3,
        num_blocks=5,
        page_size=4096,
    )
    blocks = [4, 0, 2]
    staged = torch.empty(len(blocks), seg.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([seg], blocks, staged)
    with _page_file(tmp_path, seg.page_bytes) as file:
        gathered = engine.write_pages_gathered(file, [0, 1, 2], page_pieces([seg], blocks))
        plain = engine.write_pages(file, [3, 4, 5], list(staged.numpy()))
        back = [bytearray(seg.page_bytes) for _ in range(3)]
        engine.read_pages(file, [0, 1, 2], back)
    assert [g.ok for g in gathered] == [p.ok for p in plain] == [True] * 3
    assert [g.checksum for g in gathered] == [p.checksum for p in plain]
    assert back == [bytes(row.numpy()) for row in staged]


def test_gathered_pieces_past_a_page_are_bounds_errors(tmp_path: Path, engine: PosixEngine) -> None:
    with _page_file(tmp_path, 8192) as file:
        results = engine.write_pages_gathered(
            file, [1, 2, NUM_PAGES], [[b"x" * 8192, b"y"], [b"z" * 100], [b"w" * 10]]
        )
    assert [(r.ok, r.error) for r in results] == [
        (False, ERROR_BOUNDS),
        (True, None),
        (False, ERROR_BOUNDS),
    ]


def test_page_pieces_name_the_bytes_gather_copies() -> None:
    seg = KVSegment(
        buffer=torch.randint(0, 256, (2 * 3 * 5 * 16 + 8,), dtype=torch.uint8),
        offset=8,
        layer_stride=5 * 32,
        block_stride=32,
        num_layers=3,
        num_blocks=5,
        page_size=16,
    )
    blocks = [4, 0, 2]
    out = torch.empty(len(blocks), seg.page_bytes, dtype=torch.uint8)
    gather_blocks_reference([seg], blocks, out)
    pieces = page_pieces([seg], blocks)
    assert [b"".join(p) for p in pieces] == [bytes(row.numpy()) for row in out]


def test_page_pieces_write_into_the_cache() -> None:
    buffer = torch.zeros(4 * 64, dtype=torch.uint8)
    seg = KVSegment(buffer, 0, 2 * 64, 64, num_layers=2, num_blocks=2, page_size=64)
    (pieces,) = page_pieces([seg], [1])
    for piece in pieces:
        piece[:] = b"\x07" * 64
    assert buffer.view(2, 2, 64)[:, 1].eq(7).all().item() and buffer.sum().item() == 7 * 128


def test_block_pieces_kept_across_calls_name_what_a_gather_copies_of_two_segments() -> None:
    segs = [
        KVSegment(torch.randint(0, 256, (2 * 4 * 16,), dtype=torch.uint8), 0, 64, 16, 2, 4, 16),
        KVSegment(torch.randint(0, 256, (3 * 4 * 8 + 4,), dtype=torch.uint8), 4, 8, 24, 3, 4, 8),
    ]
    kept = HostBlockPieces(segs)
    for blocks in ([3, 1], [0, 2, 3]):
        out = torch.empty(len(blocks), 2 * 16 + 3 * 8, dtype=torch.uint8)
        gather_blocks_reference(segs, blocks, out)
        assert [b"".join(p) for p in kept.pieces(blocks)] == [bytes(r.numpy()) for r in out]
    with pytest.raises(ValueError, match="outside"):
        kept.pieces([4])
