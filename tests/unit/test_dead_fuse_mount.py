"""A store whose FUSE daemon died (3FS after hf3fs_fuse exited), then came back.

A real FUSE mount (`bindfs`, a passthrough FUSE file system from Debian, installed by
`make fuse`) whose daemon is killed with SIGKILL: every call on the mount point then
fails with ENOTCONN ("Transport endpoint is not connected") until it is unmounted and
mounted again. Found with vLLM on such a mount: every CLI command died with an OSError
traceback (pathlib's `exists()` raises ENOTCONN), doctor too; and after the mount came
back the worker's saves failed for good, since its open page file still pointed at the
dead connection. Now each command is one line with the fix, doctor a failed check, and
the worker reopens its page file once the mount answers again.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import hf3fsctl_connector
import pytest
from helpers.cli_store import STORE_COMMANDS, Store, cli, fill, make_store, one_line_error
from helpers.connector_harness import (
    BLOCK_SIZE,
    Harness,
    make_harness,
    make_request,
    prompt_tokens,
)
from helpers.meta_builders import keys as make_keys
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.errors import MetadataUnavailable, StorageError

T = TypeVar("T")


@dataclass
class FuseMount:
    """A `bindfs` mount of `source` at `path`, its daemon in the foreground (`-f`)."""

    source: Path
    path: Path
    daemon: subprocess.Popen[bytes] | None = None

    def mount(self) -> None:
        self.daemon = subprocess.Popen(["bindfs", "-f", str(self.source), str(self.path)])
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.path):
            assert self.daemon.poll() is None, "bindfs exited before mounting"
            assert time.monotonic() < deadline, "bindfs did not mount in 20 s"
            time.sleep(0.05)

    def kill(self) -> None:
        """Kill the daemon as a crash would: the mount point stays, every call ENOTCONN."""
        assert self.daemon is not None
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon.wait(10)
        deadline = time.monotonic() + 20  # the kernel's attribute cache expires (~1 s)
        while True:
            try:
                os.stat(self.path)
            except OSError as exc:
                assert exc.errno == errno.ENOTCONN, exc
                return
            assert time.monotonic() < deadline, "the mount still answers without its daemon"
            time.sleep(0.1)

    def remount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=True)
        self.mount()


@pytest.fixture
def fuse_mount(tmp_path: Path) -> Iterator[FuseMount]:
    if shutil.which("bindfs") is None:
        raise RuntimeError("bindfs is not installed: run `make fuse` (Debian's bindfs)")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine: FUSE mounts cannot exist here")
    mount = FuseMount(tmp_path / "src", tmp_path / "mnt")
    mount.source.mkdir()
    mount.path.mkdir()
    mount.mount()
    try:
        yield mount
    finally:
        if mount.daemon is not None and mount.daemon.poll() is None:
            mount.daemon.kill()
        subprocess.run(["umount", "-l", str(mount.path)], check=False, capture_output=True)


@pytest.fixture
def dead_store(fuse_mount: FuseMount, tmp_path: Path) -> Store:
    """A filled store on the mount (its config file beside the test, off the mount),
    the mount's daemon then killed."""
    made = make_store(fuse_mount.path)
    fill(made, make_keys(4))
    store = dataclasses.replace(made, config_file=tmp_path / "hf3fs.yaml")
    shutil.copy(made.config_file, store.config_file)
    fuse_mount.kill()
    return store


def test_a_config_file_on_a_dead_fuse_mount_isone_line_error(
    dead_store: Store, fuse_mount: FuseMount
) -> None:
    on_mount = dataclasses.replace(dead_store, config_file=fuse_mount.path / "hf3fs.yaml")
    result = cli(on_mount, "stats")
    assert result.exit_code == StorageError.exit_code, result.output
    assert one_line_error(result.stderr) and "hf3fs.yaml" in result.stderr, result.stderr


@pytest.mark.parametrize("args", STORE_COMMANDS)
def test_every_command_on_a_dead_fuse_mount_is_one_line_with_the_fix(
    dead_store: Store, args: list[str]
) -> None:
    result = cli(dead_store, *args)
    assert result.exit_code == StorageError.exit_code, result.output
    assert one_line_error(result.stderr), result.stderr
    assert "not reachable" in result.stderr and "remount" in result.stderr, result.stderr


def test_doctor_on_a_dead_fuse_mount_fails_the_storage_check(dead_store: Store) -> None:
    result = cli(dead_store, "doctor", "--json")
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["storage.path"]["status"] == "fail"
    assert "not reachable" in checks["storage.path"]["detail"]
    assert "remount" in checks["storage.path"]["fix"]
    assert checks["metadata.reachable"]["status"] == "fail"


def test_the_worker_reopens_its_page_file_when_the_mount_comes_back(
    fuse_mount: FuseMount, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Pages on the FUSE mount, metadata on the local disk (so lookups still answer):
    the daemon dies under a running engine, the mount comes back, and the same worker
    saves again — to a freshly opened page file — and loads what it saved before."""
    (tmp_path / "meta").mkdir()
    extra = {
        "metadata.url": f"sqlite:///{tmp_path / 'meta' / 'metadata.db'}",
        "connector.storage_retry_s": 0.2,
    }
    store = fuse_mount.path / "kv"
    first, during, after, later = (
        prompt_tokens(3 * BLOCK_SIZE + 5, salt=s) for s in (11, 12, 13, 14)
    )
    caplog.set_level(logging.INFO)
    harness: Harness | None = None
    try:
        harness = make_harness(tiny_model_dir, store, extra=extra)
        harness.run(make_request("first", first, max_tokens=2))
        assert hf3fsctl_connector.wait_for_saves(10)
        side = harness.worker.worker_side
        old_file = side.page_file
        fuse_mount.kill()
        harness.run(make_request("during", during, max_tokens=2))
        assert hf3fsctl_connector.wait_for_saves(10)
        down = side.health.snapshot()
        assert down.state == "disabled" and "not reachable" in down.reason, down
        fuse_mount.remount()
        deadline = time.monotonic() + 30
        reopened = None
        n = 0
        while time.monotonic() < deadline:  # saves dropped while disabled retry storage
            n += 1
            harness.run(make_request(f"after{n}", after, max_tokens=2))
            assert hf3fsctl_connector.wait_for_saves(10)
            if side.health.snapshot().state == "ok" and side.page_file is not None:
                reopened = side.page_file
                break
            time.sleep(0.3)
        assert reopened is not None and reopened is not old_file, side.health.snapshot()
        harness.run(make_request("later", later, max_tokens=2))  # saved to the new file
        assert hf3fsctl_connector.wait_for_saves(10)
    finally:
        if harness is not None:
            harness.close()
    reader = make_harness(tiny_model_dir, store, extra=extra)  # another engine
    try:
        reader.run(make_request("first", first, max_tokens=2))
        reader.run(make_request("later", later, max_tokens=2))
        loaded = [key for meta in reader.metas for job in meta.loads for key in job.keys]
    finally:
        reader.close()
    assert len(loaded) == 6 and not reader.invalid_reported, (loaded, reader.invalid_reported)
    ours = [r for r in caplog.records if r.name.startswith("hf3fsctl")]
    assert not [r for r in ours if r.exc_info], [r.getMessage() for r in ours if r.exc_info]
    assert [r for r in ours if "ok again" in r.getMessage() and "worker" in r.getMessage()]


def test_warm_on_a_dead_fuse_mount_says_so_before_starting_an_engine(
    fuse_mount: FuseMount, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Metadata on the local disk, pages on the dead mount: `warm` used to start vLLM
    (a minute on a large model), whose connector was disabled, and end with "namespace
    … is not registered"."""
    (tmp_path / "meta").mkdir()
    config = tmp_path / "hf3fs.yaml"
    made = CliRunner().invoke(
        app,
        [
            *("init", "--storage-path", str(fuse_mount.path / "kv"), "--create-path"),
            *("--metadata-url", f"sqlite:///{tmp_path / 'meta' / 'metadata.db'}"),
            *("--write-config", str(config)),
        ],
    )
    assert made.exit_code == 0, made.output
    fuse_mount.kill()
    prompt = " ".join(f"word{i % 97}" for i in range(400))
    result = CliRunner().invoke(
        app,
        ["--config", str(config), "warm", "--model", str(tiny_model_dir), "--prompt", prompt],
    )
    assert result.exit_code == StorageError.exit_code, result.output
    assert one_line_error(result.stderr) and "not reachable" in result.stderr, result.stderr
    assert "starting vLLM" not in result.output


def _until_it_answers(call: Callable[[], T], timeout_s: float = 20.0) -> T:
    """`call()` once the store answers again: the first call after a remount may find
    the file it had open gone (MetadataUnavailable, its connections then reopened)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except MetadataUnavailable:
            assert time.monotonic() < deadline, "the store never answered again"
            time.sleep(0.2)


def test_a_sqlite_store_on_a_dead_fuse_mount_is_unavailable_then_reopens(
    fuse_mount: FuseMount,
) -> None:
    """The embedded store (the default: its DB under the storage root, on the mount):
    while the daemon is dead every call is MetadataUnavailable, never a raw sqlite3
    error ("disk I/O error", "cannot commit - no transaction is active"); once the mount
    is back the same store object opens the file again and has every committed key."""
    from hf3fsctl.meta.client import open_store

    store = make_store(fuse_mount.path)
    kept = make_keys(4)
    fill(store, kept)
    client = open_store(str(store.root / "metadata.db"), background_checkpoint=True)
    try:
        assert client.lookup(store.namespace, kept) == 4
        fuse_mount.kill()
        try:  # SQLite may answer a read from its cache: then rightly
            assert client.lookup(store.namespace, kept) == 4
        except MetadataUnavailable as exc:
            assert "not reachable" in str(exc)
        with pytest.raises(MetadataUnavailable, match="not reachable"):
            client.allocate(store.namespace, 0, make_keys(2, salt="b"))
        fuse_mount.remount()
        assert _until_it_answers(lambda: client.lookup(store.namespace, kept)) == 4
        fresh = make_keys(3, salt="c")
        fill(store, fresh, client)  # writes: the writer lock reopened too
        assert client.lookup(store.namespace, fresh) == 3
    finally:
        client.close()


@pytest.mark.integration
def test_serve_on_a_dead_fuse_mount_answers_503_then_recovers(fuse_mount: FuseMount) -> None:
    """`serve` whose DB is on the mount: 503 with the reason while the daemon is dead
    (it was a 500 with a traceback per request), 200 again after the remount, without
    a restart (its connections and writer lock are opened again)."""
    import urllib.error
    import urllib.request

    from helpers.servers import start_server

    server = start_server(fuse_mount.path / "server")
    try:
        fuse_mount.kill()
        with pytest.raises(urllib.error.HTTPError) as down:
            urllib.request.urlopen(f"{server.url}/healthz", timeout=10)
        assert down.value.code == 503
        assert "not reachable" in down.value.read().decode()
        fuse_mount.remount()

        def healthy() -> int:
            try:
                with urllib.request.urlopen(f"{server.url}/healthz", timeout=10) as answer:
                    return int(answer.status)
            except urllib.error.HTTPError as exc:
                raise MetadataUnavailable(str(exc)) from None

        assert _until_it_answers(healthy) == 200
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_a_hung_fuse_mount_never_holds_the_engine_step(
    fuse_mount: FuseMount,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon stopped (SIGSTOP: every call on the mount waits, for good): the
    scheduler's storage check and a synchronous load each held vLLM's engine step until
    the daemon went on. Now the check runs off the step (misses once it has not
    answered for a second) and a step waits for its loads at most a deadline (their
    blocks recomputed, later loads failing at once until the read returns)."""
    from hf3fsctl_connector import worker as worker_module
    from hf3fsctl_connector.metadata import Hf3fsctlConnectorMetadata, LoadJob

    monkeypatch.setattr(worker_module, "SYNC_LOAD_DEADLINE_S", 0.5, raising=False)
    (tmp_path / "meta").mkdir()
    extra = {
        "metadata.url": f"sqlite:///{tmp_path / 'meta' / 'metadata.db'}",
        "connector.storage_retry_s": 0.2,
    }
    prompt = prompt_tokens(3 * BLOCK_SIZE + 5, salt=21)
    harness = make_harness(tiny_model_dir, fuse_mount.path / "kv", extra=extra)
    try:
        harness.run(make_request("saved", prompt, max_tokens=2))
        assert hf3fsctl_connector.wait_for_saves(10)
        side = harness.worker.worker_side
        keys = [key for meta in harness.metas for job in meta.saves for key in job.keys][:3]
        assert len(keys) == 3
        Path("/proc/sys/vm/drop_caches").write_text("3\n")  # the read must reach the daemon
        assert fuse_mount.daemon is not None
        fuse_mount.daemon.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            side.start_load_kv(
                Hf3fsctlConnectorMetadata(loads=[LoadJob("a", [40, 41, 42], keys, True)])
            )
            again = time.monotonic()
            side.start_load_kv(
                Hf3fsctlConnectorMetadata(loads=[LoadJob("b", [43, 44, 45], keys, True)])
            )
            done = time.monotonic()
            errors = side.get_block_ids_with_load_errors()
            scheduler = harness.connector.scheduler_side
            checks: list[bool] = []
            while len(checks) < 100 and (not checks or checks[-1]):  # ~5 s of steps
                time.sleep(0.05)
                checks.append(scheduler.storage_available())
            during = time.monotonic() - done
        finally:
            fuse_mount.daemon.send_signal(signal.SIGCONT)
        assert again - started < 30 and done - again < 5 and during < 30  # seconds, not forever
        assert checks[-1] is False  # the scheduler serves misses: its check has not answered
        assert errors == {40, 41, 42, 43, 44, 45}
        deadline = time.monotonic() + 30
        while True:  # once the hung read returned, loads run again
            side.start_load_kv(
                Hf3fsctlConnectorMetadata(loads=[LoadJob("c", [46, 47, 48], keys, True)])
            )
            if not side.get_block_ids_with_load_errors():
                break
            assert time.monotonic() < deadline, "loads never ran again"
            time.sleep(0.2)
    finally:
        harness.close()
