"""What every `hf3fsctl bench` sub-command shares: the document's frame, parsing, statistics.

A sub-command builds one JSON document (`run(...)`) carrying `benchmark`, `schema`,
`machine`, `settings`, the `ceiling` it is measured against (what it is, measured in the
same run) and figures with their ratio to that ceiling. Handing the document out —
tables, `--json`, `--plot` — is the CLI's (`hf3fsctl.cli.bench_output`).

Contract: the parsers raise `InvalidRequest` naming the flag; sizes take the same units
as every size in hf3fsctl (a bare number is bytes: `4096`, `64KiB`, `2MiB`).
"""

from __future__ import annotations

import math
import os
import platform
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hf3fsctl.errors import InvalidRequest

SCHEMA = 1
Progress = Callable[[str], None]


def machine() -> dict[str, Any]:
    """Facts about this machine that a figure depends on."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "platform": platform.platform(terse=True),
    }


def parse_ints(text: str, name: str, *, minimum: int = 1) -> list[int]:
    """`"1,4,16"` → `[1, 4, 16]` (order kept, duplicates dropped).

    Raises:
        InvalidRequest: naming `name` when an item is not an integer >= `minimum`.
    """
    values: list[int] = []
    for item in str(text).split(","):
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            raise InvalidRequest(
                f"{name}: {item!r} is not an integer; give a comma-separated list like 1,4,16"
            ) from None
        if value < minimum:
            raise InvalidRequest(f"{name}: {value} is below {minimum}")
        if value not in values:
            values.append(value)
    return values


def parse_sizes(text: str, name: str) -> list[int]:
    """`"4096,64KiB,2MiB"` → bytes, by the units of `--capacity` and every size key (a
    bare number is bytes; `k`/`KiB`, `M`/`MiB`, … are 1024-based, `kB`/`MB` 1000-based);
    order kept, duplicates dropped.

    Raises:
        InvalidRequest: naming `name` when an item is not a positive size.
    """
    from hf3fsctl.config import parse_size
    from hf3fsctl.errors import ConfigError

    values: list[int] = []
    for item in str(text).split(","):
        item = item.strip()
        try:
            value = parse_size(item, name)
        except ConfigError:
            raise InvalidRequest(
                f"{name}: {item!r} is not a size; give bytes or units, e.g. "
                "4096,64KiB,2MiB (a bare number is bytes, as for --capacity)"
            ) from None
        if value <= 0:
            raise InvalidRequest(f"{name}: sizes must be positive, got {item!r}")
        if value not in values:
            values.append(value)
    return values


def parse_choices(text: str, name: str, allowed: Sequence[str]) -> list[str]:
    """`"a,b"` → `["a", "b"]`, each one of `allowed` (order kept, duplicates dropped)."""
    values: list[str] = []
    for item in str(text).split(","):
        item = item.strip()
        if item not in allowed:
            raise InvalidRequest(f"{name}: {item!r} is not one of {', '.join(allowed)}")
        if item not in values:
            values.append(item)
    return values


def percentile(ordered: Sequence[float], share: float) -> float:
    """The nearest-rank percentile of an ascending sequence (`share` in 0..1)."""
    if not ordered:
        raise ValueError("no values")
    rank = max(1, math.ceil(share * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def latency_ms(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """p50, p99, p999, mean and max of latencies in seconds, as milliseconds."""
    ordered = sorted(latencies_s)
    if not ordered:
        return {"p50_ms": None, "p99_ms": None, "p999_ms": None, "mean_ms": None, "max_ms": None}
    return {
        "p50_ms": 1e3 * percentile(ordered, 0.50),
        "p99_ms": 1e3 * percentile(ordered, 0.99),
        "p999_ms": 1e3 * percentile(ordered, 0.999),
        "mean_ms": 1e3 * sum(ordered) / len(ordered),
        "max_ms": 1e3 * ordered[-1],
    }


def ratio(value: float | None, ceiling: float | None) -> float | None:
    """`value / ceiling`, None when either is missing or the ceiling is 0."""
    if value is None or not ceiling:
        return None
    return value / ceiling


def fmt(value: float | None, digits: int = 2) -> str:
    """A figure for a table cell (`-` when missing), with at most `digits` decimals."""
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def size_label(num_bytes: int) -> str:
    """`4096` → `4 KiB`, `1048576` → `1 MiB` (exact units for axis labels)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size} {unit}"
    return f"{num_bytes} B"


def work_directory(directory: str | Path | None, name: str) -> Path:
    """A fresh `hf3fsctl-bench-NAME-*` directory under `directory` (made if missing), or
    under the system's temporary directory."""
    parent = Path(directory) if directory else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"hf3fsctl-bench-{name}-", dir=parent))
