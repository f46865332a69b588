"""The configuration schema: one frozen pydantic model per section, and `Config`.

Contract: a section forbids unknown keys and coerces YAML values, environment strings and
flags into its field types (`coerce_value`); every failure is a `ConfigError` naming
`<section>.<key>`, the value and the fix (`_raise_config_error`), never a pydantic
`ValidationError`. `config_keys()` lists every dotted key with its help line and default.
"""

from __future__ import annotations

import difflib
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

from hf3fsctl.config.units import parse_amount, parse_duration, parse_size
from hf3fsctl.config.urls import MetadataUrl
from hf3fsctl.errors import ConfigError

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


def coerce_value(key: str, info: FieldInfo, value: Any) -> Any:
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
    if kind == "duration":
        return parse_duration(value, key)
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
        raise unknown_key_error(key)
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
        return coerce_value(f"{cls.section}.{name}", cls.model_fields[name], value)

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
    io_threads: int = _field(
        16,
        "parallel page reads and O_DIRECT writes per process (buffered writes, copies into "
        "the page cache, use at most one thread per CPU)",
        ge=1,
        le=256,
    )
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
    strict_numerics: bool = _field(
        False,
        "put the engine's numerics (compilation, CUDA graphs, dtypes, batch invariance, "
        "device, vLLM and torch versions) into the namespace: engines that compute KV "
        "differently never share pages",
    )
    capture: bool = _field(
        False,
        "`hf3fsctl verify` only: keep the pages a save would write in memory; load "
        "nothing, save nothing",
    )
    store_after_hits: int = _field(
        0,
        "admission: save a block only once its key has been seen this many times, "
        "counted in the store across engines (0 or 1 = save every block)",
        ge=0,
        le=1_000_000,
    )


class RetentionConfig(ConfigSection):
    """How long saved entries live (the store's expiry; a request's `retention` wins)."""

    section: ClassVar[str] = "retention"

    default: float | None = _field(
        None,
        "expiry of every saved entry, counted from its commit: seconds or 90s, 5m, 1h, "
        "7d (null = entries never expire; a request's kv_transfer_params retention wins)",
        kind="duration",
    )
    renew_on_read: bool = _field(
        False,
        "a load of an entry with an expiry moves the expiry to then + its retention "
        "(off: reads never extend an expiry)",
    )


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
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    # Namespace id or model name → most bytes it may hold (a size, or a share of the
    # store's capacity). A model's quota covers all of its namespaces together.
    quotas: dict[str, str] = Field(default_factory=dict)
    # Engine args of the serving engines, as `vllm serve` takes them (`warm`, `verify`).
    vllm: dict[str, Any] = Field(default_factory=dict)
    source: str | None = Field(default=None, exclude=True)

    @field_validator("vllm", mode="before")
    @classmethod
    def _vllm(cls, value: Any) -> Any:
        return engine_args_mapping(value, VLLM)

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
        data[VLLM] = dict(self.vllm)
        return data


QUOTAS = "quotas"
QUOTAS_HELP = (
    "per-namespace or per-model caps, e.g. {my-org/llama-8b: 40%, 0123456789abcdef: 100GiB} "
    "(a share is of the store's capacity)"
)

VLLM = "vllm"
VLLM_HELP = (
    "engine args of the serving engines, as `vllm serve` takes them (its --config file's "
    "keys, e.g. {enforce_eager: true, dtype: bfloat16, compilation_config: {mode: 3}}): "
    "`hf3fsctl warm` and `verify` run their engine with them"
)


def engine_args_mapping(value: Any, origin: str) -> dict[str, Any]:
    """vLLM engine args from YAML/JSON: a mapping, keys as `vllm serve`'s options
    (`enforce-eager` or `enforce_eager`) → `vllm.LLM` keyword names.

    Raises:
        ConfigError: not a mapping, or a key that is not a name.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{origin}: must map vLLM engine args to values (enforce_eager: true)")
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = str(key).strip().lstrip("-").replace("-", "_")
        if not name.isidentifier():
            raise ConfigError(f"{origin}: {key!r} is not a vLLM engine arg name")
        out[name] = item
    return out


SECTIONS: dict[str, type[ConfigSection]] = {
    "storage": StorageConfig,
    "metadata": MetadataConfig,
    "server": ServerConfig,
    "connector": ConnectorConfig,
    "retention": RetentionConfig,
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


def unknown_key_error(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(config_keys()), n=1)
    fix = f"; did you mean {close[0]}?" if close else f"; known keys: {', '.join(config_keys())}"
    return ConfigError(f"unknown config key {key!r}{fix}")
