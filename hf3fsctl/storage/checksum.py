"""Page checksums: ``"<algorithm>:<hex digest>"`` strings over a buffer's bytes.

Contract:
    * `page_checksum` hashes exactly the bytes of the buffer it is given (no copy) with
      xxh3-64 and returns ``"xxh3:<16 hex digits>"``; that is what commit records.
    * `verify` recomputes with the algorithm named by the expected string's prefix
      (``xxh3``, ``xxh64``, ``xxh128``, ``crc32``) and compares; an unknown or malformed
      checksum string raises `InvalidRequest` rather than passing or failing silently.
    * `checksum_pieces` hashes several buffers as if concatenated (streaming, no copy);
      `checksum_views` the same for byte views an engine already checked.
    * All accept any C-contiguous object supporting the buffer protocol (bytes,
      bytearray, memoryview, numpy arrays). xxhash releases the GIL while hashing, so
      callers may verify from I/O threads in parallel.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from hf3fsctl.errors import InvalidRequest

DEFAULT_ALGORITHM = "xxh3"
_CHECKSUM_RE = re.compile(r"^([a-z0-9_]+):([0-9a-f]+)$")


def _crc32(data: Any) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


_ALGORITHMS: dict[str, Callable[[Any], str]] = {
    "xxh3": lambda data: xxhash.xxh3_64_hexdigest(data),
    "xxh64": lambda data: xxhash.xxh64_hexdigest(data),
    "xxh128": lambda data: xxhash.xxh3_128_hexdigest(data),
    "crc32": _crc32,
}


def supported_algorithms() -> tuple[str, ...]:
    """Names of the algorithms `checksum` and `verify` accept."""
    return tuple(_ALGORITHMS)


def checksum(buffer: Any, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The checksum string of `buffer` under `algorithm`.

    Args:
        buffer: any C-contiguous buffer-protocol object.
        algorithm: one of `supported_algorithms()`.

    Returns:
        ``"<algorithm>:<hex digest>"``.
    """
    try:
        digest = _ALGORITHMS[algorithm]
    except KeyError:
        raise InvalidRequest(
            f"unknown checksum algorithm {algorithm!r}; expected one of {', '.join(_ALGORITHMS)}"
        ) from None
    return f"{algorithm}:{digest(_as_bytes_view(buffer))}"


_STREAMING: dict[str, Callable[[], Any]] = {
    "xxh3": xxhash.xxh3_64,
    "xxh64": xxhash.xxh64,
    "xxh128": xxhash.xxh3_128,
}


def checksum_pieces(pieces: Sequence[Any], algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The checksum of the concatenation of `pieces`, without concatenating them.

    Equal to ``checksum(b"".join(pieces), algorithm)``: a page read straight into its
    scattered destinations is verified against the checksum its writer recorded.

    Args:
        pieces: C-contiguous buffer-protocol objects, in page order.
        algorithm: one of `supported_algorithms()`.
    """
    if len(pieces) == 1:
        return checksum(pieces[0], algorithm)
    if algorithm == "crc32":
        crc = 0
        for piece in pieces:
            crc = zlib.crc32(_as_bytes_view(piece), crc)
        return f"crc32:{crc & 0xFFFFFFFF:08x}"
    try:
        state = _STREAMING[algorithm]()
    except KeyError:
        raise InvalidRequest(
            f"unknown checksum algorithm {algorithm!r}; expected one of {', '.join(_ALGORITHMS)}"
        ) from None
    for piece in pieces:
        state.update(_as_bytes_view(piece))
    return f"{algorithm}:{state.hexdigest()}"


def checksum_views(views: Sequence[memoryview], algorithm: str = DEFAULT_ALGORITHM) -> str:
    """`checksum_pieces` of byte views the caller already checked (1-D, C-contiguous,
    format "B"): an engine's verify pass, without checking each piece again."""
    new = _STREAMING.get(algorithm)
    if new is None:  # crc32, or unknown (which `checksum_pieces` refuses)
        return checksum_pieces(views, algorithm)
    state = new()
    for view in views:
        state.update(view)
    return f"{algorithm}:{state.hexdigest()}"


def page_checksum(buffer: Any) -> str:
    """The checksum recorded for a page: ``"xxh3:<16 hex>"`` of the buffer's bytes."""
    return checksum(buffer, DEFAULT_ALGORITHM)


def verify(buffer: Any, expected: str) -> bool:
    """Whether `buffer`'s bytes match the checksum string `expected`.

    Raises:
        InvalidRequest: `expected` is malformed or names an unknown algorithm.
    """
    match = _CHECKSUM_RE.match(expected) if isinstance(expected, str) else None
    if match is None:
        raise InvalidRequest(f"checksum {expected!r} is malformed; expected '<algorithm>:<hex>'")
    return checksum(buffer, match.group(1)) == expected


def _as_bytes_view(buffer: Any) -> memoryview:
    view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if not view.c_contiguous:
        raise InvalidRequest("cannot checksum a non-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
