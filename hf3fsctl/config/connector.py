"""What vLLM needs to load the hf3fsctl connector for a configuration.

`kv_transfer_config(config)` is the value of vLLM's `--kv-transfer-config` (printed by
`hf3fsctl vllm-config`, used by `hf3fsctl warm`): the connector by module path,
`kv_load_failure_policy: recompute` (vLLM's default `fail` ends a request whose load
failed; docs/design.md decision 3), and `kv_connector_extra_config` naming the config file and
the resolved storage path and metadata URL, so a vLLM process without this shell's
`HF3FSCTL_*` environment finds the same store. No vLLM import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

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
