"""The CLI's shape: help, version, error mapping, exit codes, one JSON document."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hf3fsctl.cli.main import app
from hf3fsctl.cli.options import parse_duration
from hf3fsctl.cli.output import format_age
from hf3fsctl.errors import AuthError, ConfigError, MetadataUnavailable, NotFound, StorageError

runner = CliRunner()

COMMANDS = ["init", "serve", "stats", "ls", "evict", "doctor", "vllm-config"]


def test_help_lists_every_command_and_the_exit_codes() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.stdout
    assert "Exit codes" in result.stdout
    assert "7 authentication refused" in " ".join(result.stdout.split())


@pytest.mark.parametrize("command", COMMANDS, ids=COMMANDS)
def test_every_command_has_help(command: str) -> None:
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.stdout


HELP_OF = [[], *([command] for command in COMMANDS)]
WIDE = {"COLUMNS": "200"}  # no type column is elided


@pytest.mark.parametrize("command", HELP_OF, ids=["app", *COMMANDS])
def test_help_shows_no_value_type_after_flags(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"], env=WIDE)
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout and "BOOLEAN" not in result.stdout


def test_help_still_names_the_value_an_option_takes() -> None:
    result = runner.invoke(app, ["evict", "--help"], env=WIDE)
    assert "DURATION" in result.stdout and "TEXT" in result.stdout
    assert "<str>" not in result.stdout  # Typer's type, shown as a plain word


def test_version_prints_the_package_version() -> None:
    from hf3fsctl import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"hf3fsctl {__version__}"


def test_unknown_config_key_exits_2_naming_the_key(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("storage:\n  pathh: /x\n")
    result = runner.invoke(app, ["--config", str(bad), "vllm-config"])
    assert result.exit_code == ConfigError.exit_code == 2
    assert "storage.pathh" in result.stderr
    assert "did you mean storage.path" in result.stderr
    assert result.stdout == ""


def test_missing_config_named_by_the_environment_blames_hf3fsctl_config(tmp_path) -> None:
    result = runner.invoke(app, ["stats"], env={"HF3FSCTL_CONFIG": str(tmp_path / "none.yaml")})
    assert "does not exist (from HF3FSCTL_CONFIG)" in result.stderr


@pytest.mark.parametrize("where", ["global", "command"])
def test_missing_config_named_by_the_flag_blames_config(tmp_path, where: str) -> None:
    flag = ["--config", str(tmp_path / "none.yaml")]
    args = [*flag, "stats"] if where == "global" else ["stats", *flag]
    result = runner.invoke(app, args)
    assert "does not exist (from --config)" in result.stderr


@pytest.mark.parametrize("command", ["stats", "ls", "evict", "doctor", "vllm-config", "serve"])
def test_missing_config_named_by_the_environment_fails_every_command_but_init(
    tmp_path, command: str
) -> None:
    env = {"HF3FSCTL_CONFIG": str(tmp_path / "none.yaml")}
    args = {"evict": ["evict", "--all", "--dry-run"], "doctor": ["doctor", "--json"]}
    result = runner.invoke(app, args.get(command, [command]), env=env)
    assert result.exit_code == (1 if command == "doctor" else ConfigError.exit_code)


def test_config_flag_wins_over_hf3fsctl_config(tmp_path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("storage:\n  path: /from/flag\n")
    env = {"HF3FSCTL_CONFIG": str(tmp_path / "none.yaml")}
    result = runner.invoke(app, ["--config", str(file), "vllm-config", "--no-check"], env=env)
    assert json.loads(result.stdout)["kv_connector_extra_config"]["storage.path"] == "/from/flag"


def test_bad_environment_value_exits_2_naming_the_key() -> None:
    result = runner.invoke(app, ["vllm-config"], env={"HF3FSCTL_STORAGE_ENGINE": "fast"})
    assert result.exit_code == 2
    assert "storage.engine" in result.stderr


def test_error_has_a_hint_line() -> None:
    result = runner.invoke(app, ["vllm-config"], env={"HF3FSCTL_STORAGE_ENGINE": "fast"})
    assert "Hint:" in result.stderr


def test_debug_env_shows_the_traceback() -> None:
    result = runner.invoke(
        app, ["vllm-config"], env={"HF3FSCTL_STORAGE_ENGINE": "fast", "HF3FSCTL_DEBUG": "1"}
    )
    assert result.exit_code == 2
    assert "Traceback" in result.stderr


def test_without_debug_there_is_no_traceback() -> None:
    result = runner.invoke(app, ["vllm-config"], env={"HF3FSCTL_STORAGE_ENGINE": "fast"})
    assert "Traceback" not in result.stderr


def test_missing_store_is_not_found_with_the_init_hint(tmp_path) -> None:
    result = runner.invoke(app, ["stats"], env={"HF3FSCTL_STORAGE_PATH": str(tmp_path / "none")})
    assert result.exit_code == NotFound.exit_code
    assert "hf3fsctl init" in result.stderr
    assert not (tmp_path / "none").exists()


def test_unreachable_service_exits_with_metadata_unavailable(tmp_path) -> None:
    env = {"HF3FSCTL_METADATA_URL": "http://127.0.0.1:9", "HF3FSCTL_METADATA_TIMEOUT_S": "0.5"}
    result = runner.invoke(app, ["stats"], env=env)
    assert result.exit_code == MetadataUnavailable.exit_code
    assert "hf3fsctl serve" in result.stderr


def test_exit_codes_are_distinct_per_error_kind() -> None:
    codes = [
        ConfigError.exit_code,
        NotFound.exit_code,
        StorageError.exit_code,
        MetadataUnavailable.exit_code,
        AuthError.exit_code,
    ]
    assert len(set(codes)) == len(codes)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("7d", 604800),
        ("1w", 604800),
        ("1.5h", 5400),
    ],
    ids=["bare", "seconds", "minutes", "hours", "days", "weeks", "fraction"],
)
def test_parse_duration_accepts_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "2x", "h", "-1h", "1 hour"], ids=["empty", "unit", "no-number", "negative", "word"]
)
def test_bad_duration_is_a_usage_error(text: str) -> None:
    result = runner.invoke(app, ["evict", "--older-than", text, "--dry-run"])
    assert result.exit_code == 2
    assert "--older-than" in result.stderr


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (5, "5s"), (120, "2m"), (7200, "2h"), (3 * 86400, "3d")],
    ids=["unknown", "seconds", "minutes", "hours", "days"],
)
def test_format_age(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text


def test_evict_without_a_criterion_is_refused() -> None:
    result = runner.invoke(app, ["evict", "--dry-run"])
    assert result.exit_code == 2
    assert "criterion" in result.stderr


def test_stats_json_and_watch_are_refused_together() -> None:
    result = runner.invoke(app, ["stats", "--json", "--watch", "1"])
    assert result.exit_code == 2
    assert result.stdout == ""


@pytest.mark.timeout(30)
def test_serve_refuses_a_public_address_without_a_token(tmp_path) -> None:
    env = {"HF3FSCTL_STORAGE_PATH": str(tmp_path)}
    result = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--port", "1"], env=env)
    assert result.exit_code == 2
    assert "token" in result.stderr
    assert not (tmp_path / "metadata.db").exists()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("10.0.0.5", False),
        ("node1.example", False),
    ],
    ids=["v4", "name", "v6", "v6-brackets", "any", "private", "hostname"],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    from hf3fsctl.cli.serve import is_loopback

    assert is_loopback(host) is loopback


def test_vllm_config_is_one_json_object_with_recompute() -> None:
    result = runner.invoke(
        app, ["vllm-config", "--compact", "--no-check"], env={"HF3FSCTL_STORAGE_PATH": "/data/kv"}
    )
    assert result.exit_code == 0
    assert len(result.stdout.strip().splitlines()) == 1
    document = json.loads(result.stdout)
    assert document["kv_load_failure_policy"] == "recompute"
    assert document["kv_connector_extra_config"]["storage.path"] == "/data/kv"
    assert document["kv_connector_extra_config"]["metadata.url"] == "sqlite:////data/kv/metadata.db"


def test_vllm_config_names_the_config_file_absolutely(tmp_path, monkeypatch) -> None:
    (tmp_path / "hf3fs.yaml").write_text("storage:\n  path: /data/kv\n")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["vllm-config", "--config", "hf3fs.yaml", "--no-check"])
    extra = json.loads(result.stdout)["kv_connector_extra_config"]
    assert extra["config_file"] == str(tmp_path / "hf3fs.yaml")


def test_vllm_config_is_accepted_by_vllm_kv_transfer_config() -> None:
    from vllm.config.kv_transfer import KVTransferConfig

    document = json.loads(runner.invoke(app, ["vllm-config", "--no-check"]).stdout)
    config = KVTransferConfig(**document)
    assert config.kv_load_failure_policy == "recompute"
    assert config.is_kv_transfer_instance
