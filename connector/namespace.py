"""The connector's view of vLLM's configuration: settings, KV geometry and namespace.

Contract:
    * `load_settings(vllm_config)` reads `kv_connector_extra_config`: `config_file` (the
      hf3fsctl YAML) plus dotted overrides (`"storage.path": ...`), through
      `hf3fsctl.config.load_config` (so errors name the key).
    * `kv_groups(kv_cache_config)` returns every transferable KV cache group as a
      `StoredGroup`: full attention and MLA (FULL), sliding window (SLIDING), chunked
      local attention (CHUNKED), Mamba state in prefix-caching "align" mode (MAMBA).
      Anything else (sliding-window MLA, sink attention, non-"align" Mamba, EAGLE/MTP
      draft groups, groups of different block sizes) is one `ConfigError` line at
      start-up naming what is unsupported.
    * `build_manifests(vllm_config, kv_cache_config)` gives each stored group its own
      namespace manifest (docs/design.md decision 16); a pure function of the two
      configs, so the scheduler and every worker compute the same namespace ids;
      workers additionally check the real tensors against them (`connector.geometry`).
    * `none_hash_fingerprint(algorithm)` fingerprints vLLM's NONE_HASH from the same
      inputs vLLM uses (algorithm, PYTHONHASHSEED), without needing the engine's global.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf3fsctl.config import Config, load_config
from hf3fsctl.errors import ConfigError
from hf3fsctl.keys import DEFAULT_NONE_HASH_SEED, NamespaceManifest, model_revision, none_hash
from hf3fsctl.kv_groups import CHUNKED, FULL, MAMBA, SLIDING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

CONFIG_FILE_KEY = "config_file"
_REPRODUCIBLE_ALGORITHMS = ("sha256", "sha256_cbor")


def load_settings(vllm_config: VllmConfig) -> Config:
    """The hf3fsctl configuration named by `kv_connector_extra_config`.

    Raises:
        ConfigError: an unknown key, a bad value, or a missing config file.
    """
    transfer = vllm_config.kv_transfer_config
    extra: dict[str, Any] = dict(transfer.kv_connector_extra_config) if transfer else {}
    path = extra.pop(CONFIG_FILE_KEY, None)
    return load_config(path, overrides=extra)


@dataclass(frozen=True)
class StoredGroup:
    """One KV cache group the connector stores, as plain data (see `hf3fsctl.kv_groups`)."""

    index: int  # position in vLLM's `kv_cache_groups`
    kind: str  # FULL, SLIDING, CHUNKED or MAMBA
    spec: Any  # vLLM's KVCacheSpec of the group
    layer_names: tuple[str, ...]  # the group's layers, in order
    page_size_bytes: int  # stored bytes of one block of one layer
    # SLIDING: tokens the window keeps (window + retained); CHUNKED: the attention chunk
    window_tokens: int = 0


def _unsupported(message: str, hint: str) -> ConfigError:
    # vLLM shows only the message: the fix goes in it, on the same line.
    return ConfigError(f"Hf3fsctlConnector cannot store this model: {message} ({hint})", hint=hint)


def _group_kind(index: int, group: Any) -> StoredGroup:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec = group.kv_cache_spec
    name = type(spec).__name__
    layers = tuple(group.layer_names)
    if group.is_eagle_group:
        raise _unsupported(
            f"KV cache group {index} holds EAGLE/MTP draft layers {list(layers)}",
            "run without speculative decoding, or without the connector",
        )
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return StoredGroup(index, FULL, spec, layers, int(spec.page_size_bytes))
    if type(spec) is SlidingWindowSpec:
        window = int(spec.sliding_window) + int(spec.extra_retained_tokens)
        return StoredGroup(index, SLIDING, spec, layers, int(spec.page_size_bytes), window)
    if type(spec) is ChunkedLocalAttentionSpec:
        chunk = int(spec.attention_chunk_size)
        return StoredGroup(index, CHUNKED, spec, layers, int(spec.page_size_bytes), chunk)
    if type(spec) is MambaSpec:
        if spec.mamba_cache_mode != "align":
            raise _unsupported(
                f"Mamba state group {index} is in mamba_cache_mode={spec.mamba_cache_mode!r}",
                "enable prefix caching (--enable-prefix-caching, mamba_cache_mode 'align'): "
                "only block-boundary states can be stored",
            )
        if spec.num_speculative_blocks:
            raise _unsupported(
                f"Mamba state group {index} keeps speculative-decoding blocks",
                "run without speculative decoding, or without the connector",
            )
        # Only the state itself, not the padding that aligns it to the attention page.
        return StoredGroup(index, MAMBA, spec, layers, int(spec.real_page_size_bytes))
    raise _unsupported(
        f"KV cache group {index} has spec {name}",
        "stored: full attention, MLA, sliding window, chunked local attention and Mamba "
        "'align' groups "
        "(docs/vllm.md lists the rest)",
    )


def kv_groups(kv_cache_config: KVCacheConfig) -> list[StoredGroup]:
    """Every KV cache group this connector stores (vLLM rebuilds the others).

    Raises:
        ConfigError: no transferable group, a spec the connector cannot store, EAGLE/MTP
            draft groups, or groups with different block sizes.
    """
    stored = [
        _group_kind(index, group)
        for index, group in enumerate(kv_cache_config.kv_cache_groups)
        if group.enable_kv_transfer
    ]
    if not stored:
        raise _unsupported("it has no transferable KV cache group", "run without the connector")
    sizes = {int(g.spec.block_size) for g in stored}
    hashed = kv_cache_config.hash_block_size
    if len(sizes) != 1 or (hashed is not None and int(hashed) not in sizes):
        raise _unsupported(
            f"KV cache groups have block sizes {sorted(sizes)} (hash block size {hashed})",
            "set one --block-size every group can use",
        )
    return stored


def kv_group(kv_cache_config: KVCacheConfig) -> StoredGroup:
    """The one stored group of a single-group model.

    Raises:
        ConfigError: as `kv_groups`, or the model has several stored groups.
    """
    groups = kv_groups(kv_cache_config)
    if len(groups) != 1:
        raise ConfigError(f"the model has {len(groups)} stored KV cache groups, not one")
    return groups[0]


def none_hash_fingerprint(algorithm: str) -> str:
    """A short hex fingerprint of vLLM's NONE_HASH for `algorithm` in this environment.

    Cryptographic algorithms hash the seed (PYTHONHASHSEED, else vLLM's constant)
    exactly as vLLM does. Non-cryptographic ones (xxhash*) use a random per-process seed
    unless PYTHONHASHSEED is set: their keys never match another process, which is
    recorded in the fingerprint (and warned about) rather than guessed.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if algorithm in _REPRODUCIBLE_ALGORITHMS:
        try:
            return none_hash(algorithm).hex()[:16]
        except ImportError:  # sha256_cbor without cbor2: fingerprint the inputs instead
            pass
    elif seed is None:
        logger.warning(
            "prefix_caching_hash_algo=%s without PYTHONHASHSEED: block keys are random per "
            "process, so nothing this instance saves can be loaded by another; use sha256 "
            "or set PYTHONHASHSEED",
            algorithm,
        )
        return "random-per-process"
    text = f"{algorithm}:{seed if seed is not None else DEFAULT_NONE_HASH_SEED}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _backend_name(vllm_config: VllmConfig) -> str:
    from vllm.platforms import current_platform

    backend = vllm_config.attention_config.backend
    chosen = backend.name if backend is not None else "auto"
    return f"{current_platform.device_type}:{chosen}"


def _structure(kv_cache_config: KVCacheConfig) -> str:
    """A fingerprint of every group's kind, spec and layers: the model's layer pattern."""
    rows = []
    for group in kv_cache_config.kv_cache_groups:
        spec: Any = group.kv_cache_spec
        rows.append(
            [
                type(spec).__name__,
                list(group.layer_names),
                int(spec.block_size),
                int(spec.page_size_bytes),
                int(getattr(spec, "sliding_window", 0) or 0),
                repr(getattr(spec, "shapes", "")),
                repr(getattr(spec, "dtypes", "")),
                bool(group.enable_kv_transfer),
            ]
        )
        if getattr(spec, "attention_chunk_size", None):  # (only there: older ids unchanged)
            rows[-1].append(int(spec.attention_chunk_size))
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _group_manifest(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    group: StoredGroup,
    hybrid: bool,
    numerics: str | None = None,
) -> NamespaceManifest:
    spec: Any = group.spec
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    layout = kv_cache_config.kv_cache_layout or cache.kv_cache_layout or "unresolved"
    extra = {
        "cache_dtype": str(cache.cache_dtype),
        "kv_quant_mode": str(getattr(spec, "kv_quant_mode", "")),
        "spec": type(spec).__name__,
        "head_size_v": str(getattr(spec, "head_size_v", getattr(spec, "head_size", 0))),
        "page_size_bytes": str(group.page_size_bytes),
    }
    if hybrid:  # a single full-attention group keeps the manifest it always had
        extra |= {
            "group": str(group.index),
            "group_kind": group.kind,
            "groups": _structure(kv_cache_config),
            "sliding_window": str(group.window_tokens if group.kind == SLIDING else 0),
        }
        if group.kind == CHUNKED:
            extra["attention_chunk"] = str(group.window_tokens)
        if group.kind == MAMBA:
            extra["mamba_state"] = f"{spec.shapes}:{[_dtype_name(d) for d in spec.dtypes]}"
    if numerics is not None:  # connector.strict_numerics: other numerics, other namespace
        extra["numerics"] = numerics
    dtype = spec.dtypes[0] if group.kind == MAMBA else spec.dtype
    return NamespaceManifest(
        model=str(model.model),
        revision=model_revision(model.model, model.revision),
        kv_dtype=_dtype_name(dtype),
        block_size=int(spec.block_size),
        layout=str(layout),
        backend=_backend_name(vllm_config),
        num_layers=len(group.layer_names),
        num_kv_heads=int(getattr(spec, "num_kv_heads", 0)),
        head_dim=int(getattr(spec, "head_size", 0)),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        page_bytes=group.page_size_bytes * len(group.layer_names),
        hash_algorithm=str(cache.prefix_caching_hash_algo),
        none_hash=none_hash_fingerprint(str(cache.prefix_caching_hash_algo)),
        extra=extra,
    )


def build_manifests(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, numerics: str | None = None
) -> list[tuple[StoredGroup, NamespaceManifest]]:
    """Each stored group with the manifest of its namespace on this rank.

    One namespace per group: a group's pages have their own size and their own layers.
    With more than one group (or a group that is not full attention) every manifest
    records its group index and kind and a fingerprint of the whole group structure,
    so a changed layer pattern never reuses pages. A single full-attention group keeps
    the manifest it always had (existing stores stay valid). `numerics` (the engine's
    `strict_hash`, with `connector.strict_numerics`) goes into every manifest.

    Raises:
        ConfigError: unsupported KV cache groups or pipeline parallelism.
    """
    groups = kv_groups(kv_cache_config)
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            "Hf3fsctlConnector does not support pipeline parallelism yet "
            f"(pipeline_parallel_size={parallel.pipeline_parallel_size})"
        )
    hybrid = len(groups) > 1 or groups[0].kind != FULL
    return [(g, _group_manifest(vllm_config, kv_cache_config, g, hybrid, numerics)) for g in groups]


def build_manifest(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> NamespaceManifest:
    """The manifest of a single-group model (the first group's for a hybrid one).

    Raises:
        ConfigError: unsupported KV cache groups or pipeline parallelism.
    """
    return build_manifests(vllm_config, kv_cache_config)[0][1]
