"""The engines' surroundings: model, KV-cache sizing, a private store, page cache.

Contract: the store is made the way a user makes one (`hf3fsctl init`, then `hf3fsctl
vllm-config`, as subprocesses); sizes left unset are derived from the model and the
workload so every prompt of a pass fits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf3fsctl.bench.e2e.settings import MIB, TOKEN_ID_LIMIT, E2ESettings
from hf3fsctl.errors import Hf3fsctlError, InvalidRequest


def model_shape(model: Path) -> dict[str, int]:
    """Vocabulary and KV bytes per token (at 1 byte per element) from `config.json`."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads") or 0)
    head_dim = int(config.get("head_dim") or (config.get("hidden_size", 0) // max(1, heads)))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    layers = int(config.get("num_hidden_layers") or 0)
    return {
        "vocab_size": int(config.get("vocab_size") or TOKEN_ID_LIMIT),
        "kv_elements_per_token": 2 * layers * kv_heads * head_dim,
    }


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "float", "fp32") else 2


def auto_kv_cache_bytes(settings: E2ESettings, elements_per_token: int) -> int:
    """Room for every block of one pass (so the floor pass finds all of them), + 25%."""
    w, bs = settings.workload, settings.block_size
    prefix_blocks = w.prefixes * (w.prefix_tokens // bs)
    per_request = math.ceil((w.prompt_tokens + w.output_tokens) / bs) - w.prefix_tokens // bs + 1
    warmup = math.ceil((settings.warmup_tokens + w.output_tokens) / bs) + 1
    blocks = prefix_blocks + w.requests * per_request + warmup
    per_block = bs * elements_per_token * dtype_bytes(settings.dtype)
    need = int(blocks * per_block * 1.25) + 16 * MIB
    return max(64 * MIB, math.ceil(need / MIB) * MIB)


def auto_max_model_len(settings: E2ESettings) -> int:
    """The longest request (a prompt or the warm-up, plus output) and a block of slack."""
    w = settings.workload
    longest = max(w.prompt_tokens, settings.warmup_tokens) + w.output_tokens
    return math.ceil(longest / settings.block_size) * settings.block_size + settings.block_size


def clean_env() -> dict[str, str]:
    """This environment without `HF3FSCTL_*` config (the store must be the private one)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HF3FSCTL_") or k in ("HF3FSCTL_STATE_DIR", "HF3FSCTL_DEBUG")
    }


def make_store(directory: Path) -> dict[str, Any]:
    """A private store, made as a user would: `hf3fsctl init`, then `hf3fsctl vllm-config`.

    Returns:
        `{"config_file", "storage_path", "kv_transfer_config"}`.

    Raises:
        Hf3fsctlError: either command failed (its stderr is in the message).
    """
    storage, config_file = directory / "storage", directory / "hf3fs.yaml"
    directory.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "hf3fsctl"]
    steps = [
        [
            *base,
            "init",
            "--storage-path",
            str(storage),
            "--create-path",
            "--metadata-url",
            f"sqlite:///{storage / 'metadata.db'}",
            "--write-config",
            str(config_file),
            "--json",
        ],
        [*base, "vllm-config", "--config", str(config_file), "--compact"],
    ]
    outputs = []
    for argv in steps:
        proc = subprocess.run(
            argv, cwd=directory, env=clean_env(), capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            raise Hf3fsctlError(
                f"`hf3fsctl {argv[3]}` for the benchmark store failed "
                f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
            )
        outputs.append(proc.stdout)
    return {
        "config_file": str(config_file),
        "storage_path": str(storage),
        "kv_transfer_config": json.loads(outputs[1]),
    }


def drop_page_cache(root: Path) -> int:
    """Flush and drop every file under `root` from the page cache; returns bytes on disk."""
    dropped = 0
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_blocks * 512  # allocated, not the sparse size
        finally:
            os.close(fd)
    return dropped


def short_error(message: str, lines: int = 6) -> str:
    useful = [ln for ln in message.splitlines() if ln.strip()]
    return "\n".join(useful[-lines:])


def resolve_model(settings: E2ESettings, work: Path, log: Callable[[str], None]) -> Path:
    if settings.model:
        model = Path(settings.model).expanduser().resolve()
        if not (model / "config.json").is_file():
            raise InvalidRequest(f"--model {settings.model!r} is not a model directory")
        return model
    from hf3fsctl.vllm_tools.tiny_model import SIZES, build_tiny_model

    if settings.model_size not in SIZES:
        raise InvalidRequest(f"unknown tiny model size {settings.model_size!r}")
    target = work / f"model-{settings.model_size}"
    log(f"model: the {settings.model_size!r} tiny model under {target} (built once)")
    return build_tiny_model(target, SIZES[settings.model_size])
