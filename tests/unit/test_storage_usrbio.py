"""The USRBIO engine against a MOCK of 3FS's `hf3fs_fuse.io` binding (no 3FS exists here).

The mock implements the binding's documented Python API with plain preadv/pwrite on the
registered descriptors, so these tests check our use of that API (iov slots, ring
prepare/submit/wait, fd registration, checksums), not 3FS itself.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hf3fsctl.storage.layout import PageFile
from hf3fsctl.storage.usrbio import UsrbioEngine

NS = "0123456789abcdef"
MOCK_NAME = "mock_hf3fs_usrbio"


@dataclass
class _MockCompletion:
    result: int
    userdata: Any


class _MockRing:
    def __init__(self, registered: set[int], for_read: bool) -> None:
        self.registered, self.for_read, self.pending = registered, for_read, []

    def prepare(self, iov: Any, for_read: bool, fd: int, offset: int, userdata: Any) -> None:
        assert for_read == self.for_read, "a ring only takes I/O of its own direction"
        assert fd in self.registered, "USRBIO needs register_fd before I/O"
        self.pending.append((memoryview(iov), fd, offset, userdata))

    def submit(self) -> _MockRing:
        return self

    def wait(self, min_results: int) -> list[_MockCompletion]:
        done, self.pending = self.pending, []
        assert len(done) >= min_results
        out = []
        for view, fd, offset, userdata in done:
            moved = os.preadv(fd, [view], offset) if self.for_read else os.pwrite(fd, view, offset)
            out.append(_MockCompletion(moved, userdata))
        return out


@pytest.fixture
def mock_binding(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    registered: set[int] = set()
    module = types.ModuleType(MOCK_NAME)
    module.make_iovec = lambda shm, mount, block_size, numa: memoryview(bytearray(shm.size))  # type: ignore[attr-defined]
    module.make_ioring = lambda mount, entries, for_read, depth: _MockRing(registered, for_read)  # type: ignore[attr-defined]
    module.register_fd = registered.add  # type: ignore[attr-defined]
    module.deregister_fd = registered.discard  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MOCK_NAME, module)
    yield types.SimpleNamespace(registered=registered)


@pytest.fixture
def usrbio(tmp_path: Path, mock_binding: types.SimpleNamespace) -> Iterator[UsrbioEngine]:
    engine = UsrbioEngine(root=tmp_path, iov_bytes=4 * 8192, binding=MOCK_NAME)
    yield engine
    engine.close()


def test_usrbio_round_trip_through_rounds_of_the_iov(tmp_path: Path, usrbio: UsrbioEngine) -> None:
    pages = [0, 5, 6, 7, 9, 11]  # more pages than the 4-slot iov holds
    data = [os.urandom(5000) for _ in pages]
    with PageFile.create(tmp_path, NS, 0, 5000, 16 * 8192) as file:
        written = usrbio.write_pages(file, pages, data)
        out = [bytearray(5000) for _ in pages]
        read = usrbio.read_pages(file, pages, out, expected=[w.checksum for w in written])
    assert all(r.ok for r in written + read)
    assert [bytes(b) for b in out] == data


def test_usrbio_detects_bytes_changed_on_disk(tmp_path: Path, usrbio: UsrbioEngine) -> None:
    with PageFile.create(tmp_path, NS, 0, 4096, 8 * 4096) as file:
        (written,) = usrbio.write_pages(file, [3], [os.urandom(4096)])
        os.pwrite(file.fd, b"\x00\x01", file.offset(3) + 7)
        (read,) = usrbio.read_pages(file, [3], [bytearray(4096)], expected=[written.checksum])
    assert (read.ok, read.error) == (False, "checksum")


def test_usrbio_reports_out_of_range_pages_as_bounds(tmp_path: Path, usrbio: UsrbioEngine) -> None:
    with PageFile.create(tmp_path, NS, 0, 4096, 8 * 4096) as file:
        results = usrbio.read_pages(file, [1, 8], [bytearray(4096), bytearray(4096)])
    assert [r.error for r in results] == [None, "bounds"]


def test_usrbio_deregisters_descriptors_on_close(
    tmp_path: Path, mock_binding: types.SimpleNamespace
) -> None:
    engine = UsrbioEngine(root=tmp_path, iov_bytes=8192, binding=MOCK_NAME)
    with PageFile.create(tmp_path, NS, 0, 4096, 8 * 4096) as file:
        engine.write_pages(file, [0], [bytes(4096)])
        assert mock_binding.registered == {file.fd}
        engine.close()
    assert mock_binding.registered == set()
