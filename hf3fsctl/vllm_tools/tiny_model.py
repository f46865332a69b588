"""Build a random-weight Llama model and a BPE tokenizer on disk, with no downloads.

Tests, `make demo` and the benchmarks need a real model directory that vLLM can load,
on a machine with no model hub. This writes `config.json`, `generation_config.json`,
`model.safetensors`, `tokenizer.json` and `tokenizer_config.json`; the tokenizer is a
byte-level BPE trained on the Python standard library's sources (always on disk).
Weights are seeded, so the same arguments give the same files and greedy outputs.

Run: `python -m hf3fsctl.vllm_tools.tiny_model OUT_DIR [--size tiny|bench] [--seed N]`.
Not part of the core: nothing in `hf3fsctl` imports it.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the model to build."""

    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 4096
    max_position: int = 8192
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.05


SIZES = {
    # ~13 MB; prefill is fast. Tests and the demo.
    "tiny": TinyModelSpec(),
    # ~336 MB in fp32; a 4,000-token prefill costs seconds on a CPU. TTFT benchmarks.
    "bench": TinyModelSpec(
        hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=2816
    ),
}


def _training_files(limit: int = 60) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[:limit]


CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer on stdlib sources and save it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(_training_files(), trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": 1 << 20,
                "add_bos_token": False,
                # A minimal chat template, so chat prompts (`warm`/`lookup` JSONL
                # messages, vLLM's chat API) render the way a real model's would.
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )


def build_weights(out_dir: Path, spec: TinyModelSpec) -> None:
    """Write seeded random Llama weights as safetensors."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * spec.init_std).to(dtype)

    h, d = spec.hidden_size, spec.head_dim
    tensors = {
        "model.embed_tokens.weight": rand(spec.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": rand(spec.vocab_size, h),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(spec.num_heads * d, h),
            p + "self_attn.k_proj.weight": rand(spec.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": rand(spec.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": rand(h, spec.num_heads * d),
            p + "mlp.gate_proj.weight": rand(spec.intermediate_size, h),
            p + "mlp.up_proj.weight": rand(spec.intermediate_size, h),
            p + "mlp.down_proj.weight": rand(h, spec.intermediate_size),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def build_config(out_dir: Path, spec: TinyModelSpec) -> None:
    """Write the transformers `config.json` and `generation_config.json`."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2)
    )
    (out_dir / "hf3fsctl_tiny_model.json").write_text(json.dumps(asdict(spec), indent=2))


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Build the model directory (idempotent: an identical existing build is reused).

    Args:
        out_dir: directory to write; created if missing.
        spec: the model shape; default `SIZES["tiny"]`.

    Returns:
        The model directory.
    """
    spec = spec or SIZES["tiny"]
    out = Path(out_dir)
    marker = out / "hf3fsctl_tiny_model.json"
    if marker.is_file() and json.loads(marker.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec.vocab_size)
    build_weights(out, spec)
    build_config(out, spec)  # last: the marker means "complete"
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args(argv)
    spec = SIZES[args.size]
    overrides: dict[str, object] = {"seed": args.seed}
    if args.dtype:
        overrides["dtype"] = args.dtype
    spec = TinyModelSpec(**(asdict(spec) | overrides))
    print(build_tiny_model(args.out_dir, spec))


if __name__ == "__main__":
    main()
