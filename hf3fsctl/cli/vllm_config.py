"""`hf3fsctl vllm-config`: the value to give vLLM's `--kv-transfer-config`.

Prints exactly one JSON object on stdout, e.g.::

    vllm serve MODEL --kv-transfer-config "$(hf3fsctl vllm-config --compact)"
    LLM(model=..., kv_transfer_config=json.loads(...))

`kv_load_failure_policy` is `recompute` (vLLM's default `fail` ends a request whose
load failed; docs/design.md decision 3). `kv_connector_extra_config` names the config file in
use (absolute) and carries the resolved storage path and metadata URL, so a vLLM
process that lacks this shell's `HF3FSCTL_*` environment still finds the same store.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from hf3fsctl.cli import context
from hf3fsctl.cli.options import ConfigOpt
from hf3fsctl.config.connector import kv_transfer_config


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
