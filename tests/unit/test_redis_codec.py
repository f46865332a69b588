"""The Redis store's stored forms (format 4, `hf3fsctl/meta/redis/codec.py`): keys and
checksums as bytes, one to one with their text; entries and change-log runs read back as
`lua/common.lua` writes them. No Redis needed: the bytes are built here the way the
scripts build them (`struct` layouts, little-endian)."""

from __future__ import annotations

import struct

import pytest

from hf3fsctl.meta.redis.codec import (
    EPOCH_MS,
    committed_counts,
    decode_checksum,
    decode_key,
    decode_run,
    encode_checksum,
    encode_key,
    entry_counts,
    unpack_entry,
)

KEYS = [
    "00" * 32,  # 64 digits: 32 bytes
    "ff" * 64,  # the longest key: 64 bytes
    "0123456789abcdef",  # the shortest: 8 bytes
    "0123456789abcdef0",  # odd: no byte form
    "f" * 127,  # the longest odd key
]


def _text(data: bytes) -> str:
    """What redis-py hands over for `data` (`decode_responses`, `surrogateescape`)."""
    return data.decode("utf-8", "surrogateescape")


def _entry(
    flags: int, until_us: int, page: int = 7, checksum: bytes = b"", generation: int = 9
) -> bytes:
    """An entry as `common.lua` packs it: `<BI7I5I2I5I5I3I5I5I4I5f`, then the checksum."""

    def le(value: int, size: int) -> bytes:
        return value.to_bytes(size, "little")

    return (
        bytes([flags])
        + le(until_us, 7)
        + le(page, 5)
        + struct.pack("<H", 3)  # depth
        + le(1000, 5)  # created, ms after the epoch
        + le(2000, 5)  # last access
        + le(5, 3)  # hits
        + le(0, 5)  # lease_until
        + le(0, 5)  # page_free_at
        + struct.pack("<I", 4096)  # size
        + le(generation, 5)  # the key's LRU generation
        + struct.pack("<f", 0.5)  # retention
        + checksum
    )


@pytest.mark.parametrize("key", KEYS, ids=["32-bytes", "64-bytes", "8-bytes", "odd", "odd-127"])
def test_a_key_is_stored_as_bytes_and_read_back_as_itself(key: str) -> None:
    stored = encode_key(key)
    assert len(stored) == (len(key) // 2 if len(key) % 2 == 0 else max(65, len(key)))
    assert decode_key(stored) == key
    assert decode_key(_text(stored)) == key  # as a reply carries it


def test_no_two_keys_share_a_stored_form() -> None:
    odd = "3031323334353637383"  # odd: its text is bytes an even key could be …
    even = "30313233343536373833"
    assert encode_key(odd) != encode_key(even)  # … but odd keys are padded past 64 bytes
    assert len({encode_key(k) for k in KEYS}) == len(KEYS)


@pytest.mark.parametrize(
    ("checksum", "size"),
    [("xxh3:0123456789abcdef", 9), ("xxh3:00", 7), ("sha256:ab", 9), ("x", 1)],
    ids=["xxh3-packed", "xxh3-short", "other", "opaque"],
)
def test_a_checksum_round_trips(checksum: str, size: int) -> None:
    stored = encode_checksum(checksum)
    assert len(stored) == size
    assert decode_checksum(_text(stored)) == checksum


def test_an_entry_reads_back_its_fields() -> None:
    expires_us = 123_456_789
    stored = _entry(3, expires_us, page=(1 << 40) - 1, checksum=b"\x01" + bytes(8))
    assert len(stored) == 60  # one 64-byte allocation with its string header
    e = unpack_entry(_text(stored))
    assert (e["state"], e["renew"], e["page"], e["depth"], e["hits"], e["size"]) == (
        1,
        True,
        (1 << 40) - 1,
        3,
        5,
        4096,
    )
    assert e["generation"] == 9
    assert e["created"] == (EPOCH_MS + 1000) / 1000
    assert e["expires_at"] == pytest.approx((EPOCH_MS + expires_us / 1000) / 1000, abs=1e-6)
    assert e["retention"] == 0.5
    assert e["checksum"] == "xxh3:" + "00" * 8
    pending = unpack_entry(_text(_entry(0, expires_us)))
    assert pending["expires_at"] is None and pending["deadline"] > 0  # until: the deadline


def test_a_lookup_counts_committed_unexpired_entries_only() -> None:
    now_ms = float(EPOCH_MS + 10_000)
    forever = _text(_entry(1, 0, checksum=b"\xff" * 9))
    later = _text(_entry(1, 10_001_000))  # µs after the epoch: 1 ms after now
    gone = _text(_entry(1, 10_000_000))  # exactly now: expired
    pending = _text(_entry(0, 0))
    assert [entry_counts(v, now_ms) for v in (forever, later, gone, pending, None)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    # `c:NS`: "RANKS GEN[ EXPIRY_MS]"
    assert committed_counts("2 7", 2, now_ms) and not committed_counts("1 7", 2, now_ms)
    assert committed_counts(f"2 7 {now_ms + 1:.3f}", 2, now_ms)
    assert not committed_counts(f"2 7 {now_ms:.3f}", 2, now_ms)


def test_a_change_log_run_reads_back_its_keys() -> None:
    run = b"".join(bytes([len(encode_key(k))]) + encode_key(k) for k in KEYS)
    assert decode_run(_text(run)) == KEYS
