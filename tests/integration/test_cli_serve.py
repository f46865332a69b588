"""`hf3fsctl serve` as a real process: where its database lives, and `--insecure`."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.servers import free_port

pytestmark = pytest.mark.integration


@contextmanager
def serving(config: Path, *args: str) -> Iterator[tuple[int, Path]]:
    """Run `hf3fsctl serve --config CONFIG ARGS` until /healthz answers; yield (port, log)."""
    port = free_port()
    log = config.parent / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hf3fsctl",
                "serve",
                "--config",
                str(config),
                "--port",
                str(port),
                "--log-level",
                "warning",
                *args,
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        yield port, log
    finally:
        process.terminate()
        process.wait(10)


def test_serve_keeps_its_db_under_the_storage_path_for_an_http_config(tmp_path: Path) -> None:
    config = tmp_path / "hf3fs.yaml"
    config.write_text(
        f"storage:\n  path: {tmp_path / 'store'}\nmetadata:\n  url: http://127.0.0.1:1\n"
    )
    with serving(config):
        assert (tmp_path / "store" / "metadata.db").is_file()


def test_serve_insecure_on_all_interfaces_warns_loudly(tmp_path: Path) -> None:
    config = tmp_path / "hf3fs.yaml"
    config.write_text(f"storage:\n  path: {tmp_path / 'store'}\n")
    with serving(config, "--host", "0.0.0.0", "--insecure") as (_, log):
        pass
    assert "WITHOUT authentication" in log.read_text()


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_on_a_missing_mount_refuses_and_creates_nothing(tmp_path: Path, workers: int) -> None:
    """storage.path under a file system not mounted (its parent missing too): serve's
    database lives there by default, and making its directories would put the store on
    this node's root disk, where the engines beside it would then cache too. It exits
    with the store's error instead; with several workers too, which used to start and
    die again and again, for good, and never exit."""
    from hf3fsctl.errors import StorageError

    root = tmp_path / "unmounted" / "kv"
    config = tmp_path / "hf3fs.yaml"
    config.write_text(f"storage:\n  path: {root}\n")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "hf3fsctl", "serve", "--config", str(config)),
            *("--port", str(free_port()), "--workers", str(workers)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == StorageError.exit_code, done.stderr
    assert "a file system not mounted?" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "unmounted").exists()
