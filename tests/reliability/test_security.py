"""Security of `hf3fsctl serve` (docs/design.md decision 11), each claim checked for real.

- With a token, every route but `/healthz` answers 401 without it and with a wrong one:
  the routes come from `/openapi.json`, so a new route cannot be forgotten. `/healthz`
  stays open (load balancers probe it without credentials; it says only "ok" and a count);
  `/metrics` needs the token (it names every namespace and its traffic; Prometheus sends
  one with `authorization: {credentials_file: …}`).
- The token is compared in constant time (`hmac.compare_digest`, on the request path).
- `serve` binds loopback unless told otherwise (the listening socket, read from
  /proc/net/tcp, not the log line).
- A token file that group or others can read is warned about, in one line with the fix.
- Neither the token nor a wrong one appears in serve's (debug) log, in CLI `--json`
  output (`stats`, `doctor`) or in the CLI's error (even with `HF3FSCTL_DEBUG=1`).
"""

from __future__ import annotations

import hmac
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from helpers.cli_runner import run_hf3fsctl
from helpers.servers import ServerProcess, free_port, write_config

from hf3fsctl.cli.serve import read_token
from hf3fsctl.meta.server.app import create_app
from hf3fsctl.meta.sqlite.store import MetadataStore

TOKEN = "sekret-7f3a9c0d5e1b2468ace0"
WRONG = "wrong-0d5e1b2468ace07f3a9c"
OPEN_ROUTES = {("get", "/healthz")}  # everything else needs the token
NAMESPACE = "0123456789abcdef"


@pytest.fixture
def app(tmp_path: Path) -> Iterator[FastAPI]:
    store = MetadataStore(tmp_path / "meta.db")
    yield create_app(store, token=TOKEN)
    store.close()


def schema_routes(client: TestClient) -> list[tuple[str, str, dict[str, Any]]]:
    spec = client.get("/openapi.json").json()
    return [
        (method, path, operation)
        for path, item in spec["paths"].items()
        for method, operation in item.items()
    ]


def test_only_healthz_is_open(app: FastAPI) -> None:
    with TestClient(app) as client:
        routes = schema_routes(client)
        assert {(m, p) for m, p, op in routes if "security" not in op} == OPEN_ROUTES
        assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": f"Bearer {WRONG}"}, {"authorization": TOKEN}],
    ids=["none", "wrong", "not-bearer"],
)
def test_every_other_route_refuses_a_missing_or_wrong_token(
    app: FastAPI, headers: dict[str, str]
) -> None:
    with TestClient(app) as client:
        guarded = [(m, p) for m, p, _ in schema_routes(client) if (m, p) not in OPEN_ROUTES]
        assert len(guarded) >= 20
        for method, path in guarded:
            url = path.replace("{namespace}", NAMESPACE)
            response = client.request(method, url, json={}, headers=headers)
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"] == "AuthError"
            assert response.headers["www-authenticate"] == "Bearer"
            assert WRONG not in response.text and TOKEN not in response.text


def test_the_token_is_compared_in_constant_time(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with TestClient(app) as client:
        wrong = client.post("/v1/lookup", json={}, headers={"authorization": f"Bearer {WRONG}"})
        right = client.get("/v1/stats", headers={"authorization": f"Bearer {TOKEN}"})
    assert (wrong.status_code, right.status_code) == (401, 200)
    expected = f"Bearer {TOKEN}".encode()
    assert compared == [(f"Bearer {WRONG}".encode(), expected), (expected, expected)]


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o640, True), (0o600, False)])
def test_a_token_file_others_can_read_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: int, warned: bool
) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    assert read_token(str(path)) == TOKEN
    err = capsys.readouterr().err
    assert ("chmod 600" in err) is warned
    assert TOKEN not in err and len(err.strip().splitlines()) == int(warned)


class DefaultHostServer(ServerProcess):
    """`hf3fsctl serve` without `--host` (the default bind address), logging at debug."""

    def command(self) -> list[str]:
        cmd = super().command()
        at = cmd.index("--host")
        del cmd[at : at + 2]
        cmd[cmd.index("--log-level") + 1] = "debug"
        return cmd


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} spell them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


def cli(config: Path, *args: str, debug: bool = False) -> subprocess.CompletedProcess[str]:
    """`hf3fsctl ARGS --config CONFIG` as a fresh process (`helpers.cli_runner`: forked
    from the session's CLI zygote when there is one, ~1 s less of start-up each)."""
    env = {**os.environ, "HF3FSCTL_DEBUG": "1" if debug else "0"}
    return run_hf3fsctl(*args, "--config", str(config), env=env, timeout=120)


@pytest.mark.integration
def test_serve_binds_loopback_warns_and_never_shows_a_token(tmp_path: Path) -> None:
    directory = tmp_path / "server"
    directory.mkdir()
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o644)
    server = DefaultHostServer(
        config=write_config(directory, directory / "metadata.db"),
        db_path=directory / "metadata.db",
        port=free_port(),
        token=TOKEN,
        log_path=directory / "serve.log",
        token_file=token_file,
    )
    server.start()
    try:
        assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1 only
        client_dir = tmp_path / "client"
        client_dir.mkdir()
        outputs = []
        for name, secret in (("right", TOKEN), ("wrong", WRONG)):
            secret_file = client_dir / name
            secret_file.write_text(secret + "\n")
            secret_file.chmod(0o600)
            config = client_dir / f"{name}.yaml"
            config.write_text(
                f"storage:\n  path: {tmp_path / 'storage'}\nmetadata:\n"
                f"  url: {server.url}\n  token_file: {secret_file}\n"
            )
            stats = cli(config, "stats", "--json")
            debug_stats = cli(config, "stats", "--json", debug=True)
            doctor = cli(config, "doctor", "--json", debug=True)  # checks auth itself
            outputs += [stats, debug_stats, doctor]
            assert (stats.returncode == 0) is (name == "right"), stats.stderr
            if name == "wrong":
                assert "AuthError" in stats.stderr or "token" in stats.stderr.lower()
    finally:
        server.stop()
    log = server.log()
    warnings = [line for line in log.splitlines() if "chmod 600" in line]
    assert len(warnings) == 1 and str(token_file) in warnings[0], log
    for text in [log] + [o.stdout + o.stderr for o in outputs]:
        assert TOKEN not in text and WRONG not in text
