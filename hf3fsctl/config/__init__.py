"""One configuration schema for the CLI, the metadata server and the vLLM connector.

Values are layered, later wins: built-in defaults (identical to the packaged, documented
`default_config.yaml`) → a YAML file → `HF3FSCTL_<SECTION>_<KEY>` environment variables
→ explicit overrides (CLI flags, the connector's `kv_connector_extra_config`).

The file is found by `find_config_file`: an explicit path, else `$HF3FSCTL_CONFIG`, else
`./hf3fs.yaml`, else `$XDG_CONFIG_HOME/hf3fsctl/config.yaml` (`~/.config/...`), else
`/etc/hf3fsctl/config.yaml`, else none (the packaged defaults).

The schema is frozen pydantic models, one per section (`StorageConfig`, …), that forbid
unknown keys. Every bad value raises `ConfigError` naming the key, the value and the fix.
Sizes accept plain bytes or units (`64GiB`, `512MiB`, `4k`); durations are seconds or
`90s`, `5m`, `1h`, `7d`.

Rooms: `units` (sizes and shares), `urls` (`MetadataUrl`, the one URL parser), `schema`
(the pydantic models and their error wording), `loader` (files, environment, layering,
dump), `connector` (vLLM's `--kv-transfer-config` for a configuration). Every public name
is importable from `hf3fsctl.config`.
"""

from hf3fsctl.config.loader import (
    ENV_PREFIX,
    RESERVED_ENV,
    build_config,
    dump_config,
    env_overrides,
    find_config_file,
    load_config,
    read_yaml,
)
from hf3fsctl.config.schema import (
    QUOTAS,
    QUOTAS_HELP,
    SECTIONS,
    Config,
    ConfigKey,
    ConfigSection,
    ConnectorConfig,
    MetadataConfig,
    RetentionConfig,
    ServerConfig,
    StorageConfig,
    config_keys,
)
from hf3fsctl.config.units import (
    Amount,
    format_size,
    parse_amount,
    parse_duration,
    parse_size,
)
from hf3fsctl.config.urls import MetadataUrl

__all__ = [
    "ENV_PREFIX",
    "QUOTAS",
    "QUOTAS_HELP",
    "RESERVED_ENV",
    "SECTIONS",
    "Amount",
    "Config",
    "ConfigKey",
    "ConfigSection",
    "ConnectorConfig",
    "MetadataConfig",
    "MetadataUrl",
    "RetentionConfig",
    "ServerConfig",
    "StorageConfig",
    "build_config",
    "config_keys",
    "dump_config",
    "env_overrides",
    "find_config_file",
    "format_size",
    "load_config",
    "parse_amount",
    "parse_duration",
    "parse_size",
    "read_yaml",
]
