"""An engine's numerics: the settings that decide the bits of the KV it computes.

Two engines of one model and dtype can still write KV that differs at bf16 rounding
level on every element: a compiled and an eager forward, another attention backend,
another GPU, another vLLM or torch build (docs/design.md decision 15, with measurements).
The block keys are the same, so the pages mix in one namespace unless something says
who wrote them.

Contract:
    * `engine_numerics(vllm_config)` is a flat `{name: str}` dict (`NUMERICS_FIELDS`)
      read from a finished `VllmConfig` (after the platform adjusted it) and the
      process: compilation mode and backend, CUDA graph mode, enforce_eager, the
      attention backend (the layers' own once the model is loaded, else the configured
      one), model dtype, KV-cache dtype, batch-invariant mode (`VLLM_BATCH_INVARIANT`),
      platform and device (GPU name and compute capability, or the CPU's machine), and
      the vLLM and torch versions.
    * `numerics_hash(numerics)`: 12 hex digits over the sorted dict: the writer's id.
    * `strict_hash(numerics)`: the same without the attention backend, which the
      scheduler side cannot see before the model is loaded (the manifest's `backend`
      carries the configured one, and device + versions decide an automatic choice):
      the value `connector.strict_numerics` puts into the namespace manifest, equal on
      the scheduler side and every worker.
    * Imports vLLM and torch only inside the functions (callers already have them).
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Any

NUMERICS_FIELDS = (
    "compilation_mode",
    "compile_backend",
    "cudagraph_mode",
    "enforce_eager",
    "attention_backend",
    "dtype",
    "kv_cache_dtype",
    "batch_invariant",
    "platform",
    "device",
    "vllm",
    "torch",
)


def _name(value: Any) -> str:
    if value is None:
        return "none"
    return str(getattr(value, "name", value))


def _attention_backend(vllm_config: Any) -> str:
    layers = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    names = set()
    for layer in layers.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None:
            try:
                names.add(str(backend.get_name()))
            except Exception:  # a backend class without get_name: its class name
                names.add(getattr(backend, "__name__", type(backend).__name__))
    if names:
        return "+".join(sorted(names))
    configured = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return _name(configured) if configured is not None else "auto"


def _device(device_type: str) -> str:
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} sm{major}{minor}"
    return f"{device_type} {platform.machine()}"


def engine_numerics(vllm_config: Any) -> dict[str, str]:
    """The numerics-relevant settings of the engine `vllm_config` describes."""
    import torch
    import vllm
    from vllm import envs
    from vllm.platforms import current_platform

    compilation = vllm_config.compilation_config
    mode = _name(compilation.mode)
    return {
        "compilation_mode": mode,
        "compile_backend": str(compilation.backend or "") if mode != "NONE" else "",
        "cudagraph_mode": _name(compilation.cudagraph_mode),
        "enforce_eager": str(bool(vllm_config.model_config.enforce_eager)).lower(),
        "attention_backend": _attention_backend(vllm_config),
        "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "batch_invariant": str(bool(envs.VLLM_BATCH_INVARIANT)).lower(),
        "platform": str(current_platform.device_type),
        "device": _device(str(current_platform.device_type)),
        "vllm": str(vllm.__version__),
        "torch": str(torch.__version__),
    }


def numerics_hash(numerics: dict[str, Any]) -> str:
    """A writer's short id: 12 hex digits of sha256 over the sorted settings."""
    text = json.dumps(numerics, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def strict_hash(numerics: dict[str, Any]) -> str:
    """`numerics_hash` without the attention backend (see the module contract)."""
    return numerics_hash({k: v for k, v in numerics.items() if k != "attention_backend"})


def differing(writers: list[dict[str, Any]]) -> list[str]:
    """The settings on which recorded writers differ (an empty list: one numerics)."""
    names = sorted({k for w in writers for k in w.get("numerics", {})})
    return [n for n in names if len({str(w.get("numerics", {}).get(n)) for w in writers}) > 1]
