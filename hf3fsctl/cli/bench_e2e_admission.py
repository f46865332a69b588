"""The table of `hf3fsctl bench e2e --admission N`: store all vs the Nth sighting.

Renders the document's `admission` section (`hf3fsctl.bench.e2e.admission` says what is
measured): one row per setting and wave, then a total per setting, then N's ratios to
store-all of the same run. "blocks skipped" is the engine's own count of the prompt
blocks its admission kept from being saved; the store's columns are what it holds after
the wave (its skipped keys: every engine's, the warm-up's included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import RenderableType


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{suffix}"


def _percent(value: float | None) -> str:
    return _fmt(None if value is None else value * 100, ".1f", "%")


def _mib(value: float | None) -> str:
    return _fmt(None if value is None else value / (1 << 20), ",.1f", " MiB")


def render_admission(section: dict[str, Any]) -> RenderableType:
    """The admission table and its ratios."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    w = section["workload"]
    table = Table(
        title=f"admission: store all vs store_after_hits {section['store_after_hits']} — 2 "
        f"waves of {w['repeated_prompts_per_wave']} repeated + {w['one_off_prompts_per_wave']} "
        f"one-off prompts of {w['prompt_tokens']} tokens (wave 2: the same prefixes, new "
        "suffixes and one-offs)",
        title_justify="left",
        header_style="bold",
    )
    columns = (
        "store_after_hits",
        "wave",
        "hit rate",
        "store hit rate",
        "TTFT p50",
        "blocks written",
        "bytes written",
        "blocks skipped",
        "store: keys",
        "store: skipped keys",
        "outputs",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in columns[:2] else "right")
    for row in section["runs"]:
        setting = f"{row['store_after_hits']} ({row['label']})"
        for wave, label in (("cold", "1, empty store"), ("warm", "2, fresh process")):
            entry = row[wave]
            if entry.get("status") != "ok":
                reason = (entry.get("error") or "").strip().splitlines()
                shown = f"{entry.get('status')}: {reason[-1][:120]}" if reason else entry["status"]
                table.add_row(setting, label, Text(shown, style="yellow"))
                continue
            store = entry.get("store_after") or {}
            same = entry.get("outputs_match_none")
            table.add_row(
                setting,
                label,
                _percent(entry["hit_rate"]),
                _percent(entry["store_hit_rate"]),
                _fmt(entry["ttft_p50_s"], ".3f", " s"),
                _fmt(entry["blocks_written"], ",.0f"),
                _mib(entry["bytes_written"]),
                _fmt(entry.get("blocks_skipped"), ",.0f"),
                _fmt(store.get("keys"), ",d"),
                _fmt(store.get("admission_skipped"), ",d"),
                Text("same" if same else "DIFFER", style="green" if same else "bold red"),
            )
        table.add_row(
            setting,
            "both",
            "",
            "",
            "",
            _fmt(row["blocks_written"], ",.0f"),
            _mib(row["bytes_written"]),
            end_section=True,
        )
    ratios = Table.grid(padding=(0, 2))
    ratios.title = "admission ratios (N over store all, the same run)"
    ratios.title_justify = "left"
    ratios.add_column(style="bold")
    ratios.add_column()
    ratios.add_row("ceiling", section["ceiling"])
    for key, value in section["ratios"].items():
        ratios.add_row(key, _fmt(value, ".3f"))
    ratios.add_row("outputs identical to no connector", str(section["outputs_identical"]))
    return Group(table, ratios)
