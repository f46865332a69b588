"""A store the connector cannot write: misses, one log line per outage, no tracebacks.

Found by running vLLM over a store whose mount had been remounted read-only: every
request's lookup logged "lookup failed unexpectedly" with a traceback, because opening the
embedded store raised a typed `StorageError` that the metadata guard passed through without
marking the service down. Now an open that fails marks it down (one warning, retried
silently after the back-off), and a typed error is one line.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import hf3fsctl_connector
import pytest
from helpers.connector_harness import BLOCK_SIZE, Harness, make_harness, make_request, prompt_tokens
from hf3fsctl_connector.service import MetadataGuard, ServiceDown

from hf3fsctl.config import load_config
from hf3fsctl.errors import StorageError
from hf3fsctl.meta.protocol import MetadataClient

PROMPT = prompt_tokens(3 * BLOCK_SIZE + 5, salt=7)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _guard(tmp_path: Path, opener: Callable[..., MetadataClient]) -> MetadataGuard:
    config = load_config(None, overrides={"storage.path": str(tmp_path)})
    return MetadataGuard(config, opener=opener)


def test_a_store_that_cannot_be_opened_is_marked_down_and_logged_once_per_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr("hf3fsctl_connector.service.time.monotonic", clock)
    opens: list[int] = []
    broken = {"yes": True}

    class _Client:
        def lookup(self, namespace: str, keys: list[str]) -> int:
            return len(keys)

        def close(self) -> None:
            pass

    def opener(config: object) -> MetadataClient:
        opens.append(1)
        if broken["yes"]:
            raise StorageError("metadata store X is read-only here")
        return _Client()  # type: ignore[return-value]

    guard = _guard(tmp_path, opener)
    caplog.set_level(logging.INFO, logger="hf3fsctl_connector.service")
    for _ in range(3):  # three back-offs, each retried once
        with pytest.raises(StorageError):  # typed: the worker disables itself on it
            guard.call(lambda c: c.lookup("ns", ["a"]))
        with pytest.raises(ServiceDown):  # within the back-off, nothing is tried
            guard.call(lambda c: c.lookup("ns", ["a"]))
        clock.now += guard.backoff_s + 0.1
    broken["yes"] = False
    assert guard.call(lambda c: c.lookup("ns", ["a", "b"])) == 2
    assert guard.call(lambda c: c.lookup("ns", ["a"])) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(opens) == 4
    assert len([m for m in lines if "unavailable" in m and "read-only" in m]) == 1, lines
    assert len([m for m in lines if "is back" in m]) == 1, lines


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs the test fills, then remounts read-only (`remount` below)."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_requests_on_a_read_only_store_are_misses_with_no_traceback(
    read_only_mount: Path,
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = read_only_mount / "store"
    cold = make_harness(tiny_model_dir, store)
    try:
        cold.run(make_request("cold", PROMPT))
        assert hf3fsctl_connector.wait_for_saves(10)
    finally:
        cold.close()
    assert len(cold.saved_keys()) == 3  # the store holds the prompt's full blocks
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)

    caplog.set_level(logging.INFO)
    warm: Harness | None = None
    try:
        warm = make_harness(tiny_model_dir, store)
        requests = [make_request(f"warm{i}", PROMPT, max_tokens=2) for i in range(3)]
        warm.run(*requests)
        loads = [job for meta in warm.metas for job in meta.loads]
    finally:
        if warm is not None:
            warm.close()
    assert all(r.is_finished() for r in requests)
    assert loads == []  # served as misses: nothing loaded, nothing raised
    ours = [r for r in caplog.records if r.name.startswith("hf3fsctl")]
    assert not [r for r in ours if r.exc_info], [r.getMessage() for r in ours if r.exc_info]
    read_only = [r.getMessage() for r in ours if "read-only" in r.getMessage().lower()]
    assert read_only, [r.getMessage() for r in ours]  # said, with the path
    lookup_lines = [m for m in read_only if "lookup failed" in m or "unavailable" in m]
    assert len(lookup_lines) <= 1, lookup_lines


@pytest.mark.integration
@pytest.mark.parametrize("token", ["wrong", "missing"])
def test_a_token_the_service_refuses_disables_the_worker_with_the_fix(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, token: str
) -> None:
    """A configuration error the service reports: the worker is disabled, logged once
    with the fix (and recorded for `doctor`), the scheduler's lookups are misses with
    one line, and no request fails."""
    from helpers.servers import TOKEN, start_server

    server = start_server(tmp_path / "server", token=TOKEN)
    wrong = tmp_path / "wrong-token"
    if token == "wrong":
        wrong.write_text("not-the-token\n")
        wrong.chmod(0o600)
    extra = {"metadata.url": server.url, "metadata.token_file": str(wrong)}
    caplog.set_level(logging.INFO)
    harness: Harness | None = None
    try:
        harness = make_harness(tiny_model_dir, tmp_path / "store", extra=extra)
        requests = [make_request(f"r{i}", PROMPT, max_tokens=2) for i in range(3)]
        harness.run(*requests)
        assert hf3fsctl_connector.wait_for_saves(10)
        state = harness.worker.worker_side.health.snapshot()
    finally:
        if harness is not None:
            harness.close()
        server.stop()
    assert all(r.is_finished() for r in requests)
    assert state.state == "disabled" and "token" in state.reason, state
    ours = [r for r in caplog.records if r.name.startswith("hf3fsctl")]
    assert not [r for r in ours if r.exc_info]
    said = "refused the token" if token == "wrong" else "cannot read"
    lines = [
        r.getMessage() for r in ours if said in r.getMessage() and r.levelno >= logging.WARNING
    ]
    assert 1 <= len(lines) <= 3, lines  # the worker's state, each side's outage or lookups (once)
