"""Page checksums: format, algorithms, and that any changed byte is caught."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from hf3fsctl.errors import InvalidRequest
from hf3fsctl.storage.checksum import checksum, page_checksum, supported_algorithms, verify

PAYLOAD = bytes(range(256)) * 40


def test_page_checksum_is_xxh3_with_16_hex_digits() -> None:
    assert page_checksum(PAYLOAD) == f"xxh3:{xxhash.xxh3_64_hexdigest(PAYLOAD)}"
    assert len(page_checksum(PAYLOAD).split(":")[1]) == 16


@pytest.mark.parametrize(
    "wrap",
    [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.float16)],
    ids=["bytes", "bytearray", "memoryview", "numpy-float16"],
)
def test_checksum_covers_the_bytes_whatever_the_buffer_type(wrap: object) -> None:
    assert page_checksum(wrap(PAYLOAD)) == page_checksum(PAYLOAD)  # type: ignore[operator]


@pytest.mark.parametrize("algorithm", supported_algorithms(), ids=supported_algorithms())
def test_verify_accepts_each_algorithm_it_supports(algorithm: str) -> None:
    assert verify(PAYLOAD, checksum(PAYLOAD, algorithm))


@pytest.mark.parametrize("position", [0, 5000, len(PAYLOAD) - 1], ids=["first", "middle", "last"])
def test_verify_rejects_a_single_flipped_byte(position: int) -> None:
    expected = page_checksum(PAYLOAD)
    damaged = bytearray(PAYLOAD)
    damaged[position] ^= 0x01
    assert not verify(damaged, expected)


@pytest.mark.parametrize(
    "expected",
    ["", "deadbeef", "md5:0123", "xxh3:XYZ", None],
    ids=["empty", "no-prefix", "unknown-algorithm", "not-hex", "none"],
)
def test_verify_refuses_malformed_checksums(expected: str) -> None:
    with pytest.raises(InvalidRequest):
        verify(PAYLOAD, expected)


def test_non_contiguous_buffers_are_refused() -> None:
    strided = np.arange(100, dtype=np.uint8)[::2]
    with pytest.raises(InvalidRequest):
        page_checksum(strided)
