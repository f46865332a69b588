"""Tables of `hf3fsctl bench metadata --entries N[,N…]` (the scale study) and `--fleet`.

The documents are `hf3fsctl.bench.metadata.scale`'s and `…fleet`'s (their docstrings
list the JSON keys); this only renders them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hf3fsctl.bench import report

if TYPE_CHECKING:
    from rich.console import RenderableType


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}×"


def render_scale(document: dict[str, Any]) -> RenderableType:
    """One row per (mode, N), then the smallest-÷-largest rate ratios."""
    from rich.console import Group

    from hf3fsctl.cli import output

    columns = [
        "mode",
        "N",
        "fill/s",
        "lookups/s",
        "keys saved/s",
        "evicted/call",
        "save p99 ms",
        "CPU µs/lookup",
        "CPU µs/save",
        "B/entry",
        "÷ in-tree lookups",
        "÷ in-tree saved",
        "in-tree CPU ÷ ours (lookup, save)",
    ]
    rows = []
    for r in document["results"]:
        bar = r.get("in_tree") or {}
        memory = r["memory"]
        used = memory.get("used_memory_bytes_per_entry")
        rows.append(
            [
                r["mode"],
                f"{r['entries']:,}",
                report.fmt(r["fill"].get("entries_per_s"), 0),
                report.fmt(r["lookups_per_s"], 1),
                report.fmt(r["saved_keys_per_s"], 0),
                report.fmt(r["save"].get("evicted_per_call"), 1),
                ("≥ " if r["save"].get("truncated") else "") + report.fmt(r["save"]["p99_ms"]),
                report.fmt(r["cpu_us_per_lookup"], 0),
                report.fmt(r["cpu_us_per_save"], 0),
                f"{memory['bytes_per_entry']:.0f}"
                + ("" if used is None else f" (used_memory {used:.0f})"),
                _x(bar.get("lookups")),
                _x(bar.get("saved_keys")),
                ", ".join(_x(bar.get(k)) or "-" for k in ("cpu_lookup", "cpu_save")) if bar else "",
            ]
        )
    settings = document["settings"]
    table = output.table(
        columns,
        rows,
        title=f"full stores at each N ({settings['clients']} client processes, "
        f"{settings['seconds']:g} s per cell): lookups of {settings['lookup_keys']:,} keys "
        f"anywhere in the store; saves = allocate + commit {settings['save_keys']}, every "
        "allocate evicting",
        right=columns[1:],
    )
    table.caption = (
        "CPU µs: the server process's CPU time per call (embedded: the client processes', "
        "where the store runs); B/entry: serve — RSS after the cells less a serve on an "
        "empty store, ÷ N; embedded — a fresh process before/after its first lookup; "
        "redis — MEMORY USAGE over its keys ÷ N (INFO used_memory delta ÷ N beside it); "
        "in-tree — vLLM's server measured in this run (no capacity: its saves never evict)"
    )
    table.caption_justify = "left"
    parts: list[Any] = [table]
    ratios = document["rate_ratios"]
    if ratios:
        parts.append(
            output.table(
                [
                    "mode",
                    "N small",
                    "N large",
                    "saved/s small ÷ large",
                    "lookups/s",
                    "goal",
                    "marginal B/entry",
                ],
                [
                    [
                        f["mode"],
                        f"{f['smallest']:,}",
                        f"{f['largest']:,}",
                        _x(f["saved_keys_per_s_ratio"]),
                        _x(f["lookups_per_s_ratio"]),
                        {True: "met", False: "missed", None: "unknown"}[f["met"]]
                        + f" (≤ {f['goal']:g})",
                        report.fmt(f.get("marginal_bytes_per_entry"), 0),
                    ]
                    for f in ratios
                ],
                title="rates at the smallest N ÷ at the largest",
                right=(
                    "N small",
                    "N large",
                    "saved/s small ÷ large",
                    "lookups/s",
                    "marginal B/entry",
                ),
            )
        )
    for mode, why in (document.get("skipped_modes") or {}).items():
        parts.append(f"mode {mode} skipped: {why}")
    for cell, why in (document.get("failed") or {}).items():
        parts.append(f"FAILED {cell}: {why[-500:]}")
    return Group(*parts)


def render_fleet(document: dict[str, Any]) -> RenderableType:
    """The fleet's routes, then each backend's measured cost and the instances it needs."""
    from rich.console import Group

    from hf3fsctl.cli import output

    settings, model = document["settings"], document["model"]
    routes = output.table(
        ["route", "calls/s", "keys/call"],
        [
            [r["route"], report.fmt(r["calls_per_s"], 0), r["keys_per_call"]]
            for r in document["routes"]
        ],
        title=f"fleet: {settings['nodes']} nodes × {settings['gpus_per_node']} GPUs × "
        f"{settings['requests_per_gpu']:g} requests/s, {settings['prompt_tokens']} tokens "
        f"= {model['blocks']} pages of {settings['block_size']} ({model['hit']} hit, "
        f"{model['miss']} saved): {model['requests_per_s']:,.0f} requests/s",
        right=("calls/s", "keys/call"),
    )
    sizing = output.table(
        ["backend", "CPU µs/request", "by route", "cores", "instances", "nodes/instance"],
        [
            [
                s["mode"],
                report.fmt(s["cpu_us_per_request"], 0),
                ", ".join(f"{k} {report.fmt(v, 0)}" for k, v in s["cpu_us"].items()),
                report.fmt(s["cores"], 1),
                "" if s["instances"] is None else f"{s['instances']} {s['instance']}",
                report.fmt(s["nodes_per_instance"], 1),
            ]
            for s in document["sizing"]
        ],
        title=f"what the fleet needs: server CPU per request measured here on full stores of "
        f"{settings['entries']:,} entries ({settings['clients']} clients, "
        f"{settings['seconds']:g} s per route), one core per instance at "
        f"{settings['utilization']:.0%}",
        right=("CPU µs/request", "cores", "instances", "nodes/instance"),
    )
    parts: list[Any] = [routes, sizing]
    for mode, why in (document.get("skipped_modes") or {}).items():
        parts.append(f"mode {mode} skipped: {why}")
    for cell, why in (document.get("failed") or {}).items():
        parts.append(f"FAILED {cell}: {why[-500:]}")
    return Group(*parts)
