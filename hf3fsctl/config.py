"""One configuration schema for the CLI, the metadata server and the vLLM connector.

Values are layered, later wins: built-in defaults (identical to the packaged, documented
`default_config.yaml`) → a YAML file → `HF3FSCTL_<SECTION>_<KEY>` environment variables
→ explicit overrides (CLI flags, the connector's `kv_connector_extra_config`).

The file is found by `find_config_file`: an explicit path, else `$HF3FSCTL_CONFIG`, else
`./hf3fs.yaml`, else `$XDG_CONFIG_HOME/hf3fsctl/config.yaml` (`~/.config/...`), else
`/etc/hf3fsctl/config.yaml`, else none (the packaged defaults).

Every bad value raises `ConfigError` naming the key, the value and the fix. Sizes accept
plain bytes or units (`64GiB`, `512MiB`, `4k`); durations are seconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf3fsctl.errors import ConfigError

ENV_PREFIX = "HF3FSCTL_"
# Environment variables with the prefix that are not configuration keys.
RESERVED_ENV = {"HF3FSCTL_CONFIG", "HF3FSCTL_DEBUG", "HF3FSCTL_STATE_DIR"}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, key: str = "size") -> int:
    """Parse `64GiB`, `512 MiB`, `4k` or a plain integer into bytes.

    Raises:
        ConfigError: naming `key` when the value is not a size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not a size; use bytes or a unit like 64GiB")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: {value!r} is negative; sizes are >= 0")
        return value
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"{key}: {value!r} is not a size; use bytes or a unit like 64GiB, 512MiB, 4k"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


_SHARE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class Amount:
    """A size in bytes (`2TiB`) or a share of something larger (`50%`)."""

    bytes: int | None = None
    share: float | None = None

    def of(self, whole: int) -> int:
        """Bytes this amount means against `whole` (a share's base)."""
        if self.bytes is not None:
            return self.bytes
        return int((self.share or 0.0) * whole)

    def __str__(self) -> str:
        if self.share is not None:
            return f"{self.share * 100:g}%"
        return format_size(self.bytes or 0)


def parse_amount(value: object, key: str = "size") -> Amount:
    """Parse `2TiB`, `512MiB`, plain bytes, or a share `50%` (0 < share <= 100%).

    Raises:
        ConfigError: naming `key` when the value is neither.
    """
    match = _SHARE_RE.match(str(value)) if not isinstance(value, (bool, int)) else None
    if match is not None:
        share = float(match.group(1)) / 100
        if not 0 < share <= 1:
            raise ConfigError(f"{key}: {value!r} must be a share above 0% and at most 100%")
        return Amount(share=share)
    try:
        return Amount(bytes=parse_size(value, key))
    except ConfigError:
        raise ConfigError(
            f"{key}: {value!r} is neither a size (2TiB, 512MiB) nor a share (50%)"
        ) from None


def format_size(num_bytes: float) -> str:
    """Format bytes for people: `1.5 GiB`."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _spec(
    help: str,
    *,
    kind: str | None = None,
    choices: tuple[str, ...] | None = None,
    min: float | None = None,
    max: float | None = None,
) -> dict[str, Any]:
    """Field metadata: the help line, and how to validate the value."""
    return {"help": help, "kind": kind, "choices": choices, "min": min, "max": max}


@dataclass(frozen=True)
class StorageConfig:
    """Where and how KV pages are stored."""

    path: str = field(
        default="/mnt/3fs/hf3fsctl",
        metadata=_spec("storage root; on 3FS, a directory under the mount", kind="path"),
    )
    engine: str = field(
        default="auto",
        metadata=_spec(
            "I/O engine: auto (usrbio on a 3FS mount, else posix), posix, usrbio",
            choices=("auto", "posix", "usrbio"),
        ),
    )
    capacity: str = field(
        default="80%",
        metadata=_spec(
            "bytes the whole store may hold, all namespaces and ranks together: a size "
            "(2TiB) or a share of the file system's free space when the store is created "
            "(50%); recorded in the store by `hf3fsctl init`",
            kind="amount",
        ),
    )
    max_pinned: str = field(
        default="25%",
        metadata=_spec(
            "most bytes pinned prefixes may hold: a size or a share of the capacity",
            kind="amount",
        ),
    )
    preallocate: bool = field(
        default=False,
        metadata=_spec(
            "new page files are fallocated at storage.file_size up front (else they "
            "grow on demand, page by page, within the store's capacity)"
        ),
    )
    file_size: int = field(
        default=64 * 1024**3,
        metadata=_spec(
            "bytes of one preallocated page file (storage.preallocate)", kind="size", min=1 << 20
        ),
    )
    io_threads: int = field(
        default=16, metadata=_spec("parallel page reads/writes per process", min=1, max=256)
    )
    o_direct: bool = field(
        default=False, metadata=_spec("bypass the page cache (O_DIRECT) when aligned")
    )


@dataclass(frozen=True)
class MetadataConfig:
    """How the connector and the CLI reach the metadata store."""

    url: str = field(
        default="",
        metadata=_spec(
            "sqlite:///PATH (embedded, no server) or http://HOST:PORT (hf3fsctl serve); "
            "empty = sqlite:///<storage.path>/metadata.db",
            kind="url",
        ),
    )
    timeout_s: float = field(
        default=2.0, metadata=_spec("timeout of every metadata call", min=0.01, max=600)
    )
    token_file: str | None = field(
        default=None, metadata=_spec("file holding the bearer token for http:// URLs")
    )
    ca_file: str | None = field(
        default=None,
        metadata=_spec(
            "PEM file of the CA that signed an https:// service's certificate "
            "(default: the system's trust store)"
        ),
    )
    retry_backoff_s: float = field(
        default=5.0,
        metadata=_spec("connector: wait this long before retrying a dead service", min=0),
    )
    lease_s: float = field(
        default=30.0,
        metadata=_spec("a located page is not reused for this long", min=0.1, max=3600),
    )
    high_watermark: float = field(
        default=0.95,
        metadata=_spec("evict when the store (or a quota) is fuller than this", min=0, max=1),
    )
    low_watermark: float = field(
        default=0.85, metadata=_spec("evict down to this usage", min=0, max=1)
    )


@dataclass(frozen=True)
class ServerConfig:
    """`hf3fsctl serve`."""

    host: str = field(default="127.0.0.1", metadata=_spec("bind address (loopback by default)"))
    port: int = field(default=18765, metadata=_spec("TCP port", min=0, max=65535))
    token_file: str | None = field(
        default=None,
        metadata=_spec("bearer token required on mutating and admin routes when set"),
    )
    max_body_bytes: int = field(
        default=16 * 1024**2, metadata=_spec("largest request body", kind="size", min=1024)
    )
    max_batch: int = field(
        default=8192, metadata=_spec("most keys in one request", min=1, max=1_000_000)
    )
    workers: int = field(
        default=1,
        metadata=_spec("server processes sharing the port (at most one per core)", min=1, max=64),
    )


@dataclass(frozen=True)
class ConnectorConfig:
    """The vLLM connector."""

    save_decode_blocks: bool = field(
        default=False, metadata=_spec("also save blocks filled by generated tokens")
    )
    staging_bytes: int = field(
        default=1024**3,
        metadata=_spec("pinned host staging memory per worker", kind="size", min=1 << 20),
    )
    min_hit_blocks: int = field(
        default=1, metadata=_spec("load only when at least this many blocks hit", min=1)
    )
    lookup_wait_ms: float = field(
        default=5.0,
        metadata=_spec(
            "the scheduler step waits at most this long in all for store lookups "
            "(0 = never); requests not answered by then are asked again next step",
            min=0,
            max=1000,
        ),
    )
    storage_retry_s: float = field(
        default=5.0,
        metadata=_spec(
            "after a storage failure (no space, I/O error, missing mount) skip saves "
            "this long before trying again",
            min=0,
            max=3600,
        ),
    )
    load_mode: str = field(
        default="sync",
        metadata=_spec(
            "sync: load inside the step that computes the rest of the prompt; "
            "async: load on a thread while the engine runs other requests",
            choices=("sync", "async"),
        ),
    )


@dataclass(frozen=True)
class Config:
    """The whole configuration. `source` is the file it was read from, if any."""

    storage: StorageConfig = field(default_factory=StorageConfig)
    metadata: MetadataConfig = field(default_factory=MetadataConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    # Namespace id or model name → most bytes it may hold (a size, or a share of the
    # store's capacity). A model's quota covers all of its namespaces together.
    quotas: dict[str, str] = field(default_factory=dict)
    source: str | None = field(default=None, compare=False)

    @property
    def metadata_url(self) -> str:
        """The metadata URL with the embedded default filled in."""
        if self.metadata.url:
            return self.metadata.url
        return f"sqlite:///{Path(self.storage.path) / 'metadata.db'}"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The configuration as a plain nested dict (no `source`)."""
        data = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        data[QUOTAS] = dict(self.quotas)
        return data


QUOTAS = "quotas"
QUOTAS_HELP = (
    "per-namespace or per-model caps, e.g. {my-org/llama-8b: 40%, 0123456789abcdef: 100GiB} "
    "(a share is of the store's capacity)"
)

SECTIONS: dict[str, type[Any]] = {
    "storage": StorageConfig,
    "metadata": MetadataConfig,
    "server": ServerConfig,
    "connector": ConnectorConfig,
}


def config_keys() -> dict[str, dataclasses.Field[Any]]:
    """Every dotted key (`storage.path`, …) and its dataclass field."""
    return {
        f"{section}.{f.name}": f
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
    }


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _coerce(key: str, f: dataclasses.Field[Any], value: Any) -> Any:
    """Turn a YAML/env/flag value into the field's type, or raise ConfigError."""
    meta = f.metadata
    type_name = str(f.type)
    if value is None or (isinstance(value, str) and value == "" and "None" in type_name):
        if "None" in type_name:
            return None
        if type_name == "str":
            return ""
        raise ConfigError(f"{key}: a value is required (default {f.default!r})")
    if meta.get("kind") == "size":
        result: Any = parse_size(value, key)
    elif meta.get("kind") == "amount":
        result = str(parse_amount(value, key)) if not isinstance(value, str) else value.strip()
        parse_amount(result, key)
    elif type_name == "bool":
        if isinstance(value, bool):
            result = value
        elif str(value).strip().lower() in _TRUE | _FALSE:
            result = str(value).strip().lower() in _TRUE
        else:
            raise ConfigError(f"{key}: {value!r} is not a boolean; use true or false")
    elif type_name == "int":
        if isinstance(value, bool) or not re.fullmatch(r"\s*-?\d+\s*", str(value)):
            raise ConfigError(f"{key}: {value!r} is not an integer")
        result = int(value)
    elif type_name == "float":
        try:
            if isinstance(value, bool):
                raise ValueError
            result = float(value)
        except ValueError:
            raise ConfigError(f"{key}: {value!r} is not a number") from None
    else:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not a string")
        result = str(value)
    choices = meta.get("choices")
    if choices and result not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")
    low, high = meta.get("min"), meta.get("max")
    if low is not None and result < low:
        raise ConfigError(f"{key}: {value!r} is below the minimum {low}")
    if high is not None and result > high:
        raise ConfigError(f"{key}: {value!r} is above the maximum {high}")
    if meta.get("kind") == "url" and result:
        _check_url(key, result)
    return result


def _check_url(key: str, url: str) -> None:
    if url.startswith("sqlite:///") and len(url) > len("sqlite:///"):
        return
    if re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
        return
    raise ConfigError(
        f"{key}: {url!r} is not a metadata URL; use sqlite:///ABSOLUTE/PATH.db or http://HOST:PORT"
    )


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(config_keys()), n=1)
    fix = f"; did you mean {close[0]}?" if close else f"; known keys: {', '.join(config_keys())}"
    return ConfigError(f"unknown config key {key!r}{fix}")


def _flatten(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Nested `{section: {key: value}}` or dotted `{section.key: value}` → dotted."""
    flat: dict[str, Any] = {}
    for name, value in data.items():
        if "." in name:
            flat[name] = value
        elif name == QUOTAS:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{origin}: {QUOTAS} must map a namespace id or model name to a size or share"
                )
            for sub, sub_value in value.items():
                flat[f"{QUOTAS}.{sub}"] = sub_value
        elif name in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{origin}: section {name!r} must be a mapping of keys")
            for sub, sub_value in value.items():
                flat[f"{name}.{sub}"] = sub_value
        else:
            raise _unknown_key(name)
    return flat


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """`HF3FSCTL_STORAGE_PATH=/x` → `{"storage.path": "/x"}`; unknown names are errors."""
    known = config_keys()
    out: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        section, _, key = rest.partition("_")
        dotted = f"{section}.{key}"
        if dotted not in known:
            close = difflib.get_close_matches(dotted, list(known), n=1)
            hint = (
                f"; did you mean {ENV_PREFIX}{close[0].replace('.', '_').upper()}?" if close else ""
            )
            raise ConfigError(f"environment variable {name} names no config key{hint}")
        out[dotted] = value
    return out


def _named_config_file(
    explicit: str | os.PathLike[str] | None, origin: str | None, environ: Mapping[str, str]
) -> tuple[Path, str | None] | None:
    """The config file the caller or `$HF3FSCTL_CONFIG` names, and where the name came from."""
    if explicit:
        return Path(explicit).expanduser(), origin
    if environ.get("HF3FSCTL_CONFIG"):
        return Path(environ["HF3FSCTL_CONFIG"]).expanduser(), "HF3FSCTL_CONFIG"
    return None


def find_config_file(
    explicit: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    origin: str | None = None,
    missing_ok: bool = False,
) -> Path | None:
    """The config file to read, by the documented search order, or None.

    Args:
        explicit: a path the caller was given (the CLI's `--config`); wins over the rest.
        environ: where `HF3FSCTL_CONFIG` and `XDG_CONFIG_HOME` are read (default
            `os.environ`).
        origin: where `explicit` came from (`--config`), named when it does not exist.
        missing_ok: a named file (`explicit` or `$HF3FSCTL_CONFIG`) that does not exist is
            no error but None: for `hf3fsctl init`, which writes it.

    Raises:
        ConfigError: a named file does not exist; the message says where it was named.
    """
    environ = os.environ if environ is None else environ
    named = _named_config_file(explicit, origin, environ)
    if named is not None:
        path, source = named
        if path.is_file():
            return path
        if missing_ok:
            return None
        where = f" (from {source})" if source else ""
        fix = (
            "point HF3FSCTL_CONFIG at an existing file (or unset it)"
            if source == "HF3FSCTL_CONFIG"
            else "give an existing file"
        )
        raise ConfigError(
            f"config file {str(path)!r} does not exist{where}",
            hint=f"{fix}, or create one with `hf3fsctl init --storage-path DIR --write-config PATH`",
        )
    xdg = Path(environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    for candidate in (
        Path("hf3fs.yaml"),
        xdg / "hf3fsctl" / "config.yaml",
        Path("/etc/hf3fsctl/config.yaml"),
    ):
        if candidate.is_file():
            return candidate
    return None


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    return data


def build_config(layers: list[tuple[str, Mapping[str, Any]]], source: str | None = None) -> Config:
    """Apply `(origin, values)` layers over the defaults and validate the result."""
    known = config_keys()
    values: dict[str, Any] = {}
    quotas: dict[str, str] = {}
    for origin, layer in layers:
        for key, value in _flatten(layer, origin).items():
            if key.startswith(QUOTAS + "."):
                name = key[len(QUOTAS) + 1 :]
                if not name:
                    raise ConfigError(f"{origin}: a quota needs a namespace id or model name")
                quotas[name] = str(parse_amount(value, key))
                continue
            if key not in known:
                raise _unknown_key(key)
            values[key] = _coerce(key, known[key], value)
    sections = {}
    for name, cls in SECTIONS.items():
        kwargs = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")}
        sections[name] = cls(**kwargs)
    config = Config(**sections, quotas=quotas, source=source)
    _check_cross_field(config)
    return config


def _check_cross_field(config: Config) -> None:
    md = config.metadata
    if md.low_watermark >= md.high_watermark:
        raise ConfigError(
            f"metadata.low_watermark ({md.low_watermark}) must be below "
            f"metadata.high_watermark ({md.high_watermark})"
        )
    if not config.storage.path:
        raise ConfigError("storage.path: a directory is required")


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Load the configuration: defaults → file → environment → overrides.

    Args:
        path: an explicit config file (the CLI's `--config`); else the search order.
        overrides: dotted (`{"storage.path": …}`) or nested values that win over all.
        environ: the environment to read (default `os.environ`).

    Raises:
        ConfigError: naming the key, the value and the fix.
    """
    environ = os.environ if environ is None else environ
    file = find_config_file(path, environ)
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if file is not None:
        layers.append((str(file), read_yaml(file)))
    layers.append(("environment", env_overrides(environ)))
    if overrides:
        layers.append(("overrides", {k: v for k, v in overrides.items() if v is not None}))
    return build_config(layers, source=str(file) if file else None)


def dump_config(config: Config) -> str:
    """The configuration as YAML, each key with its help line as a comment."""
    lines = ["# hf3fsctl configuration (see configs/hf3fs.yaml for every key)"]
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:")
        for f in dataclasses.fields(cls):
            value = getattr(getattr(config, section), f.name)
            lines.append(f"  # {f.metadata['help']}")
            lines.append(f"  {f.name}: {_yaml_scalar(value)}")
    lines.append(f"# {QUOTAS_HELP}")
    if config.quotas:
        lines.append(f"{QUOTAS}:")
        lines.extend(f"  {_yaml_scalar(k)}: {_yaml_scalar(v)}" for k, v in config.quotas.items())
    else:
        lines.append(f"{QUOTAS}: {{}}")
    return "\n".join(lines) + "\n"


def _yaml_scalar(value: Any) -> str:
    import json

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)
