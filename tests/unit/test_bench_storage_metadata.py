"""`hf3fsctl bench storage` and `bench metadata` at tiny sizes, through the real CLI.

Each run checks the JSON document's fields and that its figures are sane (positive
rates, ratios in a plausible range, p50 <= p99 <= p99.9), that `--plot` writes a real
PNG, and that the work directory is removed. No wall-clock thresholds: this machine's
speed is what the benchmarks measure, not what the tests assert.
"""

from __future__ import annotations

import io
import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hf3fsctl.bench import report
from hf3fsctl.cli.main import app
from hf3fsctl.errors import InvalidRequest
from hf3fsctl.storage.layout import PageFile, slot_bytes
from hf3fsctl.storage.posix import MIN_TASK_BYTES, PosixEngine

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


def _invoke(args: list[str]) -> Any:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, f"{result.stdout}\n{result.stderr}\n{result.exception!r}"
    return result


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG
    assert len(data) > 5 * 1024


def _assert_latencies(row: dict[str, Any]) -> None:
    assert row["calls"] > 0
    assert row["ops"] > 0
    assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["p999_ms"] <= row["max_ms"]


# --- storage --------------------------------------------------------------------------


def test_bench_storage_json_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "storage.png"
    args = ["bench", "storage", "--sizes", "64k,256k", "--batches", "1,4"]
    args += ["--threads", "1,2", "--total", "4MiB", "--repeats", "1", "--dir", str(tmp_path)]
    result = _invoke([*args, "--json", "--plot", str(plot)])
    document = json.loads(result.stdout)  # --json: the document is all of stdout
    assert document["benchmark"] == "storage"
    assert document["unit"].startswith("GB/s")
    assert document["machine"]["cpus"] >= 1 and document["machine"]["fstype"]
    assert document["plot"] == str(plot)
    ceiling = document["ceiling"]
    assert ceiling["name"] == "plain" and "same" in ceiling["description"]
    assert [r["page_bytes"] for r in ceiling["rows"]] == [64 * 1024, 256 * 1024]
    for row in ceiling["rows"]:
        assert all(row[k] > 0 for k in ("write_gbs", "warm_read_gbs", "cold_read_gbs"))
    rows = document["results"]
    assert len(rows) == 2 * 2 * 2
    assert {(r["batch"], r["threads"]) for r in rows} == {(1, 1), (1, 2), (4, 1), (4, 2)}
    for row in rows:
        for _, name in (
            ("write", "write_gbs"),
            ("nochecksum", "write_nochecksum_gbs"),
            ("warm", "warm_read_gbs"),
            ("noverify", "warm_read_noverify_gbs"),
            ("cold", "cold_read_gbs"),
        ):
            assert row[name] > 0
            assert 0.001 < row[name.replace("_gbs", "_ratio")] < 1000
    _assert_png(plot)
    assert not list(tmp_path.glob("hf3fsctl-bench-storage-*"))  # work directory removed


def test_bench_storage_tables_and_json_out(tmp_path: Path) -> None:
    out = tmp_path / "out" / "storage.json"
    args = ["bench", "storage", "--sizes", "128k", "--batches", "2", "--threads", "1"]
    args += ["--total", "2MiB", "--repeats", "1", "--dir", str(tmp_path), "--json-out", str(out)]
    result = _invoke(args)
    assert "ceiling: plain" in result.stdout and "ratio to the plain ceiling" in result.stdout
    assert "128 KiB" in result.stdout
    document = json.loads(out.read_text())
    assert len(document["results"]) == 1
    assert document["settings"]["repeats"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes", "12x"], "--sizes"),
        (["--threads", "0"], "--threads"),
        (["--total", "4k", "--sizes", "1MiB"], "hold no page"),
    ],
    ids=["bad-size", "zero-threads", "too-small"],
)
def test_bench_storage_refuses_bad_settings(tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", "storage", "--dir", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())


def test_small_calls_run_inline_and_big_ones_fan_out(tmp_path: Path) -> None:
    """The io_threads finding: a call of a few small pages never wakes an I/O thread."""
    page = 256 * 1024
    pages = 2 * MIN_TASK_BYTES // slot_bytes(page)  # two tasks' worth

    def io_threads() -> int:
        return sum(t.name.startswith("hf3fs-io") for t in threading.enumerate())

    with (
        PageFile.create(tmp_path, "0123456789abcdef", 0, page, pages * page) as file,
        PosixEngine(io_threads=16) as engine,
    ):
        before = io_threads()
        small = [bytes([i]) * page for i in range(4)]
        written = engine.write_pages(file, [0, 1, 2, 3], small)
        out = [bytearray(page) for _ in small]
        read = engine.read_pages(file, [0, 1, 2, 3], out, expected=[w.checksum for w in written])
        assert all(r.ok for r in written + read) and [bytes(b) for b in out] == small
        assert io_threads() == before  # 1 MiB in one call: inline, no thread woken
        big = [bytes([i % 251]) * page for i in range(pages)]
        assert all(r.ok for r in engine.write_pages(file, list(range(pages)), big))
        assert io_threads() > before  # two tasks of MIN_TASK_BYTES: shared with a thread


# --- metadata -------------------------------------------------------------------------


def _metadata_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "bench",
        "metadata",
        "--entries",
        "2000",
        "--seconds",
        "0.2",
        "--dir",
        str(tmp_path),
        "--json",
        *extra,
    ]


def test_bench_metadata_embedded_every_op_json_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "metadata.png"
    args = _metadata_args(tmp_path, "--mode", "embedded", "--clients", "1,2")
    result = _invoke([*args, "--ops", ",".join(report_ops()), "--plot", str(plot)])
    document = json.loads(result.stdout)
    assert document["benchmark"] == "metadata"
    assert document["ceiling"]["name"] == "ping"
    assert document["settings"]["entries"] == 2000
    rows = document["rows"]
    assert {(r["op"], r["clients"]) for r in rows} == {
        (op, c) for op in report_ops() for c in (1, 2)
    }
    for row in rows:
        assert row["mode"] == "embedded"
        _assert_latencies(row)
        assert row["cpu_of"] == "clients" and row["server_cpu_us_per_call"] is None
        assert 0 < row["ratio_to_ping"] < 5
        if row["op"] == "ping":
            assert row["ratio_to_ping"] == pytest.approx(1.0)
        if row["op"].startswith("full_"):
            assert row["store_keys_before"] == 2000
            assert row["evicted_keys"] >= 0 and row["evicted_per_call"] >= 0
        if row["op"] in ("alloc_commit", "full_1ns", "full_8ns"):
            assert row["committed_keys"] + row["no_space_keys"] == 64 * row["calls"]
        if row["op"] == "alloc_commit":
            assert row["no_space_keys"] == 0  # a store with room grants every key
    (mode,) = document["modes"]
    memory = mode["memory"]
    assert memory["entries"] == 2000
    # a first lookup need load nothing per entry (the store holds no index in Python)
    assert memory["rss_after_bytes"] >= memory["rss_before_bytes"] > 0
    assert 0 <= memory["bytes_per_entry"] < 100_000
    # no in-tree server ran: no in-tree figure and no ratio to one (none is stored in code)
    assert (memory["in_tree_bytes_per_key"], memory["ratio_to_in_tree"]) == (None, None)
    assert all(r["in_tree"] is None and r["in_tree_ratio"] is None for r in rows)
    assert document["reference"]["measured_in_this_run"] is False
    text = _rendered(document)  # the tables say so themselves
    assert "empty: not measured in this run (mode in-tree was not asked for" in text
    assert "÷ in-tree empty: not measured in this run" in text
    full = document["full_store"]
    assert {f["clients"] for f in full} == {1, 2}
    for f in full:
        assert f["ops_1ns"] > 0 and f["ops_8ns"] > 0
        assert f["saved_keys_per_s_1ns"] > 0
        if f["saved_keys_per_s_8ns"]:  # keys saved per second, not calls: refusals don't count
            ratio = f["saved_keys_per_s_1ns"] / f["saved_keys_per_s_8ns"]
            assert f["ratio_1ns_over_8ns"] == pytest.approx(ratio)
            assert f["met"] is (ratio <= 1.5)
        assert f["goal"] == 1.5
        assert 0 <= f["no_space_share_1ns"] <= 1 and 0 <= f["no_space_share_8ns"] <= 1
    _assert_png(plot)
    assert not list(tmp_path.glob("hf3fsctl-bench-metadata-*"))


def _rendered(document: dict[str, Any]) -> str:
    """The `bench metadata` tables of `document` as plain text, one space between words."""
    from rich.console import Console

    from hf3fsctl.cli.bench_metadata import render

    console = Console(width=400, record=True, file=io.StringIO())
    console.print(render(document))
    return " ".join(console.export_text().split())


def report_ops() -> list[str]:
    return ["ping", "lookup", "locate", "alloc_commit", "full_1ns", "full_8ns"]


@pytest.mark.integration  # starts a real hf3fsctl serve
def test_bench_metadata_against_the_server_it_starts(tmp_path: Path) -> None:
    args = _metadata_args(tmp_path, "--mode", "serve", "--clients", "2")
    document = json.loads(_invoke([*args, "--ops", "lookup,alloc_commit,full_8ns"]).stdout)
    (mode,) = document["modes"]
    assert mode["mode"] == "serve" and mode["url"].startswith("http://127.0.0.1:")
    assert mode["memory"]["rss_after_bytes"] > mode["memory"]["rss_before_bytes"] > 0
    assert {r["op"] for r in document["rows"]} == {"ping", "lookup", "alloc_commit", "full_8ns"}
    for row in document["rows"]:
        _assert_latencies(row)
        assert row["cpu_of"] == "server"  # the serve process's CPU per call, from /proc
        assert row["cpu_us_per_call"] == row["server_cpu_us_per_call"] >= 0
    assert sum(r["server_cpu_us_per_call"] * r["calls"] for r in document["rows"]) > 0
    assert "CPU µs/call" in _rendered(document)
    assert document["full_store"] == []  # 8 namespaces without 1: nothing to compare


@pytest.mark.integration  # starts a real hf3fsctl serve
def test_bench_metadata_measures_the_in_tree_server_and_redis_in_the_same_run(
    tmp_path: Path,
) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    args = _metadata_args(tmp_path, "--mode", "in-tree,redis,serve-redis", "--clients", "1")
    document = json.loads(_invoke([*args, "--ops", "lookup,alloc_commit,full_1ns"]).stdout)
    assert [m["mode"] for m in document["modes"]] == ["in-tree", "redis", "serve-redis"]
    assert document["skipped_modes"] == {}
    replicas = document["modes"][2]["url"].split(",")
    assert len(replicas) == 2 and all(u.startswith("http://127.0.0.1:") for u in replicas)
    rows = {(r["mode"], r["op"]): r for r in document["rows"]}
    assert set(rows) == {
        (mode, op)
        for mode in ("in-tree", "redis", "serve-redis")
        for op in ("ping", "lookup", "alloc_commit")
    }  # no full-store cells on stores of their own
    for (mode, op), row in rows.items():
        _assert_latencies(row)
        if op == "alloc_commit":
            assert row["committed_keys"] == 64 * row["calls"] > 0
        if mode == "in-tree":
            assert row["in_tree_ratio"] is None
        else:  # the ratio is to the in-tree cell of this very run
            twin = rows[("in-tree", op)]
            assert row["in_tree_source"] == "this run"
            assert row["in_tree_ratio"] == pytest.approx(row["ops"] / twin["ops"])
            if row["cpu_us_per_call"] and twin["server_cpu_us_per_call"] is not None:
                assert row["in_tree_cpu_ratio"] == pytest.approx(
                    twin["server_cpu_us_per_call"] / row["cpu_us_per_call"]
                )
        assert row["cpu_of"] == "server"  # each peer's server (serve-redis: replicas + Redis)
    in_tree_memory = document["modes"][0]["memory"]["bytes_per_entry"]
    for mode in document["modes"][1:]:  # memory, too, is compared within this run only
        assert mode["memory"]["in_tree_bytes_per_key"] == pytest.approx(in_tree_memory)
    text = _rendered(document)
    assert "vLLM's in-tree metadata server, measured in this run" in text
    assert "not measured in this run" not in text  # every cell here has its in-tree twin


@pytest.mark.integration  # starts a real hf3fsctl serve
def test_bench_metadata_against_a_running_server(tmp_path: Path) -> None:
    from helpers.servers import TOKEN, start_server

    from hf3fsctl.meta.client import open_metadata_client

    server = start_server(tmp_path / "server", token=TOKEN)
    try:
        args = _metadata_args(tmp_path, "--url", server.url, "--clients", "1")
        args += ["--token-file", str(server.token_file), "--ops", "lookup,locate,full_1ns"]
        document = json.loads(_invoke(args).stdout)
        (mode,) = document["modes"]
        assert mode["mode"] == "url" and mode["memory"] is None
        assert document["skipped"] == ["full_1ns"]
        assert {r["op"] for r in document["rows"]} == {"ping", "lookup", "locate"}
        for row in document["rows"]:
            _assert_latencies(row)
        client = open_metadata_client(server.url, token=TOKEN)
        try:
            assert client.namespaces() == []  # the benchmark's namespace was dropped
        finally:
            client.close()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "http://10.1.2.3:18765"], "not on loopback"),
        (["--mode", "remote"], "--mode"),
        (["--ops", "scan"], "--ops"),
        (["--entries", "100"], "entries must be at least"),
        (["--token-file", "/nonexistent"], "--token-file is for --url"),
    ],
    ids=["not-loopback", "bad-mode", "bad-op", "too-few-entries", "token-without-url"],
)
def test_bench_metadata_refuses_bad_settings(tmp_path: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["bench", "metadata", "--dir", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())


# --- shared helpers -------------------------------------------------------------------


def test_percentiles_are_nearest_rank_and_ordered() -> None:
    values = [float(i) for i in range(1, 1001)]
    figures = report.latency_ms([v / 1000 for v in values])
    assert figures["p50_ms"] == pytest.approx(500.0)
    assert figures["p99_ms"] == pytest.approx(990.0)
    assert figures["p999_ms"] == pytest.approx(999.0)
    assert report.latency_ms([])["p99_ms"] is None


def test_list_and_size_parsing() -> None:
    assert report.parse_ints("1, 4,16,4", "--x") == [1, 4, 16]
    # a bare number is bytes, as for --capacity and every size key
    assert report.parse_sizes("4096,1MiB,4k,64KiB", "--x") == [4096, 1 << 20, 64 << 10]
    assert report.size_label(4 << 20) == "4 MiB" and report.size_label(3000) == "3000 B"
    for bad in ("12x", "1.5.2MiB", "-4k", ""):
        with pytest.raises(InvalidRequest, match="bare number is bytes, as for --capacity"):
            report.parse_sizes(bad, "--sizes")
    with pytest.raises(InvalidRequest, match="must be positive"):
        report.parse_sizes("0", "--sizes")
