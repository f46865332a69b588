"""The connector's view of vLLM's configuration: settings, KV geometry and namespace.

Contract:
    * `load_settings(vllm_config)` reads `kv_connector_extra_config`: `config_file` (the
      hf3fsctl YAML) plus dotted overrides (`"storage.path": ...`), through
      `hf3fsctl.config.load_config` (so errors name the key).
    * `kv_group(kv_cache_config)` returns the single full-attention KV cache group the
      connector supports; anything else (hybrid models, MLA-with-indexer, several
      groups, encoder-only) is a clear `ConfigError` at start-up.
    * `build_manifest(vllm_config, kv_cache_config)` is a pure function of the two
      configs, so the scheduler and every worker compute the same namespace id; workers
      additionally check the real tensors against it (`connector.geometry`).
    * `none_hash_fingerprint(algorithm)` fingerprints vLLM's NONE_HASH from the same
      inputs vLLM uses (algorithm, PYTHONHASHSEED), without needing the engine's global.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any

from hf3fsctl.config import Config, load_config
from hf3fsctl.errors import ConfigError
from hf3fsctl.keys import DEFAULT_NONE_HASH_SEED, NamespaceManifest, model_revision, none_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

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


def kv_group(kv_cache_config: KVCacheConfig) -> KVCacheGroupSpec:
    """The one KV cache group this connector stores.

    Raises:
        ConfigError: the model has no or several KV cache groups, or its group is not
            plain (full) attention.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, MLAAttentionSpec

    groups = [g for g in kv_cache_config.kv_cache_groups if g.enable_kv_transfer]
    if len(groups) != 1:
        raise ConfigError(
            f"Hf3fsctlConnector supports models with one KV cache group; this one has "
            f"{len(groups)} ({[type(g.kv_cache_spec).__name__ for g in groups]})",
            hint="hybrid / sliding-window-grouped models are not supported yet",
        )
    spec = groups[0].kv_cache_spec
    allowed = isinstance(spec, FullAttentionSpec) and type(spec) in (
        FullAttentionSpec,
        MLAAttentionSpec,
    )
    if not allowed or not isinstance(spec, AttentionSpec):
        raise ConfigError(
            f"Hf3fsctlConnector does not support KV cache spec {type(spec).__name__}",
            hint="only full attention (FullAttentionSpec, MLAAttentionSpec) is stored",
        )
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


def build_manifest(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> NamespaceManifest:
    """The namespace manifest of this engine's KV pages on one rank.

    Raises:
        ConfigError: unsupported KV cache groups or pipeline parallelism.
    """
    group = kv_group(kv_cache_config)
    spec: Any = group.kv_cache_spec
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            "Hf3fsctlConnector does not support pipeline parallelism yet "
            f"(pipeline_parallel_size={parallel.pipeline_parallel_size})"
        )
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    layout = kv_cache_config.kv_cache_layout or cache.kv_cache_layout or "unresolved"
    extra = {
        "cache_dtype": str(cache.cache_dtype),
        "kv_quant_mode": str(getattr(spec, "kv_quant_mode", "")),
        "spec": type(spec).__name__,
        "head_size_v": str(getattr(spec, "head_size_v", spec.head_size)),
        "page_size_bytes": str(spec.page_size_bytes),
    }
    return NamespaceManifest(
        model=str(model.model),
        revision=model_revision(model.model, model.revision),
        kv_dtype=_dtype_name(spec.dtype),
        block_size=int(spec.block_size),
        layout=str(layout),
        backend=_backend_name(vllm_config),
        num_layers=len(group.layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        page_bytes=int(spec.page_size_bytes) * len(group.layer_names),
        hash_algorithm=str(cache.prefix_caching_hash_algo),
        none_hash=none_hash_fingerprint(str(cache.prefix_caching_hash_algo)),
        extra=extra,
    )
