"""Sizes, shares and durations as people write them: `64GiB`, `4k`, `50%`, `5m`, `1h`.

Contract: every parser raises `ConfigError` naming the key and the accepted forms; a bare
number is bytes everywhere (config keys, `--capacity`, `bench --sizes`) and seconds for
a duration (`retention.default`, a request's `retention`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hf3fsctl.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, key: str = "size") -> int:
    """Parse `64GiB`, `512 MiB`, `4k` or a plain integer into bytes.

    Raises:
        ConfigError: naming `key` when the value is not a size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not a size; use bytes or a unit like 64GiB")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: {value!r} is negative; sizes are >= 0")
        return value
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"{key}: {value!r} is not a size; use bytes or a unit like 64GiB, 512MiB, 4k"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The longest duration taken: 100 years (a store's expiry fields hold far more).
MAX_DURATION_S = 100 * 365 * 86400.0


def parse_duration(value: object, key: str = "duration") -> float:
    """Parse seconds (`90`, `2.5`) or `90s`, `5m`, `1h`, `7d`, `1w` into seconds (> 0).

    Raises:
        ConfigError: naming `key` when the value is not a positive duration of at most
            `MAX_DURATION_S`.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not a duration; use seconds or 90s, 5m, 1h, 7d")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION_RE.match(str(value).lower())
        if match is None:
            raise ConfigError(f"{key}: {value!r} is not a duration; use seconds or 90s, 5m, 1h, 7d")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{key}: {value!r} is not a positive duration")
    if seconds > MAX_DURATION_S:
        raise ConfigError(f"{key}: {value!r} is longer than 100 years")
    return seconds


_SHARE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class Amount:
    """A size in bytes (`2TiB`) or a share of something larger (`50%`)."""

    bytes: int | None = None
    share: float | None = None

    def of(self, whole: int) -> int:
        """Bytes this amount means against `whole` (a share's base)."""
        if self.bytes is not None:
            return self.bytes
        return int((self.share or 0.0) * whole)

    def __str__(self) -> str:
        if self.share is not None:
            return f"{self.share * 100:g}%"
        return format_size(self.bytes or 0)


def parse_amount(value: object, key: str = "size") -> Amount:
    """Parse `2TiB`, `512MiB`, plain bytes, or a share `50%` (0 < share <= 100%).

    Raises:
        ConfigError: naming `key` when the value is neither.
    """
    match = _SHARE_RE.match(str(value)) if not isinstance(value, (bool, int)) else None
    if match is not None:
        share = float(match.group(1)) / 100
        if not 0 < share <= 1:
            raise ConfigError(f"{key}: {value!r} must be a share above 0% and at most 100%")
        return Amount(share=share)
    try:
        return Amount(bytes=parse_size(value, key))
    except ConfigError:
        raise ConfigError(
            f"{key}: {value!r} is neither a size (2TiB, 512MiB) nor a share (50%)"
        ) from None


def format_size(num_bytes: float) -> str:
    """Format bytes for people: `1.5 GiB`."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
