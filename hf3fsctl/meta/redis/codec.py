"""How the Redis store writes keys, checksums and entries (format 4): bytes, converted once
at the Python boundary.

- A block key (hex text, `keys.KEY_RE`) is stored as its bytes: 64 hex digits are 32
  bytes in every hash field, sorted-set member and change-log run. A key of an odd number
  of digits has no byte form; it is stored as its text padded with NULs to 65 bytes, a
  length no even key reaches (128 digits are 64 bytes), so the mapping stays one to one.
- A checksum `"xxh3:" + 16 hex digits` (what `storage.checksum.page_checksum` records)
  is stored as 9 bytes (`\\x01` then the digest); any other is stored as its text.
- An entry is `lua/common.lua`'s `ENTRY` (`<BI7I5I2I5I5I3I5I5I4I5f`, then the checksum:
  times in ms since `EPOCH_MS`, `until` in µs, 0 for none; the key's LRU generation in 5
  bytes): 60 bytes with an xxh3 checksum, one 64-byte allocation. Flags and `until` lead: a committed entry without an
  expiry starts with 0x01 and seven zero bytes, all `entry_counts` reads of it (`lookup`
  takes its `HMGET` as bytes: decoding 1,000 binary values would cost more than the
  rest).

redis-py hands replies over decoded (`decode_responses=True`, `surrogateescape`), so
`raw(text)` gives back the bytes Redis holds.
"""

from __future__ import annotations

import re
import struct
from typing import Any

_ODD_KEY_BYTES = 65  # an odd-length key's text is padded to this (even keys: at most 64)
_XXH3 = re.compile(r"^xxh3:[0-9a-f]{16}$")
_XXH3_TAG = b"\x01"
# flags, until, page, depth, created, last_access, hits, lease_until, page_free_at, size,
# generation, retention: the 3-, 5- and 7-byte integers are read as bytes (struct has none)
_ENTRY = struct.Struct("<B7s5sH5s5s3s5s5sI5sf")
ENTRY_BYTES = _ENTRY.size
FOREVER = b"\x01" + bytes(7)  # committed, no expiry: how such an entry starts
EPOCH_MS = 1_735_689_600_000  # 2025-01-01 UTC: entries' times count from it
COMMITTED, RENEW = 1, 2  # flag bits


def raw(text: str) -> bytes:
    """The bytes behind a reply redis-py decoded with `surrogateescape`."""
    return text.encode("utf-8", "surrogateescape")


def encode_key(key: str) -> bytes:
    """A block key's stored form (bytes of its hex digits; odd length: padded text)."""
    if len(key) % 2 == 0:
        return bytes.fromhex(key)
    return key.encode().ljust(_ODD_KEY_BYTES, b"\0")


def decode_key(stored: bytes | str) -> str:
    """The hex key of a stored one (a reply's text or its bytes)."""
    data = raw(stored) if isinstance(stored, str) else stored
    if len(data) >= _ODD_KEY_BYTES:
        return data.rstrip(b"\0").decode()
    return data.hex()


def encode_checksum(checksum: str) -> bytes:
    """A checksum's stored form (an xxh3 digest in 9 bytes, else its text)."""
    if _XXH3.match(checksum):
        return _XXH3_TAG + bytes.fromhex(checksum[5:])
    return checksum.encode("utf-8", "surrogateescape")


def decode_checksum(stored: bytes | str) -> str:
    """The checksum text of a stored one."""
    data = raw(stored) if isinstance(stored, str) else stored
    if len(data) == 9 and data[:1] == _XXH3_TAG:
        return "xxh3:" + data[1:].hex()
    return data.decode("utf-8", "replace")


def _int(data: bytes) -> int:
    return int.from_bytes(data, "little")


def _ms(data: bytes) -> int:
    """An entry's time: ms since 1970 (0: none)."""
    value = int.from_bytes(data, "little")
    return value + EPOCH_MS if value else 0


def _until_ms(data: bytes) -> float:
    """An entry's `until`: ms since 1970, to the µs (0: none)."""
    value = int.from_bytes(data, "little")
    return value / 1000 + EPOCH_MS if value else 0.0


def unpack_entry(value: str) -> dict[str, Any]:
    """An entry's fields, times in seconds (as stored: whole milliseconds)."""
    data = raw(value)
    flags, until, page, depth, created, last, hits, lease, free_at, size, gen, retention = (
        _ENTRY.unpack_from(data)
    )
    committed = bool(flags & COMMITTED)
    expires = _until_ms(until) if committed else 0
    return {
        "state": flags & COMMITTED,
        "renew": bool(flags & RENEW),
        "page": _int(page),
        "depth": depth,
        "created": _ms(created) / 1000,
        "last_access": _ms(last) / 1000,
        "hits": _int(hits),
        "deadline": 0.0 if committed else _until_ms(until) / 1000,
        "expires_at": expires / 1000 if expires else None,
        "lease_until": _ms(lease) / 1000,
        "page_free_at": _ms(free_at) / 1000,
        "size": size,
        "generation": _int(gen),
        "retention": float(retention),
        "checksum": decode_checksum(data[ENTRY_BYTES:]) if len(data) > ENTRY_BYTES else "",
    }


def entry_counts(value: bytes | str | None, now_ms: float) -> bool:
    """Whether an entry (of a one-rank namespace's `e:NS:0`, as `lookup` reads it: bytes)
    is committed and unexpired at `now_ms`, from its flags and `until` alone."""
    if value is None:
        return False
    data = raw(value) if isinstance(value, str) else value
    if data.startswith(FOREVER):  # the common case
        return True
    if not data[0] & COMMITTED:
        return False
    until = _until_ms(data[1:8])
    return until == 0 or until > now_ms


def committed_counts(value: bytes | str | None, num_ranks: int, now_ms: float) -> bool:
    """Whether a `c:NS` value ("RANKS GEN" or "RANKS GEN EXPIRY_MS": the ranks committed,
    the key's LRU generation, its earliest expiry) says the key is committed on every rank
    and unexpired at `now_ms`."""
    if value is None:
        return False
    text = value.decode() if isinstance(value, bytes) else value
    count, _, rest = text.partition(" ")
    expiry = rest.partition(" ")[2]
    return int(count) >= num_ranks and (not expiry or float(expiry) > now_ms)


def decode_run(keys: str) -> list[str]:
    """The hex keys of a change-log run's `keys` field (each key's length as one byte,
    then its bytes)."""
    data = raw(keys)
    out = []
    at = 0
    while at < len(data):
        size = data[at]
        out.append(decode_key(data[at + 1 : at + 1 + size]))
        at += 1 + size
    return out
