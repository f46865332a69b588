"""`hf3fsctl bench metadata --entries N[,N…]` (the scale study) at a tiny size, through the CLI.

The document's fields and their sanity (a full store: every allocate evicts, the key
count never passes N; positive rates, memory and CPU figures), the rate ratio's
arithmetic, and the parsing of `--entries`. No wall-clock thresholds.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hf3fsctl.bench.metadata import scale_modes
from hf3fsctl.bench.metadata.scale import rate_ratios
from hf3fsctl.cli.bench_metadata import parse_entries
from hf3fsctl.cli.bench_metadata_scale import render_scale
from hf3fsctl.cli.main import app
from hf3fsctl.errors import InvalidRequest

runner = CliRunner()
N = 2000


def _rendered(document: dict[str, Any]) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=240, color_system=None).print(render_scale(document))
    return buffer.getvalue()


def _scale(tmp_path: Path, modes: str) -> dict[str, Any]:
    args = ["bench", "metadata", "--scale", "--entries", str(N), "--mode", modes]
    args += ["--clients", "1", "--seconds", "0.3", "--dir", str(tmp_path), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, f"{result.stdout}\n{result.stderr}\n{result.exception!r}"
    document: dict[str, Any] = json.loads(result.stdout)
    assert list(tmp_path.iterdir()) == []  # the work directory is gone
    return document


def _assert_full_store_row(row: dict[str, Any]) -> None:
    assert row["entries"] == N
    assert row["fill"]["entries_per_s"] > 0
    lookup, save = row["lookup"], row["save"]
    assert lookup["calls"] > 0 and row["lookups_per_s"] == lookup["ops"] > 0
    assert lookup["keys_per_call"] == 1000
    assert save["calls"] > 0 and row["saved_keys_per_s"] == save["committed_keys_per_s"] > 0
    assert save["committed_keys"] + save["no_space_keys"] == 64 * save["calls"]
    # full: the store starts at N and every allocate evicts what it needs, so it never
    # holds more than N keys, and at least what was committed was evicted
    assert save["store_keys_before"] == N
    assert save["store_keys_after"] <= N
    assert save["evicted_keys"] >= save["committed_keys"] > 0
    assert 0 < save["p50_ms"] <= save["p99_ms"]
    assert row["cpu_us_per_lookup"] >= 0 and row["cpu_us_per_save"] >= 0
    assert row["memory"]["bytes_per_entry"] >= 0 and row["memory"]["method"]


def test_scale_embedded_and_redis(tmp_path: Path) -> None:
    modes = "embedded,redis" if shutil.which("redis-server") else "embedded"
    document = _scale(tmp_path, modes)
    assert document["benchmark"] == "metadata-scale"
    assert document["failed"] == {}
    assert document["settings"]["entries"] == [N]
    assert document["settings"]["clients"] == 1
    rows = {r["mode"]: r for r in document["results"]}
    assert set(rows) == set(modes.split(","))
    for row in rows.values():
        _assert_full_store_row(row)
        assert row["in_tree"] is None  # no in-tree server ran: no ratio to one
    embedded = rows["embedded"]
    assert embedded["cpu_of"].startswith("client processes")
    assert embedded["cpu_us_per_save"] > 0  # the store's work is the clients' CPU
    assert embedded["memory"]["db_bytes_per_entry"] > 0
    if "redis" in rows:
        redis = rows["redis"]
        assert redis["cpu_of"] == "server process"
        memory = redis["memory"]
        assert memory["memory_usage_bytes_per_entry"] > 0
        assert memory["used_memory_after_bytes"] > memory["used_memory_before_bytes"]
        assert memory["keys"] == memory["sampled_keys"] > 0  # a few keys: every one measured
        kinds = {p["type"] for p in memory["by_pattern"].values()}
        assert "hash" in kinds  # the entries live in hashes (the layout's index structures)
        assert redis["save"]["redis_scripts_per_call"] >= 1  # allocate and commit are scripts
        assert redis["save"]["redis_script_usec_per_call"] > 0
    assert document["rate_ratios"] == []  # one size: nothing to compare
    text = _rendered(document)
    assert "keys saved/s" in text and f"{N:,}" in text


def test_rate_ratio_is_smallest_over_largest() -> None:
    def row(mode: str, entries: int, saved: float, lookups: float) -> dict[str, Any]:
        return {
            "mode": mode,
            "entries": entries,
            "saved_keys_per_s": saved,
            "lookups_per_s": lookups,
            "memory": {"held_bytes": 1000 + entries // 10},
        }

    rows = [row("serve", 10**6, 1000.0, 50.0), row("serve", 10**5, 2000.0, 100.0)]
    rows += [row("redis", 10**5, 900.0, 80.0), row("redis", 10**6, 800.0, 80.0)]
    ratios = {r["mode"]: r for r in rate_ratios(rows)}
    assert ratios["serve"]["saved_keys_per_s_ratio"] == pytest.approx(2.0)
    assert ratios["serve"]["lookups_per_s_ratio"] == pytest.approx(2.0)
    assert ratios["serve"]["met"] is False and ratios["serve"]["smallest"] == 10**5
    assert ratios["redis"]["saved_keys_per_s_ratio"] == pytest.approx(900 / 800)
    assert ratios["redis"]["met"] is True and ratios["redis"]["largest"] == 10**6
    assert ratios["serve"]["marginal_bytes_per_entry"] == pytest.approx(0.1)


def test_entries_parsing() -> None:
    assert parse_entries("1e5,1e6,100000") == [100_000, 1_000_000]
    assert parse_entries("2000") == [2000]
    for bad in ("1.5", "x", "-1e3", "0"):
        with pytest.raises(InvalidRequest, match="--entries"):
            parse_entries(bad)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--entries", "100,2000"], "every size must be at least"),
        (["--entries", "2000,3000", "--clients", "1,2"], "one --clients count"),
        (["--entries", "2000,3000", "--mode", "serve-redis"], "--mode"),
    ],
    ids=["too-small", "several-client-counts", "no-scale-mode"],
)
def test_scale_refuses_bad_settings(tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", "metadata", "--dir", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())


def test_fleet_routes_and_sizing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale_modes, "STORE_LEASE_S", 0.0)  # its 3,000 keys are barely leased
    args = ["bench", "metadata", "--fleet", "2", "--gpus-per-node", "4", "--requests-per-gpu"]
    args += ["2.5", "--prompt-tokens", "500", "--block-size", "16", "--hit-ratio", "0.25"]
    args += ["--mode", "serve", "--entries", "3000", "--clients", "1", "--seconds", "0.3"]
    result = runner.invoke(app, [*args, "--dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, f"{result.stdout}\n{result.stderr}\n{result.exception!r}"
    document = json.loads(result.stdout)
    assert document["benchmark"] == "metadata-fleet"
    assert document["failed"] == {}
    model = document["model"]
    assert (model["blocks"], model["hit"], model["miss"]) == (32, 8, 24)  # ceil(500/16)
    assert model["requests_per_s"] == pytest.approx(2 * 4 * 2.5)
    routes = {r["route"]: r for r in document["routes"]}
    assert {k: (r["calls_per_s"], r["keys_per_call"]) for k, r in routes.items()} == {
        "lookup": (20.0, 32),
        "locate": (20.0, 8),
        "allocate": (20.0, 24),
        "commit": (20.0, 24),
    }
    (measured,) = document["measured"]
    assert measured["mode"] == "serve" and measured["entries"] == 3000
    assert measured["lookup"]["keys_per_call"] == 32 and measured["locate"]["keys_per_call"] == 8
    assert measured["save"]["keys_per_call"] == 24
    assert measured["save"]["evicted_keys"] >= measured["save"]["committed_keys"] > 0
    (sizing,) = document["sizing"]
    assert set(sizing["cpu_us"]) == {"lookup", "locate", "save"}
    if sizing["cpu_us_per_request"] is not None:
        assert sizing["cpu_us_per_request"] == pytest.approx(sum(sizing["cpu_us"].values()))
        assert sizing["cores"] == pytest.approx(20.0 * sizing["cpu_us_per_request"] / 1e6)
        assert sizing["instances"] >= 1
    assert "serve replicas" in sizing["instance"]
