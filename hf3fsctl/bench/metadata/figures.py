"""Figures derived from the cells: ratios, memory per entry, the full-store comparison.

Contract: a ratio is to a figure measured in the same run, or None — `÷ ping` to the
same mode's ping cell, `÷ in-tree` to the in-tree server's cell of the same operation and
client count (mode `in-tree`), memory to the in-tree server's bytes per key measured
in this run. CPU: each row's `cpu_us_per_call` is the server's CPU per call (`cpu_of`
"server") or, without a server (embedded), the client processes' (`cpu_of` "clients");
`in_tree_cpu_ratio` = the in-tree server's CPU per call ÷ this row's. Nothing here is a
stored reference figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf3fsctl.bench import report
from hf3fsctl.bench.metadata.settings import BATCH, FULL_GOAL

IN_TREE_MODE = "in-tree"


def memory_figures(entries: int, before: int, after: int, db: Path | None) -> dict[str, Any]:
    """RSS before and after a store process loaded `entries`, per entry (the ratio to the
    in-tree server is added once every mode ran: `add_memory_ratios`)."""
    grown = max(0, after - before)
    per_entry = grown / entries
    return {
        "entries": entries,
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "bytes_per_entry": per_entry,
        "rss_after_per_entry": after / entries,
        "in_tree_bytes_per_key": None,
        "ratio_to_in_tree": None,
        "db_bytes_per_entry": None
        if db is None or not db.exists()
        else db.stat().st_size / entries,
    }


def eviction_figures(row: dict[str, Any], keys_before: int, keys_after: int) -> dict[str, Any]:
    """What a full-store cell evicted: the keys it started with and committed, less what
    is left (every allocate is expected to evict about what it allocates)."""
    evicted = keys_before + row["committed_keys"] - keys_after
    return {
        "store_keys_before": keys_before,
        "store_keys_after": keys_after,
        "evicted_keys": evicted,
        "evicted_per_call": evicted / row["calls"] if row["calls"] else None,
    }


def in_tree_bytes_per_key(modes: list[dict[str, Any]]) -> float | None:
    """The in-tree server's RSS bytes per key measured in this run (None: not measured)."""
    for mode in modes:
        if mode["mode"] == IN_TREE_MODE and mode.get("memory"):
            value: float = mode["memory"]["bytes_per_entry"]
            return value
    return None


def add_memory_ratios(modes: list[dict[str, Any]]) -> None:
    """Each mode's bytes per entry ÷ the in-tree server's, both measured in this run."""
    reference = in_tree_bytes_per_key(modes)
    for mode in modes:
        memory = mode.get("memory")
        if memory is None or mode["mode"] == IN_TREE_MODE:
            continue
        memory["in_tree_bytes_per_key"] = reference
        memory["ratio_to_in_tree"] = report.ratio(memory["bytes_per_entry"], reference)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """÷ ping of the same mode; ÷ in-tree: the in-tree cell of the same operation and
    client count in this run, else none (a figure not measured here is never a bar)."""
    ping = {(r["mode"], r["clients"]): r["ops"] for r in rows if r["op"] == "ping"}
    same_run = {
        (r["op"], r["clients"]): {k: r[k] for k in ("ops", "p50_ms", "p99_ms")}
        for r in rows
        if r["mode"] == "in-tree" and r["ops"]
    }
    in_tree_cpu = {
        (r["op"], r["clients"]): r.get("server_cpu_us_per_call")
        for r in rows
        if r["mode"] == "in-tree"
    }
    for row in rows:
        row["ratio_to_ping"] = report.ratio(row["ops"], ping.get((row["mode"], row["clients"])))
        row["cpu_us_per_call"] = (
            row.get("server_cpu_us_per_call")
            if row.get("server_cpu_us_per_call") is not None
            else row.get("client_cpu_us_per_call")
        )
        row["cpu_of"] = "server" if row.get("server_cpu_us_per_call") is not None else "clients"
        if row["mode"] == IN_TREE_MODE:
            row["in_tree"], row["in_tree_ratio"], row["in_tree_source"] = None, None, None
            row["in_tree_cpu_ratio"] = None
            continue
        row["in_tree_cpu_ratio"] = report.ratio(
            in_tree_cpu.get((row["op"], row["clients"])), row["cpu_us_per_call"]
        )
        bar = same_run.get((row["op"], row["clients"]))
        row["in_tree"] = bar
        row["in_tree_source"] = None if bar is None else "this run"
        row["in_tree_ratio"] = report.ratio(row["ops"], bar["ops"]) if bar else None


def no_space_share(row: dict[str, Any]) -> float | None:
    """Share of the keys asked for that found no space (a skipped save)."""
    asked = row["calls"] * BATCH
    return row["no_space_keys"] / asked if asked else None


def full_store_figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """1-namespace vs 8-namespace full-store cells, per mode and client count."""
    cells = {(r["mode"], r["op"], r["clients"]): r for r in rows}
    out = []
    for (mode, op, clients), one in cells.items():
        if op != "full_1ns" or (mode, "full_8ns", clients) not in cells:
            continue
        eight = cells[(mode, "full_8ns", clients)]
        # A cell that finished no call within the cut-off has no rate to compare.
        known = one["calls"] > 0 and eight["calls"] > 0
        # Compared on keys saved per second: an allocate that refuses keys (no space)
        # is fast, not useful.
        slowdown = (
            report.ratio(one["committed_keys_per_s"], eight["committed_keys_per_s"])
            if known
            else None
        )
        out.append(
            {
                "mode": mode,
                "clients": clients,
                "ops_1ns": one["ops"],
                "ops_8ns": eight["ops"],
                "saved_keys_per_s_1ns": one["committed_keys_per_s"],
                "saved_keys_per_s_8ns": eight["committed_keys_per_s"],
                "p50_ms_1ns": one["p50_ms"],
                "p50_ms_8ns": eight["p50_ms"],
                "p99_ms_1ns": one["p99_ms"],
                "p99_ms_8ns": eight["p99_ms"],
                "evicted_per_call_1ns": one.get("evicted_per_call"),
                "evicted_per_call_8ns": eight.get("evicted_per_call"),
                "no_space_share_1ns": no_space_share(one),
                "no_space_share_8ns": no_space_share(eight),
                "ratio_1ns_over_8ns": slowdown,
                "goal": FULL_GOAL,
                "met": None if slowdown is None else slowdown <= FULL_GOAL,
                "note": None
                if known
                else "no allocate finished within the cut-off in "
                + " and ".join(
                    name for name, cell in (("1 ns", one), ("8 ns", eight)) if not cell["calls"]
                ),
            }
        )
    return out
