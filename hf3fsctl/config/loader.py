"""Loading the configuration: find the file, read it, layer the environment and overrides.

Contract: values are layered, later wins — built-in defaults → the YAML file →
`HF3FSCTL_<SECTION>_<KEY>` → explicit overrides; an unknown key or variable fails with a
"did you mean" naming the closest key; a missing named file fails naming where it was
named (`--config` or `$HF3FSCTL_CONFIG`). `dump_config` writes a file `load_config` reads
back to an equal `Config`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf3fsctl.config.schema import (
    QUOTAS,
    QUOTAS_HELP,
    SECTIONS,
    VLLM,
    VLLM_HELP,
    Config,
    coerce_value,
    config_keys,
    engine_args_mapping,
    unknown_key_error,
)
from hf3fsctl.config.units import parse_amount
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


def _flatten(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Nested `{section: {key: value}}` or dotted `{section.key: value}` → dotted."""
    flat: dict[str, Any] = {}
    for name, value in data.items():
        if "." in name:
            flat[name] = value
        elif name == VLLM:  # engine args stay whole (nested values such as compilation_config)
            for sub, sub_value in engine_args_mapping(value, f"{origin}: {VLLM}").items():
                flat[f"{VLLM}.{sub}"] = sub_value
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
            raise unknown_key_error(name)
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
    engine_args: dict[str, Any] = {}
    for origin, layer in layers:
        for key, value in _flatten(layer, origin).items():
            if key.startswith(VLLM + "."):
                engine_args[key[len(VLLM) + 1 :].replace("-", "_")] = value
                continue
            if key.startswith(QUOTAS + "."):
                name = key[len(QUOTAS) + 1 :]
                if not name:
                    raise ConfigError(f"{origin}: a quota needs a namespace id or model name")
                quotas[name] = str(parse_amount(value, key))
                continue
            if key not in known:
                raise unknown_key_error(key)
            values[key] = coerce_value(key, known[key].info, value)
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        kwargs = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")}
        sections[name] = cls(**kwargs)
    return Config(**sections, quotas=quotas, vllm=engine_args, source=source)


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
    defaults = Path(__file__).resolve().parent.parent / "default_config.yaml"  # in the wheel
    lines = [f"# hf3fsctl configuration; every key and its default: {defaults}"]
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
    lines.append(f"# {VLLM_HELP}")
    if config.vllm:
        import json

        lines.append(f"{VLLM}:")
        lines.extend(f"  {k}: {json.dumps(v)}" for k, v in config.vllm.items())
    else:
        lines.append(f"{VLLM}: {{}}")
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
