"""Handing a benchmark's document out: Rich tables, `--json`, `--json-out`, `--plot`.

- people get Rich tables (the sub-command's `render(document)`) on stdout, progress
  lines on stderr;
- `--json` prints exactly that document on stdout and nothing else (no tables, no
  progress); `--json-out PATH` also writes it to a file (either, both, or neither);
- `--plot PATH` writes a PNG (`plot(document, path)`), drawn with matplotlib's Agg
  canvas (no display, no pyplot global state). matplotlib is imported only when a plot
  is asked for, and `require_plotting` checks for it before a run starts, so a missing
  matplotlib fails in a second, not after the benchmark.

The measurements are `hf3fsctl.bench`; it imports nothing from the CLI.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf3fsctl.bench.report import Progress
from hf3fsctl.cli import output
from hf3fsctl.errors import InvalidRequest

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import RenderableType

Renderer = Callable[[dict[str, Any]], "RenderableType"]
Plotter = Callable[[dict[str, Any], Path], None]
Runner = Callable[..., dict[str, Any]]


def progress_printer(enabled: bool) -> Progress:
    """A progress-line printer on stderr (a no-op when disabled, e.g. under `--json`)."""
    if not enabled:
        return lambda message: None
    return output.info


def write_json(document: dict[str, Any], path: Path | None) -> None:
    """The document on stdout (`path` None: the only thing on stdout) or into a file."""
    if path is None:
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
    output.show(render(document))
    if json_path is not None:
        output.info(f"JSON document written to {json_path}")
    if plot_path is not None:
        output.info(f"plot written to {plot_path}")


def run_and_publish(
    run: Runner,
    settings_type: Any,
    *,
    quick: bool,
    overrides: dict[str, Any],
    fixed: dict[str, Any],
    json_stdout: bool,
    json_path: Path | None,
    plot_path: Path | None,
    render: Renderer,
    plot: Plotter,
) -> None:
    """Build a sub-command's settings, run it and hand its document out.

    Args:
        run: the sub-command's `run(settings, progress=...)`.
        settings_type: its settings class (with a `quick(...)` constructor).
        quick: start from `settings_type.quick` (else from the class defaults).
        overrides: flags that replace a default only when given (None: not given).
        fixed: settings passed as they are.
        render: its tables; plot: its PNG.
    """
    if quick:
        settings = settings_type.quick(**overrides, **fixed)
    else:
        given = {k: v for k, v in overrides.items() if v is not None}
        settings = settings_type(**given, **fixed)
    document = run(settings, progress=progress_printer(not json_stdout))
    publish(
        document,
        render=render,
        plot=plot,
        json_stdout=json_stdout,
        json_path=json_path,
        plot_path=plot_path,
    )


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
