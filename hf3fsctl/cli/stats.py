"""`hf3fsctl stats`: capacity, usage, hit rates and namespaces of the store.

The summary shows keys turned away by admission (`admission skipped`) and keys with an
expiry (`expiring`, how many expired) when there are any; every namespace's figures are
in `--json` (`admission_skipped`, `expiring_keys`, `expired_keys`).

`--json` prints one document: the store's `StoreStats` plus derived fields (usage,
per-namespace lookup hit rate, the namespace's recorded writers) and the metadata URL,
and `warnings` (a namespace written by engines with other numerics: `cli/writers.py`). `--watch SECONDS` redraws the
tables until Ctrl-C or SIGTERM, which exit 0: in place at a terminal (Rich Live), else
one full snapshot after another (not with `--json`, which is one document). The store is
opened read-only: this works on a read-only mount.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import context, output
from hf3fsctl.cli.options import ConfigOpt, JsonOpt
from hf3fsctl.cli.writers import Writers, read_writers
from hf3fsctl.errors import InvalidRequest

if TYPE_CHECKING:
    from rich.console import RenderableType

    from hf3fsctl.meta.models import NamespaceStats, StoreStats, WriterInfo


def storage_space(path: str) -> dict[str, Any]:
    """The storage root and its file system's free space (None where it is not mounted here)."""
    import shutil

    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return {"path": path, "fs_total_bytes": None, "fs_free_bytes": None}
    return {"path": path, "fs_total_bytes": usage.total, "fs_free_bytes": usage.free}


def stats_document(
    url: str, storage: dict[str, Any], stats: StoreStats, writers: Writers | None = None
) -> dict[str, Any]:
    """The `--json` document: the store's stats, with usage, hit rates and writers added."""
    from hf3fsctl.cli.writers import writer_warnings

    writers = writers or {}
    document: dict[str, Any] = {"metadata_url": url, "storage": storage, **stats.model_dump()}
    document["usage"] = stats.usage
    for ns, ns_doc in zip(stats.namespaces, document["namespaces"], strict=True):
        ns_doc["lookup_hit_rate"] = ns.hit_keys / ns.lookup_keys if ns.lookup_keys else None
        ns_doc["writers"] = [w.model_dump() for w in writers.get(ns.id, [])]
    document["warnings"] = writer_warnings(writers)
    return document


def _manifest_field(ns: NamespaceStats, name: str) -> str:
    value = ns.manifest.get(name)
    return "-" if value is None else str(value)


def door(manifest: dict[str, Any]) -> str:
    """Which door wrote a namespace: `offload-tier` (vLLM's offloading stack) or the
    connector (whose manifests record no door)."""
    extra = manifest.get("extra") or {}
    return str(extra.get("door", "connector"))


def render(
    url: str, storage: dict[str, Any], stats: StoreStats, writers: Writers | None = None
) -> RenderableType:
    """The tables people see: a summary, one row per namespace, writer warnings."""
    from rich.console import Group

    from hf3fsctl.config import format_size

    lookups = sum(ns.lookup_keys for ns in stats.namespaces)
    hits = sum(ns.hit_keys for ns in stats.namespaces)
    free = storage["fs_free_bytes"]
    summary = output.key_values(
        {
            "metadata": url,
            "storage": storage["path"]
            + (f" ({format_size(free)} free)" if free is not None else " (not mounted here)"),
            "namespaces": len(stats.namespaces),
            "capacity": "unbounded"
            if stats.capacity_bytes is None
            else format_size(stats.capacity_bytes),
            "used": format_size(stats.bytes_used)
            + (
                f" ({output.format_ratio(stats.bytes_used, stats.capacity_bytes)})"
                if stats.capacity_bytes
                else ""
            ),
            "free": "-" if stats.bytes_free is None else format_size(stats.bytes_free),
            "in entries": f"{format_size(stats.bytes_live)} ({stats.pages_used} pages)",
            "pinned": f"{stats.pinned_keys} keys, {format_size(stats.pinned_bytes)}"
            + (
                f" of {format_size(stats.max_pinned_bytes)}"
                if stats.max_pinned_bytes is not None
                else ""
            ),
            "lookup hit rate": f"{output.format_ratio(hits, lookups)} ({hits} of {lookups} keys)",
            **_issue_22_lines(stats),
        },
        title="hf3fsctl store",
    )
    now = time.time()
    # A door column only when vLLM's offloading stack (`door: offload-tier`) wrote some.
    two_doors = any(door(ns.manifest) != "connector" for ns in stats.namespaces)
    rows = [
        [
            ns.id,
            _manifest_field(ns, "model"),
            _manifest_field(ns, "kv_dtype"),
            _manifest_field(ns, "layout"),
            *([door(ns.manifest)] if two_doors else []),
            _manifest_field(ns, "block_size"),
            _manifest_field(ns, "tp_size"),
            ns.keys,
            ns.pages_used,
            format_size(ns.bytes_used)
            + ("" if ns.quota_bytes is None else f" / {format_size(ns.quota_bytes)}"),
            ns.pinned_keys or "-",
            ns.hits,
            output.format_ratio(ns.hit_keys, ns.lookup_keys),
            output.format_age(now - ns.last_used if ns.last_used else None),
            _writers_cell(writers.get(ns.id, []) if writers else []),
        ]
        for ns in stats.namespaces
    ]
    columns = [
        "namespace",
        "model",
        "dtype",
        "layout",
        *(["door"] if two_doors else []),
        "block",
        "TP",
        "keys",
        "pages",
        "disk (quota)",
        "pinned",
        "hits",
        "hit rate",
        "last use",
        "writers",
    ]
    table = output.table(
        columns,
        rows,
        title="namespaces",
        right=("block", "TP", "keys", "pages", "disk (quota)", "pinned", "hits", "hit rate"),
    )
    from rich.text import Text

    from hf3fsctl.cli.writers import writer_warnings

    warnings = [Text(f"warning: {line}", style="yellow") for line in writer_warnings(writers or {})]
    return Group(summary, "", table, *warnings)


def _issue_22_lines(stats: StoreStats) -> dict[str, str]:
    """Summary lines for admission and retention, where the store has seen either."""
    lines: dict[str, str] = {}
    skipped = sum(ns.admission_skipped for ns in stats.namespaces)
    if skipped:
        lines["admission skipped"] = f"{skipped} keys (seen fewer than store_after_hits times)"
    expiring = sum(ns.expiring_keys for ns in stats.namespaces)
    if expiring:
        expired = sum(ns.expired_keys for ns in stats.namespaces)
        lines["expiring"] = f"{expiring} keys ({expired} expired, evicted first)"
    return lines


def _writers_cell(found: list[WriterInfo]) -> str:
    """`-`, the one writer's id, or `N (numerics differ)`."""
    if not found:
        return "-"
    return found[0].id if len(found) == 1 else f"{len(found)} (numerics differ)"


def stats(
    ctx: typer.Context,
    config: ConfigOpt = None,
    json: JsonOpt = False,
    watch: Annotated[
        float | None,
        typer.Option(
            "--watch",
            metavar="SECONDS",
            min=0.1,
            help="Redraw every SECONDS until Ctrl-C or SIGTERM (a new snapshot each time when "
            "stdout is not a terminal).",
        ),
    ] = None,
) -> None:
    """Show capacity, usage, hit rates and namespaces."""
    if json and watch is not None:
        raise InvalidRequest(
            "--json prints one document and cannot --watch",
            hint="poll `hf3fsctl stats --json` instead",
        )
    cfg = context.load(ctx, config)
    with context.open_client(cfg, read_only=True) as client:
        if json:
            storage = storage_space(cfg.storage.path)
            writers = read_writers(client)
            output.print_json(stats_document(client.url, storage, client.stats(), writers))
            return

        def draw() -> RenderableType:
            stats = client.stats()
            return render(client.url, storage_space(cfg.storage.path), stats, read_writers(client))

        if watch is None:
            output.show(draw())
            return
        watch_stats(draw, watch)


class _Stop(Exception):
    """SIGTERM during `--watch`: stop as Ctrl-C does."""


def _stop(signum: int, frame: object) -> None:
    raise _Stop


def watch_stats(draw: Callable[[], RenderableType], every: float) -> None:
    """Redraw `draw()` every `every` seconds until Ctrl-C or SIGTERM (both exit 0).

    At a terminal the tables are redrawn in place (Rich Live); otherwise (a pipe, a log
    file, `watch`-less monitoring) each snapshot is printed in full after a time stamp,
    since Live draws nothing where there is no terminal.
    """
    import signal

    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        if output.stdout.is_terminal:
            from rich.live import Live

            with Live(draw(), console=output.stdout, auto_refresh=False) as live:
                while True:
                    time.sleep(every)
                    live.update(draw(), refresh=True)
        else:
            while True:
                output.line(time.strftime("%Y-%m-%d %H:%M:%S %Z"), style="bold")
                output.show(draw())
                sys.stdout.flush()
                time.sleep(every)
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
