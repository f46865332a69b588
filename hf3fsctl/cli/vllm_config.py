"""`hf3fsctl vllm-config`: the value to give vLLM's `--kv-transfer-config`.

Prints exactly one JSON object on stdout, e.g.::

    vllm serve MODEL --kv-transfer-config "$(hf3fsctl vllm-config --compact)"
    LLM(model=..., kv_transfer_config=json.loads(...))

`kv_load_failure_policy` is `recompute` (vLLM's default `fail` ends a request whose
load failed; DESIGN decision 3). `kv_connector_extra_config` names the config file in
use (absolute) and carries the resolved storage path and metadata URL, so a vLLM
process that lacks this shell's `HF3FSCTL_*` environment still finds the same store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hf3fsctl.cli import context
from hf3fsctl.cli.options import ConfigOpt

if TYPE_CHECKING:
    from hf3fsctl.config import Config

CONNECTOR_CLASS = "Hf3fsctlConnector"
CONNECTOR_MODULE = "hf3fsctl_connector.connector"


def kv_transfer_config(config: Config) -> dict[str, Any]:
    """The `KVTransferConfig` fields that load the hf3fsctl connector for `config`.

    Paths are made absolute: vLLM may run in another working directory.
    """
    storage_path = Path(config.storage.path).resolve()
    extra: dict[str, Any] = {}
    if config.source:
        extra["config_file"] = str(Path(config.source).resolve())
    extra["storage.path"] = str(storage_path)
    extra["metadata.url"] = config.metadata.url or f"sqlite:///{storage_path / 'metadata.db'}"
    if config.metadata.token_file:
        extra["metadata.token_file"] = str(Path(config.metadata.token_file).resolve())
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_role": "kv_both",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def vllm_config(
    ctx: typer.Context,
    config: ConfigOpt = None,
    compact: Annotated[
        bool, typer.Option("--compact", help="One line, for a shell argument.")
    ] = False,
) -> None:
    """Print the JSON for vLLM's --kv-transfer-config (one object on stdout)."""
    cfg = context.load(ctx, config)
    document = kv_transfer_config(cfg)
    if compact:
        typer.echo(json.dumps(document, separators=(",", ":")))
    else:
        typer.echo(json.dumps(document, indent=2))
