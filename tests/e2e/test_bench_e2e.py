"""`hf3fsctl bench e2e`: the real CLI on real vLLM (`--quick`), and its `--url` client.

One `--quick` run (tiny model, 2×2 prompts, about a minute) as a fresh `python -m
hf3fsctl` process (`helpers.cli_runner`), with `--json`, `--json-out` and `--plot`: every configuration
must reproduce the no-connector outputs, the figures must be sane and the ratios to the
ceilings present, and the plot a real PNG. No wall-clock thresholds. The `--url` mode is
checked against a small streaming stub on loopback, and a non-loopback URL is refused.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from e2e_scenario import RESERVED_CPU
from helpers.cli_runner import run_hf3fsctl
from typer.testing import CliRunner

from hf3fsctl.bench.e2e import lmcache_available
from hf3fsctl.bench.e2e.settings import ENGINE_ENV
from hf3fsctl.cli.main import app
from hf3fsctl.vllm_tools.zygote import ZYGOTE_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN_TIMEOUT_S = 420  # a bound for a busy machine; about a minute when idle
OURS = ("none", "floor", "cold", "warm")
PEER = ("example-cold", "example-warm")


@pytest.fixture(scope="module")
def bench_env(reserved_cpu_zygote: str | None) -> dict[str, str]:
    """The environment of the `bench` process: its engines (`ENGINE_ENV`) forked from the
    session's reserved-CPU zygote (e2e conftest) instead of five `python -m` starts."""
    assert ENGINE_ENV == RESERVED_CPU, "the zygote must be started with the bench's engine env"
    if reserved_cpu_zygote is None:
        return dict(os.environ)
    return {**os.environ, ZYGOTE_ENV: reserved_cpu_zygote}


@pytest.fixture(scope="module")
def quick_run(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, bench_env: dict[str, str]
) -> dict[str, Any]:
    """`hf3fsctl bench e2e --quick --peer example --peer lmcache --json --plot ...`, once,
    on the session's tiny model (the one `--quick` would build: SIZES["tiny"])."""
    tmp = tmp_path_factory.mktemp("bench-e2e")
    png, json_out = tmp / "e2e.png", tmp / "e2e.json"
    args = [
        "bench",
        "e2e",
        "--quick",
        "--peer",
        "example",
        "--peer",
        "lmcache",
        "--model",
        str(tiny_model),
        "--work-dir",
        str(tmp / "work"),
        "--timeout",
        str(RUN_TIMEOUT_S - 30),
        "--json",
        "--json-out",
        str(json_out),
        "--plot",
        str(png),
    ]
    proc = run_hf3fsctl(*args, env=bench_env, timeout=RUN_TIMEOUT_S, check=True)
    document = json.loads(proc.stdout)  # exactly one JSON document on stdout
    return {
        "document": document,
        "json_out": json_out,
        "png": png,
        "work": tmp / "work",
    }


def _configs(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return run["document"]["configurations"]


def test_every_configuration_ran(quick_run: dict[str, Any]) -> None:
    configs = _configs(quick_run)
    for name in (*OURS, *PEER):
        assert configs[name]["status"] == "ok", configs[name]


def test_outputs_of_every_configuration_equal_no_connector(quick_run: dict[str, Any]) -> None:
    configs = _configs(quick_run)
    reference = configs["none"]["outputs_sha256"]
    assert len(reference) == 64
    for name in (*OURS, *PEER):
        assert configs[name]["outputs_sha256"] == reference, name
        assert configs[name]["outputs_match_none"] is True
    assert quick_run["document"]["goals"]["outputs_identical"] is True


def test_ttfts_are_positive_and_ordered(quick_run: dict[str, Any]) -> None:
    for name in (*OURS, *PEER):
        entry = _configs(quick_run)[name]
        assert entry["requests"] == 4
        assert 0 < entry["ttft_p50_s"] <= entry["ttft_p99_s"] <= entry["ttft_max_s"]


def test_throughputs_are_positive(quick_run: dict[str, Any]) -> None:
    for name in (*OURS, *PEER):
        entry = _configs(quick_run)[name]
        for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
            assert entry[key] > 0, (name, key)
        assert entry["prefill_tokens_per_s"] > 0
        assert entry["output_tokens"] == 4 * 8  # --quick: 8 tokens per request


def test_warm_run_hits_the_store(quick_run: dict[str, Any]) -> None:
    configs = _configs(quick_run)
    warm, floor = configs["warm"], configs["floor"]
    assert warm["hit_rate"] > 0
    assert warm["connector_hit_rate"] > 0  # through our connector, not vLLM's own cache
    assert warm["connector"]["blocks_loaded"] > 0
    assert warm["connector"]["failed_blocks"] == 0
    assert 0 < warm["hit_rate"] <= floor["hit_rate"] <= 1


def test_cold_run_saves_to_the_store(quick_run: dict[str, Any]) -> None:
    cold = _configs(quick_run)["cold"]
    assert cold["connector"]["blocks_saved"] > 0
    assert cold["connector_hit_rate"] == 0


def test_ratios_to_the_ceilings_are_present(quick_run: dict[str, Any]) -> None:
    document = quick_run["document"]
    ratios = document["ratios"]
    for key in (
        "warm_ttft_p50_over_floor",
        "warm_ttft_p99_over_floor",
        "warm_ttft_p50_over_none",
        "cold_prefill_throughput_over_none",
        "warm_hit_rate_over_floor",
        "example_warm_ttft_p50_over_floor",
        "ours_warm_over_example_warm",
    ):
        assert ratios[key] is not None and ratios[key] > 0, key
    assert set(document["ceiling"]) >= {"ttft", "throughput"}
    warm = document["configurations"]["warm"]
    assert warm["ratios"]["ttft_p50_over_floor"] == pytest.approx(
        warm["ttft_p50_s"] / document["configurations"]["floor"]["ttft_p50_s"]
    )
    assert document["goals"]["cold_prefill_within_10pct_of_none"] in (True, False)


def test_lmcache_is_skipped_with_a_note_when_not_importable(quick_run: dict[str, Any]) -> None:
    if lmcache_available():
        pytest.skip("lmcache is importable here: its runs are measured instead")
    configs = _configs(quick_run)
    for name in ("lmcache-cold", "lmcache-warm"):
        assert configs[name]["status"] == "skipped"
        assert "lmcache" in configs[name]["note"]
    assert any("lmcache" in note for note in quick_run["document"]["notes"])


def test_json_out_holds_the_same_document(quick_run: dict[str, Any]) -> None:
    assert json.loads(quick_run["json_out"].read_text()) == quick_run["document"]


def test_plot_is_a_real_png(quick_run: dict[str, Any]) -> None:
    data = quick_run["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5 * 1024


def test_private_stores_are_removed(quick_run: dict[str, Any]) -> None:
    assert not list(quick_run["work"].glob("run-*"))


# --- --url --------------------------------------------------------------------------


class _StubCompletions(BaseHTTPRequestHandler):
    """`/v1/models` and a streamed `/v1/completions` whose text depends on the prompt."""

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, document: Any) -> None:
        body = json.dumps(document).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._json({"data": [{"id": "stub-model"}]})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert request["stream"] is True and request["model"] == "stub-model"
        prompt = request["prompt"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(request["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f" t{(sum(prompt) + i) % 97}"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(prompt), "completion_tokens": request["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def stub_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_url_mode_streams_the_workload_twice(stub_server: str, tmp_path: Path) -> None:
    args = ["bench", "e2e", "--url", stub_server, "--prefixes", "2", "--suffixes", "3"]
    args += ["--prefix-tokens", "64", "--suffix-tokens", "8", "--output-tokens", "4"]
    args += ["--warmup-tokens", "8", "--json", "--plot", str(tmp_path / "url.png")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["mode"] == "url"
    configs = document["configurations"]
    for name in ("server", "server-repeat"):
        entry = configs[name]
        assert entry["status"] == "ok"
        assert entry["requests"] == 6
        assert entry["prompt_tokens"] == 6 * 72
        assert entry["output_tokens"] == 6 * 4
        assert 0 < entry["ttft_p50_s"] <= entry["ttft_p99_s"]
    assert configs["server-repeat"]["outputs_sha256"] == configs["server"]["outputs_sha256"]
    assert document["ratios"]["first_ttft_p50_over_repeat"] > 0
    assert (tmp_path / "url.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com:8000", "ftp://x"])
def test_url_mode_refuses_hosts_that_are_not_loopback(url: str) -> None:
    result = CliRunner().invoke(app, ["bench", "e2e", "--url", url, "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""


def test_url_mode_refuses_offline_only_flags() -> None:
    args = ["bench", "e2e", "--url", "http://127.0.0.1:9", "--peer", "example", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--peer" in result.stderr
