"""The engine args of `warm` and `verify`: the serving engines' args, from one place.

Pages are right for the engine that reads them only when the engine that wrote them
computed KV the same way (docs/design.md decision 15), so `warm` runs its engine with the
serving engines' args rather than defaults of its own. Layers, later wins:

1. the config's `vllm:` section (the args an operator keeps for `vllm serve`);
2. `--engine-args-file FILE`: YAML or JSON, the keys vLLM's `--config` file takes;
3. explicit flags (`--dtype`, `--block-size`, …, `--engine-arg KEY=VALUE`).

Each arg remembers where it came from (`EngineArgs.sources`), for the output. Keys are
`vllm.LLM` keyword names (`enforce-eager` becomes `enforce_eager`). Serving-only keys
(`host`, `port`, …) and a `kv_transfer_config` of the file (the connector is this
configuration's) are dropped at engine start (`split_llm_kwargs`), and said so.

Contract: no vLLM import here except inside `split_llm_kwargs` (called with the engine).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf3fsctl.config.schema import engine_args_mapping
from hf3fsctl.errors import ConfigError, InvalidRequest
from hf3fsctl.offline.namespaces import NamespaceQuery

CONFIG_SOURCE = "config vllm:"
FLAG_SOURCE = "flag"
# Engine args that `warm` sets itself (the connector, the model it was given).
OWN_ARGS = ("model", "kv_transfer_config")
# Args that decide the KV's numerics, shown first in the output when set.
NUMERICS_ARGS = (
    "dtype",
    "kv_cache_dtype",
    "enforce_eager",
    "compilation_config",
    "attention_backend",
    "attention_config",
    "block_size",
    "tensor_parallel_size",
)


@dataclass(frozen=True)
class EngineArgs:
    """Merged engine args and where each came from."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # arg → "config vllm:", file, "flag"

    def shown(self) -> dict[str, str]:
        """`arg → "value (source)"`, numerics-relevant args first (for the output)."""
        order = [k for k in NUMERICS_ARGS if k in self.values]
        order += sorted(k for k in self.values if k not in NUMERICS_ARGS)
        return {k: f"{json.dumps(self.values[k], default=str)} ({self.sources[k]})" for k in order}

    def to_dict(self) -> dict[str, Any]:
        return {k: {"value": v, "source": self.sources[k]} for k, v in self.values.items()}


def parse_engine_arg_pairs(pairs: list[str] | None) -> dict[str, Any]:
    """`KEY=VALUE` pairs → engine kwargs (values parsed as JSON when they are JSON).

    Raises:
        InvalidRequest: a pair without `=`.
    """
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise InvalidRequest(f"--engine-arg {pair!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def read_engine_args_file(path: str | Path) -> dict[str, Any]:
    """An engine args file: YAML or JSON, a mapping of `vllm serve` options.

    Raises:
        ConfigError: unreadable, not YAML/JSON, or not a mapping.
    """
    import yaml

    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text())  # JSON is YAML
    except OSError as exc:
        raise ConfigError(
            f"cannot read --engine-args-file {str(file)!r}: {exc.strerror}",
            hint="give the YAML/JSON file your `vllm serve --config` reads",
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--engine-args-file {str(file)!r} is not YAML or JSON: {exc}") from None
    return engine_args_mapping(data, f"--engine-args-file {file}")


def resolve_engine_args(
    config_section: Mapping[str, Any],
    file: str | Path | None,
    flags: Mapping[str, Any],
) -> EngineArgs:
    """Merge the layers (config section < file < flags; None flags are not given)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    layers: list[tuple[str, Mapping[str, Any]]] = [(CONFIG_SOURCE, config_section)]
    if file is not None:
        layers.append((f"file {Path(file).name}", read_engine_args_file(file)))
    layers.append((FLAG_SOURCE, {k: v for k, v in flags.items() if v is not None}))
    for source, layer in layers:
        for key, value in layer.items():
            values[key] = value
            sources[key] = source
    return EngineArgs(values, sources)


def split_llm_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the kwargs `vllm.LLM` takes, the names dropped): serving-only options such as
    `host` or `port` are not engine args. Imports vLLM."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs as VllmEngineArgs

    known = {f.name for f in dataclasses.fields(VllmEngineArgs)}
    kept = {k: v for k, v in kwargs.items() if k in known}
    return kept, sorted(k for k in kwargs if k not in known)


@dataclass(frozen=True)
class EngineOptions:
    """vLLM engine settings `warm` passes through (None = vLLM's default)."""

    model: str
    dtype: str = "auto"
    block_size: int | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)  # --engine-arg KEY=VALUE

    def query(self) -> NamespaceQuery:
        return NamespaceQuery(
            model=self.model,
            dtype=self.dtype,
            block_size=self.block_size,
            tp_size=self.tensor_parallel_size,
        )

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `vllm.LLM` (engine args last: they win)."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "enable_prefix_caching": True,
        }
        optional = {
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
        }
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        kwargs.update(self.engine_args)
        return kwargs


def engine_options(model: str, args: EngineArgs) -> EngineOptions:
    """`warm`'s `EngineOptions` from merged args (the typed ones taken out, the rest
    passed to `vllm.LLM` as they are; `model` and `kv_transfer_config` are warm's own).

    Raises:
        ConfigError: a typed arg of the wrong type (`block_size: big`).
    """
    from hf3fsctl.config import parse_size

    rest = {k: v for k, v in args.values.items() if k not in OWN_ARGS}

    def take(name: str, kind: type, default: Any = None) -> Any:
        value = rest.pop(name, default)
        if value is None or value == default:
            return value
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"engine arg {name}={value!r} ({args.sources.get(name)}) is not a {kind.__name__}"
            ) from None

    memory = rest.pop("kv_cache_memory_bytes", None)
    if isinstance(memory, str):
        memory = parse_size(memory, "kv_cache_memory_bytes")
    return EngineOptions(
        model=model,
        dtype=str(take("dtype", str, "auto")),
        block_size=take("block_size", int),
        max_model_len=take("max_model_len", int),
        tensor_parallel_size=int(take("tensor_parallel_size", int, 1)),
        kv_cache_memory_bytes=None if memory is None else int(memory),
        gpu_memory_utilization=take("gpu_memory_utilization", float),
        engine_args=rest,
    )
