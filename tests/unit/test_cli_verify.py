"""`hf3fsctl verify` without an engine: a prompt set with nothing stored starts no
engine and says so (exit 0); the engine args it would run come from the config's
`vllm:` section, shown with their source."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from hf3fsctl.cli.main import app

runner = CliRunner()


def test_nothing_stored_is_nothing_to_verify(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "hf3fs.yaml"
    store = tmp_path / "store"
    init = ["init", "--storage-path", str(store), "--create-path", "--write-config", str(config)]
    assert runner.invoke(app, init).exit_code == 0
    text = config.read_text().replace("\nvllm: {}\n", "\n")
    config.write_text(text + "vllm: {dtype: bfloat16, enforce-eager: true}\n")
    result = runner.invoke(
        app,
        [
            "--config",
            str(config),
            "verify",
            "--model",
            str(tiny_model_dir),
            "-p",
            "hello " * 80,
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["result"] is None and "nothing" in document["message"]
    assert document["engine_args"]["enforce_eager"] == {"value": True, "source": "config vllm:"}
