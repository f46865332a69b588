"""`hf3fsctl vllm-config --role`: the printed kv_role, as vLLM's own KVTransferConfig reads it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hf3fsctl.cli.main import app

runner = CliRunner()
ENV = {"HF3FSCTL_STORAGE_PATH": "/data/kv"}


def printed(*args: str) -> dict[str, object]:
    result = runner.invoke(app, ["vllm-config", "--no-check", "--compact", *args], env=ENV)
    assert result.exit_code == 0, result.stderr
    document: dict[str, object] = json.loads(result.stdout)
    return document


@pytest.mark.parametrize(
    ("role", "kv_role", "producer", "consumer"),
    [
        ("producer", "kv_producer", True, False),
        ("consumer", "kv_consumer", False, True),
        ("both", "kv_both", True, True),
    ],
    ids=["producer", "consumer", "both"],
)
def test_role_prints_a_kv_role_vllm_accepts(
    role: str, kv_role: str, producer: bool, consumer: bool
) -> None:
    from vllm.config.kv_transfer import KVTransferConfig

    config = KVTransferConfig(**printed("--role", role))  # vLLM's own validation
    assert config.kv_role == kv_role
    assert (config.is_kv_producer, config.is_kv_consumer) == (producer, consumer)
    assert config.kv_load_failure_policy == "recompute"


def test_without_role_it_is_both() -> None:
    assert printed()["kv_role"] == "kv_both"


def test_role_reaches_the_serve_args_and_the_offloading_config() -> None:
    serve = printed("--serve-args", "--role", "consumer")
    assert serve["kv-transfer-config"]["kv_role"] == "kv_consumer"  # type: ignore[index]
    assert printed("--offloading", "--role", "producer")["kv_role"] == "kv_producer"


def test_an_unknown_role_fails_naming_the_choices() -> None:
    result = runner.invoke(app, ["vllm-config", "--no-check", "--role", "prefill"], env=ENV)
    assert result.exit_code != 0
    assert result.stdout == ""
    assert "producer, consumer, both" in result.stderr
