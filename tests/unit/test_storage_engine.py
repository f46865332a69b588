"""The POSIX I/O engine: round trips, checksums, short reads, neighbours, engine choice."""

from __future__ import annotations

import errno
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hf3fsctl.errors import InvalidRequest, StorageError
from hf3fsctl.storage import posix
from hf3fsctl.storage.checksum import page_checksum
from hf3fsctl.storage.engine import find_mount
from hf3fsctl.storage.factory import describe_engine_choice, open_engine
from hf3fsctl.storage.layout import PageFile, slot_bytes
from hf3fsctl.storage.posix import PosixEngine

NS = "0123456789abcdef"
NUM_PAGES = 64


def _page_file(root: Path, page_bytes: int) -> PageFile:
    return PageFile.create(root, NS, 0, page_bytes, NUM_PAGES * slot_bytes(page_bytes))


@pytest.fixture
def engine() -> Iterator[PosixEngine]:
    with PosixEngine(io_threads=4) as eng:
        yield eng


def _random_pages(rng: random.Random, count: int, page_bytes: int) -> list[bytes]:
    return [rng.randbytes(page_bytes) for _ in range(count)]


@pytest.mark.parametrize(
    ("page_bytes", "threads", "pages"),
    [
        (4096, 1, list(range(16))),
        (4096, 4, list(range(NUM_PAGES))),
        (5000, 4, list(range(10, 30))),
        (5000, 16, [63, 1, 7, 2, 3, 40, 41, 0]),
        (12288, 2, [5]),
        (3000, 3, list(range(0, NUM_PAGES, 3))),
    ],
    ids=[
        "aligned-serial",
        "aligned-all",
        "unaligned-run",
        "unaligned-shuffled",
        "single",
        "strided",
    ],
)
def test_pages_round_trip(tmp_path: Path, page_bytes: int, threads: int, pages: list[int]) -> None:
    rng = random.Random(page_bytes * 31 + threads)
    data = _random_pages(rng, len(pages), page_bytes)
    with _page_file(tmp_path, page_bytes) as file, PosixEngine(io_threads=threads) as eng:
        written = eng.write_pages(file, pages, data)
        out = [bytearray(page_bytes) for _ in pages]
        read = eng.read_pages(file, pages, out, expected=[w.checksum for w in written])
    assert [r.ok for r in written + read] == [True] * (2 * len(pages))
    assert [bytes(b) for b in out] == data


def test_results_come_back_in_request_order(tmp_path: Path, engine: PosixEngine) -> None:
    pages = [9, 3, 4, 5, 0]
    with _page_file(tmp_path, 4096) as file:
        results = engine.write_pages(file, pages, [bytes([p]) * 4096 for p in pages])
    assert [r.page for r in results] == pages


def test_small_pages_that_are_not_adjacent_never_wake_a_thread(tmp_path: Path) -> None:
    # Four runs of pages apart in the file are four tasks, but far less than one
    # thread's share (MIN_TASK_BYTES): the calling thread moves them all.
    page_bytes = 64 * 1024
    pages = [0, 1, 2, 10, 20, 21, 30]
    data = _random_pages(random.Random(7), len(pages), page_bytes)

    def io_threads() -> int:
        return sum(t.name.startswith("hf3fs-io") for t in threading.enumerate())

    before = io_threads()
    with _page_file(tmp_path, page_bytes) as file, PosixEngine(io_threads=16) as engine:
        written = engine.write_pages(file, pages, data)
        out = [bytearray(page_bytes) for _ in pages]
        read = engine.read_pages(file, pages, out, expected=[w.checksum for w in written])
        scattered = [[bytearray(page_bytes // 2), bytearray(page_bytes // 2)] for _ in pages]
        pieces = engine.read_pages_scattered(
            file, pages, scattered, expected=[w.checksum for w in written]
        )
        woken = io_threads() - before
    assert all(r.ok for r in written + read + pieces)
    assert [bytes(b) for b in out] == data == [bytes(a + b) for a, b in scattered]
    assert woken == 0


def test_a_buffered_write_runs_on_no_more_threads_than_the_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy into the page cache is CPU work: 16 io_threads on 2 CPUs write on 2 (the
    page writes and their checksums dealt between them); O_DIRECT keeps every thread."""
    monkeypatch.setattr(posix, "usable_cpus", lambda: 2)
    seen: set[int] = set()
    task, checksum_task = PosixEngine._task, posix._checksum_task

    def counted_task(self: PosixEngine, *args: object) -> object:
        seen.add(threading.get_ident())
        return task(self, *args)  # type: ignore[arg-type]

    def counted_checksums(ops: object, digests: object) -> object:
        seen.add(threading.get_ident())
        return checksum_task(ops, digests)  # type: ignore[arg-type]

    monkeypatch.setattr(PosixEngine, "_task", counted_task)
    monkeypatch.setattr(posix, "_checksum_task", counted_checksums)
    page_bytes = 4 << 20
    data = _random_pages(random.Random(3), 12, page_bytes)
    with _page_file(tmp_path, page_bytes) as file, PosixEngine(io_threads=16) as engine:
        assert engine.write_threads == 2
        written = engine.write_pages(file, list(range(12)), data)
        writers = len(seen)
        out = [bytearray(page_bytes) for _ in data]
        read = engine.read_pages(file, list(range(12)), out, expected=[w.checksum for w in written])
    assert all(r.ok for r in written + read) and [bytes(b) for b in out] == data
    assert [w.checksum for w in written] == [page_checksum(d) for d in data]
    assert 1 <= writers <= 2
    with PosixEngine(io_threads=16, o_direct=True) as direct:
        assert direct.write_threads == 16


def test_write_checksum_is_of_the_bytes_written(tmp_path: Path, engine: PosixEngine) -> None:
    payload = os.urandom(4096)
    with _page_file(tmp_path, 4096) as file:
        (result,) = engine.write_pages(file, [2], [payload])
    assert result.checksum == page_checksum(payload)


def test_writes_without_checksums_record_none(tmp_path: Path, engine: PosixEngine) -> None:
    with _page_file(tmp_path, 4096) as file:
        (result,) = engine.write_pages(file, [2], [bytes(4096)], checksums=False)
    assert (result.ok, result.checksum) == (True, None)


def test_numpy_and_memoryview_buffers_are_used_in_place(
    tmp_path: Path, engine: PosixEngine
) -> None:
    source = np.arange(2048, dtype=np.float16)  # 4096 bytes, not a byte format
    target = np.zeros(4096, dtype=np.uint8)
    with _page_file(tmp_path, 4096) as file:
        engine.write_pages(file, [0], [memoryview(source)])
        (result,) = engine.read_pages(file, [0], [target])
    assert result.ok
    assert target.tobytes() == source.tobytes()


def test_read_fills_only_page_bytes_of_a_longer_buffer(tmp_path: Path, engine: PosixEngine) -> None:
    with _page_file(tmp_path, 5000) as file:
        engine.write_pages(file, [0, 1], [b"a" * 5000, b"b" * 5000])
        out = bytearray(b"z" * 6000)
        engine.read_pages(file, [0], [out])
    assert out == b"a" * 5000 + b"z" * 1000


@pytest.mark.parametrize("page_bytes", [4096, 5000], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("batch", [[10], [9, 10, 11]], ids=["alone", "with-adjacent-batch"])
def test_writes_never_touch_neighbour_pages(
    tmp_path: Path, engine: PosixEngine, page_bytes: int, batch: list[int]
) -> None:
    with _page_file(tmp_path, page_bytes) as file:
        engine.write_pages(file, [8, 12], [b"L" * page_bytes, b"R" * page_bytes])
        engine.write_pages(file, batch, [b"\xff" * page_bytes] * len(batch))
        out = [bytearray(page_bytes), bytearray(page_bytes)]
        engine.read_pages(file, [8, 12], out)
    assert out == [b"L" * page_bytes, b"R" * page_bytes]


def test_short_write_leaves_the_rest_of_its_page(tmp_path: Path, engine: PosixEngine) -> None:
    with _page_file(tmp_path, 4096) as file:
        engine.write_pages(file, [1], [b"o" * 4096])
        engine.write_pages(file, [1, 2], [b"n" * 100, b"m" * 4096])
        out = bytearray(4096)
        engine.read_pages(file, [1], [out])
    assert out == b"n" * 100 + b"o" * 3996


@pytest.mark.parametrize(
    ("code", "no_space"),
    [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EIO, False)],
    ids=["enospc", "edquot", "eio"],
)
def test_a_write_the_os_refuses_keeps_its_errno(
    tmp_path: Path, engine: PosixEngine, monkeypatch: pytest.MonkeyPatch, code: int, no_space: bool
) -> None:
    def refused(*_: object) -> int:
        raise OSError(code, os.strerror(code))

    with _page_file(tmp_path, 4096) as file:
        monkeypatch.setattr(os, "pwritev", refused)
        [result] = engine.write_pages(file, [3], [b"x" * 4096])
    assert (result.ok, result.error, result.errno, result.no_space) == (False, "io", code, no_space)


def test_bytes_overwritten_on_disk_fail_the_checksum(tmp_path: Path, engine: PosixEngine) -> None:
    data = _random_pages(random.Random(1), 3, 4096)
    with _page_file(tmp_path, 4096) as file:
        written = engine.write_pages(file, [4, 5, 6], data)
        os.pwrite(file.fd, b"\x00garbage", file.offset(5) + 100)
        results = engine.read_pages(
            file,
            [4, 5, 6],
            [bytearray(4096) for _ in range(3)],
            expected=[w.checksum for w in written],
        )
    assert [(r.ok, r.error) for r in results] == [(True, None), (False, "checksum"), (True, None)]


def test_a_page_with_no_expected_checksum_is_not_verified(
    tmp_path: Path, engine: PosixEngine
) -> None:
    with _page_file(tmp_path, 4096) as file:
        engine.write_pages(file, [0, 1], [b"a" * 4096, b"b" * 4096])
        results = engine.read_pages(
            file, [0, 1], [bytearray(4096), bytearray(4096)], expected=[None, page_checksum(b"x")]
        )
    assert [(r.ok, r.checksum) for r in results] == [(True, None), (False, results[1].checksum)]


def test_malformed_expected_checksum_is_a_checksum_failure(
    tmp_path: Path, engine: PosixEngine
) -> None:
    with _page_file(tmp_path, 4096) as file:
        (result,) = engine.read_pages(file, [0], [bytearray(4096)], expected=["md5:abc"])
    assert (result.ok, result.error) == (False, "checksum")


@pytest.mark.parametrize("pages", [[62, 63], [61, 62, 63]], ids=["pair", "run"])
def test_read_past_truncated_end_is_short_not_garbage(
    tmp_path: Path, engine: PosixEngine, pages: list[int]
) -> None:
    with _page_file(tmp_path, 4096) as file:
        engine.write_pages(file, pages, [b"p" * 4096] * len(pages))
        os.ftruncate(file.fd, file.offset(63) + 1000)  # page 63 is cut short
        out = [bytearray(4096) for _ in pages]
        results = engine.read_pages(file, pages, out)
    assert [r.error for r in results] == [None] * (len(pages) - 1) + ["short"]
    assert [bytes(b) for b in out[:-1]] == [b"p" * 4096] * (len(pages) - 1)


@pytest.mark.parametrize(
    ("page", "buffer", "reading"),
    [
        (NUM_PAGES, bytearray(4096), True),
        (-1, bytearray(4096), True),
        (0, bytearray(100), True),
        (0, bytes(4096), True),
        (0, bytes(4097), False),
        (0, b"", False),
    ],
    ids=[
        "past-end",
        "negative",
        "read-buffer-small",
        "read-buffer-readonly",
        "write-too-big",
        "write-empty",
    ],
)
def test_invalid_pages_are_bounds_results_not_exceptions(
    tmp_path: Path, engine: PosixEngine, page: int, buffer: bytes, reading: bool
) -> None:
    with _page_file(tmp_path, 4096) as file:
        call = engine.read_pages if reading else engine.write_pages
        results = call(file, [1, page], [bytearray(4096), buffer])
    assert [(r.ok, r.error) for r in results] == [(True, None), (False, "bounds")]


def test_io_errors_are_attributed_per_page(tmp_path: Path, engine: PosixEngine) -> None:
    root = tmp_path / "rw"
    PageFile.create(root, NS, 0, 4096, NUM_PAGES * 4096).close()
    with PageFile.open(root, f"{NS}/rank-0000.pages", 4096, NUM_PAGES, writable=False) as file:
        results = engine.write_pages(file, [0, 1, 2], [bytes(4096)] * 3)
    assert [r.error for r in results] == ["io"] * 3


def test_mismatched_lengths_raise(tmp_path: Path, engine: PosixEngine) -> None:
    with _page_file(tmp_path, 4096) as file, pytest.raises(InvalidRequest):
        engine.read_pages(file, [0, 1], [bytearray(4096)])


def test_o_direct_round_trip_of_aligned_and_unaligned_buffers(tmp_path: Path) -> None:
    aligned = np.zeros(3 * 4096 + 4096, dtype=np.uint8)
    start = (-aligned.ctypes.data) % 4096
    aligned_view = memoryview(aligned)[start : start + 3 * 4096]
    data = [os.urandom(4096) for _ in range(3)]
    with _page_file(tmp_path, 4096) as file, PosixEngine(io_threads=2, o_direct=True) as eng:
        assert all(r.ok for r in eng.write_pages(file, [0, 1, 2], data))
        targets = [aligned_view[i * 4096 : (i + 1) * 4096] for i in range(3)]
        assert all(r.ok for r in eng.read_pages(file, [0, 1, 2], targets))
        unaligned = [bytearray(4097) for _ in range(3)]
        assert all(r.ok for r in eng.read_pages(file, [0, 1, 2], unaligned))
    assert aligned_view.tobytes() == b"".join(data)
    assert [bytes(b[:4096]) for b in unaligned] == data


def test_closed_engine_refuses_work(tmp_path: Path) -> None:
    eng = PosixEngine(io_threads=2)
    eng.close()
    with _page_file(tmp_path, 4096) as file, pytest.raises(StorageError):
        eng.read_pages(file, [0], [bytearray(4096)])


MOUNTS = """\
/dev/vda / ext4 rw 0 0
hf3fs.cluster /mnt/3fs fuse.hf3fs rw 0 0
tmpfs /mnt/3fs\\040scratch tmpfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/mnt/3fs/kv/not-yet-created", ("/mnt/3fs", "fuse.hf3fs")),
        ("/mnt/3fs scratch/x", ("/mnt/3fs scratch", "tmpfs")),
        ("/mnt/3fsx", ("/", "ext4")),
    ],
    ids=["under-3fs", "escaped-space", "prefix-is-not-parent"],
)
def test_find_mount_picks_the_longest_enclosing_mount(path: str, expected: tuple[str, str]) -> None:
    assert find_mount(path, MOUNTS) == expected


def test_auto_is_posix_off_3fs_and_says_why(tmp_path: Path) -> None:
    choice = describe_engine_choice("auto", tmp_path)
    assert choice["engine"] == "posix"
    assert "not a 3FS mount" in choice["reason"]


def test_usrbio_requested_where_unavailable_raises_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="usrbio requested but unavailable"):
        open_engine("usrbio", root=tmp_path)


def test_open_engine_rejects_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        open_engine("spdk", root=tmp_path)
