"""What every `hf3fsctl bench` sub-command shares: parsing, statistics, output, plots.

A sub-command builds one JSON document (`run(...)`), and `publish` hands it out:

- people get Rich tables (`render(document)`) on stdout, progress lines on stderr;
- `--json` prints exactly that document on stdout and nothing else (no tables, no
  progress); `--json-out PATH` also writes it to a file (either, both, or neither);
- `--plot PATH` writes a PNG (`plot(document, path)`), drawn with matplotlib's Agg
  canvas (no display, no pyplot global state). matplotlib is imported only when a plot
  is asked for, and `require_plotting` checks for it before a run starts, so a missing
  matplotlib fails in a second, not after the benchmark.

Every document carries `benchmark`, `schema`, `machine`, `settings`, the `ceiling` it
is measured against (what it is, measured in the same run) and figures with their
ratio to that ceiling.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf3fsctl.errors import InvalidRequest

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import RenderableType

SCHEMA = 1
Renderer = Callable[[dict[str, Any]], "RenderableType"]
Plotter = Callable[[dict[str, Any], Path], None]
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
    """`"256k,1MiB,4MiB"` → bytes (a bare number is KiB); order kept, duplicates dropped.

    Raises:
        InvalidRequest: naming `name` when an item is not a positive size.
    """
    from hf3fsctl.config import parse_size
    from hf3fsctl.errors import ConfigError

    values: list[int] = []
    for item in str(text).split(","):
        item = item.strip()
        try:
            value = int(item) * 1024 if item.isdigit() else parse_size(item, name)
        except ConfigError:
            raise InvalidRequest(
                f"{name}: {item!r} is not a size; give e.g. 256k,1MiB,4MiB (a bare number is KiB)"
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


# --- output ---------------------------------------------------------------------------


def progress_printer(enabled: bool) -> Progress:
    """A progress-line printer on stderr (a no-op when disabled, e.g. under `--json`)."""
    if not enabled:
        return lambda message: None
    from hf3fsctl.cli import output

    return output.info


def write_json(document: dict[str, Any], path: Path | None) -> None:
    """The document on stdout (`path` None: the only thing on stdout) or into a file."""
    if path is None:
        from hf3fsctl.cli import output

        output.print_json(document)
        return
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    except OSError as exc:
        raise InvalidRequest(f"cannot write the JSON document to {path}: {exc.strerror}") from None


def publish(
    document: dict[str, Any],
    *,
    render: Renderer,
    plot: Plotter,
    json_stdout: bool = False,
    json_path: Path | None = None,
    plot_path: Path | None = None,
) -> None:
    """Hand a finished document out: the plot first (its path goes into the document),
    then the JSON file, then stdout (the document under `json_stdout`, else tables)."""
    if plot_path is not None:
        plot(document, Path(plot_path))
        document["plot"] = str(plot_path)
    if json_path is not None:
        write_json(document, Path(json_path))
    if json_stdout:
        write_json(document, None)
        return
    from hf3fsctl.cli import output

    output.show(render(document))
    if json_path is not None:
        output.info(f"JSON document written to {json_path}")
    if plot_path is not None:
        output.info(f"plot written to {plot_path}")


def run_and_publish(
    bench: Any,
    settings_type: Any,
    *,
    quick: bool,
    overrides: dict[str, Any],
    fixed: dict[str, Any],
    json_stdout: bool,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """Build a sub-command's settings, run it and hand its document out.

    Args:
        bench: the `hf3fsctl.bench` module (its `run`, `render` and `plot`).
        settings_type: its settings class (with a `quick(...)` constructor).
        quick: start from `settings_type.quick` (else from the class defaults).
        overrides: flags that replace a default only when given (None: not given).
        fixed: settings passed as they are.
    """
    if quick:
        settings = settings_type.quick(**overrides, **fixed)
    else:
        given = {k: v for k, v in overrides.items() if v is not None}
        settings = settings_type(**given, **fixed)
    document = bench.run(settings, progress=progress_printer(not json_stdout))
    publish(
        document,
        render=bench.render,
        plot=bench.plot,
        json_stdout=json_stdout,
        json_path=json_path,
        plot_path=plot_path,
    )


# --- plots ----------------------------------------------------------------------------


def require_plotting() -> None:
    """Fail fast when `--plot` cannot be honoured (matplotlib missing).

    Raises:
        InvalidRequest: matplotlib is not installed here.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InvalidRequest(
            "--plot needs matplotlib, which is not installed here",
            hint="pip install matplotlib (it comes with hf3fsctl[dev]), or drop --plot",
        ) from None


def figure(width: float, height: float) -> Figure:
    """A matplotlib figure on an Agg canvas (no display, no pyplot state)."""
    require_plotting()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path) -> None:
    """Write `fig` as a PNG at `path` (directories created)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=110)
    except OSError as exc:
        raise InvalidRequest(f"cannot write the plot to {path}: {exc.strerror}") from None


def size_label(num_bytes: int) -> str:
    """`4096` → `4 KiB`, `1048576` → `1 MiB` (exact units for axis labels)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size} {unit}"
    return f"{num_bytes} B"
