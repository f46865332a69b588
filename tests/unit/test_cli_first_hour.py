"""An operator's first hour (issue 17): each trap a new user hit, one invariant per test.

Driven through Typer's CliRunner (and, where a terminal, a signal or the console script
matter, a real `python -m hf3fsctl` process) against real SQLite stores, a real
`redis-server` and, for the read-only cases, a real read-only mount: a tmpfs remounted
`ro` (the tests run as root, which ignores permission bits, so `chmod` would prove
nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from helpers.cli_store import (
    STORE_COMMANDS,
    Store,
    cli,
    cli_json,
    fill,
    make_store,
    one_line_error,
)
from helpers.meta_builders import keys as make_keys
from helpers.redis_servers import redis_binaries_missing, redis_server
from helpers.servers import ServerProcess, free_port, metadata_server
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.config import load_config
from hf3fsctl.errors import (
    AddressInUse,
    AuthError,
    ConfigError,
    InvalidRequest,
    MetadataUnavailable,
    NotFound,
    StorageError,
)

__all__ = ["metadata_server"]  # a fixture used here

runner = CliRunner()
WIDE = {"COLUMNS": "200"}
NO_CONFIG = {"HF3FSCTL_CONFIG": None, "HF3FSCTL_STORAGE_PATH": None, "HF3FSCTL_METADATA_URL": None}


HF3FSCTL = [sys.executable, "-m", "hf3fsctl"]


def invoke(*args: str, env: dict[str, Any] | None = None) -> Any:
    return runner.invoke(app, list(args), env=env)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m hf3fsctl ARGS` in a fresh process, as the console script runs."""
    return subprocess.run(
        [*HF3FSCTL, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return make_store(tmp_path)


# --- 1. a refused --capacity changes nothing ------------------------------------------


@pytest.mark.parametrize("capacity", ["1KiB", "0", "50"], ids=["1KiB", "zero", "50-bytes"])
def test_init_with_a_too_small_capacity_creates_no_store(tmp_path: Path, capacity: str) -> None:
    root = tmp_path / "store"
    root.mkdir()
    result = invoke("init", "--storage-path", str(root), "--capacity", capacity)
    assert result.exit_code == InvalidRequest.exit_code, result.stderr
    assert "too small" in result.stderr
    assert list(root.iterdir()) == []


def test_reinit_with_a_too_small_capacity_keeps_the_recorded_one(store: Store) -> None:
    before = cli_json(store, "stats")["capacity_bytes"]
    refused = cli(store, "init", "--storage-path", str(store.root), "--capacity", "1KiB")
    assert refused.exit_code == InvalidRequest.exit_code
    assert cli_json(store, "stats")["capacity_bytes"] == before


def test_doctor_fails_a_store_whose_recorded_capacity_holds_no_page(store: Store) -> None:
    from hf3fsctl.meta.client import connect

    client = connect(store.config())  # as an hf3fsctl that did not check recorded it
    try:
        client.set_capacity(1024)
    finally:
        client.close()
    checks = {c["name"]: c for c in json.loads(cli(store, "doctor", "--json").stdout)["checks"]}
    assert checks["store.capacity"]["status"] == "fail"


# --- 2. a read-only store: stats, ls, doctor read it; evict is one line ---------------


@pytest.fixture
def read_only_store(tmp_path: Path) -> Iterator[Store]:
    """A filled store on a tmpfs that is then remounted read-only."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        store = make_store(mount)
        fill(store, make_keys(3))
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        yield store
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_stats_reads_a_store_on_a_read_only_mount(read_only_store: Store) -> None:
    document = cli_json(read_only_store, "stats")
    assert document["namespaces"][0]["keys"] == 3


def test_ls_reads_a_store_on_a_read_only_mount(read_only_store: Store) -> None:
    assert len(cli_json(read_only_store, "ls")["entries"]) == 6  # 3 keys x 2 ranks


def test_lookup_reads_a_store_on_a_read_only_mount(
    read_only_store: Store, tiny_model_dir: Path
) -> None:
    result = cli(read_only_store, "lookup", "--model", str(tiny_model_dir), "-p", "a b c")
    assert result.exit_code == 0, result.output
    document = cli_json(read_only_store, "lookup", "--model", str(tiny_model_dir), "-p", "a b c")
    assert document["totals"]["prompts"] == 1


def test_evict_on_a_read_only_mount_is_one_line_storage_error(read_only_store: Store) -> None:
    result = cli(read_only_store, "evict", "--all", "--yes")
    assert result.exit_code == StorageError.exit_code
    assert one_line_error(result.stderr) and "read-only" in result.stderr


def test_doctor_says_the_store_is_read_only_and_how_to_fix_it(read_only_store: Store) -> None:
    result = cli(read_only_store, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    writable = checks["storage.writable"]
    assert writable["status"] == "fail"
    assert "read-only" in writable["detail"] and "remount" in writable["fix"]


def test_a_store_on_a_full_file_system_says_so(tmp_path: Path) -> None:
    """SQLite names an ENOSPC "disk I/O error" on some file systems (btrfs), "database or
    disk is full" on others; the store says which it is, the same on every one."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        store = make_store(mount)
        fill(store, make_keys(3))
        with open(mount / "filler", "wb") as filler, pytest.raises(OSError):
            while True:
                filler.write(bytes(1 << 20))
                filler.flush()
        with pytest.raises(MetadataUnavailable, match="no space left on its file system"):
            for batch in range(64):  # until a write needs a page the WAL does not have
                fill(store, [f"{batch:04x}{i:028x}" for i in range(256)])
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def damaged_store(tmp_path: Path) -> Store:
    """A filled store whose metadata DB then had every page but the first overwritten."""
    store = make_store(tmp_path)
    fill(store, make_keys(40))
    db = store.root / "metadata.db"
    from hf3fsctl.meta.client import connect

    connect(store.config()).close()  # checkpointed: the rows are in the file itself
    for side in ("-wal", "-shm"):
        Path(f"{db}{side}").unlink(missing_ok=True)
    size = db.stat().st_size
    assert size > 8192
    with open(db, "r+b") as handle:
        handle.seek(4096)
        handle.write(os.urandom(size - 4096))
    return store


@pytest.mark.parametrize("args", STORE_COMMANDS)
def test_a_damaged_metadata_db_is_one_line_with_the_fix(
    damaged_store: Store, args: list[str]
) -> None:
    result = cli(damaged_store, *args)
    assert result.exit_code == MetadataUnavailable.exit_code, result.output
    assert one_line_error(result.stderr), result.stderr
    assert "damaged" in result.stderr and "backup" in result.stderr


def test_doctor_says_the_metadata_db_is_damaged(damaged_store: Store) -> None:
    result = cli(damaged_store, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["metadata.reachable"]["status"] == "fail"
    assert "damaged" in checks["metadata.reachable"]["detail"]
    assert "hf3fsctl init" in checks["metadata.reachable"]["fix"]


# --- 3. a key `ls` prints is accepted by pin ------------------------------------------


def shown_keys(store: Store) -> list[str]:
    """The key column of `ls`'s table, as printed."""
    table = cli(store, "ls", "--namespace", store.namespace, env=WIDE).stdout
    rows = [line.split("│") for line in table.splitlines() if store.namespace in line]
    return [cells[2].strip() for cells in rows]  # "│ namespace │ key │ …"


def test_pin_accepts_the_key_ls_shows_as_the_key_it_stands_for(store: Store) -> None:
    (key,) = make_keys(1)
    fill(store, [key])
    document = cli_json(store, "pin", store.namespace, "--key", shown_keys(store)[0])
    assert (document["keys"], document["stored"]) == ([key], 1)


@pytest.mark.integration
def test_pin_over_a_server_accepts_the_key_ls_shows(
    tmp_path: Path, metadata_server: ServerProcess
) -> None:
    node = make_store(
        tmp_path / "node", metadata_url=metadata_server.url, token_file=metadata_server.token_file
    )
    (key,) = make_keys(1)
    fill(node, [key])
    document = cli_json(node, "pin", node.namespace, "--key", shown_keys(node)[0])
    assert document["keys"] == [key]


@pytest.mark.integration
def test_vllm_config_refuses_a_token_the_service_does_not_take(
    tmp_path: Path, metadata_server: ServerProcess
) -> None:
    """`/healthz` needs no token, so a health check alone passed a wrong one, and vLLM
    then served misses for good."""
    node = make_store(
        tmp_path / "node", metadata_url=metadata_server.url, token_file=metadata_server.token_file
    )
    assert cli(node, "vllm-config").exit_code == 0
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    wrong.chmod(0o600)
    result = cli(node, "vllm-config", env={"HF3FSCTL_METADATA_TOKEN_FILE": str(wrong)})
    assert result.exit_code == AuthError.exit_code, result.output
    assert one_line_error(result.stderr) and "token" in result.stderr


def test_pin_refuses_a_shortened_key_that_matches_no_stored_key(store: Store) -> None:
    result = cli(store, "pin", store.namespace, "--key", "0123456789abcdef")
    assert result.exit_code == InvalidRequest.exit_code
    assert "whole key" in result.stderr


def test_pin_refuses_a_key_longer_than_the_namespace_hash_makes(store: Store) -> None:
    result = cli(store, "pin", store.namespace, "--key", "ab" * 40)
    assert result.exit_code == InvalidRequest.exit_code
    assert "64" in result.stderr


# --- 4. vllm-config points vLLM only at a store that is there --------------------------


def test_vllm_config_without_any_config_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    env = {**NO_CONFIG, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    result = invoke("vllm-config", env=env)
    assert result.exit_code == ConfigError.exit_code
    assert result.stdout == ""


def test_vllm_config_for_a_store_that_does_not_exist_is_not_found(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"storage:\n  path: {tmp_path / 'none'}\n")
    result = invoke("--config", str(config), "vllm-config")
    assert result.exit_code == NotFound.exit_code
    assert result.stdout == ""


def test_vllm_config_for_a_server_that_is_down_is_unavailable(store: Store) -> None:
    env = {"HF3FSCTL_METADATA_URL": f"http://127.0.0.1:{free_port()}"}
    result = cli(store, "vllm-config", env=env)
    assert result.exit_code == MetadataUnavailable.exit_code


def test_vllm_config_no_check_prints_it_for_a_store_not_there_yet(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"storage:\n  path: {tmp_path / 'later'}\n")
    result = invoke("--config", str(config), "vllm-config", "--no-check")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["kv_connector_extra_config"]["storage.path"]


def test_init_without_a_config_file_suggests_doctor_for_this_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    result = invoke("init", "--storage-path", str(root), "--create-path", env=WIDE)
    doctor = next(line for line in result.stdout.splitlines() if line.endswith(" doctor"))
    assert f"HF3FSCTL_STORAGE_PATH={root}" in doctor


@pytest.mark.parametrize("flag", ["--storage-path", "--metadata-url"])
def test_init_over_a_config_of_another_store_suggests_commands_for_this_one(
    tmp_path: Path, flag: str
) -> None:
    """`init --config A.yaml --storage-path B` (no --write-config) used to suggest
    `hf3fsctl --config A.yaml doctor`, which checks A."""
    import shlex

    first = tmp_path / "first"
    config = tmp_path / "a.yaml"
    made = invoke(
        "init", "--storage-path", str(first), "--create-path", "--write-config", str(config)
    )
    assert made.exit_code == 0, made.output
    other = tmp_path / "second"
    value = str(other) if flag == "--storage-path" else f"sqlite:///{tmp_path / 'm2.db'}"
    args = ["--config", str(config), "init", flag, value, "--create-path"]
    result = invoke(*args, env=WIDE)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.endswith(" doctor"))
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if "=" in w and w.startswith("HF3FSCTL_"))
    command = [w for w in words if w not in {f"{k}={v}" for k, v in env.items()}]
    assert command[0] == "hf3fsctl" and command[-1] == "doctor"
    shown = invoke(*command[1:-1], "stats", "--json", env=env)  # as suggested, but stats
    assert shown.exit_code == 0, shown.output
    document = json.loads(shown.stdout)
    if flag == "--storage-path":
        assert document["storage"]["path"] == str(other)
    else:
        assert document["metadata_url"].endswith(str(tmp_path / "m2.db"))


# --- 5. a missing path is never silently the root disk --------------------------------


def test_init_refuses_a_storage_path_that_does_not_exist(tmp_path: Path) -> None:
    root = tmp_path / "not-mounted" / "kv"
    result = invoke("init", "--storage-path", str(root))
    assert result.exit_code == NotFound.exit_code
    assert not root.exists()


def test_init_refusing_a_missing_path_names_its_file_system_and_the_flag(tmp_path: Path) -> None:
    from hf3fsctl.storage.engine import find_mount

    _, fstype = find_mount(tmp_path)
    result = invoke("init", "--storage-path", str(tmp_path / "kv"), env=WIDE)
    assert fstype in result.stderr and "--create-path" in result.stderr


def test_init_takes_the_storage_path_of_its_config_file(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text(f"storage:\n  path: {root}\n")
    assert invoke("init", "--config", str(config)).exit_code == 0
    assert (root / "metadata.db").is_file()


def test_init_create_path_creates_a_missing_storage_path(tmp_path: Path) -> None:
    root = tmp_path / "new" / "kv"
    result = invoke("init", "--storage-path", str(root), "--create-path")
    assert result.exit_code == 0, result.stderr
    assert (root / "metadata.db").is_file()


@pytest.fixture
def store_on_the_root_file_system() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(dir="/", prefix=".hf3fsctl-test-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_doctor_warns_about_a_store_on_the_root_file_system(
    store_on_the_root_file_system: Path,
) -> None:
    root = store_on_the_root_file_system
    assert invoke("init", "--storage-path", str(root)).exit_code == 0
    result = invoke("doctor", "--json", env={"HF3FSCTL_STORAGE_PATH": str(root)})
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["storage.mount"]["status"] == "warn"


# --- 6. two nodes: the token file, a service or Redis that is down ---------------------


def test_init_for_a_server_records_the_token_file_for_serve(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    config = tmp_path / "node.yaml"
    url = f"http://127.0.0.1:{free_port()}"
    args = ["init", "--storage-path", str(tmp_path), "--metadata-url", url]
    result = invoke(
        *args, "--token-file", str(token), "--write-config", str(config), "--config-only"
    )
    assert result.exit_code == 0, result.stderr
    assert load_config(config, environ={}).server.token_file == str(token.resolve())


@pytest.mark.integration
def test_init_against_a_live_server_records_its_capacity(
    tmp_path: Path, metadata_server: ServerProcess
) -> None:
    token = str(metadata_server.token_file)
    args = ["init", "--storage-path", str(tmp_path), "--metadata-url", metadata_server.url]
    result = invoke(*args, "--token-file", token, "--capacity", "1GiB", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["capacity"]["capacity_bytes"] == 1024**3


def test_init_against_a_server_that_is_down_fails_and_writes_no_config(tmp_path: Path) -> None:
    config = tmp_path / "node.yaml"
    url = f"http://127.0.0.1:{free_port()}"
    args = ["init", "--storage-path", str(tmp_path), "--metadata-url", url, "--capacity", "1GiB"]
    result = invoke(*args, "--write-config", str(config))
    assert result.exit_code == MetadataUnavailable.exit_code
    assert not config.exists()


def test_init_against_redis_that_is_down_does_not_say_start_serve(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = invoke("init", "--storage-path", str(tmp_path), "--metadata-url", url, env=WIDE)
    assert result.exit_code == MetadataUnavailable.exit_code
    assert "Redis" in result.stderr and "hf3fsctl serve" not in result.stderr


def test_init_on_a_new_redis_store_says_no_false_unbounded_warning(tmp_path: Path) -> None:
    """`init --create-path` read the store before it made the root, and the store's
    open then warned that it was unbounded, just before init recorded its capacity."""
    missing = redis_binaries_missing()
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not installed: run `make redis`")
    server = redis_server(tmp_path / "redis")
    try:
        url = server.url
        root = tmp_path / "store"
        env = {"HF3FSCTL_STORAGE_PATH": str(root), "HF3FSCTL_METADATA_URL": url}
        result = run_cli("stats", "--json", env=env)  # read-only, before init: records nothing
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["capacity_bytes"] is None
        made = run_cli("init", "--create-path", env=env)
        assert made.returncode == 0, made.stderr
        assert "unbounded" not in made.stderr + made.stdout, made.stderr
        shown = json.loads(run_cli("stats", "--json", env=env).stdout)
        assert shown["capacity_bytes"] and shown["capacity_bytes"] > 0
    finally:
        server.stop()


# --- 8. doctor and Redis's eviction policy ---------------------------------------------


@pytest.fixture
def lru_redis(tmp_path: Path) -> Iterator[str]:
    missing = redis_binaries_missing()
    if missing:  # as the contract suite: an error with the fix, not a skip
        raise RuntimeError(f"{', '.join(missing)} not installed: run `make redis`")
    server = redis_server(tmp_path / "redis", settings=["maxmemory-policy allkeys-lru"])
    try:
        yield server.url
    finally:
        server.stop()


def test_doctor_fails_a_redis_that_evicts_by_itself(tmp_path: Path, lru_redis: str) -> None:
    env = {"HF3FSCTL_STORAGE_PATH": str(tmp_path), "HF3FSCTL_METADATA_URL": lru_redis}
    result = invoke("doctor", "--json", env=env)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    eviction = checks["metadata.redis.eviction"]
    assert eviction["status"] == "fail" and "noeviction" in eviction["fix"]


# --- 10. the smaller ones ---------------------------------------------------------------


@pytest.mark.timeout(120)  # a watch that prints nothing to a pipe would block the read
def test_stats_watch_prints_snapshots_to_a_pipe_and_exits_0_on_sigterm(store: Store) -> None:
    process = subprocess.Popen(
        [*HF3FSCTL, "--config", str(store.config_file), "stats", "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        snapshots = 0
        for line in process.stdout:  # blocks until each snapshot is printed
            snapshots += "hf3fsctl store" in line
            if snapshots == 2:
                break
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.wait()


def test_serve_refuses_a_bogus_log_level_listing_the_levels(tmp_path: Path) -> None:
    result = invoke("serve", "--log-level", "bogus", env={"HF3FSCTL_STORAGE_PATH": str(tmp_path)})
    assert result.exit_code == InvalidRequest.exit_code
    assert one_line_error(result.stderr) and "warning" in result.stderr


def test_serve_on_a_busy_port_exits_with_address_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = invoke("serve", "--port", port, env={"HF3FSCTL_STORAGE_PATH": str(tmp_path)})
    assert result.exit_code == AddressInUse.exit_code == 9
    assert "in use" in result.stderr


def test_exit_code_9_is_in_the_help_table() -> None:
    assert "9 serve cannot listen" in " ".join(invoke("--help", env=WIDE).stdout.split())


def test_doctor_sample_implies_checksums(store: Store) -> None:
    fill(store, make_keys(2))
    names = [c["name"] for c in cli_json(store, "doctor", "--sample", "1")["checks"]]
    assert f"checksums {store.namespace}" in names


def test_verbose_after_the_command_logs_as_before_it(tmp_path: Path) -> None:
    root = tmp_path / "store"
    result = run_cli("init", "--storage-path", str(root), "--create-path", "--json", "-v")
    assert result.returncode == 0, result.stderr
    assert "INFO " in result.stderr


def _long_flags() -> list[tuple[str, str]]:
    group = typer.main.get_command(app)
    ctx = typer.Context(group)
    flags = []
    for name in group.list_commands(ctx):  # type: ignore[attr-defined]
        command = group.get_command(ctx, name)  # type: ignore[attr-defined]
        if name == "bench" or command is None:
            continue
        for param in command.params:
            flags += [(name, opt) for opt in param.opts if opt.startswith("--")]
    return flags


@pytest.mark.parametrize(("command", "flag"), _long_flags(), ids=lambda v: str(v))
def test_help_at_80_columns_shows_every_flag_name_whole(command: str, flag: str) -> None:
    result = invoke(command, "--help", env={"COLUMNS": "80"})
    assert flag in result.stdout


def test_help_shows_a_required_argument_by_name_alone() -> None:
    usage = invoke("pin", "--help", env=WIDE).stdout
    assert "hf3fsctl pin [OPTIONS] NAMESPACE" in usage and "<str>" not in usage


def test_init_metadata_url_help_names_redis() -> None:
    assert "redis://" in invoke("init", "--help", env=WIDE).stdout


def test_written_config_cites_a_file_that_exists(store: Store) -> None:
    first = store.config_file.read_text().splitlines()[0]
    assert Path(first.rsplit(": ", 1)[1]).is_file()


def test_warm_has_vllm_log_errors_only_unless_verbose(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from hf3fsctl.cli.warm import quiet_vllm_logs

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    assert quiet_vllm_logs() == "ERROR"
    assert logging.getLogger("vllm").level == logging.ERROR
