"""`hf3fsctl bench metadata --mode redis-cluster,redis-sharded` on a private Redis
Cluster, through the real CLI: the cells run, the server CPU is every master's, and the
figures say where the store and its load live (one master for the one-slot store, every
master for the sharded one). No wall-clock thresholds."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hf3fsctl.cli.main import app

runner = CliRunner()


@pytest.mark.integration  # starts a real 3-master Redis Cluster
def test_bench_metadata_spreads_the_sharded_store_over_the_cluster_masters(
    tmp_path: Path,
) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli are not installed (make test installs them)")
    args = ["bench", "metadata", "--quick", "--mode", "redis-cluster,redis-sharded"]
    args += ["--shards", "4", "--ops", "lookup,alloc_commit", "--clients", "1"]
    result = runner.invoke(app, [*args, "--dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, f"{result.stdout}\n{result.stderr}\n{result.exception!r}"
    document = json.loads(result.stdout)
    assert document["skipped_modes"] == {}
    modes = {m["mode"]: m for m in document["modes"]}
    assert modes["redis-sharded"]["url"].endswith("?shards=4")
    assert "?" not in modes["redis-cluster"]["url"]
    # the one-slot store lives on one master; 4 shards over 3 masters reach every master
    assert sorted(modes["redis-cluster"]["memory"]["keys_by_master"])[:2] == [0, 0]
    assert all(n > 0 for n in modes["redis-sharded"]["memory"]["keys_by_master"])
    rows = {(r["mode"], r["op"]): r for r in document["rows"]}
    assert set(rows) == {
        (mode, op)
        for mode in ("redis-cluster", "redis-sharded")
        for op in ("ping", "lookup", "alloc_commit")
    }
    for (mode, op), row in rows.items():
        assert row["calls"] > 0 and row["ops"] > 0 and row["failed_calls"] == 0
        assert row["cpu_of"] == "server"
        assert len(row["master_cpu_s"]) == row["masters"] == 3
        assert row["shards"] == (4 if mode == "redis-sharded" else 1)
        if op == "ping":
            continue
        # the server CPU per call is every master's, summed over the cell's window
        assert row["server_cpu_us_per_call"] == pytest.approx(
            1e6 * sum(row["master_cpu_s"]) / row["calls"]
        )
        assert row["server_cpu_us_per_call"] > 0
        share = row["busiest_master_cpu_share"]
        assert share == pytest.approx(max(row["master_cpu_s"]) / sum(row["master_cpu_s"]))
        if op == "alloc_commit":
            assert row["committed_keys"] == 64 * row["calls"]
    for op in ("lookup", "alloc_commit"):
        assert rows[("redis-sharded", op)]["busiest_master_cpu_share"] < 1.0
    assert "busiest master" in _rendered(document)


def _rendered(document: dict[str, object]) -> str:
    from rich.console import Console

    from hf3fsctl.cli.bench_metadata import render

    console = Console(width=400, record=True, file=io.StringIO())
    console.print(render(document))
    return " ".join(console.export_text().split())


@pytest.mark.integration  # starts a real 3-master Redis Cluster
def test_bench_metadata_scale_fills_the_sharded_store_full_without_evicting(
    tmp_path: Path,
) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server / redis-cli are not installed (make test installs them)")
    args = ["bench", "metadata", "--entries", "3000", "--scale", "--mode", "redis-sharded"]
    args += ["--shards", "4", "--clients", "1", "--seconds", "0.3", "--dir", str(tmp_path)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, f"{result.stdout}\n{result.stderr}\n{result.exception!r}"
    document = json.loads(result.stdout)
    # a fill that evicted would fail the lookup cell's warm-up (a chain key missing)
    assert document["failed"] == {} and document["skipped_modes"] == {}
    (row,) = document["results"]
    assert (row["mode"], row["shards"], row["masters"]) == ("redis-sharded", 4, 3)
    # full when the fullest shard is: 4 x its keys, at least the entries, and a multiple of 4
    assert row["capacity_pages"] >= 3000 and row["capacity_pages"] % 4 == 0
    assert all(n > 0 for n in row["memory"]["keys_by_master"])
    lookup, save = row["lookup"], row["save"]
    assert lookup["ops"] > 0 and save["committed_keys"] == 64 * save["calls"] > 0
    assert save["evicted_keys"] > 0  # the saves did: the fullest shard was full
    for cell in (lookup, save):
        assert cell["server_cpu_us_per_call"] > 0
        assert 0 < cell["busiest_master_cpu_share"] < 1.0
