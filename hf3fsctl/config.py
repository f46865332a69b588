"""One configuration schema for the CLI, the metadata server and the vLLM connector.

Values are layered, later wins: built-in defaults (identical to the packaged, documented
`default_config.yaml`) → a YAML file → `HF3FSCTL_<SECTION>_<KEY>` environment variables
→ explicit overrides (CLI flags, the connector's `kv_connector_extra_config`).

The file is found by `find_config_file`: an explicit path, else `$HF3FSCTL_CONFIG`, else
`./hf3fs.yaml`, else `$XDG_CONFIG_HOME/hf3fsctl/config.yaml` (`~/.config/...`), else
`/etc/hf3fsctl/config.yaml`, else none (the packaged defaults).

The schema is frozen pydantic models, one per section (`StorageConfig`, …), that forbid
unknown keys. Every bad value raises `ConfigError` naming the key, the value and the fix. Sizes accept
plain bytes or units (`64GiB`, `512MiB`, `4k`); durations are seconds.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NoReturn

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from hf3fsctl.errors import ConfigError

ENV_PREFIX = "HF3FSCTL_"
# HF3FSCTL_* variables that are not config keys: the config file, tracebacks, status
# files, and the staging ops' library, build target and kernel chunk (hf3fsctl.ops.locate,
# csrc/staging_cuda.cu). Any other HF3FSCTL_* name must be a key, or loading fails.
RESERVED_ENV = {
    "HF3FSCTL_CONFIG",
    "HF3FSCTL_DEBUG",
    "HF3FSCTL_STATE_DIR",
    "HF3FSCTL_OPS_LIB",
    "HF3FSCTL_CUDA_ARCH",
    "HF3FSCTL_STAGING_CHUNK_BYTES",
}

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


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _field(
    default: Any,
    help: str,
    *,
    kind: str | None = None,
    ge: float | None = None,
    le: float | None = None,
) -> Any:
    """A schema field: its default, help line, bounds and kind (`size`, `amount`, …)."""
    extra: dict[str, Any] = {"kind": kind} if kind else {}
    return Field(default, description=help, ge=ge, le=le, json_schema_extra=extra or None)


def _kind(info: FieldInfo) -> str | None:
    extra = info.json_schema_extra
    return extra.get("kind") if isinstance(extra, dict) else None  # type: ignore[return-value]


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """`int | None` → `(int, True)`; `int` → `(int, False)`."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), True
    return annotation, False


def _coerce(key: str, info: FieldInfo, value: Any) -> Any:
    """Turn a YAML/env/flag value into the field's type, or raise ConfigError.

    Bounds and choices are left to the model (`ge`/`le`, `Literal`); `_raise_config_error`
    words their failures.
    """
    base, optional = _unwrap(info.annotation)
    if value is None or (optional and isinstance(value, str) and value.strip() == ""):
        if optional:
            return None
        if base is str:
            return ""
        raise ConfigError(f"{key}: a value is required (default {info.default!r})")
    kind = _kind(info)
    if kind == "size":
        return parse_size(value, key)
    if kind == "amount":
        result = str(parse_amount(value, key)) if not isinstance(value, str) else value.strip()
        parse_amount(result, key)
        return result
    if base is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ConfigError(
            f"{key}: {value!r} is not a boolean; use true or false (yes/no, on/off, 1/0)"
        )
    if base is int:
        if isinstance(value, bool) or not re.fullmatch(r"\s*-?\d+\s*", str(value)):
            raise ConfigError(f"{key}: {value!r} is not an integer")
        return int(value)
    if base is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: {value!r} is not a number") from None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not a string")
    return str(value).strip() if kind == "url" else str(value)


def _raise_config_error(section: str, exc: ValidationError) -> NoReturn:
    """The first error of a section's validation as a ConfigError naming the dotted key."""
    error = exc.errors()[0]
    loc = error.get("loc") or ("?",)
    key = f"{section}.{loc[0]}" if section else str(loc[0])
    value = error.get("input")
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind == "extra_forbidden":
        raise _unknown_key(key)
    if kind in ("greater_than_equal", "greater_than"):
        raise ConfigError(f"{key}: {value!r} is below the minimum {ctx.get('ge', ctx.get('gt'))}")
    if kind in ("less_than_equal", "less_than"):
        raise ConfigError(f"{key}: {value!r} is above the maximum {ctx.get('le', ctx.get('lt'))}")
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(choices)}")
    raise ConfigError(f"{key}: {value!r} is invalid: {error['msg']}")


class ConfigSection(BaseModel):
    """One section of the configuration: frozen, no unknown keys, values coerced from
    YAML, environment strings and flags; every failure is a `ConfigError` naming
    `<section>.<key>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    section: ClassVar[str] = ""

    @field_validator("*", mode="before")
    @classmethod
    def _coerce_value(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or "?"
        return _coerce(f"{cls.section}.{name}", cls.model_fields[name], value)

    @model_validator(mode="wrap")
    @classmethod
    def _config_errors(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            _raise_config_error(cls.section, exc)


class StorageConfig(ConfigSection):
    """Where and how KV pages are stored."""

    section: ClassVar[str] = "storage"

    path: str = _field(
        "/mnt/3fs/hf3fsctl", "storage root; on 3FS, a directory under the mount", kind="path"
    )
    engine: Literal["auto", "posix", "usrbio"] = _field(
        "auto", "I/O engine: auto (usrbio on a 3FS mount, else posix), posix, usrbio"
    )
    capacity: str = _field(
        "80%",
        "bytes the whole store may hold, all namespaces and ranks together: a size "
        "(2TiB) or a share of the file system's free space when the store is created "
        "(50%); recorded in the store by `hf3fsctl init`",
        kind="amount",
    )
    max_pinned: str = _field(
        "25%",
        "most bytes pinned prefixes may hold: a size or a share of the capacity",
        kind="amount",
    )
    preallocate: bool = _field(
        False,
        "new page files are fallocated at storage.file_size up front (else they "
        "grow on demand, page by page, within the store's capacity)",
    )
    file_size: int = _field(
        64 * 1024**3,
        "bytes of one preallocated page file (storage.preallocate)",
        kind="size",
        ge=1 << 20,
    )
    io_threads: int = _field(16, "parallel page reads/writes per process", ge=1, le=256)
    o_direct: bool = _field(False, "bypass the page cache (O_DIRECT) when aligned")

    @model_validator(mode="after")
    def _path_required(self) -> StorageConfig:
        if not self.path:
            raise ConfigError("storage.path: a directory is required")
        return self


class MetadataConfig(ConfigSection):
    """How the connector and the CLI reach the metadata store."""

    section: ClassVar[str] = "metadata"

    url: str = _field(
        "",
        "sqlite:///PATH (embedded, no server), http://HOST:PORT (hf3fsctl serve), "
        "redis://HOST:PORT/DB, rediss://… or redis+sentinel://HOST:PORT[,…]/SERVICE "
        "(a shared Redis); empty = sqlite:///<storage.path>/metadata.db",
        kind="url",
    )
    timeout_s: float = _field(2.0, "timeout of every metadata call", ge=0.01, le=600)
    token_file: str | None = _field(
        None,
        "file holding the bearer token for http:// URLs (for redis:// URLs without a "
        "password: the Redis password)",
    )
    ca_file: str | None = _field(
        None,
        "PEM file of the CA that signed an https:// service's (or rediss:// server's) certificate "
        "(default: the system's trust store)",
    )
    retry_backoff_s: float = _field(
        5.0, "connector: wait this long before retrying a dead service", ge=0
    )
    lease_s: float = _field(30.0, "a located page is not reused for this long", ge=0.1, le=3600)
    pending_timeout_s: float = _field(
        120.0,
        "an allocation not committed this long after it was granted belongs to a dead "
        "writer: its pages may be reclaimed",
        ge=0.1,
        le=86400,
    )
    high_watermark: float = _field(
        0.95, "evict when the store (or a quota) is fuller than this", ge=0, le=1
    )
    low_watermark: float = _field(0.85, "evict down to this usage", ge=0, le=1)

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        if url:
            MetadataUrl.parse(url, key="metadata.url")
        return url

    @model_validator(mode="after")
    def _watermarks(self) -> MetadataConfig:
        if self.low_watermark >= self.high_watermark:
            raise ConfigError(
                f"metadata.low_watermark ({self.low_watermark}) must be below "
                f"metadata.high_watermark ({self.high_watermark})"
            )
        return self


class ServerConfig(ConfigSection):
    """`hf3fsctl serve`."""

    section: ClassVar[str] = "server"

    host: str = _field("127.0.0.1", "bind address (loopback by default)")
    port: int = _field(18765, "TCP port", ge=0, le=65535)
    token_file: str | None = _field(
        None, "bearer token required on mutating and admin routes when set"
    )
    max_body_bytes: int = _field(16 * 1024**2, "largest request body", kind="size", ge=1024)
    max_batch: int = _field(8192, "most keys in one request", ge=1, le=1_000_000)
    workers: int = _field(
        1, "server processes sharing the port (at most one per core)", ge=1, le=64
    )
    log_format: Literal["text", "json"] = _field(
        "text", "serve's logs: text (uvicorn's lines) or json (one object per line)"
    )


class ConnectorConfig(ConfigSection):
    """The vLLM connector."""

    section: ClassVar[str] = "connector"

    save_decode_blocks: bool = _field(False, "also save blocks filled by generated tokens")
    staging_bytes: int = _field(
        1024**3, "pinned host staging memory per worker", kind="size", ge=1 << 20
    )
    min_hit_blocks: int = _field(1, "load only when at least this many blocks hit", ge=1)
    lookup_wait_ms: float = _field(
        5.0,
        "the scheduler step waits at most this long in all for store lookups "
        "(0 = never); requests not answered by then are asked again next step",
        ge=0,
        le=1000,
    )
    storage_retry_s: float = _field(
        5.0,
        "after a storage failure (no space, I/O error, missing mount) skip saves "
        "this long before trying again",
        ge=0,
        le=3600,
    )
    load_mode: Literal["sync", "async"] = _field(
        "sync",
        "sync: load inside the step that computes the rest of the prompt; "
        "async: load on a thread while the engine runs other requests",
    )
    kv_events_poll_s: float = _field(
        1.0,
        "with vLLM's KV events on: how often the store's change log is read for "
        "BlockStored/BlockRemoved events",
        ge=0.05,
        le=3600,
    )
    kv_events_medium: str = _field(
        "HF3FS", "the `medium` of the connector's KV events (names this store to routers)"
    )


_HTTP_RE = re.compile(r"(https?)://([^/\s]+)(/\S*)?")


class MetadataUrl(BaseModel):
    """A parsed metadata URL.

    - `sqlite:///PATH`: embedded (`path`).
    - `http(s)://HOST:PORT[/PREFIX]`: `hf3fsctl serve` (`base`, without a trailing slash).
    - `redis://[USER[:PASSWORD]@]HOST:PORT[/DB]`, `rediss://…` (TLS): one Redis server;
      `redis+sentinel://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT…]/SERVICE[/DB]`: the master
      of `SERVICE` as Redis Sentinels report it (`hosts` are the sentinels). The password
      is `password` only: `url` and `repr` show it as `***`, so logging either is safe.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str
    scheme: Literal["sqlite", "http", "https", "redis", "rediss", "redis+sentinel"]
    path: str | None = None
    base: str | None = None
    hosts: tuple[tuple[str, int], ...] = ()  # redis: the server; sentinel: the sentinels
    db: int = 0
    service: str | None = None  # redis+sentinel: the monitored master's name
    username: str | None = None
    password: str | None = Field(default=None, repr=False)

    @property
    def embedded(self) -> bool:
        """An embedded (`sqlite`) store, opened in this process."""
        return self.scheme == "sqlite"

    @property
    def redis(self) -> bool:
        """A Redis store (`redis`, `rediss`, `redis+sentinel`), reached directly."""
        return self.scheme.startswith("redis")

    @classmethod
    def parse(cls, url: str, key: str = "metadata.url") -> MetadataUrl:
        """Parse `sqlite:////ABS/PATH`, `sqlite:///ABS/PATH`, `http(s)://HOST:PORT[/PREFIX]`,
        `redis://HOST:PORT[/DB]`, `rediss://…` or `redis+sentinel://HOST:PORT[,…]/SERVICE[/DB]`.

        Raises:
            ConfigError: naming `key` when the URL is none of these (the message never
                repeats a password).
        """
        text = url.strip() if isinstance(url, str) else ""
        if text.startswith("sqlite:///") and len(text) > len("sqlite:///"):
            path = text[len("sqlite://") :]
            return cls(url=text, scheme="sqlite", path=path[1:] if path.startswith("//") else path)
        match = _HTTP_RE.fullmatch(text)
        if match is not None:
            scheme: Literal["http", "https"] = "https" if match.group(1) == "https" else "http"
            return cls(url=text, scheme=scheme, base=text.rstrip("/"))
        redis = _REDIS_RE.fullmatch(text)
        if redis is not None:
            return cls._parse_redis(redis, key)
        raise ConfigError(
            f"{key}: {_redact(text or url)!r} is not a metadata URL; use "
            "sqlite:///ABSOLUTE/PATH.db, http://HOST:PORT, redis://HOST:PORT/DB or "
            "redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE"
        )

    @classmethod
    def _parse_redis(cls, match: re.Match[str], key: str) -> MetadataUrl:
        from urllib.parse import unquote

        scheme, userinfo, hosts_text, rest = match.groups()
        username = password = None
        if userinfo is not None:
            user, sep, secret = userinfo.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if sep else None
            if not sep:  # `redis://PASSWORD@host` is redis-py's form for a password alone
                username, password = None, unquote(user)
        hosts = []
        for item in hosts_text.split(","):
            host, _, port = item.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"{key}: {_redact(match.group(0))!r} is not a metadata URL: {item!r} is "
                    "not HOST:PORT",
                    hint="give every Redis server or sentinel as HOST:PORT",
                )
            hosts.append((host.strip("[]"), int(port)))
        parts = [p for p in (rest or "").split("/") if p]
        service = None
        if scheme == "redis+sentinel":
            if not parts:
                raise ConfigError(
                    f"{key}: {_redact(match.group(0))!r} names no Sentinel service",
                    hint="use redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE_NAME[/DB]",
                )
            service = parts.pop(0)
        elif len(hosts) > 1:
            raise ConfigError(
                f"{key}: {scheme}:// takes one HOST:PORT; several are for redis+sentinel://"
            )
        if len(parts) > 1 or (parts and not parts[0].isdigit()):
            raise ConfigError(f"{key}: the database of {_redact(match.group(0))!r} is not a number")
        return cls(
            url=_redact(match.group(0)),
            scheme=scheme,  # type: ignore[arg-type]  # the pattern allows only these
            hosts=tuple(hosts),
            db=int(parts[0]) if parts else 0,
            service=service,
            username=username,
            password=password,
        )


_REDIS_RE = re.compile(r"(redis|rediss|redis\+sentinel)://(?:([^@/\s]*)@)?([^@/\s]+)(/\S*)?")


def _redact(url: str) -> str:
    """`url` with the password of its user information replaced by `***` (all of it
    when it has no `:`: `redis://SECRET@host` is a password alone)."""
    url = re.sub(r"^([a-z+]+://)([^@/\s:]*):[^@/\s]*@", r"\1\2:***@", url)
    return re.sub(r"^([a-z+]+://)[^@/\s:]+@", r"\1***@", url)


def _check_quotas(quotas: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in quotas.items():
        key = f"{QUOTAS}.{name}"
        if not name:
            raise ConfigError(f"{QUOTAS}: a quota needs a namespace id or model name")
        out[str(name)] = value.strip() if isinstance(value, str) else str(parse_amount(value, key))
        parse_amount(out[str(name)], key)
    return out


class Config(BaseModel):
    """The whole configuration. `source` is the file it was read from, if any (not part of
    equality or `to_dict`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    storage: StorageConfig = Field(default_factory=StorageConfig)
    metadata: MetadataConfig = Field(default_factory=MetadataConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    connector: ConnectorConfig = Field(default_factory=ConnectorConfig)
    # Namespace id or model name → most bytes it may hold (a size, or a share of the
    # store's capacity). A model's quota covers all of its namespaces together.
    quotas: dict[str, str] = Field(default_factory=dict)
    source: str | None = Field(default=None, exclude=True)

    @field_validator("quotas", mode="before")
    @classmethod
    def _quotas(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{QUOTAS}: must map a namespace id or model name to a size or share")
        return _check_quotas(value)

    @model_validator(mode="wrap")
    @classmethod
    def _config_errors(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            _raise_config_error("", exc)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    @property
    def metadata_url(self) -> str:
        """The metadata URL with the embedded default filled in."""
        if self.metadata.url:
            return self.metadata.url
        return f"sqlite:///{Path(self.storage.path) / 'metadata.db'}"

    @property
    def metadata_target(self) -> MetadataUrl:
        """`metadata_url`, parsed."""
        return MetadataUrl.parse(self.metadata_url)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The configuration as a plain nested dict (no `source`)."""
        data: dict[str, dict[str, Any]] = {
            name: getattr(self, name).model_dump() for name in SECTIONS
        }
        data[QUOTAS] = dict(self.quotas)
        return data


QUOTAS = "quotas"
QUOTAS_HELP = (
    "per-namespace or per-model caps, e.g. {my-org/llama-8b: 40%, 0123456789abcdef: 100GiB} "
    "(a share is of the store's capacity)"
)

SECTIONS: dict[str, type[ConfigSection]] = {
    "storage": StorageConfig,
    "metadata": MetadataConfig,
    "server": ServerConfig,
    "connector": ConnectorConfig,
}


@dataclass(frozen=True)
class ConfigKey:
    """One dotted key of the schema: its section, name, help line, default and field."""

    section: str
    name: str
    help: str
    default: Any
    kind: str | None
    info: FieldInfo


def config_keys() -> dict[str, ConfigKey]:
    """Every dotted key (`storage.path`, …) and its schema entry."""
    return {
        f"{section}.{name}": ConfigKey(
            section, name, info.description or "", info.default, _kind(info), info
        )
        for section, cls in SECTIONS.items()
        for name, info in cls.model_fields.items()
    }


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
            values[key] = _coerce(key, known[key].info, value)
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        kwargs = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")}
        sections[name] = cls(**kwargs)
    return Config(**sections, quotas=quotas, source=source)


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
        for name, info in cls.model_fields.items():
            value = getattr(getattr(config, section), name)
            lines.append(f"  # {info.description}")
            lines.append(f"  {name}: {_yaml_scalar(value)}")
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
